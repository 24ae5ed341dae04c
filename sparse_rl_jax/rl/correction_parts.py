"""The pluggable pieces the correction parts pick by name: the ratio's level
(``correction.is_level`` / ``correction.rs_level``) and the IS weight's mode
(``correction.is_mode``).

``CorrectionConfig`` takes its allowed values from :data:`RATIO_LEVELS` and :data:`IS_MODES`,
and ``compute_corrections`` calls the registered entries. A new level or mode is one function
plus its registration.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from models.registry import Registry
from sparse_rl_jax.core.masked_math import masked_mean

RATIO_LEVELS: Registry[Callable[[jax.Array, jax.Array], jax.Array | None]] = Registry(
    "correction level")
"""``level(log_r_BxT, valid_BxT) -> per-sequence log ratio [B]``, or None at the token level
(each token keeps its own)."""

IS_MODES: Registry[Callable[[jax.Array, float, float], tuple[jax.Array, jax.Array]]] = Registry(
    "IS mode")
"""``mode(r_BxT, lower, upper) -> (weights_BxT, altered_BxT)``: the IS weight at the ratios
``r`` and the bool positions whose weight differs from ``r`` (truncated or zeroed)."""


@RATIO_LEVELS.register("token")
def token_level(log_r: jax.Array, valid: jax.Array) -> None:
    """Each token's own ratio ``r_t``."""
    del log_r, valid


@RATIO_LEVELS.register("sequence")
def sequence_level(log_r: jax.Array, valid: jax.Array) -> jax.Array:
    """``log prod_t r_t``: the sum over the response (``log_r`` is 0 off the mask)."""
    del valid
    return jnp.sum(log_r, axis=1)


@RATIO_LEVELS.register("geometric")
def geometric_level(log_r: jax.Array, valid: jax.Array) -> jax.Array:
    """``mean_t log r_t`` over the response: the log of the geometric mean."""
    return masked_mean(log_r, valid, axis=1)


def level_log_ratio(log_r_BxT: jax.Array, valid_BxT: jax.Array, level: str, clamp: float
                    ) -> jax.Array:
    """Token log ratios -> the log ratio of ``level`` at every token ``[B, T]`` (0 off the
    mask); a per-sequence aggregate is clamped to ``[-clamp, clamp]`` and broadcast."""
    per_seq = RATIO_LEVELS.get(level)(log_r_BxT, valid_BxT)
    if per_seq is None:
        return log_r_BxT
    per_seq = jnp.clip(per_seq, -clamp, clamp)
    return jnp.where(valid_BxT, per_seq[:, None], 0.0)


def is_sequence_level(level: str) -> bool:
    """Whether ``level`` aggregates over the sequence (its rejection drops whole sequences)."""
    return level != "token"


@IS_MODES.register("truncate")
def truncate(r: jax.Array, lower: float, upper: float) -> tuple[jax.Array, jax.Array]:
    """TIS: ``min(r, upper)`` (``lower`` unused)."""
    del lower
    return jnp.minimum(r, upper), r > upper


@IS_MODES.register("mask")
def mask(r: jax.Array, lower: float, upper: float) -> tuple[jax.Array, jax.Array]:
    """MIS / IcePop: ``r`` inside ``[lower, upper]``, 0 outside (the position stays in the
    loss mask; only its weight is zero)."""
    outside = (r < lower) | (r > upper)
    return jnp.where(outside, 0.0, r), outside
