"""Every KV view (``models.kv_view``) against a NumPy attention over the keys it must show:
the full-forward records (causal, expiry, mask, page replay), the slot cache (writes, query
ring, index) and the page-sparse cache (selection recomputed in NumPy). Each view is called
the way the decoder calls it: split into carried and per-layer parts, one layer's slice joined
back in."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.cache import init_cache
from models.config import ModelConfig
from models.kv_view import Causal, ExpiryRecord, MaskRecord, join_layers, split_layers
from models.page_sparse import NO_PAGE, PageReplay, page_sparse_cache
from models.paged_cache import init_paged_cache
from test_sparrow import np_select

L, B, HQ, HKV, D = 3, 2, 4, 2, 8
LAYER = 1
CFG = ModelConfig("llama", 64, HKV * D, 32, L, num_heads=HQ, num_kv_heads=HKV, head_dim=D)


def np_attention(q, k, v, visible):
    """``q [B, T, Hq, D]``, ``k, v [B, Hkv, S, D]``, ``visible [B, Hkv, T, S]`` -> softmax
    attention over the visible keys per query (zero where none), query head ``h`` reading KV
    head ``h // (Hq // Hkv)``."""
    b, t, hq, d = q.shape
    hkv = k.shape[1]
    out = np.zeros(q.shape, np.float64)
    for i, h, j in np.ndindex(b, hq, t):
        g = h // (hq // hkv)
        keys = np.flatnonzero(visible[i, g, j])
        if keys.size:
            logits = k[i, g, keys] @ q[i, j, h] / np.sqrt(d)
            p = np.exp(logits - logits.max())
            out[i, j, h] = (p / p.sum()) @ v[i, g, keys]
    return out


def call_layer(view, layer, q, k, v, q_pos, backend="blockwise"):
    """``view.attend`` as the decoder calls it at ``layer``, after ``begin_forward`` (per-layer
    fields sliced)."""
    view.check(CFG, q.shape[0], q.shape[1], backend)
    out, view = _jit_call_layer(view, layer, *map(jnp.asarray, (q, k, v, q_pos)), backend)
    return np.asarray(out), view


@functools.partial(jax.jit, static_argnames=("layer", "backend"))
def _jit_call_layer(view, layer, q, k, v, q_pos, backend):
    carried, per_layer = split_layers(view.begin_forward(q_pos))
    one = {name: x[layer] for name, x in per_layer.items()}
    out, new = join_layers(carried, one).attend(jnp.asarray(layer), q, k, v, q_pos, backend)
    return out, join_layers(split_layers(new)[0], per_layer)


def _tokens(rng, t):
    q = rng.normal(size=(B, t, HQ, D)).astype(np.float32)
    k, v = (rng.normal(size=(B, HKV, t, D)).astype(np.float32) for _ in range(2))
    return q, k, v


def _causal(q_pos):
    """``[B, Hkv, T, T]`` causal + padding visibility of a full forward."""
    qp, kp = q_pos[:, None, :, None], q_pos[:, None, None, :]
    return np.broadcast_to((kp >= 0) & (kp <= qp), (B, HKV) + (q_pos.shape[1],) * 2)


@pytest.mark.parametrize("backend", ["blockwise", "reference"])
def test_full_forward_views_equal_numpy(backend):
    rng = np.random.default_rng(0)
    t, ps = 9, 2
    q, k, v = _tokens(rng, t)
    q_pos = np.stack([np.arange(t), np.r_[-1, -1, np.arange(t - 2)]]).astype(np.int32)
    causal = _causal(q_pos)
    cases = []
    out, view = call_layer(Causal(), LAYER, q, k, v, q_pos, backend)
    cases.append((out, causal))

    expiry = rng.integers(0, 12, (L, B, HKV, t)).astype(np.int32)
    out, view = call_layer(ExpiryRecord(jnp.asarray(expiry)), LAYER, q, k, v, q_pos, backend)
    np.testing.assert_array_equal(np.asarray(view.expiry), expiry)  # the record comes back whole
    cases.append((out, causal & (q_pos[:, None, :, None] < expiry[LAYER][:, :, None, :])))

    mask = rng.random((L, B, HKV, t, t)) < 0.7
    out, _ = call_layer(MaskRecord(jnp.asarray(mask)), LAYER, q, k, v, q_pos, backend)
    cases.append((out, causal & mask[LAYER]))

    pages = rng.integers(-1, 5, (L, B, HKV, t, 3)).astype(np.int32)
    pages[LAYER, 0, 0, 4] = NO_PAGE  # a query with no page attends densely
    out, _ = call_layer(PageReplay(jnp.asarray(pages), ps), LAYER, q, k, v, q_pos, backend)
    key_page = np.maximum(q_pos, 0) // ps  # [B, S]
    chosen = (key_page[:, None, None, :, None] == pages[LAYER][:, :, :, None, :]).any(-1)
    chosen |= (pages[LAYER] < 0).all(-1)[..., None]
    cases.append((out, causal & chosen))

    for i, (got, visible) in enumerate(cases):
        np.testing.assert_allclose(got, np_attention(q, k, v, visible), atol=1e-5,
                                   err_msg=f"case {i}")
    assert not np.allclose(cases[0][0], cases[1][0])  # the records changed what was seen


def test_slot_cache_writes_its_layer_pushes_the_ring_and_attends_over_every_slot():
    rng = np.random.default_rng(1)
    cache = init_cache(L, B, HKV, 8, D, num_heads=HQ, window=3)
    old_k, old_v = (rng.normal(size=(L, B, HKV, 8, D)).astype(np.float32) for _ in range(2))
    old_pos = np.full((L, B, HKV, 8), -1, np.int32)
    old_pos[:, :, :, :4] = [0, 1, 2, 3]
    old_pos[:, 1, 1, 1] = -1  # an evicted slot
    old_q = rng.normal(size=(L, B, HQ, 3, D)).astype(np.float32)
    cache = cache.replace(k=jnp.asarray(old_k), v=jnp.asarray(old_v), pos=jnp.asarray(old_pos),
                          index=jnp.asarray(4, jnp.int32), queries=jnp.asarray(old_q))
    q, k, v = _tokens(rng, 2)
    q_pos = np.array([[4, 5], [4, 5]], np.int32)
    out, new = call_layer(cache, LAYER, q, k, v, q_pos)

    want_k, want_v, want_pos = old_k[LAYER].copy(), old_v[LAYER].copy(), old_pos[LAYER].copy()
    want_k[:, :, 4:6], want_v[:, :, 4:6], want_pos[:, :, 4:6] = k, v, q_pos[:, None, :]
    visible = (want_pos[:, :, None, :] >= 0) & (want_pos[:, :, None, :] <= q_pos[:, None, :, None])
    np.testing.assert_allclose(out, np_attention(q, want_k, want_v, visible), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(new.k[LAYER]), want_k)
    other = [l for l in range(L) if l != LAYER]
    np.testing.assert_array_equal(np.asarray(new.k)[other], old_k[other])
    # positions are written once per forward, before the layers: every layer's are new
    want_all = old_pos.copy()
    want_all[:, :, :, 4:6] = q_pos[None, :, None, :]
    np.testing.assert_array_equal(np.asarray(new.pos), want_all)
    ring = np.concatenate([old_q[LAYER], q.transpose(0, 2, 1, 3)], axis=2)[:, :, -3:]
    np.testing.assert_array_equal(np.asarray(new.queries[LAYER]), ring)
    np.testing.assert_array_equal(np.asarray(new.queries)[other], old_q[other])
    assert int(new.index) == 4 and int(new.end_forward(2).index) == 6  # advanced once


@pytest.mark.parametrize("layer", [0, LAYER])  # layer 0 is dense, layer 1 page-sparse
def test_page_sparse_cache_attends_to_the_numpy_selection(layer):
    rng = np.random.default_rng(2)
    ps, c, max_k = 2, 24, 2
    lengths = np.array([17, 9])  # the step writes positions 16 and 8
    k_all, v_all = (rng.normal(size=(L, B, HKV, c, D)).astype(np.float32) for _ in range(2))
    pos = np.where(np.arange(c) < lengths[:, None] - 1, np.arange(c), -1).astype(np.int32)
    n_pages = c // ps
    page_keys = rng.normal(size=(L, B, HKV, n_pages, D)).astype(np.float32)
    budget = np.array([2, 1], np.int32)
    cache = init_paged_cache(L, B, HKV, c, D, page_size=ps).replace(
        k=jnp.asarray(k_all), v=jnp.asarray(v_all), pos=jnp.asarray(pos),
        index=jnp.asarray(16, jnp.int32))
    view = page_sparse_cache(cache, max_k=max_k, dense_layers=(0,)).replace(
        page_keys=jnp.asarray(page_keys), budget=jnp.asarray(budget))
    q, k, v = _tokens(rng, 1)
    q_pos = (lengths - 1)[:, None].astype(np.int32)
    out, new = call_layer(view, layer, q, k, v, q_pos)
    np.testing.assert_array_equal(np.asarray(new.first_position), lengths - 1)

    want_k, want_v = k_all[layer].copy(), v_all[layer].copy()
    want_pos = np.broadcast_to(pos[:, None], (B, HKV, c)).copy()
    for i in range(B):  # each row's token at the slot of its position
        p = q_pos[i, 0]
        want_k[i, :, p], want_v[i, :, p], want_pos[i, :, p] = k[i, :, 0], v[i, :, 0], p
    visible = (want_pos >= 0) & (want_pos <= q_pos[:, None, :])  # [B, Hkv, C]
    selected = np.asarray(new.selected[layer])
    if layer == 0:
        assert (selected == NO_PAGE).all()
    else:
        q_mean = q[:, 0].reshape(B, HKV, HQ // HKV, D).mean(2)
        want = np_select(q_mean, page_keys[layer], -(-lengths // ps), budget)
        page_of = np.where(want_pos >= 0, want_pos // ps, -1)
        for (i, j), chosen in want.items():
            visible[i, j] &= np.isin(page_of[i, j], list(chosen))
            assert set(selected[i, j][selected[i, j] >= 0]) == chosen
    np.testing.assert_allclose(out, np_attention(q, want_k, want_v, visible[:, :, None]),
                               atol=1e-5)
    np.testing.assert_array_equal(np.asarray(new.cache.k[layer]), want_k)
    np.testing.assert_array_equal(np.asarray(new.page_keys), page_keys)  # read-only, whole


def test_page_sparse_cache_prefills_densely_and_keeps_its_page_means():
    """A whole forward through the cache (every layer, as the decoder runs it): a prefill
    attends densely, then ``end_forward`` holds the mean key of every prompt page; a decode
    step then refreshes the page it wrote to and no other. NumPy keeps keys by position."""
    rng = np.random.default_rng(3)
    ps, c, t = 4, 20, 14
    lengths = np.array([14, 7])
    q_pos = np.stack([np.arange(t), np.r_[[-1] * 7, np.arange(7)]]).astype(np.int32)
    view = page_sparse_cache(init_paged_cache(L, B, HKV, c, D, page_size=ps), max_k=1,
                             dense_layers=(0,))
    by_pos = np.zeros((L, B, HKV, c, D), np.float32)  # key of each position
    written = np.zeros((B, c), bool)

    def forward(view, q_pos):
        view = view.begin_forward(jnp.asarray(q_pos))
        carried, per_layer = split_layers(view)
        outs = []
        for layer in range(L):
            q, k, v = _tokens(rng, q_pos.shape[1])
            one = {name: x[layer] for name, x in per_layer.items()}
            out, new = join_layers(carried, one).attend(
                jnp.asarray(layer), jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                jnp.asarray(q_pos), "blockwise")
            carried = split_layers(new)[0]
            outs.append((np.asarray(out), q, k, v))
            for i, j in zip(*np.nonzero(q_pos >= 0)):
                by_pos[layer, i, :, q_pos[i, j]] = k[i, :, j]
        for i, j in zip(*np.nonzero(q_pos >= 0)):
            written[i, q_pos[i, j]] = True
        return join_layers(carried, per_layer).end_forward(q_pos.shape[1]), outs

    def want_means():
        means = np.zeros((L, B, HKV, c // ps, D), np.float32)
        for i, p in np.ndindex(B, c // ps):
            held = np.flatnonzero(written[i, p * ps:(p + 1) * ps]) + p * ps
            if held.size:
                means[:, i, :, p] = by_pos[:, i, :, held].mean(axis=0)
        return means

    view, outs = forward(view, q_pos)
    for out, q, k, v in outs:
        np.testing.assert_allclose(out, np_attention(q, k, v, _causal(q_pos)), atol=1e-5)
    np.testing.assert_allclose(np.asarray(view.page_keys), want_means(), atol=1e-6)
    assert int(view.index) == t and np.asarray(view.first_position).tolist() == [0, 0]
    before = np.asarray(view.page_keys)
    view, _ = forward(view, lengths[:, None].astype(np.int32))  # positions 14 and 7
    after = np.asarray(view.page_keys)
    np.testing.assert_allclose(after, want_means(), atol=1e-6)
    changed = np.argwhere(np.any(after != before, axis=(0, 2, 4)))  # (row, page) pairs
    assert changed.tolist() == [[0, 3], [1, 1]]


def test_views_reject_what_does_not_fit():
    with pytest.raises(ValueError, match=r"PageSparseCache.page_keys: expected .*5"):
        page_sparse_cache(init_paged_cache(L, B, HKV, 10, D, page_size=2), max_k=1,
                          dense_layers=()).replace(page_keys=jnp.zeros((L, B, HKV, 4, D))
                                                   ).check(CFG, B, 1, "blockwise")
    with pytest.raises(ValueError, match=r"PageSparseCache.dense_layers=\(5,\)"):
        page_sparse_cache(init_paged_cache(L, B, HKV, 8, D, page_size=2), max_k=1,
                          dense_layers=(5,)).check(CFG, B, 1, "blockwise")
    with pytest.raises(ValueError, match=r"KVCache.queries: expected .* got \[3, 2, 2, 3, 8\]"):
        init_cache(L, B, HKV, 8, D, num_heads=2, window=3).check(CFG, B, 1, "blockwise")
    with pytest.raises(ValueError, match="window=3\\) needs num_heads"):
        init_cache(L, B, HKV, 8, D, window=3)
