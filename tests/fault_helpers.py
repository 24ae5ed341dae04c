"""Shared pieces of the fault tests (tests/test_faults_*.py, issues 17 and 21): a tiny model
and data file, the ``run.py train`` arguments for them, and the one-error-line assertion.

Cases call ``run.py``'s ``main`` in-process on a tiny random HF model; docs/reliability.md
lists each case with its outcome.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from sparse_rl_jax.core.config_io import load_config
from sparse_rl_jax.records.run_dir import open_run_dir
from sparse_rl_jax.training.run_config import RunConfig
from sparse_rl_jax.training.trainer import config_hash
from tiny_hf import make_tiny_hf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import run  # noqa: E402  (run.py at the repository root)

RECORDS = [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(1, 5)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny qwen2 checkpoint (vocab 128, char tokenizer of 102 ids) and a JSONL file."""
    root = tmp_path_factory.mktemp("faults")
    model = make_tiny_hf(root, "qwen2", name="model")
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return root, Path(model), data


def run_args(model, data, run_dir) -> list[str]:
    """``run.py train`` arguments of a one-step run of ``model`` on ``data`` (tiny shapes)."""
    return ["train", f"model.path={model}", "data.source=jsonl", f"data.jsonl.path={data}",
            "data.reward=task_exact", "sampling.max_new_tokens=8", "sampling.num_samples=2",
            "sampling.prompt_bucket=8", "compression.eviction.budget=16",
            "compression.eviction.buffer=4", "compression.eviction.window=2", "trainer.steps=1",
            "trainer.prompts_per_step=2", "trainer.minibatch_size=4", f"run_dir={run_dir}"]


def refused(capsys, argv, *expected: str, prefix: str = "error") -> None:
    """``run.main(argv)`` exits 2 with one ``prefix:`` line on stderr holding ``expected``."""
    assert run.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"{prefix}: "), err
    for text in expected:
        assert text in err[0], err[0]


def existing_run(tiny, tmp_path, overrides=()) -> Path:
    """A run directory as a run of the base config leaves it (manifest, config.yaml)."""
    _, model, data = tiny
    run_dir = tmp_path / "run"
    cfg = load_config(RunConfig, None, run_args(model, data, run_dir)[1:] + list(overrides))
    owner = open_run_dir(run_dir, config_hash(cfg), None)
    owner.write_manifest(4)
    (run_dir / "config.yaml").write_text("the record of the run\n")
    owner.close()
    return run_dir


def snapshot(run_dir: Path) -> dict:
    """``{relative path: bytes}`` of every file under ``run_dir``."""
    return {p.relative_to(run_dir): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
