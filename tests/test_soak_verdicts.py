"""``benchmarks/soak.py``'s verdicts on made-up samples (issue 54): RSS growth from the settle
step, no compile after step 1, CPU seconds per step flat within 5% (a least-squares line,
checked with NumPy; in host-probe units where the host's own speed moved 5% or more),
checkpoints within ``keep``; the host probe; and re-judging a stored soak."""

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


def test_a_host_that_speeds_up_is_judged_in_probe_units():
    # the machine gets 20% faster mid-soak: CPU seconds and the probe fall together, so raw
    # CPU seconds drift past 5% while the step in host-probe units stays flat: that holds
    speed = np.array([1.0, 1.0, 0.93, 0.87, 0.8])
    out = soak.verdicts(_samples(tuple(2.0 * speed), probe=tuple(0.01 * speed)), 100, 3, [])
    raw, probe = _fitted_drift(2.0 * speed), _fitted_drift(0.01 * speed)
    assert out["step_time"][0] and raw < -0.05 and probe < -0.05
    assert out["step_time"][1].startswith("host-probe units decide; ")
    assert (f"2.000 at step 100 -> 1.600, fitted drift {raw:+.1%}; in host-probe units "
            f"200 -> 200 (+0.0%; the probe 10.0 -> 8.0 ms, {probe:+.1%})") in out["step_time"][1]


def test_a_leak_on_a_host_that_speeds_up_still_fails():
    # the host gets 20% faster, the step only 5%: in probe units the step grew ~19%
    speed = np.array([1.0, 1.0, 0.93, 0.87, 0.8])
    step = np.array([1.0, 1.0, 0.99, 0.97, 0.95])
    out = soak.verdicts(_samples(tuple(2.0 * step), probe=tuple(0.01 * speed)), 100, 3, [])
    units = _fitted_drift(2.0 * step / (0.01 * speed))
    assert not out["step_time"][0] and units > 0.05
    assert f"({units:+.1%}; the probe" in out["step_time"][1]


def test_a_steady_host_is_judged_in_cpu_seconds_even_when_probe_units_are_flat():
    # the probe moves 3% (under 5%: the host's speed is steady) and the step 6%: raw decides
    probe = np.array([1.0, 1.0, 1.01, 1.02, 1.03])
    step = np.array([1.0, 1.0, 1.02, 1.04, 1.06])
    out = soak.verdicts(_samples(tuple(2.0 * step), probe=tuple(0.01 * probe)), 100, 3, [])
    assert not out["step_time"][0] and out["step_time"][1].startswith("CPU seconds decide; ")


def test_rejudge_recomputes_a_stored_soaks_verdicts():
    speed = np.array([1.0, 1.0, 0.93, 0.87, 0.8])
    samples = [dict(s, compiles=12) for s in _samples(tuple(2.0 * speed),
                                                      probe=tuple(0.01 * speed))]
    stored = {"samples": samples, "settle": 100, "overrides": [], "late_compiles": [],
              "verdicts": {"step_time": [False, "judged by an older rule"]}}
    out = soak.rejudge(stored)
    assert out["verdicts"] == soak.verdicts(samples, 100, 3, [(1, "")] * 12)
    assert out["verdicts"]["compiles"] == (True, "12 by the end of step 1, 0 after it")
    assert stored["verdicts"]["step_time"][1] == "judged by an older rule"  # not mutated


def test_the_sampler_probes_the_host_after_every_step_outside_its_timing(tmp_path):
    sampler = soak.Sampler(tmp_path, every=2)
    for step in (1, 2):
        sampler(step, {"time_step": 0.5})
    assert len(sampler.probes) == 2 and all(0 < p < 5 for p in sampler.probes)
    (row,) = sampler.samples
    assert row["host_probe_s"] == round(float(np.median(sampler.probes)), 5)
    units = float(np.median(sampler.cpus)) / float(np.median(sampler.probes))
    assert abs(row["cpu_per_probe"] - units) <= 0.005 + 1e-9
