"""The walk regime's fingerprint (``experiments/fingerprint.py``): the first steps of seed 0's
naive and Sparse-RL arms in the regime (``experiments/reproduce.py --config
configs/walk/local.yaml --methods rkv --budgets 32``), per-step training reward, loss, gradient
norm, mismatch k3 and rejection rate; where it is stored, and how a new one differs from it."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from experiments.kit.arms import arms
from sparse_rl_jax.core.config_io import load_config
from sparse_rl_jax.records.metrics_writer import read_metrics
from sparse_rl_jax.training.run_config import RunConfig
from sparse_rl_jax.training.trainer import train

ROOT = Path(__file__).resolve().parents[2]
CONFIG = "configs/walk/local.yaml"
METHOD, BUDGET, SEED, STEPS = "rkv", 32, 0, 2
ARMS = (f"naive {METHOD} {BUDGET}", f"sparse-rl {METHOD} {BUDGET}")
KEYS = ("reward_mean", "loss", "grad_norm", "mismatch_k3", "rejection_rate")
STORED = ROOT / "docs" / "results" / "fingerprint.json"
# Rewards are multiples of 1/32 and must match exactly; the float statistics to this tolerance
# (XLA:CPU reorders sums between builds; a different sampled token moves them by far more).
RTOL, ATOL = 2e-3, 1e-5
REGENERATE = ("re-run the regime (python experiments/reproduce.py --config configs/walk/local.yaml "
              "--methods rkv --budgets 32 --controls 0.1 --seeds 0 1 2 3 4 --out runs/regime), "
              "store runs/regime/results.json as the only file in docs/results/regime/, then run "
              "python experiments/results_page.py and python experiments/fingerprint.py --write")


def fingerprint(work: Path, overrides: tuple[str, ...] = (), log=lambda _: None
                ) -> dict[str, dict[str, list[float]]]:
    """Runs the first ``STEPS`` steps of each arm in ``ARMS`` (seed ``SEED``) under ``work``,
    with run-config ``overrides`` last; returns ``{arm: {key: per-step values}}`` for every
    key in ``KEYS``."""
    out = {}
    chosen = dict(arms([METHOD], [BUDGET]))
    for label in ARMS:
        run_dir = work / label.replace(" ", "_")
        cfg = load_config(RunConfig, str(ROOT / CONFIG), [
            f"run_dir={run_dir}", f"trainer.seed={SEED}", f"trainer.steps={STEPS}",
            "trainer.plots=false", f"trainer.checkpoint_every={STEPS}", *chosen[label],
            *overrides])
        train(cfg, log=log)
        records = read_metrics(run_dir / "metrics.jsonl")
        out[label] = {key: [float(r[key]) for r in records] for key in KEYS}
    return out


def differences(stored: dict, measured: dict) -> list[str]:
    """Every value of ``measured`` that differs from ``stored`` (rewards exactly, the rest to
    ``RTOL``/``ATOL``), one line each naming the arm, the key and the step."""
    lines = []
    for arm in ARMS:
        for key in KEYS:
            want, got = stored["arms"][arm][key], measured[arm][key]
            exact = key == "reward_mean"
            for step, (a, b) in enumerate(zip(want, got), start=1):
                if (a != b) if exact else not np.isclose(b, a, rtol=RTOL, atol=ATOL):
                    lines.append(f"{arm}, step {step}: {key} {b:.6g}, stored {a:.6g}")
            if len(want) != len(got):
                lines.append(f"{arm}: {len(got)} steps of {key}, stored {len(want)}")
    return lines
