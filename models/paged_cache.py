"""The paged KV cache of a rollout: a :mod:`models.kv_view` view whose decode reads only the
pages filled so far.

Per layer, keys and values live in ``C = num_pages * page_size`` slots (page ``p`` is slots
``[p * page_size, (p + 1) * page_size)``). Slots are positions: every row writes the token of
position ``j`` at slot ``j`` (left padding is not written, padding slots carry position
``-1``), so page ``p`` of every row holds its positions ``[p * page_size, (p + 1) *
page_size)``: the pages a page-sparse decode selects (``models.page_sparse``) are these pages.
Compared with the slot cache (``models.cache.KVCache``):

- positions are written once per forward (``begin_forward``), one ``[B, C]`` array for every
  layer and KV head (a cache that evicts nothing keeps the same tokens everywhere);
- ``attend`` writes the layer's new keys/values with one scatter into the carried
  ``[L, ...]`` buffers at ``(layer, row, position)`` and reads them back in chunks of
  ``chunk_pages`` pages with dynamic slices at ``(layer, chunk)``: no layer's buffer is
  sliced or copied whole;
- the chunks run in a loop with a traced trip count, ``ceil((newest position + 1) / chunk)``,
  folding each into an fp32 online softmax (``models.attention.online_softmax_step``), so a
  decode step costs the resident tokens, not the maximum length.

Visibility is the slot cache's: slot ``s`` is visible to a query at position ``t`` iff
``0 <= pos[s] <= t``. Positions must be below the capacity (the caller sizes it; a row's
positions never exceed its forwarded columns, which ``check`` bounds when the index is known).
Rollouts only (no gradient through the loop). With ``quant`` (``models.kv_quant``) the
buffers hold codes and a scale per slot and KV head (written by the same scatter), and every
read decodes what it reads (a chunk, selected pages, never a layer whole).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from models.attention import online_softmax_finish, online_softmax_init, online_softmax_step
from models.attention_backends import attention, visibility_backend
from models.cache import WriteIndexCache, decoded_kv, empty_kv, encoded_kv
from models.kv_quant import get_quant
from models.paged_kernels import paged_kernel_attention
from models.shapes import check_shape

CHUNK_PAGES = {"cpu": 2}  # pages per loop iteration by platform (CPU: benchmarks/README.md)
OTHER_CHUNK_PAGES = 32  # elsewhere (not measured): few iterations, each costs kernel launches
QUERY_BLOCK = 512  # queries of a long forward (prefill) handled per block


class PositionSlots(WriteIndexCache):
    """Shared parts of the caches whose slot ``j`` of a row holds its position ``j`` (``pos
    [B, C]``, one array for every layer and KV head; ``write`` / ``read`` place the slots):
    :class:`PagedKVCache` and ``models.page_pool.PagePoolCache``."""

    def begin_forward(self, positions: jax.Array):
        """Write the forward's positions ``[B, T]`` at their own slots (position ``j`` of a
        row at slot ``j``; padding, ``-1``, is not written), once for every layer."""
        return self.replace(pos=self.pos.at[_rows(positions), _slots(positions, self.capacity)]
                            .set(positions.astype(jnp.int32), mode="drop"))

    def attend(self, layer, q, k, v, q_pos, backend):
        """``write`` the layer's keys/values, then ``read`` over the filled chunks."""
        cache = self.write(layer, k, v, q_pos)
        return cache.read(layer, q, q_pos, backend), cache

    def write(self, layer: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array):
        """Write ``k, v [B, Hkv, T, D]`` of ``layer`` at the slots of their positions ``q_pos
        [B, T]`` (padding, and slots the view does not map, are dropped): one in-place
        scatter per buffer (codes and scales when ``quant`` quantizes)."""
        index = (layer,) + self.write_index(q_pos)  # [B, T] first, then Hkv (and D)
        return self.replace(**{
            name: getattr(self, name).at[index].set(
                jnp.moveaxis(value, 2, 1).astype(getattr(self, name).dtype), mode="drop")
            for name, value in encoded_kv(self.quant, k, v).items()})

    def decoded_at(self, name: str, index: tuple, dtype) -> jax.Array:
        """Buffer ``name`` (``"k"`` or ``"v"``) at ``index`` (into its axes before ``D``; out
        of range reads zeros), decoded to ``dtype`` when ``quant`` quantizes (as stored
        otherwise)."""
        got = getattr(self, name).at[index].get(mode="fill", fill_value=0)
        quant = get_quant(self.quant)
        if not quant.quantizes:
            return got
        scale = getattr(self, f"{name}_scale").at[index].get(mode="fill", fill_value=0)
        return quant.decode(got, scale, dtype)

    def kv_at(self, index: tuple, dtype) -> tuple[jax.Array, jax.Array]:
        """Keys and values at ``index`` (:meth:`decoded_at`)."""
        return self.decoded_at("k", index, dtype), self.decoded_at("v", index, dtype)

    @property
    def head_dim(self) -> int:
        """Values ``D`` per key (the stored last axis times the quant's values per byte)."""
        return self.k.shape[-1] * get_quant(self.quant).per_byte

    def check_kv(self, config, **dims) -> None:
        """ValueError naming the buffer whose shape is not ``dims`` (then ``D``, stored as
        ``quant`` packs it; the scales without it), or a head dim ``quant`` cannot pack."""
        who = type(self).__name__
        quant = get_quant(self.quant)
        quant.check_head_dim(config.head_dim, who)
        for name in ("k", "v"):
            check_shape(f"{who}.{name}", getattr(self, name), **dims,
                        D=quant.stored_dim(config.head_dim))
            if quant.quantizes:
                check_shape(f"{who}.{name}_scale", getattr(self, f"{name}_scale"), **dims)

    def row_tokens(self) -> jax.Array:
        """``[B]`` int32 resident (non-empty) slots of each row."""
        return jnp.sum(self.pos >= 0, axis=-1, dtype=jnp.int32)

    def kv_index(self, rows: jax.Array, heads: jax.Array,
                 slots: jax.Array) -> tuple[jax.Array, ...]:
        """Where logical slots ``slots`` of KV heads ``heads`` of rows ``rows`` (broadcasting
        int arrays, slots in ``[0, C)``) live in ``k, v``: indices into their axes 1-3
        (``k[(layer,) + index]``, advanced indices side by side, so the result is the
        broadcast shape, then ``D``); here ``(rows, heads, slots)`` themselves."""
        return rows, heads, slots

    @property
    def num_kv_heads(self) -> int:
        """KV heads ``Hkv`` of the buffers (``k [L, B, Hkv, C, D]``)."""
        return self.k.shape[2]

    def page_buffers(self) -> tuple[jax.Array, jax.Array] | None:
        """Keys and values as a page kernel reads them in place, ``[L, Hp, N, page_size, D]``
        (``models.paged_kernels``), or None for a view without that layout (its decode steps
        then read through XLA). A view that returns buffers also defines ``page_ids(logical)
        -> [B, Ht, K]`` int32: the ids in those buffers of logical pages ``logical``
        (broadcasting to ``[B, Ht, K]``; a page outside ``[0, C / page_size)`` or unmapped:
        an id outside ``[0, N)``)."""
        return None

    def page_scales(self) -> tuple[jax.Array, jax.Array] | None:
        """The scales of quantized ``page_buffers``, ``[L, Hp, N, page_size]`` (page by page
        as the buffers), or None when the keys and values are stored unquantized."""
        if self.k_scale is None:
            return None
        n_layers, hp, n, ps = self.page_buffers()[0].shape[:4]
        return self.k_scale.reshape(n_layers, hp, n, ps), self.v_scale.reshape(n_layers, hp, n, ps)

    def kernel_read(self, layer: jax.Array, q: jax.Array, q_pos: jax.Array,
                    kernel) -> jax.Array:
        """Attention ``[B, T, Hq, D]`` of ``q`` (positions ``q_pos [B, T]``) over each row's
        logical pages in order, read in place by the Pallas ``kernel`` (a
        ``models.paged_kernels.PageKernel``) up to the page of the row's newest position."""
        r = self.capacity // self.page_size
        k_pages, v_pages = self.page_buffers()
        live = (jnp.max(q_pos, axis=1) + self.page_size) // self.page_size  # -1 -> 0 pages
        return paged_kernel_attention(
            q, k_pages, v_pages, layer, self.page_ids(jnp.arange(r)[None, None]),
            self.pos[:, None], q_pos, live, kernel=kernel.platform, scales=self.page_scales())


@struct.dataclass
class PagedKVCache(PositionSlots):
    """Paged key/value buffers for every layer (a ``models.kv_view`` view).

    Attributes:
      k: ``[L, B, Hkv, C, D]`` keys after RoPE, ``C`` a multiple of ``page_size``.
      v: ``[L, B, Hkv, C, D]`` values.
      pos: ``[B, C]`` int32 original token position of each slot, ``-1`` = empty or padding;
        shared by every layer and KV head.
      index: ``[]`` int32, the next slot to write, shared by all rows.
      k_scale, v_scale: ``[L, B, Hkv, C]`` bfloat16 scale of each slot's key / value when
        ``quant`` quantizes (``k``, ``v`` then hold codes ``[..., D / per_byte]``,
        ``models.kv_quant``; attention reads them decoded); None otherwise.
      page_size: slots per page (static).
      chunk_pages: pages read per iteration of the attention loop (static; see
        :func:`default_chunk_pages`).
      quant: the ``models.kv_quant`` format of ``k`` and ``v`` (static).
    """

    k: jax.Array
    v: jax.Array
    pos: jax.Array
    index: jax.Array
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None
    page_size: int = struct.field(pytree_node=False, default=16)
    chunk_pages: int = struct.field(pytree_node=False, default=CHUNK_PAGES["cpu"])
    quant: str = struct.field(pytree_node=False, default="none")

    def check(self, config, batch: int, t: int, backend: str) -> None:
        """ValueError naming the field when the cache does not fit ``config`` and a forward
        of ``[batch, t]`` tokens: shapes, whole pages, room for ``t`` more tokens (when the
        index is known, not under jit), a backend that takes per-key visibility (not
        ``"fused"``), a page kernel that takes ``page_size`` and the model's heads."""
        self.check_kv(config, L=config.num_layers, B=batch, Hkv=config.num_kv_heads, C=None)
        check_shape("PagedKVCache.pos", self.pos, B=batch, C=self.capacity)
        if self.capacity % self.page_size:
            raise ValueError(f"PagedKVCache: capacity {self.capacity} is not a whole number "
                             f"of pages of page_size={self.page_size}")
        self.check_room(t, backend)
        check_kernel_shapes(backend, self.page_size, config, "PagedKVCache", self.quant)

    def write_index(self, q_pos: jax.Array) -> tuple:
        """Index of positions ``q_pos [B, T]`` into the buffers' axes 1-3 (advanced ``(rows,
        slots)`` around the heads' slice: ``[B, T]`` first); padding at slot ``C``."""
        return _rows(q_pos), slice(None), _slots(q_pos, self.capacity)

    def read(self, layer: jax.Array, q: jax.Array, q_pos: jax.Array,
             backend: str) -> jax.Array:
        """Attention ``[B, T, Hq, D]`` of ``q`` (positions ``q_pos [B, T]``) over the chunks of
        ``layer`` up to the newest position when the backend ``reads_pages_in_chunks``
        (``"blockwise"``); otherwise the backend over every slot (``"reference"``: the einsum,
        the oracle); a decode step (``T == 1``) of a backend with a ``page_kernel`` reads the
        pages in place through it. ValueError for an unknown backend or one without per-key
        visibility."""
        chosen = visibility_backend(backend, "PagedKVCache.read")
        if chosen.page_kernel is not None and q.shape[1] == 1:  # this cache has page_buffers
            return self.kernel_read(layer, q, q_pos, chosen.page_kernel)
        if not chosen.reads_pages_in_chunks:
            b, hkv = self.pos.shape[0], self.k.shape[2]
            k_pos = jnp.broadcast_to(self.pos[:, None], (b, hkv, self.capacity))
            return attention(q, *self.kv_at((layer,), q.dtype), q_pos, k_pos, backend=backend)
        chunk = min(self.chunk_pages * self.page_size, self.capacity)
        b, hkv = self.k.shape[1:3]

        def fetch(start):  # dynamic slices at (layer, chunk): no layer is copied whole
            def cut(buf):
                if buf is None:
                    return None
                at = (layer, 0, 0, start) + (0,) * (buf.ndim - 4)
                return jax.lax.dynamic_slice(buf, at, (1, b, hkv, chunk) + buf.shape[4:])[0]

            return decoded_kv(self.quant, cut(self.k), cut(self.v), cut(self.k_scale),
                              cut(self.v_scale), q.dtype)

        return chunked_attention(q, self.pos, q_pos, fetch, hkv=hkv,
                                 filled=jnp.max(q_pos) + 1, chunk=chunk)

    def page_buffers(self) -> tuple[jax.Array, jax.Array]:
        """``[L, 1, B * Hkv * R, page_size, D]``: the buffers with each (row, head)'s ``R``
        pages numbered in turn (a reshape, no copy)."""
        n_layers, b, hkv, c, d = self.k.shape
        shape = (n_layers, 1, b * hkv * (c // self.page_size), self.page_size, d)
        return self.k.reshape(shape), self.v.reshape(shape)

    def page_ids(self, logical: jax.Array) -> jax.Array:
        """``[B, Hkv, K]`` ids of logical pages ``logical`` of each (row, head) (``-1`` for a
        page outside ``[0, R)``)."""
        b, hkv = self.k.shape[1:3]
        r = self.capacity // self.page_size
        row_head = jnp.arange(b)[:, None, None] * hkv + jnp.arange(hkv)[None, :, None]
        ids = row_head * r + logical
        return jnp.where((logical >= 0) & (logical < r), ids, -1).astype(jnp.int32)

    def repeat_rows(self, n: int) -> PagedKVCache:
        """The cache with each row repeated ``n`` times (row ``i`` -> rows ``i*n .. i*n+n-1``)."""
        fan_out = lambda x: None if x is None else jnp.repeat(x, n, axis=1)  # noqa: E731
        return self.replace(k=fan_out(self.k), v=fan_out(self.v), k_scale=fan_out(self.k_scale),
                            v_scale=fan_out(self.v_scale), pos=jnp.repeat(self.pos, n, axis=0))


def check_kernel_shapes(backend: str, page_size: int, config, who: str,
                        quant: str = "none") -> None:
    """ValueError naming ``who`` when ``backend``'s page kernel (if any) cannot take
    ``page_size``, the heads of the model ``config`` and KV stored as ``quant``."""
    kernel = visibility_backend(backend, who).page_kernel
    problem = kernel and kernel.shape_error(page_size, config.num_heads, config.num_kv_heads,
                                            config.head_dim, quant)
    if problem:
        raise ValueError(f"{who}: attention_backend={backend!r} cannot take {problem}")


def _rows(positions: jax.Array) -> jax.Array:
    """``[B, 1]`` row indices broadcasting against positions ``[B, T]``."""
    return jnp.arange(positions.shape[0])[:, None]


def _slots(positions: jax.Array, capacity: int) -> jax.Array:
    """``[B, T]`` the slot of each position: itself, or ``capacity`` (dropped) for padding."""
    return jnp.where(positions >= 0, positions, capacity)


def init_paged_cache(num_layers: int, batch: int, num_kv_heads: int, max_len: int,
                     head_dim: int, dtype=jnp.float32, *, page_size: int = 16,
                     chunk_pages: int | None = None, quant: str = "none") -> PagedKVCache:
    """An empty paged cache holding ``max_len`` tokens per row in ``ceil(max_len /
    page_size)`` pages: zero keys/values (codes and scales when ``quant``, a
    ``models.kv_quant`` format, quantizes), every slot empty (``pos == -1``), index 0;
    ``chunk_pages`` None = :func:`default_chunk_pages`."""
    chunk_pages = default_chunk_pages() if chunk_pages is None else chunk_pages
    for name, value in (("page_size", page_size), ("chunk_pages", chunk_pages),
                        ("max_len", max_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"init_paged_cache: {name}={value!r} must be an int >= 1")
    capacity = -(-max_len // page_size) * page_size
    shape = (num_layers, batch, num_kv_heads, capacity, head_dim)
    return PagedKVCache(**empty_kv(shape, dtype, quant, "init_paged_cache"),
                        pos=jnp.full((batch, capacity), -1, jnp.int32),
                        index=jnp.zeros((), jnp.int32), page_size=page_size,
                        chunk_pages=chunk_pages, quant=quant)


def default_chunk_pages() -> int:
    """Pages per iteration of the paged attention loop on the default JAX platform:
    :data:`CHUNK_PAGES` where measured, else :data:`OTHER_CHUNK_PAGES` (read when called)."""
    return CHUNK_PAGES.get(jax.default_backend(), OTHER_CHUNK_PAGES)


def chunked_attention(q: jax.Array, k_pos: jax.Array, q_pos: jax.Array, fetch, *, hkv: int,
                      filled: jax.Array, chunk: int) -> jax.Array:
    """Attention of ``q`` over the first ``filled`` slots of a row-major slot space, ``chunk``
    slots at a time (an fp32 online softmax; slots past ``filled`` are never read).

    Args:
      q: ``[B, T, Hq, D]`` queries (after RoPE), ``Hq`` a multiple of ``Hkv``.
      k_pos: ``[B, C]`` int32 slot positions (``-1`` empty), shared by layers and heads.
      q_pos: ``[B, T]`` int32 query positions (``-1`` padding: zero output).
      fetch: ``start -> (k, v)``, each ``[B, Hkv, chunk, D]``: the keys/values of slots
        ``[start, start + chunk)`` (``start`` traced).
      hkv: KV heads (static).
      filled: ``[]`` int slots ``[0, filled)`` may hold keys (traced: sets the trip count).
      chunk: slots per iteration (static, ``<= C``).

    Returns:
      ``[B, T, Hq, D]`` in ``q.dtype``.
    """
    b, t, hq, d = q.shape
    c = k_pos.shape[1]
    g = hq // hkv
    bq = min(t, QUERY_BLOCK)
    pad = -t % bq
    qg = jnp.pad(q.reshape(b, t, hkv, g, d), ((0, 0), (0, pad), (0, 0), (0, 0), (0, 0)))
    qg = qg.reshape(b, -1, bq, hkv, g, d).transpose(1, 0, 3, 4, 2, 5)  # [nq, B, Hkv, G, bq, D]
    qp = jnp.pad(q_pos.astype(jnp.int32), ((0, 0), (0, pad)), constant_values=-1)
    qp = qp.reshape(b, -1, bq).transpose(1, 0, 2)  # [nq, B, bq]
    trips = (filled + chunk - 1) // chunk
    scale = d ** -0.5

    def one_query_block(block):
        qb, qpb = block

        def one_chunk(i, carry):
            start = jnp.minimum(i * chunk, c - chunk)  # the last chunk may overlap the one before
            kb, vb = fetch(start)
            kp = jax.lax.dynamic_slice(k_pos, (0, start), (b, chunk))[:, None, :]  # [B, 1, S]
            fresh = (start + jnp.arange(chunk)) >= i * chunk  # slots not folded in before
            visible = (kp >= 0) & (kp <= qpb[:, :, None]) & fresh  # [B, bq, S]
            return online_softmax_step(carry, qb, kb, vb, visible[:, None, None], scale)

        carry = jax.lax.fori_loop(0, trips, one_chunk, online_softmax_init(qb.shape[:4], d))
        return online_softmax_finish(carry)[0]

    if qg.shape[0] == 1:  # a decode step: no loop over query blocks
        out = one_query_block((qg[0], qp[0]))[None]
    else:
        out = jax.lax.map(one_query_block, (qg, qp))  # [nq, B, Hkv, G, bq, D]
    out = out.transpose(1, 0, 4, 2, 3, 5).reshape(b, -1, hq, d)[:, :t]
    return out.astype(q.dtype)
