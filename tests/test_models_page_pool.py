"""The page pool (``models.page_pool``) against the paged cache (``models.paged_cache``, itself
tested against NumPy attention): the same forwards, each row's logical pages mapped to
scattered pool pages only as it fills them, give the same attention bit for bit (chunked and
reference backends), and Sparrow over the pool selects and reads the same pages as over the
paged cache; a prefilled paged cache put into the pool reads the same; unmapped pages take
no writes; and the inputs it rejects."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.kv_view import join_layers, split_layers
from models.page_pool import init_page_pool
from models.page_sparse import page_sparse_cache
from models.paged_cache import init_paged_cache
from test_models_paged_cache import LAYER, B, D, L, _config, _forward


def _steps(rng, width, lengths, steps, hq, hkv):
    """``(q, k, v, q_pos)`` of a left-padded prefill of ``width`` columns, then ``steps``."""
    q_pos = np.where(np.arange(width) >= width - lengths[:, None],
                     np.arange(width) - (width - lengths[:, None]), -1).astype(np.int32)
    nxt = lengths.copy()
    for i, t in enumerate([width] + steps):
        if i:
            q_pos = (nxt[:, None] + np.arange(t)).astype(np.int32)
            nxt = nxt + t
        q = rng.normal(size=(B, t, hq, D)).astype(np.float32)
        k, v = (rng.normal(size=(B, hkv, t, D)).astype(np.float32) for _ in range(2))
        yield q, k, v, q_pos


@pytest.mark.parametrize("backend", ["blockwise", "reference"])
@pytest.mark.parametrize("page_size,chunk_pages,hq,hkv", [(4, 1, 4, 2), (4, 3, 4, 1),
                                                          (3, 2, 6, 2)])
def test_pool_attention_equals_the_paged_cache(page_size, chunk_pages, hq, hkv, backend):
    rng = np.random.default_rng(page_size + 7 * chunk_pages)
    cfg = _config(hq, hkv)
    width, steps, lengths = 7, [1, 1, 5, 1, 1], np.array([7, 3])
    max_len = width + sum(steps)
    r = -(-max_len // page_size)
    pool_pages = 2 * r + 3  # more pages than the rows hold: some are never mapped
    paged = init_paged_cache(L, B, hkv, max_len, D, page_size=page_size,
                             chunk_pages=chunk_pages)
    pool = init_page_pool(L, B, hkv, max_len, D, pool_pages, page_size=page_size,
                          chunk_pages=chunk_pages)
    assert pool.capacity == paged.capacity == r * page_size
    order = rng.permutation(pool_pages)  # row b's logical page p -> order[b * r + p]
    table = np.full((B, r), pool_pages, np.int32)
    for q, k, v, q_pos in _steps(rng, width, lengths, steps, hq, hkv):
        for b in range(B):  # map the pages this forward fills, no more
            held = -(-(int(q_pos[b].max()) + 1) // page_size)
            table[b, :held] = order[b * r:b * r + held]
        want, paged = _forward(paged, cfg, LAYER, q, k, v, q_pos, backend)
        got, pool = _forward(pool.replace(pages=jnp.asarray(table)), cfg, LAYER, q, k, v,
                             q_pos, backend)
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(pool.pos, paged.pos)
    # each mapped page ([Hkv, N, P, D] per layer) holds its logical page of the row; the
    # pages never mapped stay zero
    k_pool, k_paged = np.asarray(pool.k)[LAYER], np.asarray(paged.k)[LAYER]
    for b in range(B):
        for p in np.flatnonzero(table[b] < pool_pages):
            np.testing.assert_array_equal(
                k_pool[:, table[b, p]], k_paged[b, :, p * page_size:(p + 1) * page_size])
    assert not np.asarray(pool.k)[:, :, np.setdiff1d(np.arange(pool_pages), table)].any()


@jax.jit
def _attend(view, layer, q, k, v, q_pos):
    """One layer's ``attend`` (compiled once per view type and shapes)."""
    return view.attend(layer, q, k, v, q_pos, "blockwise")


def _all_layers(view, q_pos, tokens):
    """One forward of every layer through ``view`` as the decoder runs it (per-layer fields
    scanned): ``(outputs [L] of [B, T, Hq, D], view)``."""
    view = view.begin_forward(jnp.asarray(q_pos))
    carried, per_layer = split_layers(view)
    outs = []
    for layer, (q, k, v) in enumerate(tokens):
        one = {name: x[layer] for name, x in per_layer.items()}
        out, new = _attend(join_layers(carried, one), jnp.asarray(layer), jnp.asarray(q),
                           jnp.asarray(k), jnp.asarray(v), jnp.asarray(q_pos))
        carried = split_layers(new)[0]
        outs.append(np.asarray(out))
    return outs, join_layers(carried, per_layer).end_forward(q_pos.shape[1])


def test_sparrow_over_the_pool_selects_and_reads_as_over_the_paged_cache():
    rng = np.random.default_rng(5)
    hq, hkv, ps, max_len = 4, 2, 2, 24
    r = max_len // ps
    views = [page_sparse_cache(init, max_k=2, dense_layers=(0,)).replace(
        budget=jnp.asarray([2, 1], jnp.int32)) for init in (
        init_paged_cache(L, B, hkv, max_len, D, page_size=ps),
        init_page_pool(L, B, hkv, max_len, D, 2 * r, page_size=ps).replace(
            pages=jnp.asarray(rng.permutation(2 * r).reshape(B, r), jnp.int32)))]
    for _, _, _, q_pos in _steps(rng, 9, np.array([9, 4]), [1] * 8, hq, hkv):
        tokens = [(rng.normal(size=(B, q_pos.shape[1], hq, D)).astype(np.float32),
                   *(rng.normal(size=(B, hkv, q_pos.shape[1], D)).astype(np.float32)
                     for _ in range(2))) for _ in range(L)]
        (want, views[0]), (got, views[1]) = (_all_layers(v, q_pos, tokens) for v in views)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(views[1].selected, views[0].selected)
        np.testing.assert_array_equal(views[1].page_keys, views[0].page_keys)
    assert (np.asarray(views[1].selected)[1:] >= 0).sum() > 0  # sparse layers selected pages


def test_put_rows_copies_a_prefill_into_the_mapped_pages():
    rng = np.random.default_rng(1)
    hq, hkv, ps, max_len = 4, 2, 4, 14
    cfg = _config(hq, hkv)
    gen = _steps(rng, 6, np.array([6, 2]), [1], hq, hkv)
    paged = init_paged_cache(L, B, hkv, max_len, D, page_size=ps)
    _, paged = _forward(paged, cfg, LAYER, *next(gen))
    pool = init_page_pool(L, 3, hkv, max_len, D, 9, page_size=ps)  # 3 slots, 9 pages
    table = np.full((3, 4), 9, np.int32)
    table[2, :2], table[0, :1] = [5, 1], [7]  # slot 2 <- row 0, slot 0 <- row 1
    pool = pool.replace(pages=jnp.asarray(table))
    pool = pool.put_rows(paged.replace(index=jnp.full((B,), 6, jnp.int32)),
                         jnp.asarray([2, 0]))
    np.testing.assert_array_equal(pool.pos[2], paged.pos[0])
    np.testing.assert_array_equal(pool.pos[0], paged.pos[1])
    np.testing.assert_array_equal(pool.index, [6, 0, 6])
    np.testing.assert_array_equal(pool.k[:, :, 1], paged.k[:, 0, :, 4:8])
    np.testing.assert_array_equal(pool.v[:, :, 7], paged.v[:, 1, :, 0:4])
    # the next decode step reads the same through the pool as through the paged cache
    q, k, v, q_pos = next(gen)
    want, _ = _forward(paged, cfg, LAYER, q, k, v, q_pos)
    got, _ = _forward(pool.replace(pages=pool.pages[jnp.asarray([2, 0])],
                                   pos=pool.pos[jnp.asarray([2, 0])],
                                   index=pool.index[jnp.asarray([2, 0])]),
                      cfg, LAYER, q, k, v, q_pos)
    np.testing.assert_array_equal(got, want)


def test_pool_rejects_what_does_not_fit():
    cfg = _config(4, 2)
    pool = init_page_pool(L, B, 2, 10, D, 5, page_size=4)
    with pytest.raises(ValueError, match="exceeds capacity 12"):
        pool.check(cfg, B, 13, "blockwise")
    with pytest.raises(ValueError, match=r"PagePoolCache.pages: expected"):
        pool.check(cfg, B + 1, 1, "blockwise")
    with pytest.raises(ValueError, match=r"PagePoolCache.k: expected"):
        pool.check(_config(4, 4), B, 1, "blockwise")
    with pytest.raises(ValueError, match="num_pages=0 must be an int >= 1"):
        init_page_pool(L, B, 2, 10, D, 0)
    with pytest.raises(NotImplementedError, match="its own pages"):
        pool.repeat_rows(2)
