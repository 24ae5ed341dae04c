"""Sparrow bookkeeping around the model's page-sparse decode (``models.page_sparse``).

- :func:`schedule_budget`: k of each row from ``budget_schedule`` and its cached length.
- :func:`refresh_page_keys`: the page-mean keys of the pages just written (the model scores
  only full pages, so a page's mean is final once it fills).
- :func:`mask_from_page_record`: the selection record as the visibility mask of a
  teacher-forced forward, which replays the sampler's page-sparse policy exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models.cache import KVCache
from sparse_rl_jax.compression_config import CompressionConfig


def schedule_budget(cfg: CompressionConfig, lengths: jax.Array) -> jax.Array:
    """k per row ``[B]`` int32 for cached lengths ``lengths [B]`` (current token included).

    Row ``b`` takes ``k_i`` of the last schedule entry with ``start_i <= ceil(L / page_size) *
    page_size`` (with 16-token pages and 2000-token starts this is Sparrow's
    ``bin = ceil(L / 16) // 125``, the last bin open-ended).
    """
    starts = jnp.asarray([s for s, _ in cfg.budget_schedule], jnp.int32)
    ks = jnp.asarray([k for _, k in cfg.budget_schedule], jnp.int32)
    ps = cfg.page_size
    covered = (lengths.astype(jnp.int32) + ps - 1) // ps * ps
    idx = jnp.sum(covered[:, None] >= starts[None, :], axis=1) - 1
    return ks[jnp.clip(idx, 0, len(cfg.budget_schedule) - 1)]


def num_pages(max_len: int, page_size: int) -> int:
    """Pages that hold ``max_len`` positions: ``ceil(max_len / page_size)``."""
    return -(-max_len // page_size)


def refresh_page_keys(
    page_keys: jax.Array, cache: KVCache, slot_offset: jax.Array, pages: jax.Array,
    page_size: int,
) -> jax.Array:
    """Recompute the mean key of ``pages [B, n]`` of each row (every layer and KV head).

    Args:
      page_keys: ``[L, B, Hkv, P, D]`` page-mean keys.
      cache: the dense cache (``k [L, B, Hkv, C, D]``, ``pos``).
      slot_offset: ``[B]`` slot of each row's position 0.
      pages: ``[B, n]`` int page indices to refresh (``P`` or more = skipped).

    Returns ``page_keys`` with those pages set to the mean of their written keys (zero for a
    page with none). Reads ``n * page_size`` slots per row, layer and head.
    """
    n_layers, b, h, p, d = page_keys.shape
    c = cache.capacity
    want = (pages[:, :, None] * page_size + jnp.arange(page_size)).reshape(b, -1)  # [B, n*ps]
    slots = jnp.clip(slot_offset[:, None] + want, 0, c - 1)
    idx = jnp.broadcast_to(slots[None, :, None, :], (n_layers, b, h, slots.shape[1]))
    got = jnp.take_along_axis(cache.pos, idx, axis=-1) == want[None, :, None, :]
    keys = jnp.take_along_axis(cache.k, idx[..., None], axis=3).astype(jnp.float32)
    keys = jnp.where(got[..., None], keys, 0.0).reshape(n_layers, b, h, -1, page_size, d)
    count = jnp.sum(got.reshape(n_layers, b, h, -1, page_size), axis=-1)[..., None]
    means = jnp.sum(keys, axis=-2) / jnp.maximum(count, 1)  # [L, B, Hkv, n, D]
    rows = jnp.arange(b)[:, None]
    # Advanced indices (rows, pages) around a slice put [B, n] first: values [B, n, L, Hkv, D].
    return page_keys.at[:, rows, :, pages].set(
        means.transpose(1, 3, 0, 2, 4).astype(page_keys.dtype), mode="drop")


def mask_from_page_record(
    record: jax.Array, positions: jax.Array, prompt_lengths: jax.Array, page_size: int
) -> jax.Array:
    """Visibility ``[L, B, Hkv, S, S]`` of a teacher-forced forward over prompt + response.

    Args:
      record: ``[L, B, Hkv, M, K]`` int32: the pages the query at response index ``r`` (position
        ``prompt_len + r``) attended to; ``-1`` unused. A row of ``-1`` only (dense layers,
        steps that never ran) replays dense.
      positions: ``[B, S]`` positions of the columns (``-1`` padding), see
        ``scoring.sequence_positions``.
      prompt_lengths: ``[B]`` real prompt tokens per row.

    Prompt queries (prefill) are dense. ANDed with the causal rule by the model. The mask is
    materialised whole (fine at test and small-scale lengths; a blockwise replay from the
    per-step page sets is the scalable form, not built yet).
    """
    n_layers, b, h, m, _ = record.shape
    total_pages = (positions.shape[1] + page_size - 1) // page_size + 1
    page_of_key = jnp.where(positions >= 0, positions // page_size, total_pages - 1)  # [B, S]
    chosen = jnp.zeros((n_layers, b, h, m, total_pages), bool)
    chosen = jax.vmap(jax.vmap(jax.vmap(jax.vmap(
        lambda row, sel: row.at[sel].set(True, mode="drop")))))(
        chosen, jnp.where(record >= 0, record, total_pages))
    dense_step = jnp.all(record < 0, axis=-1)  # [L, B, Hkv, M]
    s = positions.shape[1]
    idx = jnp.broadcast_to(page_of_key[None, :, None, None, :], (n_layers, b, h, m, s))
    seen = jnp.take_along_axis(chosen, idx, axis=-1) | dense_step[..., None]  # [L, B, Hkv, M, S]
    r = positions - prompt_lengths[:, None]  # response index of each query column
    in_resp = (r >= 0) & (r < m)
    q_idx = jnp.broadcast_to(jnp.clip(r, 0, m - 1)[None, :, None, :, None],
                             (n_layers, b, h, s, s))
    rows = jnp.take_along_axis(seen, q_idx, axis=3)  # [L, B, Hkv, S, S]
    return rows | ~in_resp[None, :, None, :, None]

