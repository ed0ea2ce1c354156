"""The building blocks of config schemas (protocol/config.py is the language built on them):
`F` declares a documented field, `leaves` walks a schema, `yaml_leaves` a YAML file. A module of
its own so that protocol/verl_keys.py can walk schemas without importing protocol/config.py,
which imports it."""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
import typing
from typing import Any

import yaml
from omegaconf import MISSING


class ConfigError(ValueError):
    """A config value or key is invalid; the message names the field."""


def F(default: Any = dataclasses.MISSING, doc: str = "", *, ge=None, gt=None, le=None, choices=None, factory=None):
    """A documented config field with optional bounds (ge/gt/le) or a set of choices. Without a
    default it is required: OmegaConf's MISSING ('???'), so that a section with a required field
    can still be built empty as its parent's default."""
    meta = {"doc": doc, "ge": ge, "gt": gt, "le": le, "choices": choices}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=MISSING if default is dataclasses.MISSING else default, metadata=meta)


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


@functools.lru_cache(maxsize=1)
def _loader() -> type:
    """OmegaConf's YAML dialect (its float and no-timestamp resolvers, duplicate keys refused)
    on libyaml's parser where installed: verl's full configs have ~900 keys, which the pure
    Python parser takes most of a second for, in every process."""
    from omegaconf._utils import get_yaml_loader

    base: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

    class Loader(base):
        yaml_implicit_resolvers = get_yaml_loader().yaml_implicit_resolvers

        def construct_mapping(self, node, deep=False):
            keys = [k.value for k, _ in node.value if k.tag == yaml.resolver.BaseResolver.DEFAULT_SCALAR_TAG]
            if len(keys) != len(set(keys)):
                dup = next(k for k in keys if keys.count(k) > 1)
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark, f"found duplicate key {dup}"
                )
            return super().construct_mapping(node, deep=deep)

    return Loader


@functools.lru_cache(maxsize=16)
def _parse_yaml(path: str, _stamp) -> Any:
    with open(path) as f:
        return yaml.load(f, Loader=_loader())


def _read_yaml(path) -> dict:
    """The file as a plain dict, its interpolations unresolved (parsed once per version of the
    file: every role schema reads it)."""
    try:
        st = os.stat(path)
        loaded = _parse_yaml(os.path.abspath(path), (st.st_mtime_ns, st.st_size))
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"--config {path}: cannot read: {e}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"--config {path}: top level must be a mapping")
    return copy.deepcopy(loaded)


def _flatten(d: dict, stops: set[str], prefix: str = "") -> dict[str, Any]:
    """Dotted leaf keys of a nested dict; a key in `stops` (a schema leaf) is a leaf whatever its value."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v and key not in stops:
            out.update(_flatten(v, stops, key + "."))
        else:
            out[key] = v
    return out


def yaml_leaves(path) -> list[str]:
    """Every dotted leaf key of a YAML file."""
    return list(_flatten(_read_yaml(path), set()))
