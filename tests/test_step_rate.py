"""StepRate, the estimate behind every progress line's s/step and ETA, and LoopClock, which
puts it on a loop's lines, against windows worked out by hand: the compiling step and spikes
stay out, the compiling step less its compile seconds stands in until a clean step is
known."""

import jax
import numpy as np
import pytest

from sparse_rl_jax.records.step_rate import LoopClock, StepRate, format_duration


def test_the_compiling_step_stands_in_until_a_clean_step_is_known():
    rate = StepRate()
    assert rate.per_step() is None and rate.eta(5) is None and rate.describe(5) == ""
    rate.add(30.0, compile_seconds=27.0)  # step 1: 27 s of XLA, 3 s of step
    assert rate.per_step() == pytest.approx(3.0)
    assert rate.eta(99) == pytest.approx(297.0)
    assert rate.compile_seconds == 27.0
    rate.add(1.2)  # step 2: the first clean step replaces the stand-in
    assert rate.per_step() == pytest.approx(1.2)
    assert rate.describe(100) == "1.20 s/step | eta 0:02:00"


def test_a_compile_measured_longer_than_its_step_leaves_a_floor():
    rate = StepRate()
    rate.add(10.0, compile_seconds=12.0)
    assert rate.per_step() == pytest.approx(0.2)  # 2% of the interval


def test_a_later_compiling_step_stays_out_of_the_window():
    rate = StepRate()
    for seconds in (2.0, 2.2):
        rate.add(seconds)
    rate.add(40.0, compile_seconds=38.0)  # a new shape mid-run: not a step's time
    assert rate.per_step() == pytest.approx(2.1)  # median of [2.0, 2.2]


def test_a_checkpoint_spike_is_left_out_by_the_median():
    rate = StepRate()
    for seconds in (1.0, 1.1, 0.9, 9.0, 1.0):  # the fourth step waited for a save
        rate.add(seconds)
    # median of [0.9, 1.0, 1.0, 1.1, 9.0] = 1.0; the mean would be 2.6
    assert rate.per_step() == pytest.approx(1.0)
    assert rate.eta(10) == pytest.approx(10.0)


def test_the_window_keeps_the_last_steps_only():
    rate = StepRate(window=10)
    for seconds in range(1, 13):  # 1 .. 12 s: the window holds 3 .. 12
        rate.add(float(seconds))
    assert rate.per_step() == pytest.approx(7.5)


def test_an_interval_of_several_steps_counts_as_that_many_steps():
    rate = StepRate()
    rate.add(50.0, steps=50, compile_seconds=20.0)  # a warm start's first 50 steps
    assert rate.per_step() == pytest.approx(0.6)  # (50 - 20) / 50
    rate.add(25.0, steps=50)
    rate.add(35.0, steps=50)
    assert rate.per_step() == pytest.approx(0.6)  # median of [0.5, 0.7]
    assert rate.eta(1000) == pytest.approx(600.0)


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="window"):
        StepRate(window=0)
    with pytest.raises(ValueError, match="steps=0"):
        StepRate().add(1.0, steps=0)
    with pytest.raises(ValueError, match="seconds=-1"):
        StepRate().add(-1.0)


def test_format_duration():
    assert format_duration(0) == "0:00:00"
    assert format_duration(272.4) == "0:04:32"
    assert format_duration(3 * 3600 + 61) == "3:01:01"


def test_a_loop_clock_reports_the_compile_then_the_rate_of_recent_intervals():
    """A loop logging every 5 steps (the warm start's way): the first interval compiled (a
    real jit compile, whatever its seconds) and is reported apart; then 4 s and 6 s per 5
    steps: 0.8, then the median 1.0 s/step; an ETA "at most" for a loop that may stop early,
    none at the last step."""
    now = iter([0.0, 10.0, 14.0, 20.0, 21.0])
    clock = LoopClock(20, stops_early=True, clock=lambda: next(now))
    with clock.compiles:
        jax.jit(lambda x: x * 3 + 1)(np.arange(7.0))
        first = clock.lap(5)
        assert first.startswith("(10s) | compiled in ") and " s/step | eta 0:00:" in first
        assert clock.rate.compile_seconds > 0
        assert clock.lap(10) == "(14s) | 0.80 s/step | eta 0:00:08 at most"
        assert clock.lap(15) == "(20s) | 1.00 s/step | eta 0:00:05 at most"
        assert clock.lap(20) == "(21s)"
