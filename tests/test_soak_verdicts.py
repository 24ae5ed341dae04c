"""``benchmarks/soak.py``'s verdicts on made-up samples (issue 54): RSS growth from the settle
step, no compile after step 1, CPU seconds per step in host-probe units flat within 5% (a
least-squares line, checked with NumPy), checkpoints within ``keep``; and the host probe."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import soak  # noqa: E402


def _samples(cpu, rss=(1000.0,) * 5, wall=(3.0,) * 5, checkpoints=3, probe=(0.01,) * 5):
    return [{"step": 50 * (i + 1), "rss_mib": rss[i], "rss_max_mib": rss[i] + 10,
             "step_median_s": wall[i], "cpu_median_s": cpu[i], "host_probe_s": probe[i],
             "cpu_per_probe": cpu[i] / probe[i], "checkpoints": checkpoints}
            for i in range(5)]


def _fitted_drift(values):
    steps = np.array([100, 150, 200, 250.0])
    slope, intercept = np.polyfit(steps, values[1:], 1)
    return slope * (steps[-1] - steps[0]) / (intercept + slope * steps[0])


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
    drift = _fitted_drift(cpu)
    assert drift > 0.05 and not out["step_time"][0]
    assert f"fitted drift {drift:+.1%}" in out["step_time"][1]
    assert not out["rss"][0] and "(+6.0%" in out["rss"][1]
    assert out["compiles"] == (False, "1 by the end of step 1, 1 after it "
                                      "(first at step 610: decode_loop)")
    assert out["checkpoints"] == (False, "at most 4 committed (keep 3)")


def test_a_host_that_speeds_up_moves_the_probe_and_every_step_alike_and_holds():
    # the machine gets 20% faster mid-soak: CPU seconds and the probe fall together
    speed = np.array([1.0, 1.0, 0.93, 0.87, 0.8])
    out = soak.verdicts(_samples(tuple(2.0 * speed), probe=tuple(0.01 * speed)), 100, 3, [])
    assert out["step_time"][0], out["step_time"]
    raw = _fitted_drift(2.0 * speed)
    assert raw < -0.05 and f"raw CPU 2.000 s -> 1.600 s ({raw:+.1%})" in out["step_time"][1]
    # the same raw fall with a steady probe is the process's own and fails
    assert not soak.verdicts(_samples(tuple(2.0 * speed)), 100, 3, [])["step_time"][0]


def test_the_host_probe_measures_cpu_seconds_of_a_fixed_workload():
    probe = soak.host_probe_s(repeats=3)
    assert 0 < probe < 5
