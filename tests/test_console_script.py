"""The ``sparse-rl`` console script of pyproject.toml names a callable ``main``, the one
``run.py`` calls."""

from __future__ import annotations

import importlib
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import run  # noqa: E402  (run.py at the repository root)


def test_console_script_resolves_to_the_cli_main():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, attr = scripts["sparse-rl"].partition(":")
    main = getattr(importlib.import_module(module), attr)
    assert callable(main)
    assert main is run.main  # python run.py and sparse-rl are one command line
