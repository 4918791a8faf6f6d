"""The loading machinery of specmesh.config: YAML 1.2 booleans, typed coercion of a mapping into
frozen dataclasses (unknown keys and wrong types are errors naming their key path), merging.
Split out of specmesh.config to keep that module to the sections themselves."""

from __future__ import annotations

import dataclasses
import re
import types
import typing

import yaml

__all__ = ["ConfigError", "parse_yaml"]


class _Yaml12BoolLoader(yaml.SafeLoader):
    """YAML with only true/false as booleans, so `method: off` stays the string "off"."""


_Yaml12BoolLoader.yaml_implicit_resolvers = {
    ch: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:bool"]
    for ch, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Yaml12BoolLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))


def parse_yaml(text: str):
    return yaml.load(text, Loader=_Yaml12BoolLoader)  # noqa: S506 - a SafeLoader subclass


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range."""


def _check(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")


def _coerce(tp, value, key: str):
    """Convert a YAML value to the annotated type tp (dataclass, tuple, optional, scalar)."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key)
    if origin in (types.UnionType, typing.Union):
        if value is None:
            _check(type(None) in typing.get_args(tp), key, "may not be null")
            return None
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        for option in inner[:-1]:  # e.g. bool | str: true/false as booleans, anything else the string
            try:
                return _coerce(option, value, key)
            except ConfigError:
                pass
        return _coerce(inner[-1], value, key)
    if origin is tuple:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        _check(isinstance(value, (list, tuple)), key, "must be a list")
        return tuple(_coerce(typing.get_args(tp)[0], v, f"{key}[{i}]") for i, v in enumerate(value))
    if tp is float:
        _check(isinstance(value, (int, float)) and not isinstance(value, bool), key, "must be a number")
        return float(value)
    if tp is int:
        _check(isinstance(value, int) and not isinstance(value, bool), key, "must be an integer")
        return value
    if tp is bool:
        _check(isinstance(value, bool), key, "must be true or false")
        return value
    if tp is str:
        _check(isinstance(value, (str, int, float)) and not isinstance(value, bool), key, "must be a string")
        return str(value)
    raise ConfigError(f"{key}: unsupported type {tp}")


def _build(cls, data, key: str):
    if data is None:
        data = {}
    _check(isinstance(data, dict), key or "config", "must be a mapping")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    _check(not unknown, key or "config", f"unknown key(s) {', '.join(map(str, unknown))}")
    kwargs = {n: _coerce(hints[n], v, f"{key}.{n}" if key else n) for n, v in data.items()}
    return cls(**kwargs)


def _set_path(data: dict, path: list[str], value) -> None:
    for part in path[:-1]:
        node = data.get(part)
        if not isinstance(node, dict):
            node = data[part] = {}
        data = node
    data[path[-1]] = value


def _merge(base: dict, over: dict) -> dict:
    merged = dict(base)
    for k, v in over.items():
        merged[k] = _merge(merged[k], v) if isinstance(v, dict) and isinstance(merged.get(k), dict) else v
    return merged
