"""Per-slot eviction scores Z for one layer of a KV cache (SnapKV, R-KV, StreamingLLM).

Geometry shared by every function (one layer):
  queries ``[B, Hq, w, D]``: the queries of the ``w`` newest written slots, oldest -> newest.
  keys ``[B, Hkv, C, D]`` (after RoPE), pos ``[B, Hkv, C]`` int32 (``-1`` = empty/padding).
  index ``[]`` int32: the next write slot; the observation window is the slots
  ``[index - w, index)`` (``index >= w``), slots ``>= index`` are empty.
Empty slots take part in nothing (no softmax, mean or similarity sees them) and score
``-inf``. Window slots also score ``-inf``: selection keeps them unconditionally. Every score
is float32 and finite on valid non-window slots, so ranking never sees NaN.

The scores a ``compression.method`` can name are registered in :data:`EVICTION_SCORES`
(``score(cfg, queries, keys, pos, index) -> [B, Hkv, C]``, masked by :func:`slot_scores`);
``CompressionConfig`` takes its evicting methods from there, so a new eviction policy is one
function plus ``@EVICTION_SCORES.register(name)``.

Array names carry their shape (``probs_BxKxWxC``): B rows, K = Hkv KV heads, G query heads per
KV head, W window queries, C cache slots, D head dim, L slots of a key block, N key blocks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import jax
import jax.numpy as jnp
from jax import lax

from models.attention import masked_softmax
from models.registry import Registry
from sparse_rl_jax.core.masked_math import masked_mean

from sparse_rl_jax.kv.compression_sections import EvictionConfig

if TYPE_CHECKING:  # the config takes its method names from this module's registry
    from sparse_rl_jax.kv.compression_config import CompressionConfig

EVICTION_SCORES: Registry[Callable[..., jax.Array]] = Registry("eviction score")

_SINK_SCORE = float(2**30)  # above any position: sinks outrank every recency score
KEY_BLOCK = 512  # most key slots per block of R-KV's duplicate search (``redundancy``)


def _slot_masks(pos: jax.Array, index: jax.Array, window: int) -> tuple[jax.Array, jax.Array]:
    """``(valid [B, Hkv, C], non_window [C])``: the slot holds a token / the slot is older
    than the window."""
    slot = jnp.arange(pos.shape[-1])
    valid = (pos >= 0) & (slot < index)
    return valid, slot < index - window


def _window_positions(pos: jax.Array, index: jax.Array, window: int) -> jax.Array:
    """Positions ``[B, Hkv, w]`` of the window slots ``[index - w, index)``."""
    return lax.dynamic_slice_in_dim(pos, index - window, window, axis=-1)


def _pool_slots(x: jax.Array, kind: str, kernel: int) -> jax.Array:
    """Stride-1 'same' pooling of non-negative ``x [..., C]`` along slots, zero padding counted.

    ``max`` equals PyTorch ``max_pool1d(padding=kernel // 2)`` on non-negative data (every
    window contains its own centre); ``avg`` equals ``avg_pool1d`` with
    ``count_include_pad=True``.
    """
    if kernel == 1:
        return x
    dims = (1,) * (x.ndim - 1) + (kernel,)
    pad = ((0, 0),) * (x.ndim - 1) + ((kernel // 2, kernel // 2),)
    if kind == "max":
        return lax.reduce_window(x, 0.0, lax.max, dims, (1,) * x.ndim, pad)
    return lax.reduce_window(x, 0.0, lax.add, dims, (1,) * x.ndim, pad) / kernel


def _reduce_group(x: jax.Array, kind: str, axis: int) -> jax.Array:
    """Reduce over the query heads of a KV group (``max`` or ``mean``)."""
    return jnp.max(x, axis=axis) if kind == "max" else jnp.mean(x, axis=axis)


def _group_logits(queries: jax.Array, keys: jax.Array) -> jax.Array:
    """Scaled logits ``[B, Hkv, G, w, C]`` (float32) of the window queries of each KV group."""
    b, hq, w, d = queries.shape
    hkv = keys.shape[1]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    q_BxKxGxWxD = queries.astype(jnp.float32).reshape(b, hkv, hq // hkv, w, d)
    k_BxKxCxD = keys.astype(jnp.float32)
    return jnp.einsum("bkgwd,bkcd->bkgwc", q_BxKxGxWxD, k_BxKxCxD) / jnp.sqrt(jnp.float32(d))


@EVICTION_SCORES.register("snapkv")
def importance(
    cfg: EvictionConfig, queries: jax.Array, keys: jax.Array, pos: jax.Array, index: jax.Array
) -> jax.Array:
    """Attention importance ``I [B, Hkv, C]`` of the non-window slots (0 on the others); the
    ``snapkv`` score.

    ``cfg.importance == "sparse_rl"`` (official Sparse-RL / R-KV): logits pooled over the
    group's query heads (``cfg.gqa_pool``), softmax over the valid non-window keys, mean over
    the valid window queries, then pooled along slots (``cfg.pool``, ``cfg.pool_kernel``).
    ``"kvpress_snapkv"`` (kvpress ``SnapKVPress``): per query head, softmax over every key the
    query may see (causal inside the window), sliced to the non-window slots without
    renormalising, mean over the window queries, pooled along slots, then reduced over the
    group's query heads.
    """
    w = queries.shape[2]
    valid_BxKxC, non_window = _slot_masks(pos, index, w)
    qpos_BxKxW = _window_positions(pos, index, w)
    q_ok_BxKxWx1 = (qpos_BxKxW >= 0)[..., None]
    logits_BxKxGxWxC = _group_logits(queries, keys)
    kept_BxKxC = valid_BxKxC & non_window
    if cfg.importance == "sparse_rl":
        logits_BxKxWxC = _reduce_group(logits_BxKxGxWxC, cfg.gqa_pool, axis=2)
        probs_BxKxWxC = masked_softmax(logits_BxKxWxC, kept_BxKxC[:, :, None, :])
        scores_BxKxC = masked_mean(probs_BxKxWxC, q_ok_BxKxWx1, axis=2)
        return _pool_slots(scores_BxKxC, cfg.pool, cfg.pool_kernel)
    causal_BxKxWxC = pos[:, :, None, :] <= qpos_BxKxW[..., None]
    visible_BxKxWxC = valid_BxKxC[:, :, None, :] & causal_BxKxWxC
    probs_BxKxGxWxC = masked_softmax(logits_BxKxGxWxC, visible_BxKxWxC[:, :, None])
    probs_BxKxGxWxC = jnp.where(kept_BxKxC[:, :, None, None, :], probs_BxKxGxWxC, 0.0)
    scores_BxKxGxC = masked_mean(probs_BxKxGxWxC, q_ok_BxKxWx1[:, :, None], axis=3)
    return _reduce_group(_pool_slots(scores_BxKxGxC, cfg.pool, cfg.pool_kernel), cfg.gqa_pool,
                         axis=2)


def _block_starts(c: int, block: int) -> tuple[int, jax.Array]:
    """``(L, starts [N])``: ``N = ceil(C / block)`` blocks of ``L = ceil(C / N) <= block``
    slots covering ``[0, C)``, the last one moved back to end at ``C`` (it may overlap the one
    before: the callers' reductions either ignore or mask the repeated slots)."""
    n = -(-c // block)
    size = -(-c // n)
    return size, jnp.minimum(jnp.arange(n) * size, c - size)


def _newer_duplicate(threshold: float):
    """The reducer of the duplicate search over ``(similarity, slot id)`` pairs: the newest id
    whose similarity is above ``threshold`` (``-1``: none), as a resolved pair ``(+inf, id)``
    (``(+inf, -1)`` is its identity), so the similarity is read once, straight from the dot."""

    def reduce(a, b):
        key_a = jnp.where(a[0] > threshold, a[1], -1.0)
        key_b = jnp.where(b[0] > threshold, b[1], -1.0)
        return jnp.full_like(a[0], jnp.inf), jnp.maximum(key_a, key_b)

    return reduce


def _newest_duplicates(k_BxKxCxD: jax.Array, valid_BxKxC: jax.Array, threshold: float,
                       block: int) -> jax.Array:
    """``[B, Hkv, C]`` int32: per row ``i`` the newest valid ``j != i`` with
    ``k_i . k_j > threshold`` (``-1``: none), a running max over key blocks of at most
    ``block`` slots (only ``[C, L]`` similarities at a time, each read once by one reduction
    that also builds the candidate ids; a block overlapping the previous one repeats a max)."""
    c = k_BxKxCxD.shape[2]
    size, starts = _block_starts(c, block)
    slot = jnp.arange(c)

    def newest_in_block(newest_BxKxC, start):
        k_BxKxLxD = lax.dynamic_slice_in_dim(k_BxKxCxD, start, size, axis=2)
        ok_BxKxL = lax.dynamic_slice_in_dim(valid_BxKxC, start, size, axis=2)
        ids_L = start + jnp.arange(size)
        sim_BxKxCxL = jnp.einsum("bkid,bkjd->bkij", k_BxKxCxD, k_BxKxLxD)
        # float slot ids (exact below 2**24): XLA:CPU vectorises a float max, not an int one
        ids_BxKxCxL = jnp.where(ok_BxKxL[..., None, :] & (slot[:, None] != ids_L[None, :]),
                                ids_L.astype(jnp.float32), -1.0)
        _, best_BxKxC = lax.reduce((sim_BxKxCxL, ids_BxKxCxL), (jnp.float32(jnp.inf),
                                   jnp.float32(-1.0)), _newer_duplicate(threshold), (3,))
        return jnp.maximum(newest_BxKxC, best_BxKxC), None

    newest_BxKxC, _ = lax.scan(newest_in_block, jnp.full(valid_BxKxC.shape, -1.0), starts)
    return newest_BxKxC.astype(jnp.int32)


def _sum_where_zero(a, b):
    """Reducer over ``(value, offset)`` pairs: the sum of the values whose offset is 0, as a
    resolved pair ``(sum, 0)`` (``(0, 0)`` is its identity)."""
    total = jnp.where(a[1] == 0.0, a[0], 0.0) + jnp.where(b[1] == 0.0, b[0], 0.0)
    return total, jnp.zeros_like(total)


def _removed_per_column(newest_BxKxC: jax.Array, zeroed_BxKxC: jax.Array,
                        block: int) -> jax.Array:
    """``[B, Hkv, C]``: per column ``j``, the sum of the ``zeroed_i`` of the rows ``i`` whose
    newest duplicate is ``j``: a compare-reduce over all rows (no scatter), one block of at
    most ``block`` columns at a time, its ``[C, L]`` compare formed inside the reduction."""
    c = newest_BxKxC.shape[2]
    size, _ = _block_starts(c, block)
    newest_BxKxCx1 = newest_BxKxC.astype(jnp.float32)[..., None]
    zeroed_BxKxCx1 = zeroed_BxKxC[..., None]

    def column_block(start):
        ids_L = (start + jnp.arange(size)).astype(jnp.float32)
        shape = newest_BxKxCx1.shape[:-1] + (size,)
        removed_BxKxL, _ = lax.reduce(
            (jnp.broadcast_to(zeroed_BxKxCx1, shape), newest_BxKxCx1 - ids_L),
            (jnp.float32(0.0), jnp.float32(0.0)), _sum_where_zero, (2,))
        return removed_BxKxL

    removed_NxBxKxL = lax.map(column_block, jnp.arange(0, c, size))
    b, h = newest_BxKxC.shape[:2]
    return jnp.moveaxis(removed_NxBxKxL, 0, 2).reshape(b, h, -1)[..., :c]


def redundancy(keys: jax.Array, pos: jax.Array, index: jax.Array, threshold: float,
               block: int = KEY_BLOCK) -> jax.Array:
    """R-KV redundancy ``R [B, Hkv, C]`` over the valid slots (0 on empty ones).

    Cosine similarity ``S`` of the valid keys (``k / (|k| + 1e-8)``), diagonal zeroed; in each
    row ``i`` the newest ``j`` with ``S_ij > threshold`` is zeroed (the newest near-duplicate
    survives; nothing is zeroed when no such ``j``); ``R = softmax_j(mean_i S_ij)``.
    ``keys [B, Hkv, C, D]``, ``pos [B, Hkv, C]``, ``index []``: the module's geometry;
    ``block`` (static): the most key slots per block of the duplicate search.

    No ``[C, C]`` array is formed: the duplicate search is a running max over ``ceil(C /
    block)`` key blocks of equal size (the last one ends at ``C``), and the column sums use
    ``sum_i S_ij = (sum_i k_i) . k_j`` minus the diagonal and the zeroed entries (one
    compare-reduce per column block, no scatter: a GPU scatter-add is not deterministic).
    Each ``[C, L]`` similarity block is written once by its dot and read once by one variadic
    reduction; the compares are formed inside the reductions, never stored.
    """
    c = keys.shape[2]
    valid_BxKxC, _ = _slot_masks(pos, index, 0)
    k_BxKxCxD = keys.astype(jnp.float32)
    norm_BxKxCx1 = jnp.linalg.norm(k_BxKxCxD, axis=-1, keepdims=True) + 1e-8
    k_BxKxCxD = jnp.where(valid_BxKxC[..., None], k_BxKxCxD / norm_BxKxCx1, 0.0)
    newest_BxKxC = _newest_duplicates(k_BxKxCxD, valid_BxKxC, threshold, block)
    partner_BxKxCxD = jnp.take_along_axis(k_BxKxCxD, jnp.maximum(newest_BxKxC, 0)[..., None],
                                          axis=-2)
    # S[i, newest_i] (0 when row i has no near-duplicate)
    zeroed_BxKxC = jnp.where(newest_BxKxC >= 0,
                             jnp.sum(k_BxKxCxD * partner_BxKxCxD, axis=-1), 0.0)
    removed_BxKxC = _removed_per_column(newest_BxKxC, zeroed_BxKxC, block)
    k_sum_BxKxD = jnp.sum(k_BxKxCxD, axis=2)
    col_sum_BxKxC = (jnp.einsum("bkd,bkjd->bkj", k_sum_BxKxD, k_BxKxCxD)
                     - jnp.sum(k_BxKxCxD * k_BxKxCxD, axis=-1))
    count = jnp.maximum(jnp.sum(valid_BxKxC, axis=-1, keepdims=True), 1).astype(jnp.float32)
    return masked_softmax((col_sum_BxKxC - removed_BxKxC) / count, valid_BxKxC)


@EVICTION_SCORES.register("rkv")
def rkv_scores(
    cfg: EvictionConfig, queries: jax.Array, keys: jax.Array, pos: jax.Array, index: jax.Array
) -> jax.Array:
    """R-KV ``Z = lambda * I - (1 - lambda) * R`` ``[B, Hkv, C]`` (:func:`importance`,
    :func:`redundancy`)."""
    z = importance(cfg, queries, keys, pos, index)
    r = redundancy(keys, pos, index, cfg.redundancy_threshold)
    return cfg.rkv_lambda * z - (1.0 - cfg.rkv_lambda) * r


@EVICTION_SCORES.register("streaming")
def streaming_scores(
    cfg: EvictionConfig, queries: jax.Array, keys: jax.Array, pos: jax.Array, index: jax.Array
) -> jax.Array:
    """StreamingLLM ``[B, Hkv, C]``: the first ``cfg.num_sinks`` valid slots of each row score
    above everything, the rest their position (newer = higher); empty slots ``-inf``. Reads
    no query or key."""
    del queries, keys
    valid, _ = _slot_masks(pos, index, 0)
    rank = jnp.cumsum(valid, axis=-1) - 1
    score = jnp.where(rank < cfg.num_sinks, _SINK_SCORE, pos.astype(jnp.float32))
    return jnp.where(valid, score, -jnp.inf)


def slot_scores(
    cfg: CompressionConfig, queries: jax.Array, keys: jax.Array, pos: jax.Array, index: jax.Array
) -> jax.Array:
    """The eviction score ``Z [B, Hkv, C]`` float32 of ``cfg.method`` for one layer: the
    registered score (:data:`EVICTION_SCORES`, called with ``cfg.eviction``; ``snapkv``: ``Z = I``; ``rkv``: ``Z = lambda *
    I - (1 - lambda) * R``; ``streaming``: sinks + recency), finite on valid non-window slots,
    ``-inf`` on window and empty slots. A method without a score (``none``, ``sparrow``: they
    never evict) is a ValueError.
    """
    if cfg.method not in EVICTION_SCORES:
        raise ValueError(f"CompressionConfig.method={cfg.method!r} never evicts and has no slot "
                         f"scores; the eviction scores are {EVICTION_SCORES.names()}")
    valid, non_window = _slot_masks(pos, index, queries.shape[2])
    z = EVICTION_SCORES.get(cfg.method)(cfg.eviction, queries, keys, pos, index)
    return jnp.where(valid & non_window, z, -jnp.inf)
