"""Page-sparse decode attention (Sparrow): attend to a few selected pages of a dense cache.

Two ``models.kv_view`` views: :class:`PageSparseCache` (a decode step over a ``KVCache``)
and :class:`PageReplay` (a full forward replaying a rollout's selections).

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
from models.kv_view import FullForward, PerLayerPositions, layer_field, self_keys
from models.shapes import check_shape

NO_PAGE = -1  # a slot of the selection that holds no page


@struct.dataclass
class PageSparseCache(PerLayerPositions):
    """A decode step of page-sparse attention over a dense slot cache (a ``models.kv_view``
    view): the step's keys are written into ``cache``, then each layer attends to its
    selected pages (densely on ``dense_layers``), recorded in ``selected``.

    Attributes:
      cache: the dense :class:`models.cache.KVCache` (``C`` covers the whole sequence).
      page_keys: ``[L, B, Hkv, P, D]`` mean key of each page (valid once the page is full).
      budget: ``[B]`` int32 k (middle pages) of each row at this step.
      slot_offset: ``[B]`` int32 cache slot of each row's position 0 (its left padding).
      selected: ``[L, B, Hkv, K]`` int32 pages each layer attended to (``NO_PAGE`` everywhere
        on dense layers); filled by ``attend``.
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
    def position_offset(self) -> jax.Array:
        """The cache's write index."""
        return self.cache.index

    def check(self, config, batch: int, t: int, backend: str) -> None:
        """The cache fits, one token per row (``T == 1``), ``page_keys`` / ``selected``
        match the model, ``dense_layers`` name layers it has."""
        if t != 1:
            raise ValueError(f"PageSparseCache: page-sparse attention decodes one token per "
                             f"row (T=1), got T={t}")
        self.cache.check(config, batch, t, backend)
        check_shape("PageSparseCache.page_keys", self.page_keys, L=config.num_layers, B=batch,
                    Hkv=config.num_kv_heads, P=None, D=config.head_dim)
        check_shape("PageSparseCache.selected", self.selected, dtype=int, L=config.num_layers,
                    B=batch, Hkv=config.num_kv_heads, K=self.num_selected)
        if any(i >= config.num_layers for i in self.dense_layers):
            raise ValueError(f"PageSparseCache.dense_layers={self.dense_layers} names a layer "
                             f"the model ({config.num_layers} layers) does not have")

    def attend(self, layer, q, k, v, q_pos, backend):
        """Store the step's token, then attend to this layer's selected pages (``page_keys``
        is this layer's ``[B, Hkv, P, D]`` slice here)."""
        del backend  # one query per row: the gathered pages are one block
        cache = self.cache.store(layer, q, k, v, q_pos)
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
        """Advance the cache's write index."""
        return self.replace(cache=self.cache.end_forward(t))


def page_sparse_cache(cache: KVCache, page_keys: jax.Array, budget: jax.Array,
                      slot_offset: jax.Array, *, page_size: int, max_k: int,
                      dense_layers: tuple[int, ...]) -> PageSparseCache:
    """A :class:`PageSparseCache` for one decode step, its ``selected`` all ``NO_PAGE``."""
    n_layers, b, hkv, p, _ = page_keys.shape
    selected = jnp.full((n_layers, b, hkv, selected_slots(max_k, p)), NO_PAGE, jnp.int32)
    return PageSparseCache(cache=cache, page_keys=page_keys, budget=budget,
                           slot_offset=slot_offset, selected=selected, page_size=page_size,
                           max_k=max_k, dense_layers=tuple(dense_layers))


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
