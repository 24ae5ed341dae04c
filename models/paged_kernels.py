"""Pallas kernels for decode attention over KV pages read in place through page tables.

Written here rather than wrapping JAX's own kernels, because neither takes what our decode
needs:

- ``jax.experimental.pallas.ops.gpu.paged_attention`` masks keys by a per-row length only.
  Our caches need per-key visibility: every slot carries the original position of its token
  (``-1`` empty, evicted or padding), so a key is visible iff ``0 <= pos <= q_pos``; pool
  rows have empty slots inside their pages and Sparrow's tables name a few pages out of
  order, per KV head. Its block table is also one per row, shared by every KV head.
- ``jax.experimental.pallas.ops.tpu.ragged_paged_attention`` masks by lengths as well and
  wants pages ``[N, page_size, 2 * Hkv, D]`` (K and V interleaved by head): feeding it our
  ``[Hkv, N, page_size, D]`` pages would cost a transpose of the KV per step, the pass the
  kernel is there to save.

Both kernels below share one layout and one online-softmax fold (:func:`_fold`, fp32):

- pages ``k_pages, v_pages [L, Hp, N, page_size, D]``: every layer's pages (the layer is read
  in place, no per-layer slice is copied); ``Hp = Hkv`` (a page pool: head ``h`` reads
  ``[:, h]``) or ``Hp = 1`` (the head is folded into the page id, as in the static paged
  cache's ``[L, B, Hkv, C, D]`` buffers seen as ``[L, 1, B * Hkv * C / page_size, ...]``);
- ``tables [B, Ht, R]`` int32 page ids (``Ht`` 1 = shared by the KV heads, or ``Hkv``): an
  id outside ``[0, N)`` names no page (its keys are never visible);
- ``pos [B, Hs, R, page_size]`` int32 original position of each table slot (``-1`` empty),
  ``Hs`` 1 or ``Hkv``;
- ``live [B]`` int32: table entries ``[0, live)`` are read (ragged rows: the trip count);
- quantized pages (``models.kv_quant``; the GPU kernel, ``int8`` and ``fp8``): the pages hold
  codes and ``[L, Hp, N, page_size]`` scale pages sit beside them; each page is decoded
  (codes times its slots' scales, in the query's dtype) as it is read, as the XLA path does;
- the ``G = Hq / Hkv`` query heads of a KV head and the ``T`` queries of a row are the rows
  of one query block (padded to a power of two >= 16 with position ``-1``), so each page is
  read once per KV head, not once per query head (GQA).

``"gpu"`` (Triton): one program per (row, KV head) looping over the row's live pages.
``"tpu"`` (Mosaic): a grid over (row, KV head, table entry) whose page block is chosen by the
index map from the scalar-prefetched table (entries past ``live`` repeat the last page, which
the pipeline does not fetch again), accumulating in VMEM scratch. Elsewhere both run in
Pallas interpret mode, the tests' way of checking them against the XLA path.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

MIN_QUERY_ROWS = 16  # a Triton dot needs >= 16 rows


def _fold(carry, q_MxD, k_PxD, v_PxD, visible_MxP, scale):
    """Fold one page into the fp32 online-softmax carry ``(max [M, 1], sum [M, 1], acc [M,
    D])``; invisible keys reach neither the max nor the sums."""
    m_Mx1, l_Mx1, acc_MxD = carry
    dims = (((1,), (1,)), ((), ()))
    logits_MxP = jax.lax.dot_general(q_MxD, k_PxD, dims,
                                     preferred_element_type=jnp.float32) * scale
    logits_MxP = jnp.where(visible_MxP, logits_MxP, -jnp.inf)
    m_new = jnp.maximum(m_Mx1, jnp.max(logits_MxP, axis=1, keepdims=True))
    shift_Mx1 = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p_MxP = jnp.exp(logits_MxP - shift_Mx1)
    corr_Mx1 = jnp.exp(m_Mx1 - shift_Mx1)
    pv_MxD = jax.lax.dot_general(p_MxP.astype(v_PxD.dtype), v_PxD, (((1,), (0,)), ((), ())),
                                 preferred_element_type=jnp.float32)
    return (m_new, l_Mx1 * corr_Mx1 + jnp.sum(p_MxP, axis=1, keepdims=True),
            acc_MxD * corr_Mx1 + pv_MxD)


def _finish(l_Mx1, acc_MxD):
    """The softmax-weighted values; zero on rows that saw no key."""
    return jnp.where(l_Mx1 > 0, acc_MxD / jnp.where(l_Mx1 > 0, l_Mx1, 1.0), 0.0)


def _visible(page, num_pages, pos_1xP, qpos_Mx1):
    """``[M, P]`` which keys of one table entry each query row sees."""
    named = (page >= 0) & (page < num_pages)
    return named & (pos_1xP >= 0) & (pos_1xP <= qpos_Mx1)


def _head(h, heads: int):
    """The index along an axis of ``heads`` KV heads (1: shared) that KV head ``h`` reads."""
    return h if heads > 1 else 0


def _table_entry(i, h, e, table_heads: int, entries: int):
    """Where entry ``e`` of row ``i``'s table for KV head ``h`` sits in the flat tables."""
    return (i * table_heads + _head(h, table_heads)) * entries + e


def _gpu_kernel(layer_ref, live_ref, q_ref, qpos_ref, tables_ref, pos_ref, k_ref, v_ref,
                *refs, page_heads, scale):
    """One (row, KV head): fold its ``live`` table entries' pages, one page at a time;
    ``refs``: ``(o_ref,)``, or ``(k_scale_ref, v_scale_ref, o_ref)`` for quantized pages
    (codes times each slot's scale, in the query's dtype, as ``models.kv_quant`` decodes)."""
    *scales, o_ref = refs
    hp = _head(pl.program_id(1), page_heads)
    layer, num_pages = layer_ref[0], k_ref.shape[2]
    q_MxD, qpos_Mx1 = q_ref[...], qpos_ref[...]
    rows, d = q_MxD.shape

    def page_of(ref, scale_ref, at):
        if scale_ref is None:
            return ref[layer, hp, at]
        codes_PxD = ref[layer, hp, at].astype(jnp.float32)
        return (codes_PxD * scale_ref[layer, hp, at].astype(jnp.float32)[:, None]
                ).astype(q_MxD.dtype)

    k_scale_ref, v_scale_ref = scales or (None, None)

    def body(r, carry):
        page = tables_ref[r]
        at = jnp.clip(page, 0, num_pages - 1)
        visible_MxP = _visible(page, num_pages, pos_ref[pl.ds(r, 1), :], qpos_Mx1)
        return _fold(carry, q_MxD, page_of(k_ref, k_scale_ref, at),
                     page_of(v_ref, v_scale_ref, at), visible_MxP, scale)

    init = (jnp.full((rows, 1), -jnp.inf, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
            jnp.zeros((rows, d), jnp.float32))
    _, l_Mx1, acc_MxD = jax.lax.fori_loop(0, live_ref[0], body, init)
    o_ref[...] = _finish(l_Mx1, acc_MxD).astype(o_ref.dtype)


def _gpu_call(layer, live, q, qpos, tables, pos, k_pages, v_pages, *scales, interpret):
    """``pallas_call`` of :func:`_gpu_kernel` over a (row, KV head) grid (``scales``: the
    ``[L, Hp, N, page_size]`` scale pages of quantized ``k_pages, v_pages``, or none)."""
    b, hkv, rows, d = q.shape
    _, hp, n, ps, _ = k_pages.shape
    ht, hs, r = tables.shape[1], pos.shape[1], tables.shape[2]
    kernel = functools.partial(_gpu_kernel, page_heads=hp, scale=d ** -0.5)
    return pl.pallas_call(
        kernel, grid=(b, hkv),
        in_specs=[
            pl.BlockSpec((1,), lambda i, h: (0,)),
            pl.BlockSpec((None, 1), lambda i, h: (i, 0)),
            pl.BlockSpec((None, None, rows, d), lambda i, h: (i, h, 0, 0)),
            pl.BlockSpec((None, rows, 1), lambda i, h: (i, 0, 0)),
            pl.BlockSpec((None, None, r), lambda i, h: (i, _head(h, ht), 0)),
            pl.BlockSpec((None, None, r, ps), lambda i, h: (i, _head(h, hs), 0, 0)),
            pl.BlockSpec(k_pages.shape, lambda i, h: (0, 0, 0, 0, 0)),
            pl.BlockSpec(v_pages.shape, lambda i, h: (0, 0, 0, 0, 0)),
            *(pl.BlockSpec(x.shape, lambda i, h: (0, 0, 0, 0)) for x in scales),
        ],
        out_specs=pl.BlockSpec((None, None, rows, d), lambda i, h: (i, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype), interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),  # Triton, not
    )(layer, live[:, None], q, qpos, tables, pos, k_pages, v_pages, *scales)  # Mosaic GPU


def _tpu_kernel(layer_ref, tables_ref, live_ref, q_ref, qpos_ref, pos_ref, k_ref, v_ref, o_ref,
                m_ref, l_ref, acc_ref, *, table_heads, num_pages, scale):
    """One table entry of one (row, KV head): fold its page (fetched by the index map) into
    the VMEM carry; write the output after the last entry."""
    del layer_ref
    i, h, r = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    entries = pl.num_programs(2)

    @pl.when(r == 0)
    def _():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(r < live_ref[i])
    def _():
        page = tables_ref[_table_entry(i, h, r, table_heads, entries)]
        visible_MxP = _visible(page, num_pages, pos_ref[pl.ds(r, 1), :], qpos_ref[...])
        m, l, acc = _fold((m_ref[...], l_ref[...], acc_ref[...]), q_ref[...], k_ref[...],
                          v_ref[...], visible_MxP, scale)
        m_ref[...], l_ref[...], acc_ref[...] = m, l, acc

    @pl.when(r == entries - 1)
    def _():
        o_ref[...] = _finish(l_ref[...], acc_ref[...]).astype(o_ref.dtype)


def _tpu_call(layer, live, q, qpos, tables, pos, k_pages, v_pages, *, interpret):
    """``pallas_call`` of :func:`_tpu_kernel` over a (row, KV head, table entry) grid with the
    layer, the flattened tables and ``live`` prefetched as scalars (unquantized pages only:
    ``PageKernel.quants``)."""
    b, hkv, rows, d = q.shape
    _, hp, n, ps, _ = k_pages.shape
    ht, hs, r = tables.shape[1], pos.shape[1], tables.shape[2]

    def page_block(i, h, e, layer_ref, tables_ref, live_ref):
        last = jnp.maximum(jnp.minimum(e, live_ref[i] - 1), 0)  # past live: no new fetch
        page = tables_ref[_table_entry(i, h, last, ht, r)]
        return layer_ref[0], _head(h, hp), jnp.clip(page, 0, n - 1), 0, 0

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3, grid=(b, hkv, r),
        in_specs=[
            pl.BlockSpec((None, None, rows, d), lambda i, h, e, *_: (i, h, 0, 0)),
            pl.BlockSpec((None, rows, 1), lambda i, h, e, *_: (i, 0, 0)),
            pl.BlockSpec((None, None, r, ps),
                         lambda i, h, e, *_: (i, _head(h, hs), 0, 0)),
            pl.BlockSpec((None, None, None, ps, d), page_block),
            pl.BlockSpec((None, None, None, ps, d), page_block),
        ],
        out_specs=pl.BlockSpec((None, None, rows, d), lambda i, h, e, *_: (i, h, 0, 0)),
        scratch_shapes=[pltpu.VMEM((rows, 1), jnp.float32), pltpu.VMEM((rows, 1), jnp.float32),
                        pltpu.VMEM((rows, d), jnp.float32)])
    kernel = functools.partial(_tpu_kernel, table_heads=ht, num_pages=n, scale=d ** -0.5)
    return pl.pallas_call(
        kernel, grid_spec=grid_spec, out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        interpret=interpret,
    )(layer, tables.reshape(-1), live, q, qpos, pos, k_pages, v_pages)


@dataclasses.dataclass(frozen=True)
class PageKernel:
    """One of the kernels and the shapes its compiler takes.

    Attributes:
      platform: the JAX platform it is compiled for (elsewhere it runs interpreted).
      call: ``call(layer, live, q, qpos, tables, pos, k_pages, v_pages, [k_scales,
        v_scales,] *, interpret)``.
      page_multiple, head_dim_multiple: ``page_size`` and ``head_dim`` must be multiples.
      power_of_two: ``page_size`` and ``head_dim`` must also be powers of two (Triton).
      quants: the ``models.kv_quant`` formats of the pages it reads (codes with a scale page
        beside them; not ``int4``, whose nibbles it does not unpack).
    """

    platform: str
    call: Callable[..., jax.Array]
    page_multiple: int
    head_dim_multiple: int
    power_of_two: bool
    quants: tuple[str, ...] = ("none",)

    def shape_error(self, page_size: int, num_q_heads: int, num_kv_heads: int,
                    head_dim: int, quant: str = "none") -> str | None:
        """Why the kernel cannot take these shapes, or pages stored as ``quant`` (a
        ``models.kv_quant`` format, one of :attr:`quants`), None: it can."""
        problems = [f"{name}={value} (needs a multiple of {multiple}"
                    + (", a power of two)" if self.power_of_two else ")")
                    for name, value, multiple in (("page_size", page_size, self.page_multiple),
                                                  ("head_dim", head_dim, self.head_dim_multiple))
                    if value % multiple or (self.power_of_two and value & (value - 1))]
        if num_kv_heads < 1 or num_q_heads % num_kv_heads:
            problems.append(f"num_q_heads={num_q_heads} not a multiple of "
                            f"num_kv_heads={num_kv_heads}")
        if quant not in self.quants:
            problems.append(f"compression.quant={quant!r} (quant levels the {self.platform} "
                            f"page kernel reads: {self.quants}; the XLA path reads every "
                            f"level)")
        return "; ".join(problems) or None


KERNELS = {  # by name; Triton dots need >= 16 along every axis, Mosaic (8, 128) tiles
    "gpu": PageKernel("gpu", _gpu_call, page_multiple=16, head_dim_multiple=16,
                      power_of_two=True, quants=("none", "int8", "fp8")),
    "tpu": PageKernel("tpu", _tpu_call, page_multiple=8, head_dim_multiple=128,
                      power_of_two=False),
}


def paged_kernel_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                           layer: jax.Array, tables: jax.Array, pos: jax.Array,
                           q_pos: jax.Array, live: jax.Array, *, kernel: str,
                           interpret: bool | None = None,
                           scales: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
    """Attention of ``q`` over the pages each row's table names, read in place by a Pallas
    kernel (see the module docstring for the layout).

    Args:
      q: ``[B, T, Hq, D]`` queries (after RoPE), ``Hq`` a multiple of ``Hkv``; q_pos ``[B,
        T]`` their positions (``-1`` padding: zero output).
      k_pages, v_pages: ``[L, Hp, N, page_size, D]``, ``Hp`` 1 or ``Hkv``.
      layer: ``[]`` int the layer to read.
      tables: ``[B, Ht, R]`` int32 page ids (outside ``[0, N)``: none), ``Ht`` 1 or ``Hkv``.
      pos: ``[B, Hs, R * page_size]`` int32 original position of each table slot (``-1``
        empty), ``Hs`` 1 or ``Hkv``.
      live: ``[B]`` int entries ``[0, live)`` of each row are read (at most ``R``).
      kernel: a name in :data:`KERNELS` (``"gpu"``, ``"tpu"``).
      interpret: Pallas interpret mode; None = unless JAX's default platform is ``kernel``.
      scales: ``(k_scales, v_scales)`` ``[L, Hp, N, page_size]`` when the pages hold
        quantized codes (``models.kv_quant``, a level in the kernel's ``quants``); None:
        the pages are keys and values.

    Returns:
      ``[B, T, Hq, D]`` in ``q.dtype``.
    """
    if kernel not in KERNELS:
        raise ValueError(f"paged_kernel_attention: kernel must be one of {tuple(KERNELS)}, "
                         f"got {kernel!r}")
    b, t, hq, d = q.shape
    _, hp, _, ps, _ = k_pages.shape
    r = tables.shape[2]
    hkv = max(hp, tables.shape[1], pos.shape[1])  # any per-head operand sets Hkv
    for name, x, heads in (("k_pages", k_pages, hp), ("tables", tables, tables.shape[1]),
                           ("pos", pos, pos.shape[1])):
        if heads not in (1, hkv) or hq % hkv:
            raise ValueError(f"paged_kernel_attention: {name} {x.shape} has {heads} KV heads: "
                             f"need 1 or Hkv={hkv}, a divisor of Hq={hq}")
    if pos.shape != (b, pos.shape[1], r * ps):
        raise ValueError(f"paged_kernel_attention: pos {pos.shape} must be [B={b}, Hs, "
                         f"R * page_size={r * ps}]")
    g = hq // hkv
    rows = max(MIN_QUERY_ROWS, pl.next_power_of_2(t * g))
    q_BxKxMxD = q.reshape(b, t, hkv, g, d).transpose(0, 2, 1, 3, 4).reshape(b, hkv, t * g, d)
    q_BxKxMxD = jnp.pad(q_BxKxMxD, ((0, 0), (0, 0), (0, rows - t * g), (0, 0)))
    qpos_BxMx1 = jnp.pad(jnp.repeat(q_pos.astype(jnp.int32), g, axis=1),
                         ((0, 0), (0, rows - t * g)), constant_values=-1)[..., None]
    if interpret is None:
        interpret = jax.default_backend() != kernel
    if scales is not None and KERNELS[kernel].quants == ("none",):
        raise ValueError(f"paged_kernel_attention: the {kernel} kernel reads unquantized "
                         f"pages only, got scale pages")
    out = KERNELS[kernel].call(
        jnp.asarray(layer, jnp.int32).reshape(1), jnp.clip(live, 0, r).astype(jnp.int32),
        q_BxKxMxD, qpos_BxMx1, tables.astype(jnp.int32),
        pos.astype(jnp.int32).reshape(b, pos.shape[1], r, ps), k_pages, v_pages,
        *(scales or ()), interpret=interpret)
    out = out[:, :, :t * g].reshape(b, hkv, t, g, d).transpose(0, 2, 1, 3, 4)
    return out.reshape(b, t, hq, d)
