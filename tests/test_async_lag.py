"""Async mode's schedule on a tiny policy, in process: step t's rows are drawn from exactly
version t - k (the rollout made from the saved params of update t - k), the lag is logged from
the oldest version, the mismatch split (``trainer.split_mismatch``) changes only the logs, a
producer that fails, or a weight sync that fails, stops the learner with an error naming the
step, and a side that goes quiet (the producer, the learner's update, the weight sync) stops
it at the deadline (``trainer.async_timeout_s``) naming the step and the side."""

from __future__ import annotations

import dataclasses
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import models
from sparse_rl_jax.rl.update_step import init_optimizer, jit_update_step
from sparse_rl_jax.training import async_lag
from sparse_rl_jax.training.async_lag import AsyncRolloutError, AsyncSteps
from sparse_rl_jax.training.collect_rounds import collect_rollouts
from sparse_rl_jax.training.rl_step import batch_sharding
from tiny_rl import G, PROMPTS, step_context, tiny_task_policy

N = PROMPTS * G


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return tiny_task_policy(tmp_path_factory.mktemp("async"), dtype=jnp.float32)


def _context(policy, *overrides):
    """An async StepContext (one prompt length: one compiled shape) with a real SGD update
    (test_rl_step's) and the initial ``(params, opt_state)`` on the one-device mesh."""
    ctx = step_context(policy, "data.task.n_min=4", "trainer.mode=async", "trainer.steps=3",
                       f"trainer.minibatch_size={N}", *overrides)
    mesh = models.make_mesh()
    params = jax.device_put(jax.tree.map(jnp.copy, policy[3]),
                            models.param_shardings(policy[3], mesh))
    optimizer = optax.sgd(0.05)
    opt_state, opt_shardings = init_optimizer(optimizer, params, mesh)
    update = jit_update_step(
        ctx.graphdef, loss_cfg=ctx.cfg.loss, optimizer=optimizer,
        param_shardings=jax.tree.map(lambda x: x.sharding, params),
        opt_shardings=opt_shardings, batch_sharding=batch_sharding(mesh),
        chunk_size=ctx.cfg.trainer.logp_chunk, temperature=ctx.cfg.sampling.temperature)
    return dataclasses.replace(ctx, update=update, mesh=mesh), params, opt_state


def _three_steps(policy, *overrides):
    """Three async steps from the initial params: ``(versions 0..3, rows, metrics)``."""
    ctx, params, opt_state = _context(policy, *overrides)
    versions, rows, metrics = [jax.tree.map(jnp.copy, params)], [], []
    with AsyncSteps(ctx, params, 0, 0) as steps:
        for step in range(3):
            params, opt_state, m = steps.step(ctx, params, opt_state, step)
            versions.append(jax.tree.map(jnp.copy, params))
            rows.append(steps.last)
            metrics.append(m)
    return ctx, versions, rows, metrics


@pytest.fixture(scope="module")
def lag_one_split(policy):
    return _three_steps(policy, "trainer.max_lag=1", "trainer.split_mismatch=true")


def test_lag_one_draws_step_t_from_the_params_of_update_t_minus_1(lag_one_split):
    ctx, versions, rows, metrics = lag_one_split
    assert [r.version for r in rows] == [0, 0, 1]
    assert [m["async/lag"] for m in metrics] == [0.0, 1.0, 1.0]
    assert all((r.versions_N == r.version).all() and len(r.versions_N) == N for r in rows)
    # step 2's rows are the rollout of version 1 (the params saved after update 1) ...
    again, _, _ = collect_rollouts(ctx, versions[1], 2)
    np.testing.assert_array_equal(rows[2].batch.response, again.response)
    np.testing.assert_array_equal(rows[2].batch.logp_sparse, again.logp_sparse)
    # ... not of version 2, which the learner updated from (and scored them under)
    newest, _, _ = collect_rollouts(ctx, versions[2], 2)
    assert not np.array_equal(np.asarray(rows[2].batch.logp_old), np.asarray(newest.logp_old))
    assert metrics[2]["async/lag_mismatch_k3"] > 0 and metrics[0]["async/lag_mismatch_k3"] == 0
    for name in ("time/wait_rollout", "time/wait_learner", "time/weight_sync"):
        assert all(m[name] >= 0 for m in metrics)


def test_without_the_split_the_lagged_rows_are_scored_once_and_train_the_same(policy,
                                                                              lag_one_split):
    """``trainer.split_mismatch`` off: the producer leaves a lagged version's rows unscored
    (the learner scores them under its own params either way), so the run is the same run,
    bit for bit, without the split's metrics after the steps whose version is their own."""
    _, versions, rows, metrics = _three_steps(policy, "trainer.max_lag=1")
    _, split_versions, split_rows, split_metrics = lag_one_split
    assert rows[2].batch.logp_old is None and split_rows[2].batch.logp_old is not None
    assert rows[0].batch.logp_old is not None  # step 0's rows are version 0's own
    for got, want in zip(jax.tree.leaves(versions[-1]), jax.tree.leaves(split_versions[-1])):
        np.testing.assert_array_equal(got, want)
    timing = ("time", "async/", "tokens_per_second")
    for got, want in zip(metrics, split_metrics):
        assert "async/lag_mismatch_k3" in got or got["async/lag"] == 1.0
        kept = [k for k in got if not k.startswith(timing) and not k.endswith("_share")]
        assert {k: got[k] for k in kept} == {k: want[k] for k in kept}
    assert "async/lag_mismatch_k3" not in metrics[2]


def test_the_timeline_keeps_only_the_newest_spans(policy, monkeypatch):
    """A long run holds a bounded timeline: past ``TIMELINE_SPANS`` the oldest spans go."""
    from sparse_rl_jax.training import async_lag
    monkeypatch.setattr(async_lag, "TIMELINE_SPANS", 3)
    ctx, params, opt_state = _context(policy, "trainer.max_lag=1")
    with AsyncSteps(ctx, params, 0, 0) as steps:
        for step in range(3):  # six spans a step: rollout, reward, score; score, update, sync
            params, opt_state, _ = steps.step(ctx, params, opt_state, step)
    assert [(role, phase, step) for role, phase, step, _, _ in steps.timeline] == [
        ("learner", "score", 2), ("learner", "update", 2), ("learner", "weight_sync", 2)]


def test_a_failing_producer_stops_the_learner_naming_the_step(policy):
    ctx, params, opt_state = _context(policy, "trainer.max_lag=1")
    calls = []

    def reward(completions, answers):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("reward server down")
        return np.zeros(len(completions), np.float32)

    ctx = dataclasses.replace(ctx, reward_fn=reward)
    with AsyncSteps(ctx, params, 0, 0) as steps:
        params, opt_state, _ = steps.step(ctx, params, opt_state, 0)
        with pytest.raises(AsyncRolloutError, match="step 2: the rollout producer failed: "
                                                    "RuntimeError: reward server down"):
            steps.step(ctx, params, opt_state, 1)


def test_a_failed_weight_sync_stops_the_learner_naming_the_step(policy, monkeypatch):
    """The learner's publish of version 1 fails: the step raises, naming the step and the
    sync, and leaving the context stops the producer (waiting for version 1) instead of
    hanging."""
    ctx, params, opt_state = _context(policy, "trainer.max_lag=1")
    real, calls = async_lag.sync_weights, []

    def sync(tree, mesh):
        calls.append(1)
        if len(calls) == 2:  # the first call places version 0; the second publishes version 1
            raise RuntimeError("rollout device lost")
        return real(tree, mesh)

    monkeypatch.setattr(async_lag, "sync_weights", sync)
    steps = AsyncSteps(ctx, params, 0, 0)
    with pytest.raises(AsyncRolloutError, match="step 1: the weight sync to the rollout "
                                                "devices failed: RuntimeError: rollout device "
                                                "lost"):
        with steps:
            steps.step(ctx, params, opt_state, 0)
    assert not steps.thread.is_alive()



@pytest.fixture
def release():
    """An event the sides that sleep forever wait on; set when the test ends, so that their
    threads end (by raising) instead of outliving it."""
    event = threading.Event()
    yield event
    event.set()


def _quiet_after(answered, answer, release):
    """``answer`` for the first ``answered`` calls; from then on a side that sleeps without
    raising, until the test ends (``release``)."""
    calls = []

    def fake(*args, **kwargs):
        calls.append(1)
        if len(calls) > answered:
            release.wait()
            raise RuntimeError("released when the test ended")
        return answer(*args, **kwargs)

    return fake


@pytest.mark.parametrize("quiet, answered, side", [
    ("collect_rollouts", 0, "rollout producer"),  # the producer's first rollout
    ("update", 0, "learner"),                      # the learner's first update
    ("sync_weights", 1, "weight sync"),            # the publish of version 1 (after version 0)
])
def test_a_side_that_goes_quiet_stops_the_learner_at_the_deadline(
        policy, lag_one_split, monkeypatch, release, quiet, answered, side):
    """One side answers ``answered`` calls, then sleeps forever without raising: step 1
    raises AsyncRolloutError naming the step and that side once the deadline
    (``trainer.async_timeout_s=0.5``, no step observed yet) has passed, and leaving the
    context does not wait for the threads left sleeping. The other sides answer at once
    (step 0's rows of the lag-1 run, an update that changes nothing)."""
    ctx, params, opt_state = _context(policy, "trainer.max_lag=1", "trainer.async_timeout_s=0.5")
    rows = lag_one_split[2][0]
    answers = {"collect_rollouts": lambda *a, **k: (rows.batch, rows.metrics, rows.clock),
               "update": lambda ctx, params, opt_state, full, step: (params, opt_state, {}),
               "sync_weights": async_lag.sync_weights}
    for name, answer in answers.items():
        monkeypatch.setattr(async_lag, name, answer)
    monkeypatch.setattr(async_lag, quiet, _quiet_after(answered, answers[quiet], release))
    steps = AsyncSteps(ctx, params, 0, 0)
    start = time.perf_counter()
    with pytest.raises(AsyncRolloutError, match=rf"^step 1: the {side} went quiet: no answer in "
                                                r"0\.[5-9] s \(deadline 0\.5 s, the larger of "
                                                r"trainer\.async_timeout_s=0\.5 "):
        with steps:
            steps.step(ctx, params, opt_state, 0)
    assert time.perf_counter() - start < 5.0  # the deadline, not a wait for the sleepers
    assert steps.thread.daemon


def test_leaving_while_the_producer_sleeps_forever_raises_at_the_deadline(policy, monkeypatch,
                                                                          release):
    """A runner left without an error while its producer never answers: the join of the
    producer ends at the deadline, with an error naming the step the producer is on."""
    ctx, params, _ = _context(policy, "trainer.max_lag=1", "trainer.async_timeout_s=0.3")
    monkeypatch.setattr(async_lag, "collect_rollouts", _quiet_after(0, None, release))
    with pytest.raises(AsyncRolloutError, match=r"^step 1: the rollout producer went quiet: "
                                                r"no answer in 0\.[3-9] s"):
        with AsyncSteps(ctx, params, 0, 0):
            pass
