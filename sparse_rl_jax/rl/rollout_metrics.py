"""Per-rollout statistics: rewards, response lengths, truncation, repetition loops, KV savings,
the sparse-vs-dense acceptance alpha."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from models.shapes import check_shape
from sparse_rl_jax.core.masked_math import as_mask, masked_count
from sparse_rl_jax.rollout.acceptance import acceptance_percentile_per_bin


def repetition_flags(
    tokens: jax.Array,
    response_mask: jax.Array,
    max_period: int = 16,
    repeats: int = 3,
    min_span: int = 16,
) -> jax.Array:
    """Which responses contain a repetition loop. `tokens`, `response_mask` `[N, T]` -> `[N]` bool.

    Let `x_0 .. x_{L-1}` be a row's response tokens (the positions where `response_mask` is set,
    in order). The row is flagged iff for some period `p` in `1..max_period` some stretch
    `x_j .. x_{j+s-1}` with `s >= max(repeats * p, min_span)` satisfies `x_i == x_{i-p}` for
    every `i` in `[j + p, j + s)`: at least `repeats` back-to-back copies of a p-gram covering
    at least `min_span` tokens, anywhere in the response (a loop that ran to the length cap or
    one that stopped). Works at every width `T` (a 40-token loop in a 40-wide batch is
    flagged). `max_period`, `repeats`, `min_span` are static ints >= 1.
    """
    if max_period < 1 or repeats < 1 or min_span < 1:
        raise ValueError("max_period, repeats and min_span must be >= 1, got "
                         f"{max_period}, {repeats}, {min_span}")
    n, t = tokens.shape
    check_shape("response_mask", response_mask, N=n, T=t)
    valid = as_mask(response_mask)
    length = jnp.sum(valid, axis=1)
    order = jnp.argsort(~valid, axis=1, stable=True)  # response positions first, in order
    compact = jnp.take_along_axis(tokens, order, axis=1)
    position = jnp.arange(t)[None, :]
    flagged = jnp.zeros((n,), jnp.bool_)
    inside = position < length[:, None]
    for p in range(1, min(max_period, t) + 1):
        # same[i]: x_i == x_{i-p} inside the response; run[i]: trues ending at i in a row.
        same = jnp.zeros((n, t), jnp.bool_).at[:, p:].set(compact[:, p:] == compact[:, :-p])
        same = same & inside
        last_break = jax.lax.cummax(jnp.where(same, -1, position), axis=1)
        run = position - last_break  # x_{i-run-p+1} .. x_i (run + p tokens) is p-periodic
        long_enough = (run + p >= max(repeats * p, min_span)) & inside & (position >= p - 1)
        flagged = flagged | jnp.any(long_enough, axis=1)
    return flagged


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
    logp: jax.Array | None = None,
    max_period: int = 16,
    repeats: int = 3,
    min_span: int = 16,
) -> dict[str, jax.Array]:
    """Scalar float32 statistics of one rollout batch of N responses.

    rewards `[N]`; tokens, response_mask `[N, T]`; truncated `[N]` bool (hit the length limit
    without EOS); sparse_resident / dense_resident: optional `[N]` KV residency arrays;
    logp: optional `[N, T]` log-prob of each token under the policy that sampled it.
    Returns reward_mean, reward_std (population, ddof=0), response_length_mean/max,
    truncated_fraction, repetition_fraction (`repetition_flags`), kv_token_savings when
    both residency arrays are given, and with ``logp`` entropy_estimate: the token mean of
    ``-logp`` over the responses, a one-sample estimate of the sampling policy's per-token
    entropy (E_x~p[-log p(x)] = H(p)), which falls when the policy collapses onto few tokens.
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
            repetition_flags(tokens, response_mask, max_period, repeats, min_span),
            dtype=jnp.float32
        ),
    }
    if sparse_resident is not None:
        metrics["kv_token_savings"] = kv_token_savings(sparse_resident, dense_resident)
    if logp is not None:
        check_shape("logp", logp, N=n, T=t)
        on = as_mask(response_mask)
        metrics["entropy_estimate"] = (-jnp.sum(jnp.where(on, logp, 0.0))
                                       / jnp.maximum(jnp.sum(on), 1))
    return {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}


def acceptance_metrics(alpha, response_mask, threshold: float = 0.86) -> dict[str, float]:
    """Host-side alpha statistics of a rollout batch (``alpha``, ``response_mask`` ``[N, M]``).

    Returns ``alpha_mean``, ``alpha_p5`` (all valid tokens pooled), ``alpha_p5_bin{i}`` per
    2000-token bin of 1-based response position (``cumsum(response_mask)``, alpha clipped to
    ``[0, 1]``: ``acceptance.acceptance_percentile_per_bin``) that holds tokens, and
    ``alpha_bins_below`` (bins whose p5 is under ``threshold``).
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
