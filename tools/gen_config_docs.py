#!/usr/bin/env python
"""Writes ``docs/config_reference.md``: every YAML key of the run config, from the dataclasses.

  python tools/gen_config_docs.py           # (re)write docs/config_reference.md
  python tools/gen_config_docs.py --check   # exit 1 when docs/config_reference.md is stale

It walks ``RunConfig`` with ``dataclasses.fields`` and ``typing.get_type_hints``: every field
whose type is a config dataclass (or an optional one) is a YAML section, recursed into at any
depth (``data.walk``, ``model.lora``, ``compression.<sub>``); every other field is a key. For
each key it writes the type, the default a YAML file or override starts from (the embedded
default's value, i.e. ``RunConfig()``'s, with the class's own default beside it where they
differ) and the description from the class docstring (its ``Attributes:`` entry, or a
``name: text`` entry where the docstring has no such heading). ``tests/test_config_docs.py``
runs the check, so a config field added, removed or re-documented without regenerating fails
the tests.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import re
import sys
import types
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "docs" / "config_reference.md"
COMMAND = "python tools/gen_config_docs.py"

sys.path.insert(0, str(ROOT))  # document this checkout's package, not an installed one

from tools import generated_page  # noqa: E402

from sparse_rl_jax import RunConfig  # noqa: E402

_MISSING = dataclasses.MISSING
# One docstring entry: ``name: text`` or ``name_a, name_b: text`` (shared description).
_ENTRY = re.compile(r"^(\s*)`{0,2}([A-Za-z_]\w*(?:`{0,2}\s*,\s*`{0,2}[A-Za-z_]\w*)*)`{0,2}\s*:\s+(.*)$")


class Section(typing.NamedTuple):
    """One YAML section: its dotted path, its class, and the instance its defaults come from
    (None when the section itself defaults to null: the class's own defaults then apply)."""

    path: str
    cls: type
    default: object | None


def dataclass_of(tp) -> type | None:
    """The config dataclass a field's type names (``X``, ``X | None``), else None."""
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return tp
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        found = [dataclass_of(arg) for arg in typing.get_args(tp)]
        found = [cls for cls in found if cls is not None]
        if len(found) == 1:
            return found[0]
    return None


def declared_default(field: dataclasses.Field):
    """The field's own default (``default`` or ``default_factory()``), or ``_MISSING``."""
    if field.default is not _MISSING:
        return field.default
    if field.default_factory is not _MISSING:
        return field.default_factory()
    return _MISSING


def sections(cls: type = RunConfig, path: str = "", default: object | None = None,
             out: list[Section] | None = None) -> list[Section]:
    """Every section under ``cls``, depth first, in field order (the root first, as ``""``)."""
    out = [] if out is None else out
    if default is None:
        try:
            default = cls()
        except TypeError:  # a section with required fields has no default instance
            default = None
    out.append(Section(path, cls, default))
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        sub = dataclass_of(hints[field.name])
        if sub is None:
            continue
        value = getattr(default, field.name) if default is not None else declared_default(field)
        value = value if dataclasses.is_dataclass(value) else None
        sections(sub, f"{path}.{field.name}" if path else field.name, value, out)
    return out


def docstring_entries(cls: type) -> dict[str, str]:
    """``{field: description}`` from ``cls``'s docstring: the entries under ``Attributes:``
    when it has that heading, else every ``name: text`` line whose names are fields;
    continuation lines (indented deeper than the entry) are joined with spaces."""
    names = {f.name for f in dataclasses.fields(cls)}
    lines = (inspect.getdoc(cls) or "").splitlines()
    heading = [i for i, line in enumerate(lines) if line.strip() == "Attributes:"]
    if heading:
        lines = lines[heading[0] + 1:]
    entries: dict[str, str] = {}
    current: list[str] | None = None
    indent = 0
    for line in lines:
        match = _ENTRY.match(line)
        keys = ([k.strip(" `") for k in match.group(2).split(",")] if match else [])
        if match and keys and all(k in names for k in keys):
            current, indent = [match.group(3).strip()], len(match.group(1))
            for key in keys:
                entries[key] = current  # shared list: the continuation joins every name
            continue
        deeper = line.strip() and len(line) - len(line.lstrip()) > indent
        if current is not None and deeper:
            current.append(line.strip())
        else:
            current = None
            if heading and line.strip() and len(line) - len(line.lstrip()) == 0:
                break  # the next heading (``Raises:``, prose) ends the Attributes block
    return {key: " ".join(text) for key, text in entries.items()}


def summary(cls: type) -> str:
    """The docstring's first paragraph, on one line."""
    doc = inspect.getdoc(cls) or ""
    return " ".join(doc.split("\n\n")[0].split())


def type_name(tp) -> str:
    """A short readable form of an annotation: ``int``, ``"rkv" | "snapkv"``, ``float | None``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is type(None):
        return "None"
    if origin is typing.Literal:
        return " | ".join(f'"{a}"' if isinstance(a, str) else repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        inner = ", ".join("..." if a is Ellipsis else type_name(a) for a in args)
        return f"{name}[{inner}]"
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def yaml_value(value) -> str:
    """A default as it would be written in YAML (``null``, ``true``, ``[0, 1]``, ``5e-05``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, enum.Enum):
        return yaml_value(value.value)
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(yaml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {yaml_value(v)}" for k, v in value.items()) + "}"
    return str(value)


def cell(text: str) -> str:
    """Text safe inside a markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def anchor(path: str) -> str:
    """GitHub's anchor of the heading ``## `path` ``."""
    return re.sub(r"[^\w\- ]", "", path.lower()).replace(" ", "-")


def code(text: str) -> str:
    """``text`` as inline code, with a longer fence when it holds a backtick."""
    fence = "``" if "`" in text else "`"
    pad = " " if fence == "``" else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def default_cell(section: Section, field: dataclasses.Field, sub: type | None) -> str:
    """The YAML default of one key, and the class's own where the embedded default differs."""
    own = declared_default(field)
    if section.default is not None:
        value = getattr(section.default, field.name)
    else:
        value = own
    if sub is not None:
        return "null (section unset)" if value is None else "section"
    if value is _MISSING:
        return "required"
    text = code(yaml_value(value))
    if own is not _MISSING and not dataclasses.is_dataclass(own) and own != value:
        text += f" (`{section.cls.__name__}()`: {code(yaml_value(own))})"
    return text


def render_section(section: Section, children: dict[str, str]) -> str:
    """One section's heading, summary and key table."""
    cls, hints, docs = section.cls, typing.get_type_hints(section.cls), docstring_entries(section.cls)
    title = section.path or "top level"
    lines = [f"## {code(title) if section.path else title}", "",
             f"`{cls.__name__}` in `{cls.__module__}`. {summary(cls)}".rstrip(), ""]
    if section.default is None and section.path:
        lines += ["Unset (null) by default; when set, its keys default as below.", ""]
    lines += ["| key | type | default | description |", "|---|---|---|---|"]
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        key = f"{section.path}.{field.name}" if section.path else field.name
        sub = dataclass_of(hints[field.name])
        kind = cell(type_name(hints[field.name]))
        description = cell(docs.get(field.name, ""))
        if sub is not None:
            description = description or cell(summary(sub))
            link = f"[`{key}`](#{anchor(children[key])})"
            description = (description + " " if description else "") + f"Keys: {link}."
        lines.append(f"| `{key}` | {code(kind) if kind else ''} | "
                     f"{default_cell(section, field, sub)} | {description} |")
    lines.append("")
    return "\n".join(lines)


def render() -> str:
    """The whole of ``docs/config_reference.md``."""
    found = sections()
    headings = {s.path: f"`{s.path}`" if s.path else "top level" for s in found}
    header = [
        "# Configuration reference", "",
        f"Generated by `{COMMAND}` from the config dataclasses (`RunConfig` and the sections",
        "it nests); do not edit by hand. Each section is a YAML mapping, each key a dotted",
        "`key=value` override (`python run.py sampling.temperature=0.7`). The default is what",
        "the embedded default (`python run.py` with no `--config`) uses and what a YAML file",
        "that leaves the key out gets; where the section class's own default differs (what",
        "`SectionClass()` gives in Python), it follows in parentheses. How files, `base:` chains",
        "and overrides combine: [configuration.md](configuration.md).", "",
        *(f"* [{headings[s.path]}](#{anchor(headings[s.path])})" for s in found), "", ""]
    return "\n".join(header) + "\n".join(render_section(s, headings) for s in found)


def main(argv: list[str] | None = None) -> int:
    """Writes docs/config_reference.md, or with ``--check`` returns 1 (and says so) when it is stale."""
    return generated_page.main(argv, description=__doc__, render=render, output=OUTPUT,
                               command=COMMAND, source="the config dataclasses")


if __name__ == "__main__":
    sys.exit(main())
