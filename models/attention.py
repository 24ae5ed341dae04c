"""The one attention function every path uses (full forward, cached decode, mask replay).

Visibility rule: key ``s`` is visible to the query at position ``t`` iff
``0 <= kpos[s] <= t`` (and ``t < expiry[s]`` when an eviction record is replayed), ANDed with
an optional arbitrary boolean mask. Padding queries carry position ``-1`` and see nothing;
such rows give a zero output instead of NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def visibility(
    q_pos: jax.Array,
    k_pos: jax.Array,
    k_expiry: jax.Array | None = None,
    mask: jax.Array | None = None,
) -> jax.Array:
    """Boolean ``[B, Hkv, T, S]``: which key each query may attend to.

    Args:
      q_pos: ``[B, T]`` int query positions (``-1`` = padding).
      k_pos: ``[B, Hkv, S]`` int key positions (``-1`` = empty/padding).
      k_expiry: optional ``[B, Hkv, S]`` int; key ``s`` is hidden from queries at ``t >= expiry``.
      mask: optional bool, broadcastable to ``[B, Hkv, T, S]``, ANDed in.
    """
    qp = q_pos[:, None, :, None]
    kp = k_pos[:, :, None, :]
    visible = (kp >= 0) & (kp <= qp)
    if k_expiry is not None:
        visible &= qp < k_expiry[:, :, None, :]
    if mask is not None:
        visible &= mask
    return visible


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_pos: jax.Array,
    k_pos: jax.Array,
    *,
    k_expiry: jax.Array | None = None,
    mask: jax.Array | None = None,
) -> jax.Array:
    """Grouped-query softmax attention with position-based masking; fp32 logits and softmax.

    Args:
      q: ``[B, T, Hq, D]`` queries (after RoPE); ``Hq`` a multiple of ``Hkv``.
      k, v: ``[B, Hkv, S, D]`` keys (after RoPE) and values. Query head ``h`` reads KV head
        ``h // (Hq // Hkv)`` (HF grouping), without repeating K/V.
      q_pos, k_pos, k_expiry, mask: see :func:`visibility`.

    Returns:
      ``[B, T, Hq, D]`` in ``q.dtype``; zero for queries that see no key.
    """
    b, t, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(b, t, hkv, hq // hkv, d)
    logits = jnp.einsum("btkgd,bksd->bkgts", qg, k, preferred_element_type=jnp.float32)
    logits = logits * (d ** -0.5)
    visible = visibility(q_pos, k_pos, k_expiry, mask)[:, :, None]  # [B, Hkv, 1, T, S]
    logits = jnp.where(visible, logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    weights = jnp.exp(logits - row_max)
    total = jnp.sum(weights, axis=-1, keepdims=True)
    probs = weights / jnp.where(total > 0, total, 1.0)
    out = jnp.einsum("bkgts,bksd->btkgd", probs.astype(v.dtype), v)
    return out.reshape(b, t, hq, d).astype(q.dtype)
