"""The off-policy correction kinds (``correction.kind``) by name: each one's IS weight and
rejection, and what else it does.

``CorrectionConfig`` takes its allowed kinds from :data:`CORRECTION_KINDS` and
``compute_corrections`` calls the registered entry. A new kind is one ``weigh`` function plus
``CORRECTION_KINDS.register(name, CorrectionKind(weigh, ...))``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from models.registry import Registry


@dataclasses.dataclass(frozen=True)
class CorrectionKind:
    """One correction kind.

    Attributes:
      weigh: ``weigh(r, cfg) -> (weights, reject)``: the IS weight and the bool rejection
        flag ``[B, T]`` at the ratios ``r`` ``[B, T]`` of ``cfg.level`` (``CorrectionConfig``).
      truncates: the weight is ``min(r, is_upper)`` (reported as ``is_truncated_fraction``).
      vetoes: drops sequences with a valid token ``r_t < veto_threshold``.
      normalizes: the default of ``CorrectionConfig.normalize``.
      ratio_to_behaviour: the PPO ratio is taken to the sampler's own log-probs (the
        behaviour policy) instead of the proximal policy's dense ones. (``shadow_mask`` does
        the same whenever its rows carry a record, which its learner replays.)
    """

    weigh: Callable[[jax.Array, Any], tuple[jax.Array, jax.Array]]
    truncates: bool = False
    vetoes: bool = False
    normalizes: bool = False
    ratio_to_behaviour: bool = False


CORRECTION_KINDS: Registry[CorrectionKind] = Registry("correction kind")


def _no_rejection(r: jax.Array) -> jax.Array:
    """All-False ``[B, T]``."""
    return jnp.zeros(r.shape, jnp.bool_)


def unweighted(r: jax.Array, cfg: Any) -> tuple[jax.Array, jax.Array]:
    """Weight 1, nothing rejected (``none``; ``shadow_mask``, whose learner replays the
    sampler's own eviction record instead)."""
    del cfg
    return jnp.ones_like(r), _no_rejection(r)


def truncated(r: jax.Array, cfg: Any) -> tuple[jax.Array, jax.Array]:
    """TIS: weight ``min(r, is_upper)``, nothing rejected."""
    return jnp.minimum(r, cfg.is_upper), _no_rejection(r)


def masked(r: jax.Array, cfg: Any) -> tuple[jax.Array, jax.Array]:
    """MIS / IcePop: weight ``r``, reject ``r`` outside ``[is_lower, is_upper]``."""
    return r, (r < cfg.is_lower) | (r > cfg.is_upper)


def sparse_rl(r: jax.Array, cfg: Any) -> tuple[jax.Array, jax.Array]:
    """Sparse-RL: weight ``min(r, is_upper)``, reject ``r`` outside ``[rs_lower, rs_upper]``
    (the sequence veto is :attr:`CorrectionKind.vetoes`)."""
    return jnp.minimum(r, cfg.is_upper), (r < cfg.rs_lower) | (r > cfg.rs_upper)


CORRECTION_KINDS.register("none", CorrectionKind(unweighted))
CORRECTION_KINDS.register("tis", CorrectionKind(truncated, truncates=True))
CORRECTION_KINDS.register("mis", CorrectionKind(masked))
CORRECTION_KINDS.register("sparse_rl", CorrectionKind(sparse_rl, truncates=True, vetoes=True,
                                                      normalizes=True))
CORRECTION_KINDS.register("shadow_mask", CorrectionKind(unweighted))
# Standard PPO on the sampler's rows: the sampler's log-probs are the old policy (the ratio's
# denominator), nothing weighted or rejected. The plain baseline of async training (AReaL's
# "naive PPO"): its clip is the only thing that sees the compression and the lag.
CORRECTION_KINDS.register("ppo_behaviour", CorrectionKind(unweighted, ratio_to_behaviour=True))
