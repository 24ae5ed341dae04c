"""Where a result came from, recorded beside it: the commit, the date, the machine and the
command. Generated result pages print these next to every table."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "transformers",
            "tokenizers")


def environment() -> str:
    """One line: Python, the packages that set the numbers, the machine."""
    versions = []
    for name in PACKAGES:
        try:
            versions.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return (f"Python {platform.python_version()}, {', '.join(versions)}; "
            f"{platform.machine()} {platform.system()}, {os.cpu_count()} CPU cores")


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.rstrip("\n")


def commit() -> str:
    """The checkout's short commit, with ``-dirty`` when a tracked file differs from it;
    ``unknown`` outside a git checkout."""
    try:
        head = _git("rev-parse", "--short=7", "HEAD")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("-dirty" if dirty_files() else "")


def dirty_files() -> list[str]:
    """The tracked files that differ from the checkout's commit (empty outside git)."""
    try:
        return [line[3:] for line in _git("status", "--porcelain", "--untracked-files=no"
                                          ).splitlines()]
    except (OSError, subprocess.CalledProcessError):
        return []


def provenance(argv: list[str] | None = None) -> dict[str, str]:
    """``commit``, ``dirty`` (the tracked files that differ from it), ``date`` (UTC),
    ``machine`` and ``command`` (the script relative to the repository root and its
    arguments, as typed)."""
    argv = sys.argv if argv is None else argv
    script = Path(argv[0]).resolve()
    try:
        script = script.relative_to(ROOT)
    except ValueError:
        pass
    return {"commit": commit(), "dirty": dirty_files(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": environment(), "command": " ".join(["python", str(script), *argv[1:]])}
