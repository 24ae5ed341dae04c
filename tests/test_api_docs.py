"""The public API: every ``sparse_rl_jax.__all__`` name resolves and is documented, and
``docs/api.md`` (``tools/gen_api_docs.py``) matches the docstrings."""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path

import pytest

import sparse_rl_jax

GENERATOR = Path(__file__).resolve().parents[1] / "tools" / "gen_api_docs.py"


def load_generator():
    """``tools/gen_api_docs.py`` as a module (``tools`` is not a package)."""
    spec = importlib.util.spec_from_file_location("gen_api_docs", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", sparse_rl_jax.__all__)
def test_public_name_resolves_with_a_docstring(name):
    assert inspect.getdoc(getattr(sparse_rl_jax, name)), f"sparse_rl_jax.{name} has no docstring"


def test_all_has_no_duplicates():
    assert len(set(sparse_rl_jax.__all__)) == len(sparse_rl_jax.__all__)


def test_api_docs_are_current(capsys):
    assert load_generator().main(["--check"]) == 0, capsys.readouterr().err


def test_check_names_the_command_when_stale(tmp_path, monkeypatch, capsys):
    generator = load_generator()
    monkeypatch.setattr(generator, "OUTPUT", tmp_path / "docs" / "api.md")
    monkeypatch.setattr(generator, "ROOT", tmp_path)
    assert generator.main(["--check"]) == 1  # missing
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "api.md").write_text(generator.render() + "edited by hand\n")
    assert generator.main(["--check"]) == 1  # stale
    assert "python tools/gen_api_docs.py" in capsys.readouterr().err
