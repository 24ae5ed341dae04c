"""Page-sparse decode attention (Sparrow): attend to a few selected pages of a full cache.

Two ``models.kv_view`` views: :class:`PageSparseCache` (Sparrow's rollout cache: a
``models.paged_cache.PagedKVCache`` and the mean key of each of its pages, which it refreshes
itself) and :class:`PageReplay` (a full forward replaying a rollout's selections).

The pages are the paged cache's own: page ``p`` of a row is slots ``[p * page_size, (p + 1) *
page_size)``, which hold its positions ``[p * page_size, (p + 1) * page_size)`` (the paged
cache writes every token at the slot of its position), so a selection is a list of page
indices, the same for the cache, the record and the replay. For the query of one decode step,
per KV head, every page is scored by the query averaged over the KV head's group dotted with
the page's mean key (post-RoPE keys, no ``1/sqrt(d)``, no softmax). The step attends to

  the sink page 0 + the top-``k`` middle pages ``1 .. n-3`` + the 2 newest pages ``n-2, n-1``

where ``n = ceil(L / page_size)`` and ``L = position + 1`` is the row's cached length; ties go
to the lower page index. A row with ``n <= k + 3`` pages is thus dense. Only the selected pages'
keys and values are gathered (``K = k_max + 3`` pages), so the bytes read scale with the budget.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from models.attention_backends import attention, visibility_backend
from models.kv_view import FullForward, layer_field, self_keys
from models.paged_cache import PositionSlots
from models.paged_kernels import paged_kernel_attention
from models.shapes import check_shape

NO_PAGE = -1  # a slot of the selection that holds no page


@struct.dataclass
class PageSparseCache:
    """Sparrow's rollout cache (a ``models.kv_view`` view): a paged cache and the mean key of
    each of its pages, kept by the cache itself.

    A forward of one token per row (a decode step) writes its keys into ``cache``, then each
    layer attends to its selected pages (densely, through the paged loop, on
    ``dense_layers``), recorded in ``selected``; a longer forward (the prefill) attends
    densely. ``end_forward`` refreshes the mean keys of the pages the forward wrote (every
    prompt page after a prefill, the step's page after a decode step), so ``page_keys``
    always describe the cache's contents.

    Attributes:
      cache: the :class:`models.paged_cache.PagedKVCache` (its pages are the selectable
        pages), or a ``models.page_pool.PagePoolCache`` (the same logical pages, drawn from
        a pool through the row's page table).
      page_keys: ``[L, B, Hkv, P, D]`` mean of each page's written keys (zero for a page with
        none), ``P = C / page_size``; a page's mean is final once the page is full, which is
        before any selection scores it.
      budget: ``[B]`` int32 k (middle pages) of each row at the next decode step (the caller
        sets it, e.g. from a schedule of the cached length).
      first_position: ``[B]`` int32 the first position the current forward writes in each
        row (set by ``begin_forward``; ``end_forward`` refreshes from its page on).
      selected: ``[L, B, Hkv, K]`` int32 pages each layer attended to at the last decode step
        (``NO_PAGE`` everywhere on dense layers); filled by ``attend``.
      max_k: the largest k any row may get (static; the selection holds ``max_k + 3`` pages).
      dense_layers: layers that attend densely (static).
    """

    cache: PositionSlots
    page_keys: jax.Array = layer_field()
    budget: jax.Array
    first_position: jax.Array
    selected: jax.Array
    max_k: int = struct.field(pytree_node=False, default=0)
    dense_layers: tuple[int, ...] = struct.field(pytree_node=False, default=(0, 1))

    @property
    def page_size(self) -> int:
        """Tokens per page: the paged cache's."""
        return self.cache.page_size

    @property
    def num_selected(self) -> int:
        """Pages in a selection: ``k_max + 3`` with ``k_max`` capped by the middle pages."""
        return selected_slots(self.max_k, self.page_keys.shape[-2])

    @property
    def index(self) -> jax.Array:
        """The cache's write index ``[]``."""
        return self.cache.index

    @property
    def capacity(self) -> int:
        """The cache's slots ``C`` per layer, row and head."""
        return self.cache.capacity

    @property
    def position_offset(self) -> jax.Array:
        """The cache's write index."""
        return self.cache.index

    def check(self, config, batch: int, t: int, backend: str) -> None:
        """The cache fits a forward of ``[batch, t]`` tokens; ``page_keys`` cover its pages;
        ``budget``, ``first_position`` and ``selected`` match the model; ``dense_layers`` name
        layers it has."""
        self.cache.check(config, batch, t, backend)
        check_shape("PageSparseCache.page_keys", self.page_keys, L=config.num_layers, B=batch,
                    Hkv=config.num_kv_heads, P=self.capacity // self.page_size,
                    D=config.head_dim)
        check_shape("PageSparseCache.budget", self.budget, dtype=int, B=batch)
        check_shape("PageSparseCache.first_position", self.first_position, dtype=int, B=batch)
        check_shape("PageSparseCache.selected", self.selected, dtype=int, L=config.num_layers,
                    B=batch, Hkv=config.num_kv_heads, K=self.num_selected)
        if any(i >= config.num_layers for i in self.dense_layers):
            raise ValueError(f"PageSparseCache.dense_layers={self.dense_layers} names a layer "
                             f"the model ({config.num_layers} layers) does not have")

    def begin_forward(self, positions: jax.Array) -> PageSparseCache:
        """Write the forward's positions ``[B, T]`` into the cache (once, every layer) and
        note each row's first one (``-1`` padding skipped)."""
        first = jnp.min(jnp.where(positions >= 0, positions, self.capacity), axis=1)
        return self.replace(cache=self.cache.begin_forward(positions),
                            first_position=first.astype(jnp.int32))

    def attend(self, layer, q, k, v, q_pos, backend):
        """Write the forward's keys/values at ``layer``; a decode step (``T == 1``) then attends
        to this layer's selected pages (``page_keys`` is this layer's ``[B, Hkv, P, D]`` slice
        here), a prefill (``T > 1``) to every filled page. A backend with a ``page_kernel``
        reads the selected pages in place through it."""
        cache = self.cache.write(layer, k, v, q_pos)
        if q.shape[1] > 1:
            return cache.read(layer, q, q_pos, backend), self.replace(cache=cache)

        def sparse(_):
            return page_sparse_attention(q, cache, q_pos, layer, self.page_keys, self.budget,
                                         max_k=self.max_k, backend=backend)

        def dense(_):
            shape = (q.shape[0], k.shape[1], self.num_selected)
            return (cache.read(layer, q, q_pos, backend),
                    jnp.full(shape, NO_PAGE, jnp.int32))

        if not self.dense_layers:
            out, pages = sparse(None)
        else:
            is_dense = jnp.any(layer == jnp.asarray(self.dense_layers, jnp.int32))
            out, pages = jax.lax.cond(is_dense, dense, sparse, None)
        selected = jax.lax.dynamic_update_index_in_dim(self.selected, pages, layer, 0)
        return out, self.replace(cache=cache, selected=selected)

    def end_forward(self, t: int) -> PageSparseCache:
        """Refresh the mean keys of the pages the forward's ``t`` tokens were written to
        (``ceil((t - 1) / page_size) + 1`` pages per row from the first position's; pages past
        the row's newest position have no written keys and stay zero), then advance the
        index."""
        first = self.first_position // self.page_size  # [B]
        touched = first[:, None] + jnp.arange(-(-(t - 1) // self.page_size) + 1)
        page_keys = refresh_page_keys(self.page_keys, self.cache, touched)
        return self.replace(cache=self.cache.end_forward(t), page_keys=page_keys)

    def row_tokens(self) -> jax.Array:
        """``[B]`` int32 resident tokens of each row (every written one: nothing is evicted)."""
        return self.cache.row_tokens()

    def repeat_rows(self, n: int) -> PageSparseCache:
        """The cache with each row repeated ``n`` times (row ``i`` -> rows ``i*n .. i*n+n-1``)."""
        return self.replace(cache=self.cache.repeat_rows(n),
                            page_keys=jnp.repeat(self.page_keys, n, axis=1),
                            budget=jnp.repeat(self.budget, n),
                            first_position=jnp.repeat(self.first_position, n),
                            selected=jnp.repeat(self.selected, n, axis=1))


def page_sparse_cache(cache: PositionSlots, *, max_k: int, dense_layers: tuple[int, ...],
                      dtype=None) -> PageSparseCache:
    """A :class:`PageSparseCache` over an empty paged ``cache`` (a ``PagedKVCache`` or a
    ``models.page_pool.PagePoolCache``: ``pos [B, C]``): zero page keys ``[L, B, Hkv,
    C / page_size, D]`` in ``dtype`` (None: the cache's, float32 for a quantized one),
    budget and first positions 0, ``selected`` all ``NO_PAGE``."""
    n_layers, hkv, d = cache.k.shape[0], cache.num_kv_heads, cache.head_dim
    b, p = cache.pos.shape[0], cache.capacity // cache.page_size
    if dtype is None:
        dtype = jnp.float32 if cache.quant != "none" else cache.k.dtype
    return PageSparseCache(
        cache=cache, page_keys=jnp.zeros((n_layers, b, hkv, p, d), dtype),
        budget=jnp.zeros((b,), jnp.int32), first_position=jnp.zeros((b,), jnp.int32),
        selected=jnp.full((n_layers, b, hkv, selected_slots(max_k, p)), NO_PAGE, jnp.int32),
        max_k=max_k, dense_layers=tuple(dense_layers))


def refresh_page_keys(page_keys: jax.Array, cache: PositionSlots,
                      pages: jax.Array) -> jax.Array:
    """Recompute the mean key of ``pages [B, n]`` of each row (every layer and KV head).

    Args:
      page_keys: ``[L, B, Hkv, P, D]`` page-mean keys.
      cache: the paged cache (``pos [B, C]``, ``C = P * page_size``; its keys read through
        its ``kv_index``, decoded when quantized, so the means are of the keys attention
        reads: a ``PagedKVCache`` or a ``models.page_pool.PagePoolCache``).
      pages: ``[B, n]`` int page indices to refresh (``P`` or more = skipped).

    Returns ``page_keys`` with those pages set to the mean of their written keys (zero for a
    page with none). Reads ``n * page_size`` slots per row, layer and head.
    """
    n_layers, b, h, p, d = page_keys.shape
    ps, c = cache.page_size, cache.capacity
    want = (pages[:, :, None] * ps + jnp.arange(ps)).reshape(b, -1)  # [B, n*ps]
    slots = jnp.clip(want, 0, c - 1)
    got = jnp.take_along_axis(cache.pos, slots, axis=-1) == want  # [B, n*ps]
    index = cache.kv_index(jnp.arange(b)[:, None, None], jnp.arange(h)[None, :, None],
                           slots[:, None, :])
    # advanced indices side by side after the layer slice: [L, B, Hkv, n*ps, D]
    keys = cache.decoded_at("k", (slice(None),) + index, jnp.float32).astype(jnp.float32)
    keys = jnp.where(got[None, :, None, :, None], keys, 0.0).reshape(n_layers, b, h, -1, ps, d)
    count = jnp.sum(got.reshape(b, -1, ps), axis=-1)[None, :, None, :, None]
    means = jnp.sum(keys, axis=-2) / jnp.maximum(count, 1)  # [L, B, Hkv, n, D]
    rows = jnp.arange(b)[:, None]
    # Advanced indices (rows, pages) around a slice put [B, n] first: values [B, n, L, Hkv, D].
    return page_keys.at[:, rows, :, pages].set(
        means.transpose(1, 3, 0, 2, 4).astype(page_keys.dtype), mode="drop")


@struct.dataclass
class PageReplay(FullForward):
    """A page-sparse rollout's selection replayed by a teacher-forced forward (a
    ``models.kv_view`` view): each query sees only the keys of its pages, expanded one query
    block at a time (never ``[T, S]`` per layer beyond one block).

    Attributes:
      pages: ``[L, B, Hkv, T, K]`` int32 pages each query attended to (``NO_PAGE`` unused; a
        query with ``NO_PAGE`` only attends densely: prompt queries, dense layers).
      page_size: tokens per page (static).
    """

    pages: jax.Array = layer_field()
    page_size: int = struct.field(pytree_node=False, default=16)
    quant: str = struct.field(pytree_node=False, default="none")

    def check(self, config, batch: int, t: int, backend: str) -> None:
        """``pages`` must be ``[L, B, Hkv, T, K]`` ints; the backend one that takes per-key
        visibility (not ``"fused"``)."""
        check_shape("PageReplay.pages", self.pages, dtype=int, L=config.num_layers, B=batch,
                    Hkv=config.num_kv_heads, T=t, K=None)
        visibility_backend(backend, "PageReplay")

    def attend(self, layer, q, k, v, q_pos, backend):
        """Causal attention limited to this layer's pages ``[B, Hkv, T, K]``."""
        del layer
        return attention(q, *self.own_kv(k, v), q_pos, self_keys(q_pos, k), q_pages=self.pages,
                         page_size=self.page_size, backend=backend), self


def middle_slots(max_k: int, num_pages: int) -> int:
    """Top-k slots of a selection: ``max_k`` capped at the ``num_pages - 3`` middle pages."""
    return max(0, min(max_k, num_pages - 3))


def selected_slots(max_k: int, num_pages: int) -> int:
    """Slots of a whole selection: the top-k middle slots plus the sink and 2 newest pages."""
    return middle_slots(max_k, num_pages) + 3


def select_pages(
    q_mean: jax.Array, page_keys: jax.Array, num_pages: jax.Array, budget: jax.Array, max_k: int
) -> jax.Array:
    """The pages one decode step attends to.

    Args:
      q_mean: ``[B, Hkv, D]`` the step's query averaged over each KV head's query heads.
      page_keys: ``[B, Hkv, P, D]`` page-mean keys.
      num_pages: ``[B]`` int ``n = ceil(L / page_size)`` pages the row holds.
      budget: ``[B]`` int k of each row (``<= max_k``).
      max_k: static upper bound of ``budget``.

    Returns:
      ``[B, Hkv, K]`` int32 page indices, ``K = min(max_k, P - 3) + 3``: slot 0 the sink page,
      then the top-k middle pages by score (highest first, ties to the lower index), then
      pages ``n - 2`` and ``n - 1``; ``NO_PAGE`` where a slot is unused.
    """
    b, h, p, _ = page_keys.shape
    m = middle_slots(max_k, p)
    n = num_pages.astype(jnp.int32)[:, None, None]  # [B, 1, 1]
    page = jnp.arange(p, dtype=jnp.int32)
    scores = jnp.einsum("bhd,bhpd->bhp", q_mean, page_keys, preferred_element_type=jnp.float32)
    middle = (page >= 1) & (page <= n - 3)  # [B, 1, P]
    parts = [jnp.zeros((b, h, 1), jnp.int32)]
    if m:
        # lax.top_k keeps the lower index first among equal values.
        _, idx = jax.lax.top_k(jnp.where(middle, scores, -jnp.inf), m)
        rank = jnp.arange(m, dtype=jnp.int32)
        keep = (rank < budget.astype(jnp.int32)[:, None, None]) & (rank < n - 3)
        parts.append(jnp.where(keep, idx.astype(jnp.int32), NO_PAGE))
    for back in (2, 1):
        newest = jnp.broadcast_to(n - back, (b, h, 1))
        parts.append(jnp.where(newest >= 1, newest, NO_PAGE))
    return jnp.concatenate(parts, axis=-1)


def selected_slots_positions(k_pos: jax.Array, pages: jax.Array,
                             page_size: int) -> tuple[jax.Array, jax.Array]:
    """The logical slots of selected pages and their keys' positions.

    Args:
      k_pos: ``[B, C]`` slot positions (``-1`` empty); pages: ``[B, Hkv, K]`` page indices
        (``NO_PAGE`` unused).

    Returns:
      ``slots [B, Hkv, K * page_size]`` (clipped into ``[0, C)``) and their positions, ``-1``
      on unused slots and on positions not yet written.
    """
    b, h = pages.shape[:2]
    want = (pages[..., None] * page_size + jnp.arange(page_size, dtype=jnp.int32))
    want = want.reshape(b, h, -1)  # [B, Hkv, K*ps]
    slots = jnp.clip(want, 0, k_pos.shape[1] - 1)
    got = k_pos[jnp.arange(b)[:, None, None], slots]
    used = jnp.repeat(pages >= 0, page_size, axis=-1) & (got == want)
    return slots, jnp.where(used, got, -1)


def gather_pages(cache: PositionSlots, pages: jax.Array, layer: jax.Array,
                 dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Keys, values and positions of the selected pages of one layer only.

    Args:
      cache: a paged cache or page pool (``pos [B, C]``; a row's logical slots found through
        its ``kv_index``).
      pages: ``[B, Hkv, K]`` page indices (``NO_PAGE`` unused).
      layer: ``[]`` int the layer to read.
      dtype: what a quantized cache's keys and values are decoded to.

    Returns:
      ``k, v [B, Hkv, K * page_size, D]`` and positions ``[B, Hkv, K * page_size]`` (see
      :func:`selected_slots_positions`).
    """
    b, h = pages.shape[:2]
    slots, positions = selected_slots_positions(cache.pos, pages, cache.page_size)
    index = (layer,) + cache.kv_index(jnp.arange(b)[:, None, None],
                                      jnp.arange(h)[None, :, None], slots)
    return cache.kv_at(index, dtype) + (positions,)


def page_sparse_attention(
    q: jax.Array, cache: PositionSlots, q_pos: jax.Array, layer: jax.Array,
    page_keys: jax.Array, budget: jax.Array, *, max_k: int, backend: str = "blockwise",
) -> tuple[jax.Array, jax.Array]:
    """One decode step of page-sparse attention for one layer of a paged cache.

    Args:
      q: ``[B, 1, Hq, D]`` the step's query (after RoPE); q_pos ``[B, 1]`` its position.
      cache: the paged cache or page pool (the step's key already written; ``pos [B, C]``).
      layer: ``[]`` the layer to read.
      page_keys: ``[B, Hkv, P, D]`` this layer's page-mean keys; budget ``[B]`` (see
        :class:`PageSparseCache`).
      backend: a backend with a ``page_kernel`` reads the selected pages in place (their ids
        a per-(row, head) table) when the cache has ``page_buffers``; otherwise ``attention``
        over the gathered pages.

    Returns:
      ``(out [B, 1, Hq, D], pages [B, Hkv, K])``.
    """
    b, t, hq, d = q.shape
    if t != 1:
        raise ValueError(f"page_sparse_attention: one decode query per row, got T={t}")
    page_size, hkv = cache.page_size, page_keys.shape[1]
    q_mean = jnp.mean(q[:, 0].reshape(b, hkv, hq // hkv, d).astype(jnp.float32), axis=2)
    num_pages = (q_pos[:, 0] + page_size) // page_size  # ceil((pos + 1) / page_size)
    pages = select_pages(q_mean, page_keys.astype(jnp.float32), num_pages, budget, max_k)
    kernel = visibility_backend(backend, "page_sparse_attention").page_kernel
    buffers = None if kernel is None else cache.page_buffers()
    if buffers is not None:
        _, positions = selected_slots_positions(cache.pos, pages, page_size)
        k_pages, v_pages = buffers
        live = jnp.full((b,), pages.shape[-1], jnp.int32)
        out = paged_kernel_attention(q, k_pages, v_pages, layer, cache.page_ids(pages),
                                     positions, q_pos, live, kernel=kernel.platform,
                                     scales=cache.page_scales())
        return out, pages
    gk, gv, gpos = gather_pages(cache, pages, layer, q.dtype)
    return attention(q, gk, gv, q_pos, gpos, backend=backend), pages
