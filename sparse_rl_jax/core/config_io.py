"""Nested frozen-dataclass configs from YAML files and dotted ``key=value`` overrides.

Errors name the dotted field path (``sampling.top_p``) and, for unknown keys, the allowed
ones, so a typo in a config or on the command line fails before any work starts.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

from sparse_rl_jax.core.config_checks import ConfigError, FieldError, reject_moved

T = TypeVar("T")


def _field_types(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Converts a YAML value to the annotated type ``tp`` (dataclasses recursively)."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping for {tp.__name__}, got {value!r}")
        return from_dict(tp, value, prefix=path)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        present = [arg for arg in args if arg is not type(None)]
        if len(present) == 1:  # Optional[X]: X's own error, which names the field
            return _coerce(value, present[0], path)
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, path)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{path}: {value!r} fits none of {tp}: {'; '.join(errors)}")
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        args = typing.get_args(tp)
        item_tp = args[0] if len(args) == 2 and args[1] is Ellipsis else None
        if item_tp is None and len(args) != len(value):
            raise ConfigError(f"{path}: expected {len(args)} items, got {len(value)}")
        return tuple(
            _coerce(v, item_tp or args[i], f"{path}[{i}]") for i, v in enumerate(value)
        )
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        return dict(value)
    if origin is typing.Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{path}: {value!r} is not one of {list(allowed)}")
        return value
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected true/false, got {value!r}")
    if tp is float:
        return _finite_float(value, path)
    if tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if tp is str and isinstance(value, str):
        return value
    raise ConfigError(f"{path}: expected {getattr(tp, '__name__', tp)}, got {value!r}")


def _finite_float(value: Any, path: str) -> float:
    """A finite float from a YAML number (or a string like "2e-4", which YAML 1.1 reads as
    text); inf and nan are refused, since no float setting means anything with them."""
    number = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            pass
    if number is None:
        raise ConfigError(f"{path}: expected float, got {value!r}")
    if not math.isfinite(number):
        raise ConfigError(f"{path}: must be a finite number, got {value!r}")
    return number


def _parse_override(item: str, raw: str) -> Any:
    """The YAML value of one ``key=value`` override (plain YAML only: no tags)."""
    if not raw.strip():
        return ""
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError as e:
        reason = str(e).splitlines()[0]
        raise ConfigError(f"override {item!r}: value is not plain YAML ({reason})") from e


def from_dict(cls: type[T], data: dict[str, Any], prefix: str = "") -> T:
    """Builds dataclass ``cls`` from a nested dict; unknown keys and bad values name the path.

    A :class:`FieldError` raised by ``cls``'s own ``__post_init__`` is re-raised named by the
    section path (``loss.eps_low``); any other validation error becomes a
    :class:`ConfigError` prefixed with it. An unknown key that ``cls.MOVED_KEYS`` (when it
    has one) maps is refused with its new place (``compression.budget moved to
    compression.eviction.budget``).
    """
    types_ = _field_types(cls)
    unknown = sorted(set(data) - set(types_))
    if unknown:
        where = prefix or cls.__name__
        reject_moved(where, unknown, getattr(cls, "MOVED_KEYS", {}))
        dotted = [f"{prefix}.{k}" if prefix else k for k in unknown]
        raise ConfigError(
            f"{where}: unknown key(s) {dotted}; allowed: {sorted(types_)}"
        )
    defaults = _section_defaults(cls)
    kwargs = {}
    for name, value in data.items():
        if name in defaults and isinstance(value, dict):
            # A partial section overrides only the keys it names; the rest keep the
            # parent's default for that section (not the section class's own defaults).
            value = _merge(_partial_base(defaults[name]), value)
        kwargs[name] = _coerce(value, types_[name], f"{prefix}.{name}" if prefix else name)
    try:
        return cls(**kwargs)
    except FieldError as e:
        if e.owner != cls.__name__:
            raise
        raise e.at(prefix) from e
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{prefix or cls.__name__}: {e}") from e


def _section_defaults(cls) -> dict[str, Any]:
    """Default values of the fields of ``cls`` that are themselves dataclasses."""
    out = {}
    for f in dataclasses.fields(cls):
        factory = f.default_factory
        value = factory() if factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(value):
            out[f.name] = value
    return out


def _partial_base(default: Any) -> dict[str, Any]:
    """The dict a partial section is merged onto: ``to_dict(default)``, except that a field
    declared ``None`` by default whose value ``default`` derived in ``__post_init__`` (the
    value it gets again when set back to None) is None again, so it is derived anew from
    the merged fields (``correction.kind=tis`` gets tis's ``normalize``, not the default
    kind's). A value the parent set on purpose (one the section would not derive) stays."""
    base = {}
    for f in dataclasses.fields(default):
        value = getattr(default, f.name)
        if dataclasses.is_dataclass(value):
            base[f.name] = _partial_base(value)
            continue
        base[f.name] = to_dict(value)
        if f.default is None and value is not None:
            try:
                derived = getattr(dataclasses.replace(default, **{f.name: None}), f.name)
            except (TypeError, ValueError):
                continue
            if derived == value:
                base[f.name] = None
    return base


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            value = _merge(merged[key], value)
        merged[key] = value
    return merged


def to_dict(config: Any, used_only: bool = False) -> Any:
    """The plain nested-dict (YAML-ready) form of a dataclass config: every field, or with
    ``used_only`` only the sections of a config with ``used_sections`` (the sections its
    settings read, ``CompressionConfig.used_sections``) that it names; the full form is the
    one that loads back."""
    if dataclasses.is_dataclass(config):
        used = getattr(config, "used_sections", None) if used_only else None
        out = {}
        for f in dataclasses.fields(config):
            value = getattr(config, f.name)
            if used is None or f.name in used or not dataclasses.is_dataclass(value):
                out[f.name] = to_dict(value, used_only)
        return out
    if isinstance(config, tuple):
        return [to_dict(v, used_only) for v in config]
    return config


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Returns a copy of ``data`` with ``a.b.c=value`` overrides applied (values parsed as YAML)."""
    data = copy.deepcopy(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key.path=value")
        node = data
        parts = key.strip().split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a section")
            node = child
        node[parts[-1]] = _parse_override(item, raw)
    return data


def read_yaml(path: str | Path, _chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A YAML config as a dict, with its ``base:`` files (a path or a list, relative to the
    file) merged underneath it in order."""
    path = Path(path).resolve()
    if path in _chain:
        raise ConfigError(f"config file {path} includes itself through 'base'")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at top level")
    bases = data.pop("base", [])
    bases = [bases] if isinstance(bases, str) else bases
    if not isinstance(bases, list) or not all(isinstance(b, str) and b for b in bases):
        raise ConfigError(f"config file {path}: 'base' must be a file path or a list of file "
                          f"paths, got {bases!r}")
    merged: dict[str, Any] = {}
    for base in bases:
        merged = _merge(merged, read_yaml(path.parent / base, _chain + (path,)))
    return _merge(merged, data)


def load_config(
    cls: type[T], paths: str | Path | list | tuple | None, overrides: list[str] = ()
) -> T:
    """Loads ``cls`` from YAML file(s) (merged in order; None = defaults) plus overrides."""
    if paths is None:
        paths = []
    elif isinstance(paths, (str, Path)):
        paths = [paths]
    data: dict[str, Any] = {}
    for path in paths:
        data = _merge(data, read_yaml(path))
    return from_dict(cls, apply_overrides(data, list(overrides)))


def save_config(config: Any, path: str | Path) -> None:
    """Writes the resolved config as YAML (what the run actually used)."""
    Path(path).write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
