"""How the trainer runs its RL steps, by ``trainer.mode``: a registry of step runners.

A runner is built as ``Runner(ctx, params, start, position, lagged, rollout_mesh)`` (see
``async_lag.AsyncSteps`` for the arguments), used as a context manager, and offers
``step(ctx, params, opt_state, step, position) -> (params, opt_state, metrics)`` and
``lagged(done)``: the older param versions a checkpoint after ``done`` steps must hold.
"""

from __future__ import annotations

from models.registry import Registry
from sparse_rl_jax.training.async_lag import AsyncSteps
from sparse_rl_jax.training.rl_step import rl_step

STEP_MODES: Registry[type] = Registry("trainer mode")


@STEP_MODES.register("sync")
class SyncSteps:
    """Each step's rollout drawn from the params it updates (``rl_step.rl_step``)."""

    def __init__(self, ctx, params, start: int, position: int, lagged=(), rollout_mesh=None):
        del ctx, params, start, position, lagged, rollout_mesh  # nothing runs ahead

    def __enter__(self) -> "SyncSteps":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def step(self, ctx, params, opt_state, step: int, position: int):
        """``rl_step.rl_step``."""
        return rl_step(ctx, params, opt_state, step, position)

    def lagged(self, done: int) -> list:
        """No older versions: a sync step's rollout uses the current params."""
        del done
        return []


STEP_MODES.register("async", AsyncSteps)
