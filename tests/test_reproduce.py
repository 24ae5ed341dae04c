"""The reproduction experiment's --quick mode end to end (tiny model, one KV method)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_reproduce_quick_writes_table_plots_and_evals(tmp_path):
    out = tmp_path / "repro"
    tiny = ["warm_start.hidden_size=32", "warm_start.num_layers=1", "warm_start.num_heads=2",
            "warm_start.num_kv_heads=1", "warm_start.intermediate_size=64",
            "data.task.n_min=2", "data.task.n_max=3", "sampling.max_new_tokens=16",
            "compression.budget=14", "compression.buffer=4", "compression.window=2",
            "trainer.logp_chunk=16", "warm_start.steps=10"]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax_cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    result = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "reproduce.py"), "--quick",
         "--methods", "rkv", "--out", str(out), *tiny],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads((out / "results.json").read_text())
    assert [r["arm"] for r in rows] == ["dense", "naive rkv", "sparse-rl rkv"]
    dense, naive, corrected = rows
    assert dense["kv_token_savings"] == 0.0 and corrected["kv_token_savings"] > 0.0
    assert naive["rejection_rate"] == 0.0  # no correction: nothing is ever rejected
    for row in rows:
        assert [e["mode"] for e in row["eval"]] == ["dense", "sparse (rkv 14)"]
    table = (out / "results.md").read_text()
    assert "sparse-rl rkv" in table and "wall time" in table
    assert (out / "plots" / "seed0" / "compare_summary.png").stat().st_size > 10_000
