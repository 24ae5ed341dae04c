"""The rollout KV state: a fixed-size cache (with its ring of window queries), the eviction record.

The model attends through ``state.cache`` (a ``models.cache.KVCache`` view: it writes the new
keys/values and pushes the newest queries into the cache's ring); the sampler then calls
``maybe_compress``, which (under ``lax.cond``) shrinks the
cache back to ``budget`` slots and records, per layer / row / KV head and token *position*, the
first query position that no longer sees that key (the raw array ``evicted_at``). A rollout
hands it on as its replay record (``Rollout.record``, an :class:`EvictionRecord`, which is a
``scoring.ReplayRecord``: per-key expiry times, a ``models.ExpiryRecord`` view); replaying it
reproduces the sparse policy in a teacher-forced forward: key ``j`` is visible to query ``t``
iff ``0 <= j <= t < evicted_at[j]``.
"""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from models.cache import KVCache, decoded_kv, init_cache
from models.kv_view import Causal, ExpiryRecord
from models.page_sparse import PageSparseCache, page_sparse_cache
from models.paged_cache import PagedKVCache, init_paged_cache
from models.shapes import check_shape
from sparse_rl_jax.kv.compression_config import CompressionConfig
from sparse_rl_jax.kv.scores import slot_scores
from sparse_rl_jax.kv.selection import select_slots

NEVER = 2**30  # eviction-record value of a key that is never evicted


@struct.dataclass
class SparseKVState:
    """Everything a compressing decode loop carries (a pytree; shapes static under ``jit``).

    Attributes:
      cache: the model's ``KVCache`` (``k, v [L, B, Hkv, C, D]``, ``pos [L, B, Hkv, C]``,
        index; for the evicting methods ``queries [L, B, Hq, window, D]``, the ring of the
        last ``window`` queries per layer, oldest -> newest, aligned with the newest written
        slots ``[index - window, index)``; None for ``none``), with ``layout: paged`` a
        ``models.paged_cache.PagedKVCache`` (``pos [B, C]``), and for ``sparrow`` a
        ``models.page_sparse.PageSparseCache`` (a ``PagedKVCache`` and its page-mean keys
        ``[L, B, Hkv, ceil(max_len / page_size), D]``, which it refreshes itself).
      evicted_at: ``[L, B, Hkv, T_total]`` int32, indexed by token position: the first query
        position that no longer sees the key; ``NEVER`` if it was never evicted. ``T_total``
        is 0 when the state keeps no record (``init_state(record=False)``, or a method that
        never evicts).
    """

    cache: KVCache | PagedKVCache | PageSparseCache
    evicted_at: jax.Array


def init_state(
    cfg: CompressionConfig,
    *,
    num_layers: int,
    batch: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_len: int,
    dtype=jnp.float32,
    record: bool = True,
) -> SparseKVState:
    """An empty state for sequences of up to ``max_len`` positions (prompt + response).

    The cache gets ``cfg.cache_capacity(max_len)`` slots (``budget + buffer``; ``max_len``,
    rounded up to whole pages when paged, for ``none`` and ``sparrow``, whose paged cache is
    wrapped in a page-sparse one) and, when it compresses, a ring of ``cfg.eviction.window``
    queries and an eviction record over positions ``[0, max_len)`` unless ``record`` is False
    (compression then skips the bookkeeping); a method that never evicts keeps no record.
    """
    for name, value in (
        ("num_layers", num_layers),
        ("batch", batch),
        ("num_heads", num_heads),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
        ("max_len", max_len),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"init_state: {name}={value!r} must be an int >= 1")
    if num_heads % num_kv_heads:
        raise ValueError(
            f"init_state: num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}"
        )
    if cfg.cache_layout == "paged":
        cache = init_paged_cache(num_layers, batch, num_kv_heads, max_len, head_dim, dtype,
                                 page_size=cfg.page_size, quant=cfg.quant)
    else:
        cache = init_cache(num_layers, batch, num_kv_heads, cfg.cache_capacity(max_len),
                           head_dim, dtype, num_heads=num_heads,
                           window=cfg.eviction.window if cfg.compresses else 0, quant=cfg.quant)
    if cfg.page_sparse:
        cache = page_sparse_cache(cache, max_k=cfg.max_pages_k,
                                  dense_layers=cfg.sparrow.dense_layers, dtype=dtype)
    return SparseKVState(
        cache=cache,
        evicted_at=jnp.full((num_layers, batch, num_kv_heads,
                             max_len if record and cfg.compresses else 0), NEVER, jnp.int32),
    )


def check_prompt_fits(cfg: CompressionConfig, prompt_len: int, capacity: int | None = None) -> None:
    """Raise ``ValueError`` if a (padded) prompt of ``prompt_len`` tokens cannot be prefilled.

    ``capacity`` defaults to ``cfg.capacity`` (``budget + buffer``); ``none`` needs the dense
    capacity passed in. A prompt is never silently truncated.
    """
    if capacity is None:
        if not cfg.compresses:
            raise ValueError("check_prompt_fits: method='none' needs the dense capacity passed in")
        capacity = cfg.capacity
    if prompt_len > capacity:
        where = (
            f"budget {cfg.eviction.budget} + buffer {cfg.eviction.buffer} = {capacity} slots"
            if cfg.compresses
            else f"the dense cache capacity of {capacity} slots"
        )
        raise ValueError(
            f"prompt length {prompt_len} exceeds the KV cache capacity ({where}, "
            f"method={cfg.method!r}); raise the budget/buffer or shorten the prompt"
        )


def _check_matches(state: SparseKVState, cfg: CompressionConfig) -> None:
    if state.cache.capacity != cfg.capacity:
        raise ValueError(
            f"cache capacity {state.cache.capacity} != budget + buffer = {cfg.capacity} "
            f"of the CompressionConfig"
        )
    ring = state.cache.queries
    if ring is None or ring.shape[3] != cfg.eviction.window:
        raise ValueError(
            f"query ring holds {0 if ring is None else ring.shape[3]} queries, "
            f"CompressionConfig.eviction.window={cfg.eviction.window}"
        )


def _compress_layer(cfg: CompressionConfig, quant: str, index: jax.Array, layer: tuple) -> tuple:
    """One layer: the kept slot buffers (``{"k", "v"[, "k_scale", "v_scale"]}``, each
    ``[B, Hkv, budget, ...]``), the kept ``pos [B, Hkv, budget]`` and ``evicted [B, Hkv, C]``
    bool (valid slots that do not survive). A quantized cache is scored on its decoded keys
    (what attention reads); its codes and scales are kept as they are."""
    buffers, pos, queries = layer
    c = pos.shape[-1]
    keys, _ = decoded_kv(quant, buffers["k"], buffers["v"], buffers.get("k_scale"),
                         buffers.get("v_scale"), queries.dtype)
    z = slot_scores(cfg, queries, keys, pos, index)
    kept = select_slots(
        z, pos, index, budget=cfg.eviction.budget, window=cfg.eviction.window,
        head_mode=cfg.eviction.head_mode
    )  # [B, Hkv, budget]
    is_kept = jax.vmap(jax.vmap(lambda idx: jnp.zeros(c, bool).at[idx].set(True)))(kept)
    evicted = (pos >= 0) & (jnp.arange(c) < index) & ~is_kept
    take = lambda x: jnp.take_along_axis(x, kept.reshape(kept.shape + (1,) * (x.ndim - 3)),  # noqa: E731
                                         axis=2)
    return ({name: take(x) for name, x in buffers.items()},
            jnp.take_along_axis(pos, kept, axis=-1), evicted)


def _overwrite_layer(buffer: jax.Array, layer: jax.Array, kept: jax.Array, fill) -> jax.Array:
    """``buffer [L, B, Hkv, C, ...]`` with layer ``layer``'s slots ``[0, budget)`` = ``kept
    [B, Hkv, budget, ...]`` and the rest = ``fill``.

    In-place updates of ``buffer`` (the layer loop's carry), so neither the loop nor a
    ``lax.cond`` around ``compress`` copies the cache (a gathered fresh buffer would make XLA
    copy the whole cache on every idle decode step)."""
    budget = kept.shape[2]
    start = (layer,) + (0,) * (buffer.ndim - 1)
    buffer = lax.dynamic_update_slice(buffer, kept.astype(buffer.dtype)[None], start)
    tail = jnp.full((1,) + buffer.shape[1:3] + (buffer.shape[3] - budget,) + buffer.shape[4:],
                    fill, buffer.dtype)
    return lax.dynamic_update_slice(buffer, tail, start[:3] + (budget,) + start[4:])


def _record_evictions(
    evicted_at: jax.Array, pos: jax.Array, evicted: jax.Array, when: jax.Array
) -> jax.Array:
    """Write ``when [L, B, 1]`` into ``evicted_at[l, b, h, pos]`` for every evicted slot."""
    total = evicted_at.shape[-1]
    if total == 0:  # the state keeps no record
        return evicted_at
    target = jnp.where(evicted, pos, total)  # out of range -> dropped

    def one_row(record: jax.Array, positions: jax.Array, value: jax.Array) -> jax.Array:
        return record.at[positions].min(value, mode="drop")

    for _ in range(3):  # over L, B, Hkv
        one_row = jax.vmap(one_row)
    return one_row(evicted_at, target, jnp.broadcast_to(when, target.shape[:3]))


def compress(state: SparseKVState, cfg: CompressionConfig) -> SparseKVState:
    """Compress every layer to ``budget`` slots (needs ``window <= index``).

    Scores the slots with ``cfg.method``, keeps the window + the top ``budget - window`` in
    temporal order at slots ``[0, budget)``, empties the rest (``pos -1``, zero k/v), sets
    ``index = budget`` and records each evicted valid token with the row's next query
    position (its newest position + 1). Layers are processed one after another (``lax.map``)
    so the ``[B, Hkv, C, C]`` similarity of R-KV exists for one layer at a time.
    """
    if not cfg.compresses:
        raise ValueError("compress: CompressionConfig.method='none' never compresses")
    _check_matches(state, cfg)
    cache = state.cache
    buffers = {name: getattr(cache, name) for name in ("k", "v", "k_scale", "v_scale")
               if getattr(cache, name) is not None}
    evicted = jnp.zeros(cache.pos.shape, bool)

    def one_layer(layer, carry):
        buffers, pos, evicted = carry
        kept, kept_pos, gone = _compress_layer(
            cfg, cache.quant, cache.index,
            ({name: x[layer] for name, x in buffers.items()}, pos[layer], cache.queries[layer]))
        return ({name: _overwrite_layer(x, layer, kept[name], 0) for name, x in buffers.items()},
                _overwrite_layer(pos, layer, kept_pos, -1), evicted.at[layer].set(gone))

    buffers, pos, evicted = lax.fori_loop(0, cache.k.shape[0], one_layer,
                                          (buffers, cache.pos, evicted))
    when = jnp.max(cache.pos, axis=(2, 3))[..., None] + 1  # [L, B, 1] next query position
    evicted_at = _record_evictions(state.evicted_at, cache.pos, evicted, when)
    cache = cache.replace(**buffers, pos=pos, index=jnp.asarray(cfg.eviction.budget, jnp.int32))
    return state.replace(cache=cache, evicted_at=evicted_at)


def maybe_compress(
    state: SparseKVState, cfg: CompressionConfig, *, after_prefill: bool = False
) -> SparseKVState:
    """Compress iff the cache is full (``index == capacity``) or, right after prefill, iff the
    prompt overflowed the budget (``index > budget``). ``none`` returns ``state`` unchanged.

    Loop structure: call it once per chunk of decode steps (an inner loop that runs until
    ``index == capacity`` or every row is done), not in the same loop body as the model's
    cache writes. There, XLA's copy insertion copies the whole k/v cache around the
    ``lax.cond`` on every step (seen on XLA:CPU with ``models.Decoder``: 2-3 full copies per
    idle step); with one call per chunk the decode loop stays copy-free.
    """
    if not cfg.compresses:
        return state
    _check_matches(state, cfg)
    index = state.cache.index
    due = index > cfg.eviction.budget if after_prefill else index >= cfg.capacity
    return lax.cond(due, lambda s: compress(s, cfg), lambda s: s, state)


def visibility_from_record(evicted_at: jax.Array, positions: jax.Array) -> jax.Array:
    """Per-key expiry ``[L, B, Hkv, S]`` int32 for keys laid out in columns.

    Args:
      evicted_at: ``[L, B, Hkv, T_total]`` the state's eviction times (``SparseKVState``).
      positions: ``[B, S]`` int32 token position of each column, ``-1`` = padding.
    Returns the model's ``key_expiry``: key ``s`` is visible to query ``t`` iff
    ``0 <= positions[s] <= t < expiry[s]``; padding and out-of-record columns get ``NEVER``.
    """
    check_shape("evicted_at", evicted_at, L=None, B=None, Hkv=None, T=None)
    n_layers, batch, heads, total = evicted_at.shape
    if total == 0:
        raise ValueError(
            "the eviction record is empty: sample with SamplingConfig(record_evictions=True) "
            "to replay the sparse context")
    check_shape("positions", positions, B=batch, S=None)
    inside = (positions >= 0) & (positions < total)
    idx = jnp.broadcast_to(
        jnp.where(inside, positions, 0)[None, :, None, :],
        (n_layers, batch, heads, positions.shape[1]),
    )
    expiry = jnp.take_along_axis(evicted_at, idx, axis=-1)
    return jnp.where(inside[None, :, None, :], expiry, NEVER).astype(jnp.int32)


@struct.dataclass
class EvictionRecord:
    """An evicting rollout's replay record (``Rollout.record``, a ``scoring.ReplayRecord``).

    Attributes:
      evicted_at: ``[N, L, Hkv, P + M]`` int32, row first (the state's ``evicted_at`` with its
        layer and row axes swapped): indexed by token position, the first query position
        that no longer sees the key; ``NEVER`` if it was never evicted.
    """

    evicted_at: jax.Array
    quant: str = struct.field(pytree_node=False, default="none")
    fill: ClassVar[int] = NEVER

    def replay_view(self, positions: jax.Array, prompt_lengths: jax.Array,
                    response_len: int) -> ExpiryRecord:
        """The expiry times of the ``[N, S]`` columns (:func:`visibility_from_record`)."""
        del prompt_lengths, response_len  # the record is indexed by position
        n, s = positions.shape
        if self.evicted_at.ndim == 4 and self.evicted_at.shape[-1]:
            check_shape("record.evicted_at", self.evicted_at, N=n, L=None, Hkv=None, T=s)
        return ExpiryRecord(visibility_from_record(jnp.moveaxis(self.evicted_at, 0, 1),
                                                   positions), quant=self.quant)


@struct.dataclass
class QuantRecord:
    """The replay record of a quantized rollout that evicted nothing (method ``none``,
    ``compression.quant`` set): a causal forward over keys and values quantized as the
    rollout's cache stored them (a ``scoring.ReplayRecord`` with no per-row arrays).

    Attributes:
      quant: the ``models.kv_quant`` format of the rollout's cache (static).
    """

    quant: str = struct.field(pytree_node=False, default="none")
    fill: ClassVar[int] = 0

    def replay_view(self, positions: jax.Array, prompt_lengths: jax.Array,
                    response_len: int) -> Causal:
        """Causal attention over quantized keys and values."""
        del positions, prompt_lengths, response_len
        return Causal(quant=self.quant)
