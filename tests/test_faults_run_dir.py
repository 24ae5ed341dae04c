"""Fault matrix, run directories (issues 17 and 21): an unusable path is one ``error:`` line;
a refused resume changes nothing; the config hash ignores where a run lives; a lock held by
a live run is refused, one left by a dead process is taken over, and one left by a run on
another host is taken over only with ``--take-over``."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from fault_helpers import existing_run, refused, run, run_args, snapshot
from sparse_rl_jax.core.config_io import load_config
from sparse_rl_jax.records.run_dir import LOCK, RunDirError, check_resumable, open_run_dir
from sparse_rl_jax.training.run_config import RunConfig
from sparse_rl_jax.training.trainer import config_hash

pytest_plugins = ("fault_helpers",)  # the tiny model + data fixture


def _read_only_dir(tmp_path) -> Path:
    """A directory this process cannot write: chmod 555, or (as root, which ignores modes)
    a sysfs directory."""
    if os.geteuid() != 0:
        path = tmp_path / "ro"
        path.mkdir()
        path.chmod(0o555)
        return path
    return Path("/sys/kernel")


@pytest.mark.parametrize("layout,expected", [
    ("file", "is a file, not a directory"),
    ("parent_file", "its parent"),
    ("read_only", "is not writable"),
    ("parent_read_only", "cannot be created"),
    ("foreign_dir", "is a non-empty directory that is not a run directory"),
])
def test_unusable_run_dir_is_one_error_line(tiny, tmp_path, capsys, layout, expected):
    _, model, data = tiny
    if layout == "file":
        run_dir = tmp_path / "f"
        run_dir.write_text("x")
    elif layout == "parent_file":
        (tmp_path / "f").write_text("x")
        run_dir = tmp_path / "f" / "run"
    elif layout == "read_only":
        run_dir = _read_only_dir(tmp_path)
    elif layout == "parent_read_only":
        run_dir = _read_only_dir(tmp_path) / "run"
    else:
        run_dir = tmp_path / "home"
        run_dir.mkdir()
        (run_dir / "notes.txt").write_text("mine")
    refused(capsys, run_args(model, data, run_dir), expected)
    if layout == "foreign_dir":
        assert sorted(p.name for p in run_dir.iterdir()) == ["notes.txt"]


def test_refused_resume_leaves_the_run_dir_untouched(tiny, tmp_path, capsys):
    _, model, data = tiny
    run_dir = existing_run(tiny, tmp_path)
    before = snapshot(run_dir)
    refused(capsys, run_args(model, data, run_dir) + ["optim.lr=0.5"],
            "holds a run with a different config")
    assert snapshot(run_dir) == before


def test_config_hash_ignores_where_the_run_lives_and_how_long(tiny, tmp_path):
    _, model, data = tiny
    base = run_args(model, data, tmp_path / "a")[1:]
    same = [load_config(RunConfig, None, base + extra) for extra in
            ([], [f"run_dir={tmp_path / 'moved'}"], ["trainer.steps=9", "eval.samples=3",
                                                      "trainer.checkpoint_every=2"])]
    assert len({config_hash(c) for c in same}) == 1
    different = [load_config(RunConfig, None, base + [extra]) for extra in
                 ("trainer.seed=1", "optim.lr=0.5", "compression.eviction.budget=24")]
    assert config_hash(same[0]) not in {config_hash(c) for c in different}


def _lock(run_dir, pid, host):
    (run_dir / LOCK).write_text(json.dumps({"pid": pid, "host": host}))


def test_second_run_on_a_locked_run_dir_refuses(tiny, tmp_path, capsys):
    _, model, data = tiny
    run_dir = existing_run(tiny, tmp_path)
    _lock(run_dir, os.getppid(), socket.gethostname())
    before = snapshot(run_dir)
    refused(capsys, run_args(model, data, run_dir) + ["--take-over"],  # never a live local run
            f"is in use by another run (pid {os.getppid()}")
    assert snapshot(run_dir) == before


def test_stale_lock_of_a_dead_process_is_taken_over(tiny, tmp_path):
    run_dir = existing_run(tiny, tmp_path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _lock(run_dir, dead.pid, socket.gethostname())
    cfg = load_config(RunConfig, None, run_args(*tiny[1:], run_dir)[1:])
    manifest = check_resumable(run_dir, config_hash(cfg), lambda: None)
    assert manifest["last_good_step"] == 4
    owner = open_run_dir(run_dir, config_hash(cfg), manifest)
    assert json.loads((run_dir / LOCK).read_text())["pid"] == os.getpid()
    with pytest.raises(RunDirError, match="in use by another run"):  # a second opener
        _lock(run_dir, os.getppid(), socket.gethostname())
        check_resumable(run_dir, config_hash(cfg), lambda: None)
    owner.close()


def test_lock_of_another_host_needs_take_over(tiny, tmp_path, capsys, monkeypatch):
    """A run that crashed on another host (or a directory moved here from one): refused with
    what to do, nothing changed; ``run.py train --take-over`` takes the lock and trains (the
    training loop is stubbed: the lock is what is tested)."""
    from sparse_rl_jax.training import trainer

    _, model, data = tiny
    run_dir = existing_run(tiny, tmp_path)
    _lock(run_dir, 4242, "elsewhere.example")
    before = snapshot(run_dir)
    refused(capsys, run_args(model, data, run_dir),
            "is locked by a run on another host (pid 4242 on elsewhere.example",
            "cannot tell whether it is still running", "run the same command with --take-over")
    assert snapshot(run_dir) == before

    owners = []
    monkeypatch.setattr(trainer, "_train", lambda *args, **kwargs: owners.append(
        json.loads((run_dir / LOCK).read_text())) or {})
    assert run.main(run_args(model, data, run_dir) + ["--take-over"]) == 0
    assert owners == [{"pid": os.getpid(), "host": socket.gethostname()}]
    assert not (run_dir / LOCK).exists()  # released at the end
