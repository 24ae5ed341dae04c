"""Rollouts that run ahead of the learner on a fixed schedule (``trainer.mode: async``).

Version ``v`` is the params after ``v`` updates (version 0: the initial params). With
``trainer.max_lag: k`` the rollout of step ``t`` (0-based) is drawn from version
``max(0, t - k)``, exactly: a schedule, not a race, so a run is as deterministic as a sync one,
and ``k = 0`` is the sync run itself. A producer thread rolls out, rewards and scores step
after step; it waits for the version a step needs (so it is never more than ``k`` steps
ahead, and never drops a group) and queues the step's rows, each stamped with its version.
The learner (the trainer's thread) takes step ``t``'s rows, scores them densely under its own
params (the proximal policy of the decoupled objective, ``rl.decoupled``; the rollout's own
dense scores when the version is its own), updates, and publishes version ``t + 1`` to the
producer as a copy on the rollout devices (``role_mesh.sync_weights``).

The two threads overlap through JAX's asynchronous dispatch: while the learner's update runs
on the device, the producer tokenises, decodes and rewards (and, with ``mesh.rollout_devices``,
samples on its own devices); logging and checkpoint writes on the learner's side overlap the
producer's rollouts. Logged per step: ``async/lag`` (the step minus the OLDEST version in its
batch), ``time/wait_rollout`` (the learner waiting for rows), ``time/wait_learner`` (the
producer waiting for the version it needs), ``time/weight_sync``, and, with
``trainer.split_mismatch``, the mismatch split (``decoupled.mismatch_split``). A producer that
fails stops the trainer with an error naming the step; a side that goes quiet (the producer, the
learner's own update, the weight sync) stops it at a deadline (``trainer.async_timeout_s``,
``async_deadline``) with an error naming the step and the side: never a hang.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from typing import Any, NamedTuple

import jax
import numpy as np

from sparse_rl_jax.rl.decoupled import mismatch_split
from sparse_rl_jax.training.async_deadline import AsyncRolloutError, Deadline, finish_within
from sparse_rl_jax.training.collect import score_all, timed
from sparse_rl_jax.training.collect_rounds import UpdateBatch, collect_rollouts
from sparse_rl_jax.training.rl_step import learner_batch, step_metrics, update
from sparse_rl_jax.training.role_mesh import sync_weights

POLL_SECONDS = 1.0
"""How often a waiting learner checks that the producer is still alive."""
TIMELINE_SPANS = 4096
"""The newest spans :attr:`AsyncSteps.timeline` keeps (six a step: the last ~680 steps);
older ones are dropped, so a long run holds a bounded timeline."""


class LaggedRollout(NamedTuple):
    """Step ``step``'s rows, drawn from param version ``version``.

    Attributes:
      step: the RL step (0-based) the rows are for.
      version: the param version that sampled them (``max(0, step - max_lag)``).
      versions_N: ``[N]`` int, each row's policy version.
      batch: the rows (``collect_rounds.UpdateBatch``; ``logp_old`` dense at ``version``, or
        None for a lagged version without ``trainer.split_mismatch``).
      metrics, clock: ``collect_rounds.collect_rollouts``'s metrics and phase seconds.
      wait_learner: seconds the producer waited for ``version`` to be published.
    """

    step: int
    version: int
    versions_N: np.ndarray
    batch: UpdateBatch
    metrics: dict[str, Any]
    clock: dict[str, float]
    wait_learner: float


class _Failure(NamedTuple):
    """What the producer queues instead of step ``step``'s rows when it fails on them."""

    step: int
    error: BaseException


class VersionRing:
    """The param versions the producer may still need, published by the learner.

    ``publish(v, params)`` adds version ``v`` and drops those older than ``v - k``; ``wait``
    blocks until a version is there (or the ring is closed). Thread-safe.
    """

    def __init__(self, max_lag: int, versions: dict[int, Any]):
        self.max_lag = max_lag
        self._versions = dict(versions)
        self._cond = threading.Condition()
        self._closed = False

    def publish(self, version: int, params) -> None:
        """Adds ``version`` (``params`` on the rollout devices) and drops the stale ones."""
        with self._cond:
            self._versions[version] = params
            for old in [v for v in self._versions if v < version - self.max_lag]:
                del self._versions[old]
            self._cond.notify_all()

    def wait(self, version: int):
        """Version ``version``'s params once published; None when the ring was closed."""
        with self._cond:
            self._cond.wait_for(lambda: self._closed or version in self._versions)
            return None if self._closed else self._versions[version]

    def get(self, version: int):
        """Version ``version``'s params (it must be held)."""
        with self._cond:
            return self._versions[version]

    def close(self) -> None:
        """Wakes and stops every waiter."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()


def rollout_version(step: int, max_lag: int) -> int:
    """The param version step ``step``'s rollout is drawn from: ``max(0, step - max_lag)``."""
    return max(0, step - max_lag)


class AsyncSteps:
    """RL steps with rollouts ``trainer.max_lag`` versions behind the learner.

    Use as a context manager (it starts and stops the producer thread)::

        with AsyncSteps(ctx, params, start, position, lagged, rollout_mesh) as steps:
            params, opt_state, metrics = steps.step(ctx, params, opt_state, step, position)

    Args:
      ctx: the ``rl_step.StepContext`` (the producer's is fixed at construction).
      params: the learner's params at step ``start`` (version ``start``).
      start: the first step to run; position: the data cursor at its rollout.
      lagged: versions ``start - k .. start - 1`` (each clamped at 0), oldest first: what a
        resumed run restores from its checkpoint (:meth:`lagged`); ignored at step 0.
      rollout_mesh: the rollout devices' mesh (``role_mesh.rollout_mesh``), or None.

    Every wait of the learner on the other side runs under ``deadline``
    (``async_deadline.Deadline`` of ``trainer.async_timeout_s``).
    """

    def __init__(self, ctx, params, start: int, position: int, lagged=(), rollout_mesh=None):
        self.ctx, self.start, self.position = ctx, start, position
        self.max_lag = ctx.cfg.trainer.max_lag
        self.steps = ctx.cfg.trainer.steps
        self.rollout_mesh = rollout_mesh
        versions = {rollout_version(start - self.max_lag + i, 0): p
                    for i, p in enumerate(lagged) if start}
        versions = {v: sync_weights(p, rollout_mesh) for v, p in versions.items()}
        versions[start] = sync_weights(params, rollout_mesh)
        self.ring = VersionRing(self.max_lag, versions)
        self.ready: queue.Queue = queue.Queue()
        self.last: LaggedRollout | None = None  # the rows of the step run last
        self.deadline = Deadline(ctx.cfg.trainer.async_timeout_s)
        self.producing = start  # the step the producer is on
        self._side = "learner"  # the side the learner's worker is on: learner / weight sync
        self._quiet = False  # a side went quiet: the producer is not waited for at the exit
        # the newest (role, phase, step, start, end) perf_counter spans, for a timeline
        # (bench_async); bounded, so a long run does not hold one per phase and step
        self.timeline: collections.deque[tuple[str, str, int, float, float]] = (
            collections.deque(maxlen=TIMELINE_SPANS))
        self.thread = threading.Thread(target=self._produce, name="rollout-producer",
                                       daemon=True)

    def __enter__(self) -> "AsyncSteps":
        self.thread.start()
        return self

    def __exit__(self, exc_type, *exc) -> None:
        """Stops the producer: closes the ring and joins it within the deadline (at once when
        a side went quiet); a producer still running after a clean exit raises
        AsyncRolloutError (after an error it is left, a daemon thread)."""
        self.ring.close()
        start = time.perf_counter()
        self.thread.join(0.0 if self._quiet else self.deadline.seconds)
        if self.thread.is_alive() and exc_type is None:
            raise self._went_quiet(self.producing, "rollout producer",
                                   time.perf_counter() - start)

    def _went_quiet(self, step: int, side: str, waited: float) -> AsyncRolloutError:
        """The deadline's error for ``side`` at step ``step``; marks the run as stopped by a
        quiet side, so that the exit does not wait for the producer."""
        self._quiet = True
        return self.deadline.quiet(step, side, waited)

    def _produce(self) -> None:
        """The producer thread: every step's rows, in order, each from its version."""
        position = self.position
        for step in range(self.start, self.steps):
            version = rollout_version(step, self.max_lag)
            self.producing = step
            try:
                start = time.perf_counter()
                params = self.ring.wait(version)
                if params is None:  # closed: the learner stopped
                    return
                begin = time.perf_counter()
                waited = begin - start
                # rows of a lagged version are scored by the learner, under its own params
                # (and here too, under their own, for the mismatch split)
                score = version == step or self.ctx.cfg.trainer.split_mismatch
                batch, metrics, clock = collect_rollouts(self.ctx, params, position, score)
                self._spans("rollout", step, begin, clock)
                position += int(metrics["collect_rounds"])
                versions = np.full(batch.response.shape[0], version, np.int64)
                self.ready.put(LaggedRollout(step, version, versions, batch, metrics, clock,
                                             waited))
            except BaseException as e:  # noqa: BLE001 -- handed to the learner, which raises
                self.ready.put(_Failure(step, e))
                return

    def _spans(self, role: str, step: int, begin: float, clock: dict[str, float]) -> None:
        """Records ``clock``'s phases (seconds, in order) as spans from ``begin``."""
        for phase, seconds in clock.items():
            self.timeline.append((role, phase, step, begin, begin + seconds))
            begin += seconds

    def _next(self, step: int) -> tuple[LaggedRollout, float]:
        """Step ``step``'s rows and the seconds waited for them; AsyncRolloutError naming the
        step when the producer failed on it, stopped without it or went quiet past the
        deadline."""
        start, limit = time.perf_counter(), self.deadline.seconds
        while True:
            waited = time.perf_counter() - start
            try:
                item = self.ready.get(timeout=POLL_SECONDS if limit is None
                                      else max(0.0, min(POLL_SECONDS, limit - waited)))
                break
            except queue.Empty:
                if not self.thread.is_alive() and self.ready.empty():
                    raise AsyncRolloutError(
                        f"step {step + 1}: the rollout producer stopped without its rows")
                waited = time.perf_counter() - start
                if limit is not None and waited >= limit:
                    raise self._went_quiet(step, "rollout producer", waited)
        if isinstance(item, _Failure):
            raise AsyncRolloutError(f"step {item.step + 1}: the rollout producer failed: "
                                    f"{type(item.error).__name__}: {item.error}") from item.error
        if item.step != step:
            raise AsyncRolloutError(f"step {step + 1}: the producer delivered step "
                                    f"{item.step + 1}'s rows out of order")
        return item, time.perf_counter() - start

    def _to_learner(self, batch: UpdateBatch) -> UpdateBatch:
        """``batch``'s device arrays on the learner's devices (replicated), when the rollouts
        ran on their own."""
        if self.rollout_mesh is None:
            return batch
        sharding = jax.sharding.NamedSharding(self.ctx.mesh, jax.sharding.PartitionSpec())
        return jax.tree.map(lambda x: jax.device_put(x, sharding)
                            if isinstance(x, jax.Array) else x, batch)

    def step(self, ctx, params, opt_state, step: int, position: int | None = None):
        """RL step ``step`` on the rows drawn from version ``max(0, step - max_lag)``:
        proximal scores under ``params``, the update, then version ``step + 1`` published.
        ``params`` and ``opt_state`` are donated; returns ``(params, opt_state, metrics)``
        as ``rl_step.rl_step`` does, plus the async metrics. ``position`` is the producer's
        business (it follows the cursor from the start) and is ignored.

        The wait for the rows, and the learner's work (scores, update, weight sync: on a
        worker thread), each end at the deadline with AsyncRolloutError naming the step and
        the side that went quiet."""
        begin = time.perf_counter()
        item, wait_rollout = self._next(step)
        self.last = item
        self._side, start = "learner", time.perf_counter()
        finished, out = finish_within(self.deadline.seconds,
                                      lambda: self._learn(ctx, params, opt_state, step, item))
        if not finished:
            raise self._went_quiet(step, self._side, time.perf_counter() - start)
        params, opt_state, metrics = out
        metrics.update({"async/lag": float(step - item.versions_N.min()),
                        "time/wait_rollout": wait_rollout,
                        "time/wait_learner": item.wait_learner})
        self.deadline.observe(time.perf_counter() - begin)
        return params, opt_state, metrics

    def _learn(self, ctx, params, opt_state, step: int, item: LaggedRollout):
        """The learner's part of step ``step`` on ``item``'s rows: proximal scores, the
        update, version ``step + 1`` synced and published; ``(params, opt_state, metrics)``."""
        batch = self._to_learner(item.batch)
        clock = dict(item.clock)
        begin = time.perf_counter()
        if item.version == step:  # the rows' own dense scores are the proximal policy's
            proximal = batch.logp_old
        else:
            proximal, t_prox = timed(score_all, ctx.policy, params, batch.prompt,
                                     batch.prompt_mask, batch.response)
            clock["score"] += t_prox
        full, more, t_ref = learner_batch(ctx, params, batch, proximal)
        clock["score"] += t_ref
        metrics = {**item.metrics, **more}
        if batch.logp_old is not None:  # trainer.split_mismatch, or the version is the step's
            metrics.update(mismatch_split(batch.logp_sparse, batch.logp_old, proximal,
                                          batch.loss_mask))
        t_score = time.perf_counter() - begin
        (params, opt_state, update_metrics), t_update = timed(
            update, ctx, params, opt_state, full, step)
        self._side, start = "weight sync", time.perf_counter()
        try:
            self.ring.publish(step + 1, jax.block_until_ready(
                sync_weights(params, self.rollout_mesh)))
        except Exception as e:
            raise AsyncRolloutError(f"step {step + 1}: the weight sync to the rollout devices "
                                    f"failed: {type(e).__name__}: {e}") from e
        self._spans("learner", step, begin, {"score": t_score, "update": t_update,
                                             "weight_sync": time.perf_counter() - start})
        metrics = step_metrics(ctx, metrics, clock, update_metrics, t_update)
        metrics["time/weight_sync"] = time.perf_counter() - start
        return params, opt_state, metrics

    def lagged(self, done: int) -> list:
        """Versions ``done - k .. done - 1`` (each clamped at 0), oldest first: what the
        rollouts of steps ``done .. done + k - 1`` are drawn from, which a checkpoint after
        ``done`` steps holds so that a resumed run draws them again."""
        return [self.ring.get(rollout_version(done - self.max_lag + i, 0))
                for i in range(self.max_lag)]
