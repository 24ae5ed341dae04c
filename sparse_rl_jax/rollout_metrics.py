"""Per-rollout statistics: rewards, response lengths, truncation, repetition loops, KV savings,
the sparse-vs-dense acceptance alpha."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from models.shapes import check_shape
from sparse_rl_jax.acceptance import acceptance_percentile_per_bin
from sparse_rl_jax.masked_math import as_mask, masked_count


def repetition_flags(
    tokens: jax.Array, response_mask: jax.Array, max_period: int = 16, repeats: int = 3
) -> jax.Array:
    """Which responses end in a repetition loop. `tokens`, `response_mask` `[N, T]` -> `[N]` bool.

    Let `x_0 .. x_{L-1}` be a row's response tokens (the positions where `response_mask` is set,
    in order) and `W = repeats * max_period`. The row is flagged iff `L >= W` and for some period
    `p` in `1..max_period` the last `W` tokens satisfy `x_i == x_{i-p}` for every
    `i in [L - W + p, L)`, i.e. the tail is at least `repeats` back-to-back copies of a p-gram.
    A response that ends with EOS after its loop is not flagged (the EOS breaks the period).
    `max_period`, `repeats` are static ints >= 1.
    """
    if max_period < 1 or repeats < 1:
        raise ValueError(f"max_period and repeats must be >= 1, got {max_period}, {repeats}")
    n, t = tokens.shape
    check_shape("response_mask", response_mask, N=n, T=t)
    window = repeats * max_period
    if window > t:
        return jnp.zeros((n,), jnp.bool_)
    valid = as_mask(response_mask)
    length = jnp.sum(valid, axis=1)
    order = jnp.argsort(~valid, axis=1, stable=True)  # response positions first, in order
    compact = jnp.take_along_axis(tokens, order, axis=1)
    idx = jnp.clip(length[:, None] - window + jnp.arange(window)[None, :], 0, t - 1)
    tail = jnp.take_along_axis(compact, idx, axis=1)  # [N, W]
    periodic = jnp.zeros((n,), jnp.bool_)
    for p in range(1, max_period + 1):
        periodic = periodic | jnp.all(tail[:, p:] == tail[:, :-p], axis=1)
    return periodic & (length >= window)


def kv_token_savings(sparse_resident: jax.Array, dense_resident: jax.Array) -> jax.Array:
    """`1 - sum(sparse_resident) / sum(dense_resident)` (0 when the dense total is 0).

    Inputs `[N]`, e.g. the sampler's per-sequence mean (or peak) resident KV tokens of the
    compressed cache and of the dense equivalent.
    """
    check_shape("dense_resident", dense_resident, N=None)
    check_shape("sparse_resident", sparse_resident, N=dense_resident.shape[0])
    dense = jnp.sum(dense_resident.astype(jnp.float32))
    sparse = jnp.sum(sparse_resident.astype(jnp.float32))
    return jnp.where(dense > 0, 1.0 - sparse / jnp.where(dense > 0, dense, 1.0), 0.0)


def rollout_metrics(
    rewards: jax.Array,
    tokens: jax.Array,
    response_mask: jax.Array,
    truncated: jax.Array,
    sparse_resident: jax.Array | None = None,
    dense_resident: jax.Array | None = None,
    *,
    max_period: int = 16,
    repeats: int = 3,
) -> dict[str, jax.Array]:
    """Scalar float32 statistics of one rollout batch of N responses.

    rewards `[N]`; tokens, response_mask `[N, T]`; truncated `[N]` bool (hit the length limit
    without EOS); sparse_resident / dense_resident: optional `[N]` KV residency arrays.
    Returns reward_mean, reward_std (population, ddof=0), response_length_mean/max,
    truncated_fraction, repetition_fraction (`repetition_flags`), and kv_token_savings when
    both residency arrays are given.
    """
    n, t = tokens.shape
    check_shape("rewards", rewards, N=n)
    check_shape("response_mask", response_mask, N=n, T=t)
    check_shape("truncated", truncated, N=n)
    if (sparse_resident is None) != (dense_resident is None):
        raise ValueError("sparse_resident and dense_resident must be given together")
    lengths = masked_count(as_mask(response_mask), axis=1)
    rewards = rewards.astype(jnp.float32)
    metrics = {
        "reward_mean": jnp.mean(rewards),
        "reward_std": jnp.std(rewards),
        "response_length_mean": jnp.mean(lengths),
        "response_length_max": jnp.max(lengths),
        "truncated_fraction": jnp.mean(as_mask(truncated), dtype=jnp.float32),
        "repetition_fraction": jnp.mean(
            repetition_flags(tokens, response_mask, max_period, repeats), dtype=jnp.float32
        ),
    }
    if sparse_resident is not None:
        metrics["kv_token_savings"] = kv_token_savings(sparse_resident, dense_resident)
    return {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}


def acceptance_metrics(alpha, response_mask, threshold: float = 0.86) -> dict[str, float]:
    """Host-side alpha statistics of a rollout batch (``alpha``, ``response_mask`` ``[N, M]``).

    Returns ``alpha_mean``, ``alpha_p5`` (all valid tokens pooled), ``alpha_p5_bin{i}`` per
    2000-token bin of response position that holds tokens, and ``alpha_bins_below`` (bins
    whose p5 is under ``threshold``).
    """
    alpha, mask = np.asarray(alpha, np.float64), np.asarray(response_mask).astype(bool)
    check_shape("alpha", alpha, N=None, M=None)
    check_shape("response_mask", mask, N=alpha.shape[0], M=alpha.shape[1])
    values = alpha[mask]
    if values.size == 0:
        return {}
    per_bin = acceptance_percentile_per_bin(alpha, mask)
    metrics = {"alpha_mean": float(values.mean()), "alpha_p5": float(np.percentile(values, 5)),
               "alpha_bins_below": float(np.sum(per_bin[~np.isnan(per_bin)] < threshold))}
    metrics.update({f"alpha_p5_bin{i}": float(v) for i, v in enumerate(per_bin)
                    if not np.isnan(v)})
    return metrics
