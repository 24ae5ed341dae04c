"""A KV page pool shared by the rows of a batch: a :mod:`models.kv_view` view whose rows hold
only the pages their page tables name.

Per layer, keys and values live in ``num_pages`` pages of ``page_size`` slots, shared by every
row. Row ``b``'s logical page ``p`` (its positions ``[p * page_size, (p + 1) * page_size)``,
as in ``models.paged_cache.PagedKVCache``, whose layout this is with the pages indirected) is
pool page ``pages[b, p]``; an entry ``num_pages`` maps nothing: writes to it are dropped and
it reads as zeros (its slots are empty, ``pos == -1``, so no query sees them). The caller owns
the tables (a continuous-batching engine draws pages from a free list as rows fill them and
returns a retired row's pages), so a row holds the pages it has filled, not ``max_len``.

Layout: each layer's pages are ``[Hkv, N, page_size, D]`` (buffers ``[L, Hkv, N, page_size,
D]``), the page layout of JAX's GPU Pallas paged-attention kernel (``k_pages [num_kv_heads,
total_pages, page_size, head_dim]`` with a ``[B, pages_per_row]`` block table), chosen for the
kernels (``models.paged_kernels``) that read pages in place: a page of one head is one
contiguous ``[page_size, D]`` block.

Attention reads a row's pages through its table in chunks of ``chunk_pages`` logical pages
(``models.paged_cache.chunked_attention``: the same chunks, online softmax and trip count as
the paged cache, so a row's attention equals the paged cache's when its table maps every page
it has written). Each chunk is one gather straight into the ``[B, Hkv, chunk, D]`` operand of
the attention dots (no transpose, no copy besides the gather's own output). That output is
still materialised: XLA:CPU fuses neither a gather into a dot (a library call) nor a gather
into a consumer that reads each of its elements ``G = Hq / Hkv`` times (GQA), so the XLA path
reads a chunk's keys twice and writes them once (``benchmarks/README.md``, the cost model);
the page kernels read them once. Rollouts only (no gradient through the loop).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from models.attention_backends import attention, visibility_backend
from models.cache import empty_kv
from models.paged_cache import (CHUNK_PAGES, PagedKVCache, PositionSlots, _rows, _slots,
                                check_kernel_shapes, chunked_attention, default_chunk_pages)
from models.shapes import check_shape


@struct.dataclass
class PagePoolCache(PositionSlots):
    """Pool key/value pages for every layer and per-row page tables (a ``models.kv_view``
    view).

    Attributes:
      k: ``[L, Hkv, N, page_size, D]`` keys after RoPE, ``N`` pool pages.
      v: ``[L, Hkv, N, page_size, D]`` values.
      pages: ``[B, R]`` int32 pool page of each row's logical page (``N`` = none); a row holds
        ``C = R * page_size`` positions.
      pos: ``[B, C]`` int32 original token position of each logical slot, ``-1`` = empty or
        padding; shared by every layer and KV head.
      index: ``[]`` or ``[B]`` int32, the next slot to write.
      k_scale, v_scale: ``[L, Hkv, N, page_size]`` bfloat16 scale of each slot's key / value
        when ``quant`` quantizes (``k``, ``v`` then hold codes ``[..., D / per_byte]``); None
        otherwise. A page then costs the quantized bytes: the same bytes hold more pages.
      page_size, chunk_pages, quant: as ``models.paged_cache.PagedKVCache`` (static).
    """

    k: jax.Array
    v: jax.Array
    pages: jax.Array
    pos: jax.Array
    index: jax.Array
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None
    page_size: int = struct.field(pytree_node=False, default=16)
    chunk_pages: int = struct.field(pytree_node=False, default=CHUNK_PAGES["cpu"])
    quant: str = struct.field(pytree_node=False, default="none")

    @property
    def capacity(self) -> int:
        """Logical slots ``C`` of a row (``R * page_size``)."""
        return self.pages.shape[1] * self.page_size

    @property
    def num_pages(self) -> int:
        """Pages ``N`` of the pool."""
        return self.k.shape[2]

    @property
    def num_kv_heads(self) -> int:
        """KV heads ``Hkv`` of the pool (``k [L, Hkv, N, page_size, D]``)."""
        return self.k.shape[1]

    def check(self, config, batch: int, t: int, backend: str) -> None:
        """ValueError naming the field when the pool does not fit ``config`` and a forward of
        ``[batch, t]`` tokens (shapes; room for ``t`` more tokens when the index is known; a
        backend that takes per-key visibility; a page kernel that takes ``page_size`` and the
        model's heads)."""
        self.check_kv(config, L=config.num_layers, Hkv=config.num_kv_heads, N=None,
                      P=self.page_size)
        check_shape("PagePoolCache.pages", self.pages, B=batch, R=None)
        check_shape("PagePoolCache.pos", self.pos, B=batch, C=self.capacity)
        self.check_room(t, backend)
        check_kernel_shapes(backend, self.page_size, config, "PagePoolCache", self.quant)

    def slot_index(self, rows: jax.Array, slots: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``(page, offset)`` in the pool of logical slots ``slots`` of rows ``rows``
        (broadcasting int arrays; a slot out of ``[0, C)`` or on an unmapped page: page
        ``N``, dropped by writes, read as zeros by ``mode="fill"`` gathers)."""
        logical = jnp.clip(slots // self.page_size, 0, self.pages.shape[1] - 1)
        page = jnp.where((slots >= 0) & (slots < self.capacity), self.pages[rows, logical],
                         self.num_pages)
        return page, slots % self.page_size

    def kv_index(self, rows: jax.Array, heads: jax.Array,
                 slots: jax.Array) -> tuple[jax.Array, ...]:
        """Where logical slots ``slots`` of KV heads ``heads`` of rows ``rows`` (broadcasting
        int arrays) live in ``k, v``: ``(heads, page, offset)``, indices into axes 1-3
        (``k[(layer,) + index]``; see ``models.paged_cache.PositionSlots.kv_index``)."""
        return (heads,) + self.slot_index(rows, slots)

    def write_index(self, q_pos: jax.Array) -> tuple:
        """Index of positions ``q_pos [B, T]`` into the buffers' axes 1-3: the heads' slice,
        then advanced ``(page, offset)`` (``[B, T]`` first); padding and unmapped pages at
        page ``N``."""
        return (slice(None),) + self.slot_index(_rows(q_pos), _slots(q_pos, self.capacity))

    def _gather(self, layer: jax.Array, pages: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
        """Keys and values ``[B, Hkv, R' * page_size, D]`` (decoded to ``dtype`` when
        quantized): logical pages ``pages [B, R']`` of ``layer`` (unmapped pages read as
        zeros), one gather per buffer whose output is already the attention's operand layout
        (the final reshape merges adjacent axes)."""
        heads = jnp.arange(self.num_kv_heads)[None, :, None]
        # advanced indices (layer, heads, pages) side by side: [B, Hkv, R', P, D]
        k, v = self.kv_at((layer, heads, pages[:, None, :]), dtype)
        return tuple(x.reshape(x.shape[:2] + (-1, x.shape[-1])) for x in (k, v))

    def page_buffers(self) -> tuple[jax.Array, jax.Array]:
        """``[L, Hkv, N, page_size, D]``: the pool's own buffers, the page kernels' layout."""
        return self.k, self.v

    def page_ids(self, logical: jax.Array) -> jax.Array:
        """``[B, Ht, K]`` pool pages of logical pages ``logical`` (broadcasting against
        ``[B, 1, 1]``; ``N`` for a page outside ``[0, R)`` or unmapped)."""
        r = self.pages.shape[1]
        rows = jnp.arange(self.pages.shape[0])[:, None, None]
        ids = self.pages[rows, jnp.clip(logical, 0, r - 1)]
        return jnp.where((logical >= 0) & (logical < r), ids, self.num_pages).astype(jnp.int32)

    def read(self, layer: jax.Array, q: jax.Array, q_pos: jax.Array,
             backend: str) -> jax.Array:
        """Attention ``[B, T, Hq, D]`` of ``q`` (positions ``q_pos [B, T]``) over each row's
        pages: a decode step (``T == 1``) of a backend with a ``page_kernel`` reads them in
        place through it; otherwise in chunks of ``chunk_pages`` pages up to the newest
        position when the backend ``reads_pages_in_chunks`` (``"blockwise"``), or the backend
        over every logical slot (``"reference"``)."""
        chosen = visibility_backend(backend, "PagePoolCache.read")
        if chosen.page_kernel is not None and q.shape[1] == 1:
            return self.kernel_read(layer, q, q_pos, chosen.page_kernel)
        if not chosen.reads_pages_in_chunks:
            k, v = self._gather(layer, self.pages, q.dtype)
            k_pos = jnp.broadcast_to(self.pos[:, None], k.shape[:3])
            return attention(q, k, v, q_pos, k_pos, backend=backend)
        chunk_pages = min(self.chunk_pages, self.pages.shape[1])

        def fetch(start):
            pages = jax.lax.dynamic_slice_in_dim(self.pages, start // self.page_size,
                                                 chunk_pages, axis=1)
            return self._gather(layer, pages, q.dtype)

        return chunked_attention(q, self.pos, q_pos, fetch, hkv=self.num_kv_heads,
                                 filled=jnp.max(q_pos) + 1,
                                 chunk=chunk_pages * self.page_size)

    def put_rows(self, src: PagedKVCache, rows: jax.Array) -> PagePoolCache:
        """The pool with rows ``rows [I]`` (``B`` = none) set to the ``I`` rows of a paged
        cache of the same capacity and page size (``src``, e.g. their prefill): its pages
        copied to the pages the rows' tables map (unmapped pages dropped), its positions
        and write index taken (codes and scales as they are: ``src`` stores the pool's
        ``quant``)."""
        if src.quant != self.quant:
            raise ValueError(f"PagePoolCache.put_rows: the rows store quant {src.quant!r}, "
                             f"the pool {self.quant!r}")
        l, i, hkv, c = src.k.shape[:4]
        r = c // self.page_size
        pages = self.pages.at[rows].get(mode="fill", fill_value=self.num_pages)  # [I, R]

        def put(dst, new):  # [L, I, Hkv, C, ...] -> pages [L, Hkv, I, R, P, ...]
            if dst is None:
                return None
            new = new.reshape((l, i, hkv, r, self.page_size) + new.shape[4:])
            return dst.at[:, :, pages].set(jnp.swapaxes(new, 1, 2).astype(dst.dtype),
                                           mode="drop")

        index = jnp.broadcast_to(self.index, (self.pages.shape[0],))
        return self.replace(k=put(self.k, src.k), v=put(self.v, src.v),
                            k_scale=put(self.k_scale, src.k_scale),
                            v_scale=put(self.v_scale, src.v_scale),
                            pos=self.pos.at[rows].set(src.pos, mode="drop"),
                            index=index.at[rows].set(src.index, mode="drop"))

    def repeat_rows(self, n: int) -> PagePoolCache:
        """Not defined for a pool: rows sharing pages would write each other's tokens."""
        raise NotImplementedError("PagePoolCache.repeat_rows: give each row its own pages")


def init_page_pool(num_layers: int, batch: int, num_kv_heads: int, max_len: int,
                   head_dim: int, num_pages: int, dtype=jnp.float32, *, page_size: int = 16,
                   chunk_pages: int | None = None, quant: str = "none") -> PagePoolCache:
    """An empty pool of ``num_pages`` pages for ``batch`` rows of up to ``max_len`` positions
    (``R = ceil(max_len / page_size)`` logical pages each): zero keys/values (codes and
    scales when ``quant``, a ``models.kv_quant`` format, quantizes), every table
    entry unmapped, every slot empty, per-row index ``[batch]`` 0; ``chunk_pages`` None =
    ``models.paged_cache.default_chunk_pages``."""
    chunk_pages = default_chunk_pages() if chunk_pages is None else chunk_pages
    for name, value in (("page_size", page_size), ("chunk_pages", chunk_pages),
                        ("max_len", max_len), ("num_pages", num_pages)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"init_page_pool: {name}={value!r} must be an int >= 1")
    r = -(-max_len // page_size)
    shape = (num_layers, num_kv_heads, num_pages, page_size, head_dim)
    return PagePoolCache(**empty_kv(shape, dtype, quant, "init_page_pool"),
                         pages=jnp.full((batch, r), num_pages, jnp.int32),
                         pos=jnp.full((batch, r * page_size), -1, jnp.int32),
                         index=jnp.zeros((batch,), jnp.int32), page_size=page_size,
                         chunk_pages=chunk_pages, quant=quant)
