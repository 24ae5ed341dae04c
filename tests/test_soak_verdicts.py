"""``benchmarks/soak.py``'s verdicts on made-up samples (issue 54): RSS growth from the settle
step, no compile after step 1, CPU seconds per step flat within 5% (a least-squares line,
checked with NumPy), checkpoints within ``keep``."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import soak  # noqa: E402


def _samples(cpu, rss=(1000.0,) * 5, wall=(3.0,) * 5, checkpoints=3):
    return [{"step": 50 * (i + 1), "rss_mib": rss[i], "rss_max_mib": rss[i] + 10,
             "step_median_s": wall[i], "cpu_median_s": cpu[i], "checkpoints": checkpoints}
            for i in range(5)]


def test_a_flat_run_holds_every_verdict_whatever_the_wall_time():
    # wall time doubles (other jobs on the cores); CPU seconds stay flat
    out = soak.verdicts(_samples((2.0,) * 5, wall=(2.0, 2.5, 3.0, 3.5, 4.0)), 100, 3,
                        [(1, "step"), (1, "update")])
    assert all(holds for holds, _ in out.values()), out
    assert out["compiles"][1] == "2 by the end of step 1, 0 after it"


def test_each_verdict_fails_on_its_own_measure():
    cpu = (2.0, 2.0, 2.05, 2.1, 2.2)
    out = soak.verdicts(_samples(cpu, rss=(1000, 1000, 1020, 1040, 1060.0), checkpoints=4),
                        100, 3, [(1, "step"), (610, "decode_loop")])
    steps = np.array([100, 150, 200, 250.0])
    slope, intercept = np.polyfit(steps, cpu[1:], 1)
    drift = slope * (steps[-1] - steps[0]) / (intercept + slope * steps[0])
    assert drift > 0.05 and not out["step_time"][0]
    assert f"fitted drift {drift:+.1%}" in out["step_time"][1]
    assert not out["rss"][0] and "(+6.0%" in out["rss"][1]
    assert out["compiles"] == (False, "1 by the end of step 1, 1 after it "
                                      "(first at step 610: decode_loop)")
    assert out["checkpoints"] == (False, "at most 4 committed (keep 3)")
