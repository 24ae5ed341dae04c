#!/usr/bin/env python
"""A short fingerprint of the walk experiment in the regime: the first steps of seed 0's naive
and Sparse-RL arms (``experiments/reproduce.py --config configs/walk/local.yaml --methods rkv
--budgets 32``), per-step training reward, loss, gradient norm, mismatch k3 and rejection rate.

``docs/results/fingerprint.json`` stores it beside the results it summarises, and
``tests/test_results_fingerprint.py`` runs it again: when sampling, scoring, a correction or
the loss changes what the experiment measures, the values move and the test names the commands
that regenerate the results. An intended change re-runs the experiment, regenerates the pages
(``experiments/results_page.py``) and rewrites this file (``--write``) in the same commit.

  python experiments/fingerprint.py            # print the fingerprint and compare (~30 s)
  python experiments/fingerprint.py --write    # store it in docs/results/fingerprint.json
  python experiments/fingerprint.py loss.seq_denominator=kept   # what a change would show
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from experiments.kit.overrides_cli import parse_with_overrides  # noqa: E402
from experiments.kit.provenance import provenance  # noqa: E402
from experiments.kit.arms import arms  # noqa: E402
from sparse_rl_jax.core.config_io import load_config  # noqa: E402
from sparse_rl_jax.records.metrics_writer import read_metrics  # noqa: E402
from sparse_rl_jax.training.run_config import RunConfig  # noqa: E402
from sparse_rl_jax.training.trainer import train  # noqa: E402

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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true",
                        help=f"store the fingerprint in {STORED.relative_to(ROOT)}")
    args = parse_with_overrides(parser, argv)
    if args.write and args.overrides:
        parser.error("--write stores the experiment's own fingerprint: drop the overrides")
    with tempfile.TemporaryDirectory() as work:
        measured = fingerprint(Path(work), tuple(args.overrides))
    print(json.dumps(measured, indent=1))
    if args.write:
        STORED.parent.mkdir(parents=True, exist_ok=True)
        STORED.write_text(json.dumps({"provenance": provenance(), "config": CONFIG,
                                      "seed": SEED, "steps": STEPS, "arms": measured},
                                     indent=1) + "\n")
        return 0
    stale = differences(json.loads(STORED.read_text()), measured)
    print("\n".join(stale) or "matches the stored fingerprint")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
