"""``docs/config_reference.md`` (``tools/gen_config_docs.py``) matches the config dataclasses:
every section and key of ``RunConfig``, nested sections included, with its type, default and
docstring description."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

GENERATOR = Path(__file__).resolve().parents[1] / "tools" / "gen_config_docs.py"


def load_generator():
    """``tools/gen_config_docs.py`` as a module (``tools`` is not a package)."""
    spec = importlib.util.spec_from_file_location("gen_config_docs", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_config_docs_are_current(capsys):
    assert load_generator().main(["--check"]) == 0, capsys.readouterr().err


def test_check_names_the_command_when_stale(tmp_path, monkeypatch, capsys):
    generator = load_generator()
    monkeypatch.setattr(generator, "OUTPUT", tmp_path / "docs" / "config_reference.md")
    monkeypatch.setattr(generator, "ROOT", tmp_path)
    assert generator.main(["--check"]) == 1  # missing
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "config_reference.md").write_text(generator.render() + "edited\n")
    assert generator.main(["--check"]) == 1  # stale
    assert "python tools/gen_config_docs.py" in capsys.readouterr().err


def test_every_key_of_the_run_config_is_documented():
    """Each dataclass field under RunConfig, at any depth, has its own row."""
    generator = load_generator()
    text = generator.render()
    for section in generator.sections():
        for field in dataclasses.fields(section.cls):
            key = f"{section.path}.{field.name}" if section.path else field.name
            assert f"| `{key}` |" in text, key


@dataclasses.dataclass(frozen=True)
class Inner:
    """An inner section.

    Attributes:
      k: the inner key,
        on two lines.
    """

    k: int = 1


@dataclasses.dataclass(frozen=True)
class Outer:
    """Outer.

    Attributes:
      inner: the nested one.
      name, other: two keys sharing a text.
    """

    inner: Inner = Inner(k=5)
    opt: Inner | None = None
    name: str = "a"
    other: float = 0.5


def test_nested_sections_are_recursed_into_and_described():
    """A section nested in a section (``Outer`` above, standing for e.g. compression.eviction) gets its own table, its keys'
    defaults from the parent's default instance and their text from ``Attributes:``."""
    generator = load_generator()
    found = {s.path: s for s in generator.sections(Outer)}
    assert set(found) == {"", "inner", "opt"}
    assert generator.docstring_entries(Inner) == {"k": "the inner key, on two lines."}
    assert generator.docstring_entries(Outer)["other"] == "two keys sharing a text."
    table = generator.render_section(found["inner"], {"inner": "`inner`", "opt": "`opt`"})
    assert "| `inner.k` | `int` | `5` (`Inner()`: `1`) | the inner key, on two lines. |" in table
    assert "`1`" in generator.render_section(found["opt"], {})
