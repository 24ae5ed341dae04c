"""The deadline of async mode's waits (``async_deadline``): the floor ``trainer.async_timeout_s``
until steps grow, then 10 x the slowest step after the first; its error names the step, the
side, the wait and the field; a worker that misses it is left behind as a daemon thread, and a
process whose producer sleeps forever still exits; the field takes a positive number or null."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sparse_rl_jax.core.config_io import ConfigError, load_config
from sparse_rl_jax.training.async_deadline import (AsyncRolloutError, Deadline,
                                                   finish_within)
from sparse_rl_jax.training.run_config import RunConfig

ROOT = Path(__file__).resolve().parents[1]


def test_the_deadline_is_the_floor_or_ten_times_the_slowest_step_after_the_first():
    deadline = Deadline(600.0)
    assert deadline.seconds == 600.0
    deadline.observe(900.0)  # the first step, mostly compiling: left out
    assert deadline.seconds == 600.0
    deadline.observe(20.0)
    assert deadline.seconds == 600.0  # 10 x 20 s is under the floor
    deadline.observe(75.0)
    assert deadline.seconds == 750.0
    deadline.observe(30.0)
    assert deadline.seconds == 750.0  # the slowest so far, not the last
    forever = Deadline(None)
    forever.observe(1.0)
    forever.observe(2.0)
    assert forever.seconds is None


def test_the_error_names_the_step_the_side_the_wait_and_the_field():
    deadline = Deadline(2.0)
    deadline.observe(9.0)
    deadline.observe(0.3)
    error = deadline.quiet(4, "weight sync", 3.04)
    assert isinstance(error, AsyncRolloutError)
    assert str(error).startswith(
        "step 5: the weight sync went quiet: no answer in 3.0 s (deadline 3.0 s, the larger of "
        "trainer.async_timeout_s=2 and 10 x the slowest step so far, 0.3 s). The run stopped; "
        "the same command resumes it from its last checkpoint."), str(error)


def test_finish_within_returns_raises_or_leaves_a_daemon_thread_behind():
    assert finish_within(5.0, lambda: 7) == (True, 7)
    assert finish_within(None, lambda: 8) == (True, 8)

    def fails():
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        finish_within(5.0, fails)
    release, before = threading.Event(), set(threading.enumerate())
    start = time.perf_counter()
    assert finish_within(0.2, release.wait) == (False, None)
    assert 0.2 <= time.perf_counter() - start < 5.0
    [left] = set(threading.enumerate()) - before
    assert left.is_alive() and left.daemon  # it keeps no process alive
    release.set()
    left.join(5.0)
    assert not left.is_alive()


@pytest.mark.parametrize("value", ["0", "-1", "true", ".inf", "soon"])
def test_async_timeout_s_is_a_positive_number_or_null(value):
    with pytest.raises(ConfigError, match=r"trainer\.async_timeout_s"):
        load_config(RunConfig, None, [f"trainer.async_timeout_s={value}"])


def test_async_timeout_s_defaults_to_the_floor_and_null_disables_it():
    assert RunConfig().trainer.async_timeout_s == 1800.0
    for value, want in (("null", None), ("0.5", 0.5), ("600", 600.0)):
        cfg = load_config(RunConfig, None, [f"trainer.async_timeout_s={value}"])
        assert cfg.trainer.async_timeout_s == want


QUIET_PRODUCER = """
import threading, types
import jax.numpy as jnp
from sparse_rl_jax.core.config_io import load_config
from sparse_rl_jax.training import async_lag
from sparse_rl_jax.training.run_config import RunConfig

async_lag.collect_rollouts = lambda *args, **kwargs: threading.Event().wait()  # forever
ctx = types.SimpleNamespace(cfg=load_config(RunConfig, None, [
    "trainer.mode=async", "trainer.async_timeout_s=0.3"]))
steps = async_lag.AsyncSteps(ctx, {"w": jnp.zeros(2)}, 0, 0)
try:
    with steps:
        steps.step(ctx, None, None, 0)
except async_lag.AsyncRolloutError as error:
    print(error, "| producer alive:", steps.thread.is_alive())
"""


def test_the_process_exits_while_its_producer_sleeps_forever():
    """A producer whose rollout never returns: the learner's step raises at the deadline and
    the interpreter then exits, the producer still asleep (a daemon thread)."""
    done = subprocess.run([sys.executable, "-c", QUIET_PRODUCER], cwd=ROOT, timeout=120,
                          capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("step 1: the rollout producer went quiet: no answer in 0.3 s")
    assert done.stdout.strip().endswith("| producer alive: True")
