"""The attention math: the visibility rule and the three backends that compute it.

Visibility rule: key ``s`` is visible to the query at position ``t`` iff
``0 <= kpos[s] <= t`` (and ``t < expiry[s]`` when an eviction record is replayed, and the
key's page ``kpos[s] // page_size`` is one the query selected when a page-sparse rollout is
replayed), ANDed with an optional arbitrary boolean mask. Padding queries carry position
``-1`` and see nothing; such rows give a zero output instead of NaN.

The backends (selected by name through ``models.attention_backends.attention``, which
registers them with what each can attend over):

- :func:`blockwise_attention` (``"blockwise"``, the default): online-softmax attention in
  plain JAX over key blocks (and query blocks), the visibility computed per block from
  positions / expiry times, with a custom backward that recomputes each block. Neither the
  forward nor the backward holds a ``[T, S]`` score or mask array once ``T * S`` exceeds one
  block; exact for any positions. A page selection (``q_pages``) becomes mask rows one query
  block at a time.
- :func:`fused_attention` (``"fused"``): ``jax.nn.dot_product_attention`` with a causal +
  padding mask (cuDNN flash on GPU for half-precision inputs, XLA elsewhere). Valid only for a
  full forward whose rows are right-padded: keys are the queries and each row's positions are
  ``0, 1, ..., n - 1`` followed by ``-1`` padding. No expiry or extra mask.
- :func:`reference_attention` (``"reference"``): the naive einsum over all ``[T, S]`` pairs,
  the test oracle.

Array names in the score math carry their shape (``logits_BxKxGxTxS``): B rows, T queries
(of a block, inside the blockwise backend), S keys (likewise), K = Hkv KV heads, G query
heads per KV head, D head dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

_ONE_BLOCK_PAIRS = 2**20  # query x key pairs per (row, head) computed as a single block
_DEFAULT_BLOCK = 512


def visibility(
    q_pos: jax.Array,
    k_pos: jax.Array,
    k_expiry: jax.Array | None = None,
    mask: jax.Array | None = None,
    q_pages: jax.Array | None = None,
    page_size: int = 16,
) -> jax.Array:
    """Boolean ``[B, Hkv, T, S]``: which key each query may attend to.

    Args:
      q_pos: ``[B, T]`` int query positions (``-1`` = padding).
      k_pos: ``[B, Hkv, S]`` int key positions (``-1`` = empty/padding).
      k_expiry: optional ``[B, Hkv, S]`` int; key ``s`` is hidden from queries at ``t >= expiry``.
      mask: optional bool, broadcastable to ``[B, Hkv, T, S]``, ANDed in.
      q_pages, page_size: optional page selection, see :func:`page_visibility`.
    """
    qp = q_pos[:, None, :, None]
    kp = k_pos[:, :, None, :]
    visible = (kp >= 0) & (kp <= qp)
    if k_expiry is not None:
        visible &= qp < k_expiry[:, :, None, :]
    if mask is not None:
        visible &= mask
    if q_pages is not None:
        visible &= page_visibility(q_pages, k_pos, page_size)
    return visible


def page_visibility(q_pages: jax.Array, k_pos: jax.Array, page_size: int) -> jax.Array:
    """Boolean ``[B, Hkv, T, S]``: whether key ``s``'s page is among query ``t``'s pages.

    Args:
      q_pages: ``[B, Hkv, T, K]`` int page indices each query attends to (page ``p`` holds
        positions ``[p * page_size, (p + 1) * page_size)``); ``-1`` marks an unused slot, and a
        query with no page at all (``-1`` only) sees every page (a dense step).
      k_pos: ``[B, Hkv, S]`` int key positions, below ``S`` (so pages below
        ``ceil(S / page_size)``: true of a forward over its own tokens and of a dense cache);
        the page of a key with position ``-1`` is immaterial (the causal rule hides it).
      page_size: tokens per page (static).

    Costs ``[B, Hkv, T, ceil(S / page_size)]`` page flags, the scatter's ``[B, Hkv, T, K]``
    indices and the ``[B, Hkv, T, S]`` result: called per query block, the replay never holds
    more than one block of rows.
    """
    num_pages = -(-k_pos.shape[-1] // page_size)
    slot = jnp.where(q_pages >= 0, q_pages, num_pages)  # -1 -> out of range: dropped

    def page_flags(pages):  # [K] -> [P]
        return jnp.zeros((num_pages,), bool).at[pages].set(True, mode="drop")

    chosen = jax.vmap(jax.vmap(jax.vmap(page_flags)))(slot)  # [B, Hkv, T, P]
    page_of_key = jnp.maximum(k_pos, 0) // page_size  # [B, Hkv, S]
    # one gather of whole query columns per key: indices [B, Hkv, S], never [B, Hkv, T, S]
    seen = jax.vmap(jax.vmap(lambda flags_TxP, page_S: jnp.take(flags_TxP, page_S, axis=1)))(
        chosen, page_of_key)
    return seen | jnp.all(q_pages < 0, axis=-1)[..., None]


def masked_softmax(x: jax.Array, mask: jax.Array, axis: int = -1) -> jax.Array:
    """Softmax of ``x`` over the entries where ``mask`` holds (broadcast against ``x``); 0
    elsewhere and on rows with no such entry. Masked entries reach neither value nor gradient."""
    x = jnp.where(mask, x, -jnp.inf)
    peak = jnp.max(x, axis=axis, keepdims=True)
    peak = jax.lax.stop_gradient(jnp.where(jnp.isfinite(peak), peak, 0.0))
    e = jnp.where(mask, jnp.exp(x - peak), 0.0)
    total = jnp.sum(e, axis=axis, keepdims=True)
    return e / jnp.where(total > 0, total, 1.0)


def reference_attention(q, k, v, q_pos, k_pos, *, k_expiry=None, mask=None, q_pages=None,
                        page_size=16) -> jax.Array:
    """The naive einsum over every ``[T, S]`` pair (the oracle). Same contract as
    ``models.attention_backends.attention``."""
    b, t, hq, d = q.shape
    hkv = k.shape[1]
    q_BxTxKxGxD = q.reshape(b, t, hkv, hq // hkv, d)
    logits_BxKxGxTxS = jnp.einsum("btkgd,bksd->bkgts", q_BxTxKxGxD, k,
                                  preferred_element_type=jnp.float32) * (d ** -0.5)
    visible_BxKx1xTxS = visibility(q_pos, k_pos, k_expiry, mask, q_pages, page_size)[:, :, None]
    probs_BxKxGxTxS = masked_softmax(logits_BxKxGxTxS, visible_BxKx1xTxS)
    out_BxTxKxGxD = jnp.einsum("bkgts,bksd->btkgd", probs_BxKxGxTxS.astype(v.dtype), v)
    return out_BxTxKxGxD.reshape(b, t, hq, d).astype(q.dtype)


def fused_is_flash(dtype) -> bool:
    """Whether the ``"fused"`` backend runs cuDNN flash attention for ``dtype`` here (a GPU
    and half precision); elsewhere it is XLA's plain attention, which ``"blockwise"`` beats."""
    return jax.default_backend() == "gpu" and dtype in (jnp.bfloat16, jnp.float16)


def fused_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array) -> jax.Array:
    """Causal + padding attention through ``jax.nn.dot_product_attention``.

    Args:
      q: ``[B, T, Hq, D]``; k, v: ``[B, Hkv, T, D]`` (the same ``T`` tokens).
      q_pos: ``[B, T]`` right-padded positions ``0..n-1`` then ``-1`` (not checked: it is the
        caller's layout contract; other layouts need ``"blockwise"``).

    Returns:
      ``[B, T, Hq, D]`` in ``q.dtype``; zero on padding queries.
    """
    if k.shape[2] != q.shape[1]:
        raise ValueError(f"fused attention needs keys == queries, got T={q.shape[1]} queries "
                         f"and S={k.shape[2]} keys")
    lengths = jnp.sum(q_pos >= 0, axis=1, dtype=jnp.int32)
    implementation = "cudnn" if fused_is_flash(q.dtype) else None
    out = jax.nn.dot_product_attention(
        q, k.swapaxes(1, 2).astype(q.dtype), v.swapaxes(1, 2).astype(q.dtype), is_causal=True,
        query_seq_lengths=lengths, key_value_seq_lengths=lengths, implementation=implementation)
    return jnp.where((q_pos >= 0)[:, :, None, None], out, 0).astype(q.dtype)


def _block_visibility(q_pos, k_pos, k_expiry, mask):
    """``[B, Hkv, 1, Tq, Sk]`` visibility of one query block x key block."""
    return visibility(q_pos, k_pos, k_expiry, mask)[:, :, None]


def _scores(qg, kb, scale):
    """``qg [B, Hkv, G, Tq, D]``, ``kb [B, Hkv, Sk, D]`` -> fp32 ``[B, Hkv, G, Tq, Sk]``."""
    return jnp.einsum("bkgtd,bksd->bkgts", qg, kb, preferred_element_type=jnp.float32) * scale


def _split_blocks(x, axis, size):
    """Cut ``axis`` of ``x`` into blocks of ``size``: blocks become the new leading axis."""
    n = x.shape[axis] // size
    x = x.reshape(x.shape[:axis] + (n, size) + x.shape[axis + 1:])
    return jnp.moveaxis(x, axis, 0)


def _join_blocks(x, axis):
    """Inverse of :func:`_split_blocks` (``x``'s leading axis holds the blocks)."""
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 2:])


def blockwise_attention(q, k, v, q_pos, k_pos, *, k_expiry=None, mask=None, q_pages=None,
                        page_size=16, block_size=None):
    """Online-softmax attention over query x key blocks; same contract as
    ``models.attention_backends.attention``.

    Queries and keys are padded to multiples of ``block_size`` (padding keys and queries get
    position ``-1``) and processed block by block; blocks with no visible pair are skipped.
    ``block_size=None``: the whole problem is one block while ``T * S <= 2**20``, else 512
    (anything but None or a positive int: ValueError).
    """
    if block_size is not None and (not isinstance(block_size, int) or block_size < 1):
        raise ValueError(f"attention: block_size must be None or a positive int, "
                         f"got {block_size!r}")
    b, t, hq, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    g = hq // hkv
    if block_size is None:
        block_size = max(t, s) if t * s <= _ONE_BLOCK_PAIRS else _DEFAULT_BLOCK
    bq, bk = min(block_size, t), min(block_size, s)
    pad_t, pad_s = -t % bq, -s % bk
    qg = jnp.pad(q.reshape(b, t, hkv, g, d), ((0, 0), (0, pad_t), (0, 0), (0, 0), (0, 0)))
    qg = qg.transpose(0, 2, 3, 1, 4)  # [B, Hkv, G, T', D]
    q_pos = jnp.pad(q_pos.astype(jnp.int32), ((0, 0), (0, pad_t)), constant_values=-1)
    k = jnp.pad(k, ((0, 0), (0, 0), (0, pad_s), (0, 0)))
    v = jnp.pad(v, ((0, 0), (0, 0), (0, pad_s), (0, 0)))
    k_pos = jnp.pad(k_pos.astype(jnp.int32), ((0, 0), (0, 0), (0, pad_s)), constant_values=-1)
    if k_expiry is not None:
        k_expiry = jnp.pad(k_expiry.astype(jnp.int32), ((0, 0), (0, 0), (0, pad_s)))
    if mask is not None:
        mask = jnp.broadcast_to(mask, (b, hkv, t, s))
        mask = jnp.pad(mask, ((0, 0), (0, 0), (0, pad_t), (0, pad_s)))
    if q_pages is not None:
        q_pages = jnp.pad(q_pages.astype(jnp.int32), ((0, 0), (0, 0), (0, pad_t), (0, 0)),
                          constant_values=-1)
    out = _flash(qg, k, v, q_pos, k_pos, k_expiry, mask, q_pages, bq, bk, page_size)
    out = out.transpose(0, 3, 1, 2, 4)[:, :t].reshape(b, t, hq, d)
    return out.astype(q.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10))
def _flash(qg, k, v, q_pos, k_pos, k_expiry, mask, q_pages, bq, bk, page_size):
    """``qg [B, Hkv, G, T, D]`` (T a multiple of ``bq``), ``k, v [B, Hkv, S, D]`` (S a multiple
    of ``bk``) -> fp32 ``[B, Hkv, G, T, D]``."""
    return _flash_forward(qg, k, v, q_pos, k_pos, k_expiry, mask, q_pages, bq, bk, page_size)[0]


def _key_blocks(k, v, k_pos, k_expiry, mask_rows, bk):
    """Key-block views for ``lax.scan`` (each leading axis indexes a key block), the mask
    rows of the current query block included."""
    return (_split_blocks(k, 2, bk), _split_blocks(v, 2, bk), _split_blocks(k_pos, 2, bk),
            None if k_expiry is None else _split_blocks(k_expiry, 2, bk),
            None if mask_rows is None else _split_blocks(mask_rows, 3, bk))


def _query_blocks(qg, q_pos, mask, q_pages, bq):
    """Query-block views for ``lax.scan``/``lax.map``; ``mask`` (if any) stays whole."""
    return (_split_blocks(qg, 3, bq), _split_blocks(q_pos, 1, bq),
            None if mask is None else _split_blocks(mask, 2, bq),
            None if q_pages is None else _split_blocks(q_pages, 2, bq))


def _block_mask_rows(mask_rows, page_rows, k_pos, page_size):
    """One query block's mask rows ``[B, Hkv, Tq, S]`` (or None): the given rows ANDed with
    the block's page selection ``page_rows [B, Hkv, Tq, K]`` expanded over the keys."""
    if page_rows is None:
        return mask_rows
    seen = page_visibility(page_rows, k_pos, page_size)
    return seen if mask_rows is None else mask_rows & seen


def _scan(step, init, xs):
    """``lax.scan(step, init, xs)``, called directly when there is a single block (keeps the
    one-block case, e.g. every decode step, free of loop structure)."""
    if jax.tree.leaves(xs)[0].shape[0] > 1:
        return jax.lax.scan(step, init, xs)
    carry, y = step(init, jax.tree.map(lambda x: x[0], xs))
    return carry, jax.tree.map(lambda x: x[None], y)


def _skip_empty(visible, compute, carry):
    """``compute(carry)`` unless no pair of the block is visible (then ``carry``)."""
    return jax.lax.cond(jnp.any(visible), compute, lambda c: c, carry)


def online_softmax_init(rows: tuple[int, ...], d: int) -> tuple[jax.Array, ...]:
    """The empty online-softmax carry of ``rows`` query rows (e.g. ``[B, Hkv, G, T]``):
    running max ``-inf``, running sum 0 and accumulator ``rows + [D]`` 0, all fp32."""
    return (jnp.full(rows, -jnp.inf, jnp.float32), jnp.zeros(rows, jnp.float32),
            jnp.zeros(rows + (d,), jnp.float32))


def online_softmax_step(carry, qg, kb, vb, visible, scale):
    """Fold one key block into the online-softmax carry.

    Args:
      carry: ``(max [B, Hkv, G, T], sum [B, Hkv, G, T], acc [B, Hkv, G, T, D])`` fp32.
      qg: ``[B, Hkv, G, T, D]`` queries; kb, vb: ``[B, Hkv, S, D]`` the block's keys/values.
      visible: bool broadcastable to ``[B, Hkv, G, T, S]``.
      scale: the logit scale (``D ** -0.5``).
    """
    m_BxKxGxT, l_BxKxGxT, acc_BxKxGxTxD = carry
    logits_BxKxGxTxS = jnp.where(visible, _scores(qg, kb, scale), -jnp.inf)
    m_new = jnp.maximum(m_BxKxGxT, jnp.max(logits_BxKxGxTxS, axis=-1))
    shift_BxKxGxT = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p_BxKxGxTxS = jnp.exp(logits_BxKxGxTxS - shift_BxKxGxT[..., None])
    corr_BxKxGxT = jnp.exp(m_BxKxGxT - shift_BxKxGxT)
    pv_BxKxGxTxD = jnp.einsum("bkgts,bksd->bkgtd", p_BxKxGxTxS.astype(vb.dtype), vb,
                              preferred_element_type=jnp.float32)
    return (m_new, l_BxKxGxT * corr_BxKxGxT + jnp.sum(p_BxKxGxTxS, axis=-1),
            acc_BxKxGxTxD * corr_BxKxGxT[..., None] + pv_BxKxGxTxD)


def online_softmax_finish(carry) -> tuple[jax.Array, jax.Array]:
    """``(out [B, Hkv, G, T, D], lse [B, Hkv, G, T])`` fp32 from a finished carry: zero output
    and ``lse = inf`` on rows that saw no key."""
    m, l, acc = carry
    seen = l > 0
    out = acc / jnp.where(seen, l, 1.0)[..., None]
    lse = jnp.where(seen, jnp.where(jnp.isfinite(m), m, 0.0) + jnp.log(jnp.where(seen, l, 1.0)),
                    jnp.inf)
    return out, lse


def _flash_forward(qg, k, v, q_pos, k_pos, k_expiry, mask, q_pages, bq, bk, page_size):
    """Forward: output fp32 ``[B, Hkv, G, T, D]`` and row log-sum-exp ``[B, Hkv, G, T]``."""
    d = qg.shape[-1]
    scale = d ** -0.5
    many = k.shape[2] > bk or qg.shape[3] > bq

    def one_query_block(qblock):
        qb, qp, mask_rows, page_rows = qblock
        mask_rows = _block_mask_rows(mask_rows, page_rows, k_pos, page_size)

        def step(carry, key_block):
            kb, vb, kp, ke, mb = key_block
            visible = _block_visibility(qp, kp, ke, mb)

            def compute(carry):
                return online_softmax_step(carry, qb, kb, vb, visible, scale)

            return (_skip_empty(visible, compute, carry) if many else compute(carry)), None

        keys = _key_blocks(k, v, k_pos, k_expiry, mask_rows, bk)
        carry, _ = _scan(step, online_softmax_init(qb.shape[:4], d), keys)
        return None, online_softmax_finish(carry)

    queries = _query_blocks(qg, q_pos, mask, q_pages, bq)
    _, (out, lse) = _scan(lambda _, qblock: one_query_block(qblock), None, queries)
    return _join_blocks(out, 3), _join_blocks(lse, 3)


def _flash_fwd(qg, k, v, q_pos, k_pos, k_expiry, mask, q_pages, bq, bk, page_size):
    out, lse = _flash_forward(qg, k, v, q_pos, k_pos, k_expiry, mask, q_pages, bq, bk,
                              page_size)
    return out, (qg, k, v, q_pos, k_pos, k_expiry, mask, q_pages, out, lse)


def _flash_bwd(bq, bk, page_size, residuals, d_out):
    """Recompute each block's probabilities from the saved log-sum-exp (no ``[T, S]`` kept)."""
    qg, k, v, q_pos, k_pos, k_expiry, mask, q_pages, out, lse = residuals
    d = qg.shape[-1]
    scale = d ** -0.5
    d_out = d_out.astype(jnp.float32)
    delta = jnp.sum(d_out * out, axis=-1)  # [B, Hkv, G, T]
    many = k.shape[2] > bk or qg.shape[3] > bq
    queries = _query_blocks(qg, q_pos, mask, q_pages, bq) + (
        _split_blocks(d_out, 3, bq), _split_blocks(delta, 3, bq), _split_blocks(lse, 3, bq))

    def one_query_block(dkv, qblock):
        qb, qp, mask_rows, page_rows, dob, deltab, lseb = qblock
        mask_rows = _block_mask_rows(mask_rows, page_rows, k_pos, page_size)
        keys = _key_blocks(k, v, k_pos, k_expiry, mask_rows, bk)

        def step(dq, key_block):
            kb, vb, kp, ke, mb = key_block
            visible = _block_visibility(qp, kp, ke, mb)

            def compute(_):
                logits_BxKxGxTxS = _scores(qb, kb, scale)
                p_BxKxGxTxS = jnp.where(visible, jnp.exp(logits_BxKxGxTxS - lseb[..., None]), 0.0)
                dv_BxKxSxD = jnp.einsum("bkgts,bkgtd->bksd", p_BxKxGxTxS, dob)
                dp_BxKxGxTxS = jnp.einsum("bkgtd,bksd->bkgts", dob, vb,
                                          preferred_element_type=jnp.float32)
                ds_BxKxGxTxS = p_BxKxGxTxS * (dp_BxKxGxTxS - deltab[..., None]) * scale
                dq_BxKxGxTxD = jnp.einsum("bkgts,bksd->bkgtd", ds_BxKxGxTxS, kb,
                                          preferred_element_type=jnp.float32)
                dk_BxKxSxD = jnp.einsum("bkgts,bkgtd->bksd", ds_BxKxGxTxS, qb,
                                        preferred_element_type=jnp.float32)
                return dq_BxKxGxTxD, dk_BxKxSxD, dv_BxKxSxD

            zeros = (jnp.zeros(dq.shape, jnp.float32), jnp.zeros(kb.shape, jnp.float32),
                     jnp.zeros(vb.shape, jnp.float32))
            dq_add, dk, dv = _skip_empty(visible, compute, zeros) if many else compute(zeros)
            return dq + dq_add, (dk, dv)

        dq, (dk, dv) = _scan(step, jnp.zeros(qb.shape, jnp.float32), keys)
        dk_all, dv_all = dkv
        return (dk_all + _join_blocks(dk, 2), dv_all + _join_blocks(dv, 2)), dq

    init = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    (dk, dv), dq = _scan(one_query_block, init, queries)
    return (_join_blocks(dq, 3).astype(qg.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
            None, None, None, None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)
