"""experiments/walk_calibration.py: the log-ratio statistics against a plain NumPy reading,
the regime test, and a --quick run whose uncompressed cell must match dense exactly."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from tiny_rl import TINY_WARM_START

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location(
        "walk_calibration", ROOT / "experiments" / "walk_calibration.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_log_ratio_stats_and_regime_test():
    calib = _script()
    rng = np.random.default_rng(0)
    dense = rng.normal(-1, 1, (50, 30))
    sparse = dense - rng.normal(0, 0.1, (50, 30))
    mask = rng.random((50, 30)) < 0.8
    sparse[3, 4], sparse[7, 0], sparse[9, 2] = 15.0, 12.0, 12.0  # r = e^-16, e^-13, e^-13
    mask[3, 4], mask[7, 0], mask[9, 2] = True, True, False  # row 9's bad token is off-mask
    stats = calib.log_ratio_stats(dense, sparse, mask)
    assert stats["seq_low_r"] == 2 / 50
    log_r = [dense[i, j] - sparse[i, j] for i in range(50) for j in range(30) if mask[i, j]]
    np.testing.assert_allclose(stats["log_r_q001"], np.quantile(log_r, 0.001))
    row = {"kv_saved": 0.4, "greedy_dense": 0.8, "greedy_sparse": 0.75, "seq_low_r": 0.05}
    assert calib.in_regime(row)
    assert not calib.in_regime({**row, "kv_saved": 0.3})
    assert not calib.in_regime({**row, "greedy_sparse": 0.71})
    assert not calib.in_regime({**row, "seq_low_r": 0.02})
    assert not calib.in_regime({**row, "seq_low_r": 0.11})


@pytest.mark.slow
def test_quick_run_uncompressed_cell_equals_dense(tmp_path):
    out = tmp_path / "calib"
    tiny = [*TINY_WARM_START, "warm_start.steps=4", "warm_start.batch_size=4", "data.walk.c_max=1",
            "data.walk.distractors_max=2", "sampling.max_new_tokens=32",
            "sampling.num_samples=2", "trainer.minibatch_size=16",
            "trainer.logp_chunk=16"]
    calib = _script()  # its main() in this process: no second interpreter
    assert calib.main(["--quick", "--methods", "rkv", "--budgets", "16", "128", "--out", str(out),
                       *tiny]) == 0
    rows = json.loads((out / "calibration.json").read_text())["rows"]
    assert [(r["method"], r["budget"]) for r in rows] == [("rkv", 16), ("rkv", 128)]
    small, large = rows
    assert small["kv_saved"] > 0
    # 128 + 16 slots exceed any context here (prompt <= 25 + 32 new tokens): never compressed,
    # so the same key gives the dense samples and the dense scorer agrees with the sampler.
    assert large["kv_saved"] == 0.0 and large["seq_low_r"] == 0.0
    assert abs(large["log_r_q001"]) < 1e-3
    # alpha = sum_x min(p_sparse, p_dense) is 1 where the cache never compressed.
    np.testing.assert_allclose(large["alpha_p5"], 1.0, atol=1e-4)
    assert len(small["alpha_p5"]) == 1 and 0 < small["alpha_p5"][0] <= 1 + 1e-6
    assert large["greedy_sparse"] == large["greedy_dense"] == small["greedy_dense"]
    assert "smallest budget in the regime: rkv" in (out / "calibration.md").read_text()


def test_a_bad_cell_is_a_usage_error_before_anything_runs(tmp_path, capsys):
    out = tmp_path / "cal"
    with pytest.raises(SystemExit) as exit_info:
        _script().main(["--out", str(out), "--budgets", "64", "8", "compression.eviction.window=8"])
    assert exit_info.value.code == 2
    assert "--methods/--budgets: EvictionConfig.budget=8 must be an int > window (8)" in (
        capsys.readouterr().err)
    assert not out.exists()


def test_a_prompt_longer_than_a_cells_cache_is_a_usage_error_before_sampling(tmp_path, capsys):
    out = tmp_path / "cal"
    with pytest.raises(SystemExit) as exit_info:
        _script().main(["--out", str(out), "--methods", "rkv", "--budgets", "64", "9",
                        "--prompts", "4", f"model.path={ROOT / 'data/warm_starts/walk_ft'}",
                        "compression.eviction.buffer=1"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--budgets 9 (rkv): prompt length" in err
    assert "exceeds the KV cache capacity (budget 9 + buffer 1 = 10 slots" in err
    assert not out.exists()
