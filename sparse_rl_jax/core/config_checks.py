"""The one way a config dataclass validates itself.

Every check takes the config and a field name and raises :class:`FieldError`, whose message
names the dotted field, its value and the rule::

    EvictionConfig.budget=8 must be an int > window (8)

Loaded from YAML (``config_io``), the owner is replaced by the field's place in the run
config, so the same error reads ``compression.eviction.budget=8 must be an int > window (8)``.
"""

from __future__ import annotations

import math
from typing import Any, NoReturn


class ConfigError(ValueError):
    """A config file, override or value that does not fit the config schema."""


class FieldError(ConfigError):
    """One field breaks a rule; the message is ``{owner}.{field}={value!r} {rule}``.

    Attributes:
      owner: the config's class name, or its place in a config tree (``model.lora``).
      field: the field (``rank``), or a dotted path for a rule that spans sections.
      rule: what the value must satisfy (``must be an int >= 1``).
      value: the offending value.
    """

    def __init__(self, owner: str, field: str, rule: str, value: Any):
        self.owner, self.field, self.rule, self.value = owner, field, rule, value
        name = f"{owner}.{field}" if owner else field
        super().__init__(f"{name}={value!r} {rule}")

    def at(self, path: str) -> FieldError:
        """The same error named by the field's place in a config tree (``""``: the root)."""
        return FieldError(path, self.field, self.rule, self.value)


_OWN_VALUE = object()


def reject(config: Any, field: str, rule: str, value: Any = _OWN_VALUE) -> NoReturn:
    """Raises :class:`FieldError` for ``config``'s ``field`` (owner: the config's class name);
    ``value`` defaults to the field's own."""
    if value is _OWN_VALUE:
        value = getattr(config, field)
    raise FieldError(type(config).__name__, field, rule, value)


def reject_moved(owner: str, keys, moved: dict[str, str]) -> None:
    """Raises :class:`ConfigError` naming the new place of each of ``keys`` that ``moved``
    maps (``{old key: its place now}``): ``compression.budget moved to
    compression.eviction.budget``."""
    found = [key for key in keys if key in moved]
    if found:
        raise ConfigError("; ".join(f"{owner}.{key} moved to {owner}.{moved[key]}"
                                    for key in found))


def check(ok: bool, config: Any, field: str, rule: str, value: Any = _OWN_VALUE) -> None:
    """:func:`reject` unless ``ok``."""
    if not ok:
        reject(config, field, rule, value)


def is_int(value: Any) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite int or float that is not a bool."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def check_choice(config: Any, field: str, allowed: tuple, optional: bool = False) -> None:
    """The field is one of ``allowed`` (or None when ``optional``)."""
    value = getattr(config, field)
    if optional and value is None:
        return
    rule = f"must be one of {tuple(allowed)}" + (" or null" if optional else "")
    check(value in allowed, config, field, rule)


def check_bool(config: Any, field: str, optional: bool = False) -> None:
    """The field is true or false (or None when ``optional``)."""
    value = getattr(config, field)
    ok = isinstance(value, bool) or (optional and value is None)
    check(ok, config, field, "must be true, false or null" if optional
          else "must be true or false")


def check_int(config: Any, field: str, minimum: int = 0, rule: str | None = None,
              optional: bool = False) -> None:
    """The field is an int >= ``minimum`` (or None when ``optional``); ``rule`` words the
    bound when it is not a plain minimum."""
    value = getattr(config, field)
    if optional and value is None:
        return
    rule = rule or f"must be {'None or ' if optional else ''}an int >= {minimum}"
    check(is_int(value) and value >= minimum, config, field, rule)


def check_number(config: Any, field: str, *, gt: float | None = None, ge: float | None = None,
                 lt: float | None = None, le: float | None = None, rule: str | None = None,
                 optional: bool = False) -> None:
    """The field is a finite number in the interval the bounds give (or None when
    ``optional``); ``rule`` words the interval when the default wording would not say why."""
    value = getattr(config, field)
    if optional and value is None:
        return
    check(is_number(value), config, field, "must be a finite number")
    ok = ((gt is None or value > gt) and (ge is None or value >= ge)
          and (lt is None or value < lt) and (le is None or value <= le))
    if not ok:
        prefix = "must be None or " if optional else "must be "
        reject(config, field, rule or prefix + _interval(gt, ge, lt, le))


def _interval(gt, ge, lt, le) -> str:
    """``> 0``, ``in [0, 1)`` ...: the words of a bound check."""
    low = ("(", gt) if gt is not None else ("[", ge) if ge is not None else None
    high = (lt, ")") if lt is not None else (le, "]") if le is not None else None
    if low and high:
        return f"in {low[0]}{low[1]}, {high[0]}{high[1]}"
    if low:
        return f"{'>' if low[0] == '(' else '>='} {low[1]}"
    return f"{'<' if high[1] == ')' else '<='} {high[0]}"


def check_text(config: Any, field: str, rule: str = "must be a non-empty string") -> None:
    """The field is a non-empty string."""
    value = getattr(config, field)
    check(isinstance(value, str) and bool(value.strip()), config, field, rule)


def check_distinct(config: Any, field: str, item_ok, rule: str) -> None:
    """The field is a tuple of distinct items, each accepted by ``item_ok``."""
    value = getattr(config, field)
    ok = (isinstance(value, tuple) and all(item_ok(x) for x in value)
          and len(set(value)) == len(value))
    check(ok, config, field, rule)
