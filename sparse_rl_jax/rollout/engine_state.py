"""The KV state of a continuous-batching engine's decode slots: per-row write indices, rows
inserted into slots, and compression of the rows that are full.

A static rollout's rows write at one shared index (``models.cache.WriteIndexCache.index []``)
and compress together. An engine's slots hold rows at different progress, so here the index
is ``[S]`` (one per slot; ``models.cache.KVCache`` writes each row at its own index) and only
the rows whose cache is full are compressed, one row at a time with the static path's own
``kv_state.compress`` (a row's cache layout and compression timing are the static ones: they
depend on its prompt width and its step, not on its neighbours).

Every leaf of a slot state has one batch axis (``k [L, S, ...]``, ``pos [S, C]`` of the paged
cache, ``index [S]``, ...): :func:`batch_axes` finds it, and :func:`set_rows` /
:func:`compress_full_rows` move rows along it. Rows of the paged layout (``none``,
``sparrow``) may instead share a page pool (``models.page_pool.PagePoolCache``,
``pool_pages`` of :func:`slot_state`): its keys/values have no batch axis (``None``), and
:func:`set_rows` copies a row's pages to the pool pages its table maps.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

from models.page_pool import PagePoolCache, init_page_pool
from models.page_sparse import PageSparseCache, page_sparse_cache
from sparse_rl_jax.kv import state as kv_state
from sparse_rl_jax.kv.compression_config import CompressionConfig


def row_index(state: kv_state.SparseKVState) -> jax.Array:
    """The write index of the state's cache (``[]`` shared or ``[B]`` per row)."""
    return _written(state.cache).index


def _written(cache):
    """The cache that holds the keys: ``cache`` itself, or the one a page-sparse cache wraps."""
    return cache.cache if isinstance(cache, PageSparseCache) else cache


def _with_written(state: kv_state.SparseKVState, **fields) -> kv_state.SparseKVState:
    """The state with ``fields`` of the cache that holds the keys (:func:`_written`) replaced."""
    cache = state.cache
    if isinstance(cache, PageSparseCache):
        return state.replace(cache=cache.replace(cache=cache.cache.replace(**fields)))
    return state.replace(cache=cache.replace(**fields))


def with_row_index(state: kv_state.SparseKVState, index: jax.Array) -> kv_state.SparseKVState:
    """The state with its cache's write index replaced by ``index``."""
    return _with_written(state, index=index)


def with_page_table(state: kv_state.SparseKVState, table: jax.Array) -> kv_state.SparseKVState:
    """A pooled state (:func:`pooled`) with its page tables ``[S, R]`` replaced by ``table``."""
    return _with_written(state, pages=table)


def per_row_index(state: kv_state.SparseKVState, batch: int) -> kv_state.SparseKVState:
    """The state with its shared write index broadcast to ``[batch]`` (one per row)."""
    return with_row_index(state, jnp.broadcast_to(row_index(state), (batch,)).astype(jnp.int32))


def pooled(cfg: CompressionConfig) -> bool:
    """Whether an engine's rows of ``cfg`` share a page pool: the rows of the paged layout
    that keep every token (``none``, and ``sparrow``, which selects among its row's pages);
    evicting methods keep their fixed budget per slot."""
    return cfg.cache_layout == "paged" and not cfg.compresses


def slot_state(cfg: CompressionConfig, model_cfg, *, slots: int, max_len: int, dtype,
               record: bool, pool_pages: int = 0) -> kv_state.SparseKVState:
    """An empty state of ``slots`` rows (``kv_state.init_state`` for sequences of ``max_len``
    positions) with a per-row write index ``[slots]``; where :func:`pooled`, with
    ``pool_pages > 0``, the rows share a ``models.page_pool.PagePoolCache`` of that many pages
    (every table entry unmapped; ``sparrow``'s page-sparse cache wraps it)."""
    if pool_pages and pooled(cfg):
        cache = init_page_pool(model_cfg.num_layers, slots, model_cfg.num_kv_heads, max_len,
                               model_cfg.head_dim, pool_pages, dtype, page_size=cfg.page_size,
                               quant=cfg.quant)
        if cfg.page_sparse:
            cache = page_sparse_cache(cache, max_k=cfg.max_pages_k,
                                      dense_layers=cfg.sparrow.dense_layers, dtype=dtype)
        return kv_state.SparseKVState(cache=cache, evicted_at=jnp.zeros(
            (model_cfg.num_layers, slots, model_cfg.num_kv_heads, 0), jnp.int32))
    state = kv_state.init_state(
        cfg, num_layers=model_cfg.num_layers, batch=slots, num_heads=model_cfg.num_heads,
        num_kv_heads=model_cfg.num_kv_heads, head_dim=model_cfg.head_dim, max_len=max_len,
        dtype=dtype, record=record)
    return per_row_index(state, slots)


def batch_axes(make: Callable[[int], Any]) -> Any:
    """The batch axis of every leaf of ``make(batch)`` (a pytree of ints, same structure;
    None for a leaf shared by the rows, a pool's pages), found by comparing the shapes of
    ``make(1)`` and ``make(2)`` (nothing is allocated)."""
    one, two = (jax.eval_shape(lambda b=b: make(b)) for b in (1, 2))

    def axis(x, y):
        return next((i for i, (p, q) in enumerate(zip(x.shape, y.shape)) if p != q), None)

    return jax.tree.map(axis, one, two)


def set_rows(dst: kv_state.SparseKVState, src: kv_state.SparseKVState, slots: jax.Array,
             axes: Any) -> kv_state.SparseKVState:
    """``dst`` with rows ``slots [I]`` replaced by the ``I`` rows of ``src`` (same structure,
    or a paged ``src`` cache into a pool, ``PagePoolCache.put_rows``, page-sparse or not; a
    slot out of range, e.g. ``S``, drops its row)."""
    def put(d, s, ax):
        return d.at[(slice(None),) * ax + (slots,)].set(s.astype(d.dtype), mode="drop")

    pool = _written(dst.cache)
    if not isinstance(pool, PagePoolCache):
        return jax.tree.map(put, dst, src, axes)
    pool = pool.put_rows(_written(src.cache), slots)
    evicted_at = put(dst.evicted_at, src.evicted_at, axes.evicted_at)
    if isinstance(dst.cache, PageSparseCache):  # its own per-row fields move as above
        outer = jax.tree.map(put, *(c.replace(cache=None) for c in (dst.cache, src.cache,
                                                                    axes.cache)))
        return dst.replace(cache=outer.replace(cache=pool), evicted_at=evicted_at)
    return dst.replace(cache=pool, evicted_at=evicted_at)


def compress_full_rows(state: kv_state.SparseKVState, cfg: CompressionConfig, axes: Any
                       ) -> tuple[kv_state.SparseKVState, jax.Array]:
    """Compress (``kv_state.compress``) every row whose cache is full (``index == capacity``),
    one row at a time; other rows are not touched.

    Args:
      state: a slot state with a per-row index ``[S]`` (:func:`slot_state`).
      cfg: the compression config (``none`` and ``sparrow``: nothing to do).
      axes: :func:`batch_axes` of the state.

    Returns:
      ``(state, compressed [S] bool)``.
    """
    full = row_index(state) >= state.cache.capacity
    if not cfg.compresses:
        return state, jnp.zeros_like(full)

    def one_row(carry):
        state, todo = carry
        r = jnp.argmax(todo)
        row = jax.tree.map(lambda x, ax: lax.dynamic_slice_in_dim(x, r, 1, axis=ax),
                           state, axes)
        row = kv_state.compress(with_row_index(row, row_index(row)[0]), cfg)
        state = jax.tree.map(lambda x, y, ax: lax.dynamic_update_slice_in_dim(x, y, r, axis=ax),
                             state, per_row_index(row, 1), axes)
        return state, todo.at[r].set(False)

    state, _ = lax.while_loop(lambda c: jnp.any(c[1]), one_row, (state, full))
    return state, full
