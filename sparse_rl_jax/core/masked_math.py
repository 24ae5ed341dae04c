"""NaN-safe reductions over masked arrays and the log ratios shared by the RL losses.

Every helper selects with `jnp.where` *before* doing arithmetic, so whatever sits at masked
positions (padding garbage, -inf, NaN) can reach neither the value nor the gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def as_mask(x: jax.Array) -> jax.Array:
    """Boolean view of a 0/1 (or bool) mask: nonzero means valid."""
    x = jnp.asarray(x)
    return x if x.dtype == jnp.bool_ else x != 0


def masked_sum(x: jax.Array, mask: jax.Array, axis: int | None = None) -> jax.Array:
    """Sum of `x` over positions where `mask` is True (masked entries never enter arithmetic)."""
    return jnp.sum(jnp.where(mask, x, jnp.zeros((), x.dtype)), axis=axis)


def masked_count(mask: jax.Array, axis: int | None = None) -> jax.Array:
    """Number of True entries of `mask` as float32."""
    return jnp.sum(mask, axis=axis, dtype=jnp.float32)


def masked_mean(x: jax.Array, mask: jax.Array, axis: int | None = None) -> jax.Array:
    """Mean of `x` over valid positions; exactly 0 where nothing is valid."""
    return masked_sum(x, mask, axis) / jnp.maximum(masked_count(mask, axis), 1.0)


def masked_max(x: jax.Array, mask: jax.Array, axis: int | None = None) -> jax.Array:
    """Max of `x` over valid positions (all axes, or `axis`); 0 where nothing is valid."""
    m = jnp.max(jnp.where(mask, x, -jnp.inf), axis=axis)
    return jnp.where(jnp.any(mask, axis=axis), m, 0.0)


def masked_min(x: jax.Array, mask: jax.Array) -> jax.Array:
    """Min of `x` over valid positions (all axes); 0 when nothing is valid."""
    return -masked_max(-x, mask)


def masked_quantile(x_N: jax.Array, mask_N: jax.Array, q: float) -> jax.Array:
    """The `q` quantile of the valid entries of the vector `x_N` (NumPy's default `linear`
    interpolation between order statistics); 0 when nothing is valid. Static shapes: the
    invalid entries sort last and the interpolation reads only the first `n` valid ones."""
    n = jnp.sum(mask_N.astype(jnp.int32))
    ordered = jnp.sort(jnp.where(mask_N, x_N, jnp.inf))
    last = jnp.maximum(n - 1, 0)
    position = q * last.astype(jnp.float32)
    below = jnp.floor(position).astype(jnp.int32)
    above = jnp.minimum(below + 1, last)
    low, high = ordered[below], ordered[above]
    value = low + (position - below.astype(jnp.float32)) * (high - low)
    return jnp.where(n > 0, value, 0.0)


def safe_log_ratio(
    logp_num: jax.Array, logp_den: jax.Array, mask: jax.Array, bound: float
) -> jax.Array:
    """`clip(logp_num - logp_den, -bound, bound)` at valid positions, 0 elsewhere. Shapes `[B, T]`.

    +-inf inputs clamp to +-bound; an undefined difference (inf - inf, NaN) maps to -bound, i.e.
    it is treated as a catastrophic mismatch rather than allowed to poison the batch. Gradients
    are zero outside the clamp range and at masked positions.
    """
    zero = jnp.zeros((), jnp.float32)
    num = jnp.where(mask, logp_num.astype(jnp.float32), zero)
    den = jnp.where(mask, logp_den.astype(jnp.float32), zero)
    diff = num - den
    diff = jnp.where(jnp.isnan(diff), -bound, diff)
    return jnp.where(mask, jnp.clip(diff, -bound, bound), zero)


def unclamped_log_ratio(
    logp_num: jax.Array, logp_den: jax.Array, mask: jax.Array, bound: float
) -> jax.Array:
    """`logp_num - logp_den` at valid positions, 0 elsewhere, not clamped: a factor that is
    never exponentiated keeps its gradient however far apart the log-probs are. Shapes `[B, T]`.

    Where the difference is not finite (an infinite log-prob, inf - inf) it takes
    `safe_log_ratio`'s value (+-bound) and a zero gradient, so the value stays finite.
    """
    zero = jnp.zeros((), jnp.float32)
    diff = (jnp.where(mask, logp_num.astype(jnp.float32), zero)
            - jnp.where(mask, logp_den.astype(jnp.float32), zero))
    return jnp.where(jnp.isfinite(diff), diff, safe_log_ratio(logp_num, logp_den, mask, bound))
