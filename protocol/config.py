"""The configuration language every tandem process speaks: OmegaConf structured configs.

Configs are nested dataclasses declared beside the component that owns them (rollout/config.py,
trainer/config.py, buffer/config.py), each field declared with `F(default, doc, ge=/gt=/le=/
choices=)`. Values come from, in order: field defaults, an optional YAML file (`--config FILE`,
with OmegaConf `${...}` interpolation), then dotted overrides as in verl (`trainer.save_freq=10`,
`--buffer.flush_interval=30`, `--buffer.flush_interval 30`). On the command line a key may also be
given by its last part (`--flush_interval=30`) when exactly one key of the schema ends with it.
`null` for a field that is not Optional means its default, as in verl's configs.

The role schemas (protocol/verl_keys.ROLES: trainer, rollout worker, validator) share one file:
each reads its own keys, accepts the other roles' keys silently, and treats verl's keys as protocol/verl_keys.py
classifies them (one warning line, an alias, or a refusal with the reason); the SFT schema treats
verl's SFT keys the same way (protocol/verl_keys.SFT_RULES). A bad type or bound, a
required key left unset, and a key in no schema stop the process at start, naming the field.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import math
import os
import sys
import types
import typing
from pathlib import Path
from typing import Any

import yaml
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from protocol import verl_keys
from protocol.fields import ConfigError, F, _fields, _flatten, _is_config, _read_yaml, leaves, yaml_leaves  # noqa: F401


def _unwrap(tp) -> tuple[Any, bool]:
    """(the type inside Optional[...], whether None is allowed)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], len(args) < len(typing.get_args(tp))
    return tp, False


def _type_name(tp) -> str:
    return str(tp).replace("typing.", "") if typing.get_args(tp) else tp.__name__


# --- reading: a YAML file and the command line ---------------------------------------------------


def _cli_value(text: str, tp):
    """A command-line string for a field of type `tp` (None: a key of no own field). Lists are
    YAML (`[a,b]`) or comma-separated; none/null is None for Optional fields; other own scalars stay
    strings for OmegaConf to convert by type (`worker.id=007` stays '007')."""
    if text.startswith("${"):
        return text
    if tp is None:
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError:
            return text
    inner, optional = _unwrap(tp)
    if optional and text.strip().lower() in ("none", "null", "~", ""):
        return None
    if typing.get_origin(inner) in (list, tuple, dict) and text.strip()[:1] in ("[", "{"):
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"cannot parse {text!r}: {e}") from None
    return text


def _suggest(key: str, candidates) -> str:
    hint = difflib.get_close_matches(key, list(candidates), n=3)
    return f" (did you mean {', '.join(hint)}?)" if hint else ""


@dataclasses.dataclass
class _Schema:
    """The keys one build knows: its own leaves (name -> type) and, for a role, the others'."""

    own: dict[str, Any]
    others: set[str]
    shared: bool  # reads verl's files: a role (shared with the other roles too) or SFT
    sft: bool = False  # verl's SFT keys (protocol/verl_keys.SFT_RULES), not its RL ones

    @classmethod
    def of(cls, config_cls) -> _Schema:
        roles = verl_keys.role_schemas()
        rules = verl_keys.rules_of(config_cls)
        others = {n for r in roles if r is not config_cls for n, _, _ in leaves(r)} if config_cls in roles else set()
        return cls({n: tp for n, _, tp in leaves(config_cls)}, others, rules is not None, bool(rules and rules[1]))

    def rules(self) -> list:
        return (verl_keys.SFT_RULES if self.sft else verl_keys.RULES) if self.shared else []

    def leaf_of(self, key: str) -> str | None:
        """The own field `key` sets: itself, or the dict-typed field it is an entry of."""
        return next((n for n in self.own if key == n or key.startswith(n + ".")), None)

    def is_node(self, key: str) -> bool:
        return any(n.startswith(key + ".") for n in (*self.own, *self.others))

    def known_elsewhere(self, key: str) -> bool:
        return self.shared and (key in self.others or verl_keys.rule_for(key, self.sft) is not None)

    def candidates(self) -> list[str]:
        literal = [r.pattern for r in self.rules() if "*" not in r.pattern]
        return [*self.own, *sorted(self.others), *literal]

    def resolve_cli_key(self, key: str) -> str:
        """The full name of a command-line key: exact, or the unique own key ending with it."""
        key = key.lstrip("+")  # Hydra's `+key=value` (add a key) means the same here
        if self.leaf_of(key) or self.known_elsewhere(key):
            return key
        by_leaf = [n for n in self.own if n.rsplit(".", 1)[-1] == key]
        if len(by_leaf) == 1:
            return by_leaf[0]
        if by_leaf:
            raise ConfigError(f"ambiguous config key {key!r}: {', '.join(by_leaf)}; give the full name")
        raise ConfigError(f"unknown config key {key!r}{_suggest(key, self.candidates())}")


# --- the untyped tree that interpolations resolve against ----------------------------------------


def _merge(base: dict, top: dict) -> dict:
    """`top` over `base`, recursively; an unset value ('???') in `top` keeps `base`'s."""
    out = dict(base)
    for k, v in top.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        elif v != MISSING or k not in out:
            out[k] = v
    return out


@functools.cache
def _defaults(cls) -> dict:
    """A schema's defaults as a plain dict (built once per process: each build merges them)."""
    tree = OmegaConf.to_container(OmegaConf.structured(cls))
    assert isinstance(tree, dict)  # a dataclass's container is a dict
    return tree


def _tree(schemas: list[type], file: dict, over: dict[str, Any]) -> DictConfig:
    """Defaults of the schemas, then the file, then the overrides; untyped, so that `${...}` may
    name any key: of this role, of another, or one accepted only to be ignored."""
    merged: dict = {}
    for cls in schemas:  # the building role last: its defaults win
        merged = _merge(merged, copy.deepcopy(_defaults(cls)))
    merged = _merge(merged, file)
    for key, value in over.items():
        for part in reversed(key.split(".")):
            value = {part: value}
        merged = _merge(merged, value)
    try:
        return OmegaConf.create(merged)
    except OmegaConfBaseException as e:
        raise ConfigError(f"cannot read the config: {e}") from None


def _value(tree: DictConfig, key: str):
    """The value of `key` with interpolations resolved; None for unset (`???`)."""
    try:
        value = OmegaConf.select(tree, key, throw_on_missing=False)
        if isinstance(value, (DictConfig, ListConfig)):
            value = OmegaConf.to_container(value, resolve=True)
    except OmegaConfBaseException as e:
        raise ConfigError(f"{key}: cannot resolve its value: {str(e).splitlines()[0]}") from None
    return value


# --- keys of no own field: other roles' keys, verl's keys, unknown keys --------------------------


def _names(keys: list[str]) -> str:
    return ", ".join(keys) if len(keys) <= 8 else f"{', '.join(keys[:3])} and {len(keys) - 3} more"


def _treat(schema: _Schema, keys: dict[str, str], tree) -> dict[str, verl_keys.Treatment]:
    """protocol/verl_keys' treatment of each of `keys` (key -> where given) that is no field of
    this schema; the other roles' fields are left out (they accept them silently)."""
    out = {}
    for key in keys:
        if schema.is_node(key) or (schema.shared and key in schema.others):
            continue
        if not schema.shared:
            out[key] = verl_keys.Treatment(verl_keys.UNKNOWN)
            continue

        def value(k: str = key):
            return _value(tree, k)

        out[key] = verl_keys.treat(key, value, value, schema.sft)
    return out


def _foreign(schema: _Schema, keys: dict[str, str], treated: dict) -> tuple[dict[str, tuple], list[str]]:
    """Act on the treatments `treated` of `keys` (key -> where it was given). Returns the
    aliases ({verl key: (rule, value)}) and one line per reason a key is ignored; raises for a
    refused value or a key in no schema."""
    aliases: dict[str, tuple] = {}
    ignored: dict = {}
    for key, t in treated.items():
        if t.verdict == verl_keys.UNKNOWN:
            raise ConfigError(f"unknown config key {key!r} ({keys[key]}){_suggest(key, schema.candidates())}")
        if t.verdict == verl_keys.REFUSED:
            raise ConfigError(f"{key}={t.value!r} ({keys[key]}): not supported: {t.reason}")
        if t.verdict == verl_keys.IGNORED and not t.quiet:
            ignored.setdefault(t.reason, []).append(key)
        elif t.verdict == verl_keys.APPLIED and t.value is not None:
            aliases[key] = (t.rule, t.value)
    return aliases, [f"ignored {_names(ks)}: {why}" for why, ks in ignored.items()]


def _set(schema: DictConfig, key: str, value, tp, name: str | None = None) -> None:
    """Set one value on the structured config; OmegaConf converts it to the field's type or
    fails. `name`: the key to blame (a verl spelling of `key`)."""
    inner, optional = _unwrap(tp)
    if value is None and not optional:
        return  # null: the field's default, as verl's configs use it
    if isinstance(value, str) and typing.get_origin(inner) is list and not value.startswith("${"):
        value = value.split(",")
    try:
        OmegaConf.update(schema, key, value, merge=False)
    except OmegaConfBaseException:
        raise ConfigError(f"{name or key}: expected {_type_name(tp)}, got {value!r}") from None


def _apply_aliases(
    schema: DictConfig, aliases: dict[str, tuple], given: dict[str, Any], own: dict[str, Any]
) -> list[str]:
    """Set each tandem key from its verl spelling unless it is given itself (then it wins, with a
    line if they differ) or is given as the verl placeholder the alias replaces."""
    notes = []
    for key, (rule, value) in aliases.items():
        target = rule.to
        if rule.convert is not None:
            value = rule.convert(value)
        if target not in own or value is None:
            continue
        if rule.convert is not None:  # a deprecated spelling: say what it became
            notes.append(f"{key} is deprecated: read as {target}={value!r}, as verl does")
        current = given.get(target)
        if current is None if rule.replaces is None else current == rule.replaces:
            _set(schema, target, value, own[target], key)
            continue
        trial = copy.deepcopy(schema)  # compare as typed values: '1.0' on the command line is 1.0
        _set(trial, target, value, own[target], key)
        if OmegaConf.select(trial, target) != (kept := OmegaConf.select(schema, target)):
            notes.append(f"ignored {key}={value!r}: {target}={kept!r} is set too and wins")
    return notes


# --- the typed config ------------------------------------------------------------------------------


def _typed(cls, values: dict[str, Any], own: dict[str, Any], aliases: dict[str, tuple]):
    """The dataclass instance from the given values and verl aliases; (config, alias notes)."""
    schema = OmegaConf.structured(cls)
    for key in getattr(cls, "REQUIRED", ()):  # a shared section's key this role must be given
        OmegaConf.update(schema, key, MISSING)
    for key, value in values.items():
        _set(schema, key, value, own[key])
    notes = _apply_aliases(schema, aliases, values, own)
    try:
        return OmegaConf.to_object(schema), notes
    except MissingMandatoryValue as e:
        raise ConfigError(f"{e.full_key}: required (set it as {e.full_key}=VALUE)") from None


def _check_bounds(key: str, value, meta) -> None:
    if value is None:
        return
    if meta.get("choices") is not None and value not in meta["choices"]:
        raise ConfigError(f"{key}: {value!r} is not one of {list(meta['choices'])}")
    bounds = [(b, meta.get(b)) for b in ("ge", "gt", "le") if meta.get(b) is not None]
    if bounds and isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}: must be a finite number, got {value!r}")
    for bound, limit in bounds:
        ok = {"ge": value >= limit, "gt": value > limit, "le": value <= limit}[bound]
        if not ok:
            word = {"ge": ">=", "gt": ">", "le": "<="}[bound]
            raise ConfigError(f"{key}: must be {word} {limit}, got {value!r}")


def validate(cfg, prefix: str = "") -> None:
    """Check bounds of every field, then each section's own `check()` for cross-field rules."""
    for f, tp in _fields(cfg):
        value = getattr(cfg, f.name)
        if _is_config(tp):
            validate(value, prefix + f.name + ".")
        else:
            _check_bounds(prefix + f.name, value, f.metadata)
    check = getattr(cfg, "check", None)
    if callable(check):
        check()


# --- entry points -------------------------------------------------------------------------------------


def _inputs(cls, overrides: dict[str, Any] | None, yaml_file: str | Path | None):
    """(the schema, the untyped tree, every key given -> where it was given)."""
    schema = _Schema.of(cls)
    file = _read_yaml(yaml_file) if yaml_file is not None else {}
    over = {}
    for k, v in (overrides or {}).items():
        key = schema.resolve_cli_key(k)
        over[key] = _cli_value(v, schema.own.get(key)) if isinstance(v, str) else v
    roles = [r for r in verl_keys.role_schemas() if r is not cls] if schema.shared else []
    tree = _tree([*roles, cls], file, over)
    where = {k: f"--config {yaml_file}" for k in _flatten(file, {*schema.own, *schema.others})}
    where.update({schema.leaf_of(k) or k: "command line" for k in over})
    return schema, tree, where


def load(
    cls, overrides: dict[str, Any] | None = None, yaml_file: str | Path | None = None, verdicts: dict | None = None
):
    """Build and validate a config; returns (config, warning lines), printing nothing.
    `verdicts`: merge this build's treatment of every key given into it (see `treatments`)."""
    schema, tree, where = _inputs(cls, overrides, yaml_file)
    values = {k: _value(tree, k) for k in where if k in schema.own}
    foreign = {k: w for k, w in where.items() if k not in schema.own}
    treated = _treat(schema, foreign, tree)
    if verdicts is not None:
        _merge_verdicts(verdicts, schema, where, treated)
    aliases, warnings = _foreign(schema, foreign, treated)
    cfg, notes = _typed(cls, values, schema.own, aliases)
    validate(cfg)
    return cfg, warnings + notes


_PRIORITY = (verl_keys.UNKNOWN, verl_keys.IGNORED, verl_keys.APPLIED, verl_keys.REFUSED)


def treatments(
    schemas: list[type], yaml_file: str | Path | None, overrides: dict[str, Any] | None = None
) -> dict[str, verl_keys.Treatment]:
    """How the schemas that read one file (the RL roles, or SFT) treat each key it and the
    overrides give: refused if any refuses it, else applied if any applies it (a field or an
    alias), else ignored (with the reason) or unknown. Raises nothing for a refused key."""
    out: dict[str, verl_keys.Treatment] = {}
    for cls in schemas:
        schema, tree, where = _inputs(cls, overrides, yaml_file)
        _merge_verdicts(
            out, schema, where, _treat(schema, {k: w for k, w in where.items() if k not in schema.own}, tree)
        )
    return out


def _merge_verdicts(out: dict, schema: _Schema, where: dict, foreign: dict) -> None:
    found = {k: verl_keys.Treatment(verl_keys.APPLIED) for k in where if k in schema.own}
    found.update(foreign)
    for key, t in found.items():
        if key not in out or _PRIORITY.index(t.verdict) > _PRIORITY.index(out[key].verdict):
            out[key] = t


def build(cls, overrides: dict[str, Any] | None = None, yaml_file: str | Path | None = None):
    """Build and validate a config from an optional YAML file and dotted overrides; print one
    line per verl key that does not apply (rank 0 only under torchrun)."""
    cfg, warnings = load(cls, overrides, yaml_file)
    if os.environ.get("RANK", "0") == "0":
        for line in warnings:
            print(f"config: {line}", file=sys.stderr)
    return cfg


def file_values(yaml_file: str | Path, keys: list[str], extra: dict[str, Any] | None = None) -> dict:
    """The resolved values a YAML file sets for `keys` (keys it does not set are left out);
    `extra` dotted values (e.g. root) are visible to its interpolations."""
    file = _read_yaml(yaml_file)
    given = _flatten(file, set(keys))
    tree = _tree(verl_keys.role_schemas(), file, extra or {})
    values = {k: _value(tree, k) for k in keys if k in given}
    return {k: v for k, v in values.items() if v is not None}


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def _default(f) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return "REQUIRED" if f.default in (MISSING, dataclasses.MISSING) else f.default


def usage(cls, prog: str, description: str) -> str:
    lines = [
        f"usage: {prog} [--config FILE.yaml] [key=value | --key=value | --key value ...]",
        "",
        description,
        "",
        "Keys are dotted as in verl. On the command line a key may be given by its last part "
        "(--flush_interval=30) only where exactly one key below ends with it; YAML files use "
        "full names and ${...} interpolation. A verl config file works as is: keys of the "
        "other role are accepted silently, verl keys that do not apply with one warning line "
        "each, and settings tandem cannot honour are refused (python -m protocol.verl_keys "
        "lists them).",
        "",
        "Keys:",
    ]
    for name, f, tp in leaves(cls):
        m = f.metadata
        bounds = [f"{w}{m[b]}" for b, w in (("ge", ">="), ("gt", ">"), ("le", "<=")) if m.get(b) is not None]
        if m.get("choices"):
            bounds.append("one of " + "|".join(map(str, m["choices"])))
        default = "REQUIRED" if name in getattr(cls, "REQUIRED", ()) else _default(f)
        lines.append(f"  {name} ({_type_name(tp)}, default {default!r}{'; ' + ', '.join(bounds) if bounds else ''})")
        if m.get("doc"):
            lines.append(f"      {m['doc']}")
    return "\n".join(lines)


def split_argv(argv: list[str]) -> tuple[dict[str, str], str | None, bool]:
    """Turn `k=v`, `--k=v`, `--k v` and `--config F` into (overrides, yaml_file, wants_help)."""
    overrides: dict[str, str] = {}
    yaml_file = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            return overrides, yaml_file, True
        key, eq, val = arg.lstrip("-").partition("=")
        if not eq:
            if not arg.startswith("--") or i + 1 >= len(argv):
                raise ConfigError(f"argument {arg!r}: expected key=value or --key value")
            val = argv[i + 1]
            i += 1
        if key == "config":
            yaml_file = val
        else:
            overrides[key] = val
        i += 1
    return overrides, yaml_file, False


def parse_cli(cls, argv: list[str] | None, prog: str, description: str):
    """Entry-point helper: print usage on --help, exit 2 with the field named on a bad value."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        overrides, yaml_file, wants_help = split_argv(argv)
        if wants_help:
            print(usage(cls, prog, description))
            raise SystemExit(0)
        return build(cls, overrides, yaml_file)
    except ConfigError as e:
        print(f"{prog}: config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
