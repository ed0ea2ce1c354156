"""The configuration language every tandem process speaks.

Configs are nested dataclasses declared beside the component that owns them (rollout/config.py,
trainer/config.py, buffer/config.py). Values come from, in order: field defaults, an optional
YAML file (`--config FILE`), then dotted overrides as in verl (`trainer.save_freq=10`,
`--buffer.flush_interval=30`, or a unique leaf name such as `--flush_interval=30`).
Every field carries a doc string and optional bounds; a bad value is rejected at start-up with a
message naming the field.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import sys
import types
import typing
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A config value or key is invalid; the message names the field."""


def F(default: Any = dataclasses.MISSING, doc: str = "", *, ge=None, gt=None, le=None,
      choices=None, factory=None):
    """A documented config field with optional bounds (ge/gt/le) or a set of choices."""
    meta = {"doc": doc, "ge": ge, "gt": gt, "le": le, "choices": choices}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _fields(cls_or_obj):
    hints = typing.get_type_hints(cls_or_obj if isinstance(cls_or_obj, type) else type(cls_or_obj))
    return [(f, hints[f.name]) for f in dataclasses.fields(cls_or_obj)]


def _is_config(tp) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def leaves(cls, prefix: str = ""):
    """Yield (dotted_name, field, type) for every leaf field of a config class."""
    for f, tp in _fields(cls):
        name = prefix + f.name
        if _is_config(tp):
            yield from leaves(tp, name + ".")
        else:
            yield name, f, tp


def _yaml(text: str, key: str):
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{key}: cannot parse {text!r}: {str(e).splitlines()[0]}") from None


def _coerce(value: Any, tp, key: str):
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null", "")):
            if type(None) in args:
                return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], key)
    if origin is list:
        if isinstance(value, str):
            value = _yaml(value, key) if value.strip().startswith("[") else value.split(",")
        if not isinstance(value, (list, tuple)):
            value = [value]
        return [_coerce(v, args[0] if args else str, key) for v in value]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("true", "1", "yes", "on"):
            return True
        if str(value).lower() in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{key}: expected true/false, got {value!r}")
    if tp in (int, float, str):
        try:
            if tp is int and isinstance(value, str):
                value = _yaml(value, key)  # "3.5" and "true" must not become 3 and 1
            if tp is int and (isinstance(value, bool) or
                              (isinstance(value, float) and not value.is_integer())):
                raise ValueError
            return tp(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected {tp.__name__}, got {value!r}") from None
    return value


def _check_bounds(key: str, value, meta) -> None:
    if value is None:
        return
    if isinstance(value, float) and not math.isfinite(value):  # inf passes gt/ge bounds
        raise ConfigError(f"{key}: must be a finite number, got {value!r}")
    if meta.get("choices") is not None and value not in meta["choices"]:
        raise ConfigError(f"{key}: {value!r} is not one of {list(meta['choices'])}")
    for bound, ok, word in (("ge", lambda v, b: v >= b, ">="), ("gt", lambda v, b: v > b, ">"),
                            ("le", lambda v, b: v <= b, "<=")):
        b = meta.get(bound)
        if b is not None and not ok(value, b):
            raise ConfigError(f"{key}: must be {word} {b}, got {value!r}")


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _resolve_key(cls, key: str) -> str:
    names = [n for n, _, _ in leaves(cls)]
    if key in names:
        return key
    by_leaf = [n for n in names if n.rsplit(".", 1)[-1] == key]
    if len(by_leaf) == 1:
        return by_leaf[0]
    hint = difflib.get_close_matches(key, names, n=3)
    extra = f" (did you mean {', '.join(hint)}?)" if hint else ""
    if len(by_leaf) > 1:
        extra = f" (ambiguous: {', '.join(by_leaf)})"
    raise ConfigError(f"unknown config key {key!r}{extra}")


def _construct(cls, values: dict[str, Any], prefix: str = ""):
    kwargs = {}
    for f, tp in _fields(cls):
        name = prefix + f.name
        if _is_config(tp):
            kwargs[f.name] = _construct(tp, values, name + ".")
        elif name in values:
            kwargs[f.name] = _coerce(values[name], tp, name)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{name}: required (set it as {name}=VALUE)")
    return cls(**kwargs)


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


def build(cls, overrides: dict[str, Any] | None = None, yaml_file: str | Path | None = None):
    """Build and validate a config from an optional YAML file and dotted overrides."""
    values: dict[str, Any] = {}
    if yaml_file is not None:
        try:
            loaded = yaml.safe_load(Path(yaml_file).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"--config {yaml_file}: cannot read: {e}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"--config {yaml_file}: top level must be a mapping")
        values.update({_resolve_key(cls, k): v for k, v in _flatten(loaded).items()})
    for k, v in (overrides or {}).items():
        values[_resolve_key(cls, k)] = v
    cfg = _construct(cls, values)
    validate(cfg)
    return cfg


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def usage(cls, prog: str, description: str) -> str:
    lines = [f"usage: {prog} [--config FILE.yaml] [key=value | --key=value ...]", "", description,
             "", "Keys (dotted as in verl; a unique last part also works, e.g. --flush_interval=30):"]
    for name, f, tp in leaves(cls):
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else "REQUIRED")
        bounds = []
        m = f.metadata
        for b, w in (("ge", ">="), ("gt", ">"), ("le", "<=")):
            if m.get(b) is not None:
                bounds.append(f"{w}{m[b]}")
        if m.get("choices"):
            bounds.append("one of " + "|".join(map(str, m["choices"])))
        tname = getattr(tp, "__name__", str(tp).replace("typing.", ""))
        lines.append(f"  {name} ({tname}, default {default!r}{'; ' + ', '.join(bounds) if bounds else ''})")
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
