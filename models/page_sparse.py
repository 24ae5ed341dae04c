"""Page-sparse decode attention (Sparrow): attend to a few selected pages of a dense cache.

Two ``models.kv_view`` views: :class:`PageSparseCache` (Sparrow's rollout cache: a
``KVCache`` and the mean key of each of its pages, which it refreshes itself) and
:class:`PageReplay` (a full forward replaying a rollout's selections).

The dense cache of a layer is read as pages of ``page_size`` consecutive token positions of a
row (page ``p`` holds positions ``[p * page_size, (p + 1) * page_size)``; with left padding
position ``j`` of row ``b`` sits at slot ``slot_offset[b] + j``). For the query of one decode
step, per KV head, every page is scored by the query averaged over the KV head's group dotted
with the page's mean key (post-RoPE keys, no ``1/sqrt(d)``, no softmax). The step attends to

  the sink page 0 + the top-``k`` middle pages ``1 .. n-3`` + the 2 newest pages ``n-2, n-1``

where ``n = ceil(L / page_size)`` and ``L = position + 1`` is the row's cached length; ties go
to the lower page index. A row with ``n <= k + 3`` pages is thus dense. Only the selected pages'
keys and values are gathered (``K = k_max + 3`` pages), so the bytes read scale with the budget.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from models.attention import attention
from models.cache import KVCache
from models.kv_view import FullForward, layer_field, self_keys
from models.shapes import check_shape

NO_PAGE = -1  # a slot of the selection that holds no page


@struct.dataclass
class PageSparseCache:
    """Sparrow's rollout cache (a ``models.kv_view`` view): a dense slot cache and the mean
    key of each of its pages, kept by the cache itself.

    A forward of one token per row (a decode step) writes its keys into ``cache``, then each
    layer attends to its selected pages (densely on ``dense_layers``), recorded in
    ``selected``; a longer forward (the prefill) attends densely. ``end_forward`` refreshes the
    mean keys of the pages the forward wrote (every prompt page after a prefill, the step's
    page after a decode step), so ``page_keys`` always describe the cache's contents.

    Rows are left-padded: positions are contiguous in the slots, row ``b``'s position ``j`` at
    slot ``slot_offset[b] + j`` (no eviction moves them).

    Attributes:
      cache: the dense :class:`models.cache.KVCache` (``C`` covers the whole sequence).
      page_keys: ``[L, B, Hkv, P, D]`` mean of each page's written keys (zero for a page with
        none), ``P = ceil(C / page_size)``; a page's mean is final once the page is full,
        which is before any selection scores it.
      budget: ``[B]`` int32 k (middle pages) of each row at the next decode step (the caller
        sets it, e.g. from a schedule of the cached length).
      slot_offset: ``[B]`` int32 cache slot of each row's position 0 (its left padding); set
        by ``begin_forward`` from the forward's positions.
      selected: ``[L, B, Hkv, K]`` int32 pages each layer attended to at the last decode step
        (``NO_PAGE`` everywhere on dense layers); filled by ``attend``.
      page_size: tokens per page (static).
      max_k: the largest k any row may get (static; the selection holds ``max_k + 3`` pages).
      dense_layers: layers that attend densely (static).
    """

    cache: KVCache
    page_keys: jax.Array = layer_field()
    budget: jax.Array
    slot_offset: jax.Array
    selected: jax.Array
    page_size: int = struct.field(pytree_node=False, default=16)
    max_k: int = struct.field(pytree_node=False, default=0)
    dense_layers: tuple[int, ...] = struct.field(pytree_node=False, default=(0, 1))

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
        """The cache fits a forward of ``[batch, t]`` tokens; ``page_keys`` cover its slots;
        ``budget``, ``slot_offset`` and ``selected`` match the model; ``dense_layers`` name
        layers it has."""
        self.cache.check(config, batch, t, backend)
        check_shape("PageSparseCache.page_keys", self.page_keys, L=config.num_layers, B=batch,
                    Hkv=config.num_kv_heads, P=-(-self.capacity // self.page_size),
                    D=config.head_dim)
        check_shape("PageSparseCache.budget", self.budget, dtype=int, B=batch)
        check_shape("PageSparseCache.slot_offset", self.slot_offset, dtype=int, B=batch)
        check_shape("PageSparseCache.selected", self.selected, dtype=int, L=config.num_layers,
                    B=batch, Hkv=config.num_kv_heads, K=self.num_selected)
        if any(i >= config.num_layers for i in self.dense_layers):
            raise ValueError(f"PageSparseCache.dense_layers={self.dense_layers} names a layer "
                             f"the model ({config.num_layers} layers) does not have")

    def begin_forward(self, positions: jax.Array) -> PageSparseCache:
        """Write the forward's positions ``[B, T]`` into the cache (once, every layer) and
        derive each row's ``slot_offset`` from them (column ``j`` goes to slot ``index + j``)."""
        t = positions.shape[1]
        offset = jnp.max(jnp.where(positions >= 0, jnp.arange(t) - positions, 0), axis=1)
        return self.replace(cache=self.cache.begin_forward(positions),
                            slot_offset=(self.cache.index + offset).astype(jnp.int32))

    def attend(self, layer, q, k, v, q_pos, backend):
        """Store the forward's tokens at ``layer``; a decode step (``T == 1``) then attends to
        this layer's selected pages (``page_keys`` is this layer's ``[B, Hkv, P, D]`` slice
        here), a prefill (``T > 1``) to every slot."""
        if q.shape[1] > 1:
            out, cache = self.cache.attend(layer, q, k, v, q_pos, backend)
            return out, self.replace(cache=cache)
        cache = self.cache.store(layer, q, k, v)
        ck, cv, cpos = cache.k[layer], cache.v[layer], cache.pos[layer]

        def sparse(_):
            return page_sparse_attention(q, ck, cv, q_pos, cpos, self.page_keys, self.budget,
                                         self.slot_offset, page_size=self.page_size,
                                         max_k=self.max_k)

        def dense(_):
            shape = (ck.shape[0], ck.shape[1], self.num_selected)
            return attention(q, ck, cv, q_pos, cpos), jnp.full(shape, NO_PAGE, jnp.int32)

        if not self.dense_layers:
            out, pages = sparse(None)
        else:
            is_dense = jnp.any(layer == jnp.asarray(self.dense_layers, jnp.int32))
            out, pages = jax.lax.cond(is_dense, dense, sparse, None)
        selected = jax.lax.dynamic_update_index_in_dim(self.selected, pages, layer, 0)
        return out, self.replace(cache=cache, selected=selected)

    def end_forward(self, t: int) -> PageSparseCache:
        """Refresh the mean keys of the pages the forward's ``t`` tokens were written to
        (``ceil((t - 1) / page_size) + 1`` pages per row from the first one; pages past the
        row's newest position have no written keys and stay zero), then advance the index."""
        first = jnp.maximum(self.cache.index - self.slot_offset, 0) // self.page_size  # [B]
        touched = first[:, None] + jnp.arange(-(-(t - 1) // self.page_size) + 1)
        page_keys = refresh_page_keys(self.page_keys, self.cache, self.slot_offset, touched,
                                      self.page_size)
        return self.replace(cache=self.cache.end_forward(t), page_keys=page_keys)

    def row_tokens(self) -> jax.Array:
        """``[B]`` int32 resident tokens of each row (every written one: nothing is evicted)."""
        return self.cache.row_tokens()

    def repeat_rows(self, n: int) -> PageSparseCache:
        """The cache with each row repeated ``n`` times (row ``i`` -> rows ``i*n .. i*n+n-1``)."""
        return self.replace(cache=self.cache.repeat_rows(n),
                            page_keys=jnp.repeat(self.page_keys, n, axis=1),
                            budget=jnp.repeat(self.budget, n),
                            slot_offset=jnp.repeat(self.slot_offset, n),
                            selected=jnp.repeat(self.selected, n, axis=1))


def page_sparse_cache(cache: KVCache, *, page_size: int, max_k: int,
                      dense_layers: tuple[int, ...]) -> PageSparseCache:
    """A :class:`PageSparseCache` over an empty dense ``cache`` (``k [L, B, Hkv, C, D]``, no
    query ring): zero page keys ``[L, B, Hkv, ceil(C / page_size), D]``, budget and
    slot offsets 0, ``selected`` all ``NO_PAGE``."""
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_sparse_cache: page_size={page_size!r} must be an int >= 1")
    n_layers, b, hkv, c, d = cache.k.shape
    p = -(-c // page_size)
    return PageSparseCache(
        cache=cache, page_keys=jnp.zeros((n_layers, b, hkv, p, d), cache.k.dtype),
        budget=jnp.zeros((b,), jnp.int32), slot_offset=jnp.zeros((b,), jnp.int32),
        selected=jnp.full((n_layers, b, hkv, selected_slots(max_k, p)), NO_PAGE, jnp.int32),
        page_size=page_size, max_k=max_k, dense_layers=tuple(dense_layers))


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

    def check(self, config, batch: int, t: int, backend: str) -> None:
        """``pages`` must be ``[L, B, Hkv, T, K]`` ints; the backend blockwise or reference."""
        check_shape("PageReplay.pages", self.pages, dtype=int, L=config.num_layers, B=batch,
                    Hkv=config.num_kv_heads, T=t, K=None)
        if backend == "fused":
            raise ValueError("PageReplay: replays with the blockwise or reference backend, "
                             "got attention_backend='fused'")

    def attend(self, layer, q, k, v, q_pos, backend):
        """Causal attention limited to this layer's pages ``[B, Hkv, T, K]``."""
        del layer
        return attention(q, k, v, q_pos, self_keys(q_pos, k), q_pages=self.pages,
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


def gather_pages(
    k: jax.Array, v: jax.Array, k_pos: jax.Array, pages: jax.Array, slot_offset: jax.Array,
    page_size: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Keys, values and positions of the selected pages only.

    Args:
      k, v: ``[B, Hkv, C, D]``; k_pos: ``[B, Hkv, C]`` (``-1`` empty).
      pages: ``[B, Hkv, K]`` page indices (``NO_PAGE`` unused).
      slot_offset: ``[B]`` slot of position 0 of each row.

    Returns:
      ``k, v [B, Hkv, K * page_size, D]`` and positions ``[B, Hkv, K * page_size]`` with ``-1``
      on unused slots and on positions not yet written.
    """
    c = k.shape[2]
    within = jnp.arange(page_size, dtype=jnp.int32)
    want = (pages[..., None] * page_size + within).reshape(pages.shape[:2] + (-1,))
    slots = jnp.clip(slot_offset[:, None, None] + want, 0, c - 1)
    got = jnp.take_along_axis(k_pos, slots, axis=-1)
    used = jnp.repeat(pages >= 0, page_size, axis=-1) & (got == want)
    gk = jnp.take_along_axis(k, slots[..., None], axis=2)
    gv = jnp.take_along_axis(v, slots[..., None], axis=2)
    return gk, gv, jnp.where(used, got, -1)


def page_sparse_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array,
    page_keys: jax.Array, budget: jax.Array, slot_offset: jax.Array, *, page_size: int,
    max_k: int,
) -> tuple[jax.Array, jax.Array]:
    """One decode step of page-sparse attention for one layer.

    Args:
      q: ``[B, 1, Hq, D]`` the step's query (after RoPE); q_pos ``[B, 1]`` its position.
      k, v: ``[B, Hkv, C, D]`` the dense cache (the step's key already written); k_pos
        ``[B, Hkv, C]``.
      page_keys: ``[B, Hkv, P, D]``; budget ``[B]``; slot_offset ``[B]`` (see
        :class:`PageSparseCache`).

    Returns:
      ``(out [B, 1, Hq, D], pages [B, Hkv, K])``.
    """
    b, t, hq, d = q.shape
    if t != 1:
        raise ValueError(f"page_sparse_attention: one decode query per row, got T={t}")
    hkv = k.shape[1]
    q_mean = jnp.mean(q[:, 0].reshape(b, hkv, hq // hkv, d).astype(jnp.float32), axis=2)
    num_pages = (q_pos[:, 0] + page_size) // page_size  # ceil((pos + 1) / page_size)
    pages = select_pages(q_mean, page_keys.astype(jnp.float32), num_pages, budget, max_k)
    gk, gv, gpos = gather_pages(k, v, k_pos, pages, slot_offset, page_size)
    return attention(q, gk, gv, q_pos, gpos), pages
