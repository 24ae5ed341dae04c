"""The slot cache of a rollout: a :mod:`models.kv_view` view the decoder writes through.

The cache is owned by the caller (the sampler). A forward writes the new tokens' positions
once, for every layer and KV head (``begin_forward``, before the layers); then, per layer,
``attend`` writes the tokens' keys and values at the shared write index and attends over
every slot. Keys are stored
*after* RoPE, so a caller may reorder or drop slots (KV eviction) without re-rotating anything.
Each slot carries the original position of its token per KV head (``-1`` marks an empty or
padding slot), which is all attention needs for its mask: slot ``s`` is visible to a query
at position ``t`` iff ``0 <= pos[s] <= t``. The position array stays per layer and head
(``[L, B, Hkv, C]``) because an evicting caller keeps different tokens in each after
compressing; only the write is shared. The dense and budget layouts are two capacities
of it (the whole sequence, or ``budget + buffer`` slots compressed by the caller).

An eviction policy that scores keys with the newest queries gets them from the cache's query
ring (``queries``, the last ``W`` queries of every layer, pushed by ``attend``), so the decoder
returns no queries.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from models.attention_backends import attention, visibility_backend
from models.kv_quant import SCALE_DTYPE, get_quant
from models.shapes import check_shape


class WriteIndexCache:
    """Shared parts of the rollout caches with a write index (``k [L, B, Hkv, C, D]``;
    ``index []`` shared by all rows, or ``[B]`` one per row, as a continuous-batching engine's
    slots at different progress need): :class:`KVCache`, ``models.paged_cache.PagedKVCache``."""

    @property
    def capacity(self) -> int:
        """Number of slots ``C`` per layer, row and head."""
        return self.k.shape[3]

    @property
    def position_offset(self) -> jax.Array:
        """Default position of the next token: the write index (before left padding)."""
        return self.index

    def check_room(self, t: int, backend: str) -> None:
        """ValueError for a backend that takes no cache (no per-key visibility, e.g.
        ``"fused"``) or an unknown one, or, when the index is known (not under jit), no room
        for ``t`` more tokens (in the fullest row, when every row has its own index)."""
        visibility_backend(backend, type(self).__name__)
        try:
            top = int(np.max(self.index))
        except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
            return  # under jit: the index is not known yet
        if top + t > self.capacity:
            raise ValueError(f"cache: writing {t} tokens at index {top} exceeds capacity "
                             f"{self.capacity}")

    def end_forward(self, t: int):
        """Advance the write index past the forward's ``t`` tokens."""
        return self.replace(index=self.index + t)


@struct.dataclass
class KVCache(WriteIndexCache):
    """Fixed-capacity key/value buffers for every layer (a ``models.kv_view`` view).

    Attributes:
      k: ``[L, B, Hkv, C, D]`` keys after RoPE.
      v: ``[L, B, Hkv, C, D]`` values.
      pos: ``[L, B, Hkv, C]`` int32 original token position of each slot, ``-1`` = empty.
      index: ``[]`` int32, the next slot to write; shared by all rows (left padding makes
        rows of different prompt lengths line up, padding slots carry ``pos == -1``); or
        ``[B]``, one per row (writes past the capacity are dropped).
      queries: ``[L, B, Hq, W, D]`` the last ``W`` queries of every layer (after qk-norm and
        RoPE), oldest -> newest, aligned with the newest written slots; or None (no ring).
      k_scale, v_scale: ``[L, B, Hkv, C]`` bfloat16 scale of each slot's key / value when
        ``quant`` quantizes (``k``, ``v`` then hold codes ``[L, B, Hkv, C, D / per_byte]``,
        ``models.kv_quant``); None otherwise.
      quant: the ``models.kv_quant`` format of ``k`` and ``v`` (static).
    """

    k: jax.Array
    v: jax.Array
    pos: jax.Array
    index: jax.Array
    queries: jax.Array | None = None
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None
    quant: str = struct.field(pytree_node=False, default="none")

    def check(self, config, batch: int, t: int, backend: str) -> None:
        """ValueError naming the field when the cache does not fit ``config`` and a forward
        of ``[batch, t]`` tokens: shapes, room for ``t`` more tokens (when the index is
        known, not under jit), a backend that takes slot positions (not ``"fused"``)."""
        dims = dict(L=config.num_layers, B=batch, Hkv=config.num_kv_heads, C=None)
        quant = get_quant(self.quant)
        quant.check_head_dim(config.head_dim, "KVCache")
        check_shape("KVCache.k", self.k, **dims, D=quant.stored_dim(config.head_dim))
        check_shape("KVCache.v", self.v, **dims, D=quant.stored_dim(config.head_dim))
        check_shape("KVCache.pos", self.pos, **dims)
        if quant.quantizes:
            check_shape("KVCache.k_scale", self.k_scale, **dims)
            check_shape("KVCache.v_scale", self.v_scale, **dims)
        check_shape("KVCache.queries", self.queries, L=config.num_layers, B=batch,
                    Hq=config.num_heads, W=None, D=config.head_dim)
        self.check_room(t, backend)

    def begin_forward(self, positions: jax.Array) -> KVCache:
        """Write the forward's positions ``[B, T]`` at slots ``[index, index + T)`` of every
        layer and KV head: one update of ``pos`` per forward, not one per layer."""
        n_layers, b, hkv, _ = self.pos.shape
        positions = positions.astype(jnp.int32)
        if self.index.ndim:  # per-row index: [B, T] positions at [B, T] slots
            rows, slots = self._row_slots(positions.shape[1])
            return self.replace(pos=self.pos.at[:, rows, :, slots].set(
                positions[..., None, None], mode="drop"))
        block = jnp.broadcast_to(positions[None, :, None, :],
                                 (n_layers, b, hkv, positions.shape[1]))
        return self.replace(pos=jax.lax.dynamic_update_slice(self.pos, block,
                                                             (0, 0, 0, self.index)))

    def _row_slots(self, t: int) -> tuple[jax.Array, jax.Array]:
        """``(rows [B, 1], slots [B, T])`` of a per-row-index write of ``t`` tokens."""
        b = self.index.shape[0]
        return jnp.arange(b)[:, None], self.index[:, None] + jnp.arange(t)

    def store(self, layer: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array) -> KVCache:
        """Write ``k, v [B, Hkv, T, D]`` at slots ``[index, index + T)`` of ``layer`` (their
        positions were written by :meth:`begin_forward`) and push the newest queries
        ``q [B, T, Hq, D]`` into the ring (a quantizing cache stores their codes and scales).
        In-place updates of the carried buffers: nothing is copied."""
        updates = {}
        for name, value in encoded_kv(self.quant, k, v).items():  # value [B, Hkv, T, ...]
            buf = getattr(self, name)
            if self.index.ndim:  # per-row index: one scatter per buffer
                rows, slots = self._row_slots(k.shape[2])
                # advanced indices (layer, rows, slots) around a slice put [B, T] first
                updates[name] = buf.at[layer, rows, :, slots].set(
                    jnp.moveaxis(value, 2, 1).astype(buf.dtype), mode="drop")
            else:
                at = (layer, 0, 0, self.index) + (0,) * (value.ndim - 3)
                updates[name] = jax.lax.dynamic_update_slice(buf, value[None].astype(buf.dtype),
                                                              at)
        cache = self.replace(**updates)
        if self.queries is None or self.queries.shape[3] == 0:
            return cache
        w = self.queries.shape[3]
        newest = q[:, -w:].transpose(0, 2, 1, 3).astype(self.queries.dtype)  # [B, Hq, <=W, D]
        ring = jnp.concatenate([self.queries[layer], newest], axis=2)[:, :, -w:]
        return cache.replace(
            queries=jax.lax.dynamic_update_index_in_dim(self.queries, ring, layer, 0))

    def attend(self, layer, q, k, v, q_pos, backend):
        """Store the new tokens at ``layer``, then attend over all ``C`` slots of it."""
        cache = self.store(layer, q, k, v)
        keys, values = cache.layer_kv(layer, q.dtype)
        out = attention(q, keys, values, q_pos, cache.pos[layer], backend=backend)
        return out, cache

    def layer_kv(self, layer: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
        """``layer``'s keys and values ``[B, Hkv, C, D]`` as attention reads them (decoded to
        ``dtype`` when quantized; the stored buffers otherwise)."""
        return decoded_kv(self.quant, self.k[layer], self.v[layer],
                          None if self.k_scale is None else self.k_scale[layer],
                          None if self.v_scale is None else self.v_scale[layer], dtype)

    def row_tokens(self) -> jax.Array:
        """``[B]`` int32 resident (non-empty) slots of each row (layer 0, KV head 0; an
        evicting cache keeps as many in every layer and head)."""
        return jnp.sum(self.pos[0, :, 0] >= 0, axis=-1, dtype=jnp.int32)

    def repeat_rows(self, n: int) -> KVCache:
        """The cache with each row repeated ``n`` times (row ``i`` -> rows ``i*n .. i*n+n-1``)."""
        fan_out = lambda x: None if x is None else jnp.repeat(x, n, axis=1)  # noqa: E731
        return self.replace(k=fan_out(self.k), v=fan_out(self.v), pos=fan_out(self.pos),
                            queries=fan_out(self.queries), k_scale=fan_out(self.k_scale),
                            v_scale=fan_out(self.v_scale))


def encoded_kv(quant: str, k: jax.Array, v: jax.Array) -> dict[str, jax.Array]:
    """A cache's new entries for keys and values ``[..., D]``, by buffer name: ``k, v``
    themselves, or, when ``quant`` quantizes, their codes ``[..., D / per_byte]`` and
    scales ``[...]`` (``k``, ``k_scale``, ``v``, ``v_scale``)."""
    fmt = get_quant(quant)
    if not fmt.quantizes:
        return dict(k=k, v=v)
    (k, k_scale), (v, v_scale) = fmt.encode(k), fmt.encode(v)
    return dict(k=k, k_scale=k_scale, v=v, v_scale=v_scale)


def decoded_kv(quant: str, k: jax.Array, v: jax.Array, k_scale: jax.Array | None,
               v_scale: jax.Array | None, dtype) -> tuple[jax.Array, jax.Array]:
    """Keys and values ``[..., D]`` in ``dtype`` from a cache's stored ``k, v`` (codes
    ``[..., D / per_byte]`` and scales ``[...]`` when ``quant`` quantizes; returned as they are
    otherwise)."""
    fmt = get_quant(quant)
    if not fmt.quantizes:
        return k, v
    return fmt.decode(k, k_scale, dtype), fmt.decode(v, v_scale, dtype)


def init_cache(
    num_layers: int,
    batch: int,
    num_kv_heads: int,
    capacity: int,
    head_dim: int,
    dtype=jnp.float32,
    *,
    num_heads: int = 0,
    window: int = 0,
    quant: str = "none",
) -> KVCache:
    """An empty cache: zero keys/values, every slot empty (``pos == -1``), index 0, and a
    zero query ring ``[L, B, num_heads, window, D]`` when ``window > 0`` (else None).
    ``quant`` (a ``models.kv_quant`` format) stores codes and zero scales instead."""
    shape = (num_layers, batch, num_kv_heads, capacity, head_dim)
    if window and num_heads < 1:
        raise ValueError(f"init_cache: a query ring (window={window}) needs num_heads >= 1, "
                         f"got {num_heads}")
    ring = (jnp.zeros((num_layers, batch, num_heads, window, head_dim), dtype) if window
            else None)
    return KVCache(**empty_kv(shape, dtype, quant, "init_cache"),
                   pos=jnp.full(shape[:-1], -1, jnp.int32), index=jnp.zeros((), jnp.int32),
                   queries=ring, quant=quant)


def empty_kv(shape: tuple[int, ...], dtype, quant: str, who: str) -> dict[str, jax.Array]:
    """Zero key/value buffers of ``shape`` (``[..., D]``) in ``dtype``, or, when ``quant``
    quantizes, zero codes ``[..., D / per_byte]`` and zero scales ``[...]`` (keys ``k``,
    ``v``, ``k_scale``, ``v_scale``; scales None unquantized); ValueError naming ``who``
    for a head dim ``quant`` cannot pack."""
    fmt = get_quant(quant)
    fmt.check_head_dim(shape[-1], who)
    stored = shape[:-1] + (fmt.stored_dim(shape[-1]),)
    codes = jnp.zeros(stored, fmt.code_dtype or dtype)
    scales = jnp.zeros(shape[:-1], SCALE_DTYPE) if fmt.quantizes else None
    return dict(k=codes, v=codes, k_scale=scales, v_scale=scales)
