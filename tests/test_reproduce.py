"""The reproduction experiment's --quick mode end to end (tiny model, one KV method)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from experiments.kit import arms, collapse, reproduce_tables, run_summary
from tiny_rl import TINY_WARM_START

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # one warm start and three arms trained, then evaluated
def test_reproduce_quick_writes_table_plots_and_evals(tmp_path):
    out = tmp_path / "repro"
    # 4 prompts x 4 samples per rollout and per eval batch (one sampler shape for both)
    tiny = [*TINY_WARM_START, "data.task.n_min=2", "data.task.n_max=3",
            "sampling.max_new_tokens=16", "compression.eviction.buffer=4",
            "compression.eviction.window=2",
            "trainer.logp_chunk=16", "warm_start.steps=10", "trainer.prompts_per_step=4",
            "sampling.num_samples=4", "trainer.minibatch_size=16", "eval.num_prompts=4",
            "eval.batch_size=4", "eval.samples=4"]
    reproduce = _load_script("reproduce")  # its main() in this process: no second interpreter
    # --only leaves shadow-mask out (its arm's behaviour: tests/test_shadow_mask.py)
    assert reproduce.main(["--quick", "--methods", "rkv", "--budgets", "14", "12", "--seeds",
                           "0", "1", "--only", "dense", "naive", "sparse-rl", "--out", str(out),
                           *tiny]) == 0
    written = json.loads((out / "results.json").read_text())
    rows = written["runs"]
    # where the numbers came from, and each run's per-step curve (what the pages are made of)
    assert set(written["provenance"]) >= {"commit", "date", "machine", "command", "wall_s"}
    assert written["provenance"]["command"].startswith("python experiments/reproduce.py --quick")
    assert all(len(r["steps"]["reward_mean"]) == 2 for r in rows)
    # --quick keeps the first seed and budget only.
    assert [(r["arm"], r["seed"]) for r in rows] == [
        ("dense", 0), ("naive rkv 14", 0), ("sparse-rl rkv 14", 0)]
    dense, naive, corrected = rows
    assert dense["kv_token_savings"] == 0.0 and corrected["kv_token_savings"] > 0.0
    assert naive["rejection_rate"] == 0.0  # no correction: nothing is ever rejected
    # only the naive arm measures the gradient share a veto would remove
    assert np.isfinite(naive["low_r_grad_share"])
    assert all(np.isnan(r["low_r_grad_share"]) for r in (dense, corrected))
    for row in rows:
        assert [e["mode"] for e in row["eval"]] == ["dense", "sparse (rkv 14)"]
    table = (out / "results.md").read_text()
    assert "sparse-rl rkv 14" in table and "shadow-mask" not in table and "wall time" in table
    assert "| policy \\ inference | dense | sparse (rkv 14) |" in table
    summary = out / "plots" / "seed0" / "budget14" / "compare_summary.png"
    assert summary.stat().st_size > 10_000


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "experiments" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tables_average_seeds_and_list_every_inference_mode():
    def result(arm, seed, own, reward_last, dense, sparse):
        stats = {key: 0.5 for key in run_summary.COMPARE_KEYS}
        return {"arm": arm, "seed": seed, "own_eval": own, "reward_first": 0.1,
                "reward_last": reward_last, **stats,
                "eval": [{"mode": "dense", "pass_at_1": dense, "avg_at_k": dense / 2},
                         {"mode": "sparse (rkv 8)", "pass_at_1": sparse, "avg_at_k": 0.0}]}

    results = [result("dense", 0, "dense", 0.2, 0.5, 0.25),
               result("naive rkv 8", 0, "sparse (rkv 8)", 0.4, 0.75, 0.5),
               result("dense", 1, "dense", 0.4, 0.25, 0.75)]
    training = reproduce_tables.training_table(results).splitlines()
    assert len(training) == 4  # header, rule, one line per arm with the seeds averaged
    # seed means ± their standard error (sd / sqrt(n)), the per-seed values in brackets
    assert training[2].startswith("| dense | 0.100 → 0.30 ± 0.10 (0.20, 0.40) |")
    assert training[2].endswith("| 0.38 ± 0.12 (0.50, 0.25) | – |")
    assert training[3].endswith("| 0.75 | 0.50 |")
    per_seed = reproduce_tables.training_table(results, per_seed=True).splitlines()
    assert [line.split(" | ")[:2] for line in per_seed[2:]] == [
        ["| dense", "0"], ["| naive rkv 8", "0"], ["| dense", "1"]]
    inference = reproduce_tables.inference_table(results).splitlines()
    assert inference[0] == "| policy \\ inference | dense | sparse (rkv 8) |"
    assert inference[2] == "| dense | 0.375 (0.188) | 0.500 (0.000) |"


def test_lag_and_quant_arms_replace_the_per_budget_arms():
    lagged = dict(arms.arms(["rkv"], [32], lags=(0, 2)))
    assert list(lagged) == ["dense", "naive rkv 32 lag 0", "sparse-rl rkv 32 lag 0",
                            "naive rkv 32 lag 2", "sparse-rl rkv 32 lag 2"]
    assert {"trainer.mode=async", "trainer.max_lag=2", "correction.kind=ppo_behaviour",
            "compression.eviction.budget=32"} <= set(lagged["naive rkv 32 lag 2"])
    assert "correction.kind=sparse_rl" in lagged["sparse-rl rkv 32 lag 0"]
    quant = dict(arms.arms(["rkv"], [32], quants=("int8",)))
    assert list(quant) == ["dense", "naive none int8", "sparse-rl none int8",
                           "naive rkv 32 int8", "sparse-rl rkv 32 int8"]
    assert {"compression.method=none", "compression.layout=dense", "compression.quant=int8",
            "correction.kind=none"} <= set(quant["naive none int8"])
    assert {"compression.method=rkv", "compression.quant=int8",
            "correction.kind=sparse_rl"} <= set(quant["sparse-rl rkv 32 int8"])
    stacked = dict(arms.arms(["rkv"], [32], quants=("int4",),
                                  corrections=("decoupled_seq_is",), quant_alone=False))
    assert list(stacked) == ["dense", "decoupled_seq_is rkv 32 int4"]
    assert {"compression.method=rkv", "compression.quant=int4",
            "correction.kind=decoupled_seq_is"} <= set(stacked["decoupled_seq_is rkv 32 int4"])


def test_first_difference_counts_changed_tokens_and_early_stops():
    sweep = _load_script("regime_sweep")
    a = np.array([[1, 2, 3, 0], [1, 2, 3, 0], [5, 6, 0, 0]])
    b = np.array([[1, 2, 3, 0], [1, 9, 3, 0], [5, 6, 7, 0]])
    on = np.array([[1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 0, 0]])
    on_b = np.array([[1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 0]])
    np.testing.assert_array_equal(sweep.first_difference(a, b, on, on_b), [-1, 1, 2])


@pytest.mark.slow
def test_regime_sweep_quick_couples_dense_and_sparse_samples(tmp_path):
    out = tmp_path / "sweep"
    tiny = [*TINY_WARM_START, "warm_start.steps=10", "compression.eviction.buffer=4",
            "compression.eviction.window=2",
            "trainer.logp_chunk=16"]
    sweep = _load_script("regime_sweep")  # its main() in this process: no second interpreter
    assert sweep.main(["--quick", "--methods", "snapkv", "--n", "2", "--budgets", "8", "64",
                       "--out", str(out), *tiny]) == 0
    rows = json.loads((out / "sweep.json").read_text())
    assert [(r["method"], r["n"], r["budget"]) for r in rows] == [
        ("snapkv", 2, 8), ("snapkv", 2, 64)]
    small, large = rows
    # Budget 64 + buffer 4 exceeds any context here (prompt 9 + at most 40 new tokens): the
    # cache never compresses, so the same key must give the very same samples.
    assert large["kv_saved_peak"] == 0.0 and large["seq_changed"] == 0.0
    assert large["rejection_rate"] == 0.0 and abs(large["mismatch_k3"]) < 1e-5
    assert large["acc_dense"] == large["acc_sparse"]
    assert small["kv_saved_peak"] > 0.0
    assert "| snapkv | 2 |" in (out / "sweep.md").read_text()


def test_reward_curve_table_averages_seeds_per_span():
    run = lambda rewards: [{"step": i + 1, "reward_mean": r}  # noqa: E731
                           for i, r in enumerate(rewards)]
    curves = {"dense": [run([0.0, 0.2, 0.4, 0.6, 0.8]), run([0.2, 0.4, 0.6, 0.8, 1.0])]}
    table = reproduce_tables.reward_curve_table(curves, blocks=2).splitlines()
    # Spans of steps 1-3 and 4-5; seed means 0.1, 0.3, 0.5, 0.7, 0.9.
    assert table[2] == "| dense | 0.300 → 0.800 |"


def test_table_means_are_exactly_rounded_on_every_python():
    """Python 3.11's ``sum`` of ten 0.1 is 0.9999999999999999, 3.12's is 1.0: a mean on a
    rounding boundary printed 0.883 on one and 0.882 on the other (docs/results.md)."""
    assert run_summary.exact_mean([0.1] * 10) == 0.1
    runs = [[{"step": 1, "reward_mean": 0.1}] for _ in range(10)]
    assert run_summary.mean_records(runs)[0]["reward_mean"] == 0.1


def test_collapse_needs_a_long_reward_drop_with_truncation():
    def run(rewards, truncated):
        return [{"step": i + 1, "reward_mean": r, "truncated_fraction": t}
                for i, (r, t) in enumerate(zip(rewards, truncated))]

    healthy = run([0.5] * 40, [0.02] * 40)
    # Reward falls 0.4 below its peak and truncation goes from 0.02 to 0.3 for the last 15 of
    # 40 steps: smoothing over 4 steps delays the flag by up to 3 steps, still >= 40 // 4.
    falls = run([0.5] * 25 + [0.1] * 15, [0.02] * 25 + [0.3] * 15)
    short = run([0.5] * 34 + [0.1] * 6, [0.02] * 34 + [0.3] * 6)
    no_truncation = run([0.5] * 25 + [0.1] * 15, [0.02] * 40)
    assert collapse.collapse_steps(healthy) == 0 and not collapse.collapsed(healthy)
    assert 10 <= collapse.collapse_steps(falls) <= 15 and collapse.collapsed(falls)
    assert not collapse.collapsed(short)  # 6 bad steps < 10
    assert collapse.collapse_steps(no_truncation) == 0


def test_control_arms_train_on_dense_rollouts_with_the_anomaly():
    labels = [label for label, _ in arms.arms(["rkv"], [], (0.03, 0.1))]
    assert labels == ["dense", "naive control 0.03", "sparse-rl control 0.03",
                      "naive control 0.1", "sparse-rl control 0.1"]
    overrides = dict(arms.arms(["rkv"], [48], (0.1,)))
    assert overrides["sparse-rl control 0.1"] == [
        "compression.method=none", "data.control_missed_increment=0.1",
        "correction.kind=sparse_rl"]
    assert "trainer.low_r_grad_share=true" in overrides["naive control 0.1"]
    assert "compression.eviction.budget=48" in overrides["naive rkv 48"]
