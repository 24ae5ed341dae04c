"""Eviction scores vs plain NumPy references written here (float64 loops) and vs kvpress."""

from __future__ import annotations

import math
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_rl_jax.kv.compression_config import CompressionConfig
from sparse_rl_jax.kv.compression_sections import EvictionConfig
from sparse_rl_jax.kv.scores import redundancy, slot_scores

# (batch, kv heads, group size, capacity, index, window, head dim)
SHAPES = [
    (2, 2, 1, 24, 24, 4, 8),  # GQA ratio 1
    (1, 3, 2, 19, 15, 3, 16),  # ratio 2, empty tail slots >= index
    (2, 1, 7, 21, 21, 5, 4),  # ratio 7
]


def _case(shape, padding: bool, seed: int):
    """Random q/k/pos; with padding: random left padding per row plus random holes (one in
    the window)."""
    b, hkv, g, c, index, w, d = shape
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(b, hkv * g, w, d)).astype(np.float32)
    k = rng.normal(size=(b, hkv, c, d)).astype(np.float32)
    # near-duplicates so the redundancy threshold is exercised
    for src, dst in ((0, 3), (2, 5), (4, 9)):
        k[:, :, dst] = k[:, :, src] + 0.2 * rng.normal(size=(b, hkv, d))
    valid = np.zeros((b, hkv, c), bool)
    valid[..., :index] = True
    if padding:
        for row in range(b):
            valid[row, :, : rng.integers(1, index - w)] = False  # left padding
        holes = rng.random((b, hkv, c)) < 0.15
        holes[..., index - w] = True  # an empty window slot: its query must be ignored
        holes[..., index - 1] = False  # the newest token is always there
        valid &= ~holes
    pos = np.where(valid, np.cumsum(valid, axis=-1) - 1, -1).astype(np.int32)
    return q, k, pos, index


def _softmax(x):
    x = np.asarray(x, np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def _pool(vals, kind, kernel):
    """Stride-1 pooling of a 1-D array with explicit zero padding (kernel // 2 each side)."""
    r = kernel // 2
    padded = np.concatenate([np.zeros(r), vals, np.zeros(r)])
    out = np.empty(len(vals))
    for j in range(len(vals)):
        win = padded[j : j + kernel]
        out[j] = win.max() if kind == "max" else win.sum() / kernel
    return out


def _logit(q, k, b, hq_idx, i, h, j):
    return q[b, hq_idx, i].astype(np.float64) @ k[b, h, j].astype(np.float64) / math.sqrt(q.shape[-1])


def ref_importance(q, k, pos, index, variant, gqa_pool, pool, kernel):
    """Importance on non-window valid slots; NaN where undefined (window / empty)."""
    b_, hq, w, _ = q.shape
    hkv, c = k.shape[1], k.shape[2]
    g_ = hq // hkv
    n = index - w  # non-window prefix length; the window is slots n..index-1
    reduce = (lambda x: x.max(0)) if gqa_pool == "max" else (lambda x: x.mean(0))
    out = np.full((b_, hkv, c), np.nan)
    for b in range(b_):
        for h in range(hkv):
            keys = [j for j in range(n) if pos[b, h, j] >= 0]
            qs = [i for i in range(w) if pos[b, h, n + i] >= 0]
            if variant == "sparse_rl":  # pool logits over the group, softmax over non-window keys
                acc = np.zeros(n)
                for i in qs:
                    logits = np.array(
                        [[_logit(q, k, b, h * g_ + g, i, h, j) for j in keys] for g in range(g_)]
                    )
                    for j, p in zip(keys, _softmax(reduce(logits))):
                        acc[j] += p / len(qs)
                score = _pool(acc, pool, kernel)
            else:  # per head: causal softmax over all keys, slice, mean, pool, reduce over group
                per_head = np.zeros((g_, n))
                for g in range(g_):
                    for i in qs:
                        seen = [j for j in range(index) if 0 <= pos[b, h, j] <= pos[b, h, n + i]]
                        probs = _softmax([_logit(q, k, b, h * g_ + g, i, h, j) for j in seen])
                        for j, p in zip(seen, probs):
                            if j < n:
                                per_head[g, j] += p / len(qs)
                score = reduce(np.stack([_pool(per_head[g], pool, kernel) for g in range(g_)]))
            for j in keys:
                out[b, h, j] = score[j]
    return out


def ref_redundancy(k, pos, index, threshold):
    """R-KV redundancy over valid slots; NaN on empty slots."""
    b_, hkv, c, _ = k.shape
    out = np.full((b_, hkv, c), np.nan)
    for b in range(b_):
        for h in range(hkv):
            idx = [j for j in range(index) if pos[b, h, j] >= 0]
            kn = {j: k[b, h, j] / (np.linalg.norm(k[b, h, j].astype(np.float64)) + 1e-8) for j in idx}
            col_sum = {j: 0.0 for j in idx}
            for i in idx:
                row = {j: (float(kn[i] @ kn[j]) if j != i else 0.0) for j in idx}
                dups = [j for j in idx if j != i and row[j] > threshold]
                if dups:
                    row[max(dups)] = 0.0
                for j in idx:
                    col_sum[j] += row[j]
            mean = [col_sum[j] / len(idx) for j in idx]
            for j, r in zip(idx, _softmax(mean)):
                out[b, h, j] = r
    return out


def ref_streaming(pos, index, w, sinks):
    """Sinks (the first `sinks` valid slots of each row) rank first, then recency; -inf on
    window and empty slots."""
    b_, hkv, c = pos.shape
    out = np.full((b_, hkv, c), -np.inf)
    for b in range(b_):
        for h in range(hkv):
            valid = [j for j in range(index) if pos[b, h, j] >= 0]
            for rank, j in enumerate(valid):
                if j < index - w:
                    out[b, h, j] = 1e12 if rank < sinks else pos[b, h, j]
    return out


def _assert_scores(got, ref):
    """Compare on valid non-window slots; -inf expected everywhere else."""
    got = np.asarray(got)
    defined = ~np.isnan(ref)
    np.testing.assert_array_equal(np.isfinite(got), defined)
    np.testing.assert_allclose(got[defined], ref[defined], rtol=1e-5, atol=1e-6)
    assert defined.any()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(
    "variant,gqa_pool,pool,kernel",
    [
        ("sparse_rl", "max", "max", 7),
        ("sparse_rl", "mean", "avg", 3),
        ("kvpress_snapkv", "mean", "avg", 5),
        ("kvpress_snapkv", "max", "max", 3),
    ],
)
def test_snapkv_importance_matches_numpy(shape, variant, gqa_pool, pool, kernel):
    w = shape[5]
    cfg = CompressionConfig(method="snapkv", eviction=EvictionConfig(
        budget=w + 2, buffer=4, window=w, importance=variant, gqa_pool=gqa_pool, pool=pool,
        pool_kernel=kernel))
    score = jax.jit(lambda *a: slot_scores(cfg, *a))
    for padding in (False, True):
        q, k, pos, index = _case(shape, padding, seed=5)
        ref = ref_importance(q, k, pos, index, variant, gqa_pool, pool, kernel)
        _assert_scores(score(q, k, pos, jnp.int32(index)), ref)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("threshold", [0.5, 0.95])
def test_redundancy_matches_numpy(shape, threshold):
    red = jax.jit(redundancy, static_argnums=3)
    for padding in (False, True):
        _, k, pos, index = _case(shape, padding, seed=7)
        got = np.asarray(red(k, pos, jnp.int32(index), threshold))
        ref = ref_redundancy(k, pos, index, threshold)
        defined = ~np.isnan(ref)
        np.testing.assert_allclose(got[defined], ref[defined], rtol=1e-5, atol=1e-7)
        np.testing.assert_array_equal(got[~defined], 0.0)


@pytest.mark.parametrize("shape", SHAPES)
def test_rkv_score_matches_numpy(shape):
    w = shape[5]
    for lam in (0.1, 0.5):
        cfg = CompressionConfig(method="rkv", eviction=EvictionConfig(
            budget=w + 2, buffer=4, window=w, rkv_lambda=lam))
        score = jax.jit(lambda *a: slot_scores(cfg, *a))
        for padding in (False, True):
            q, k, pos, index = _case(shape, padding, seed=11)
            imp = ref_importance(q, k, pos, index, "sparse_rl", "max", "max", 7)
            red = ref_redundancy(k, pos, index, 0.5)
            red[..., index - w :] = np.nan
            _assert_scores(score(q, k, pos, jnp.int32(index)), lam * imp - (1 - lam) * red)


def test_redundancy_keeps_newest_duplicate():
    """Three identical keys + distinct ones: per row only the newest duplicate is zeroed."""
    k = np.eye(6, dtype=np.float32)[None, None]  # orthogonal keys
    k[0, 0, 2] = k[0, 0, 0]
    k[0, 0, 4] = k[0, 0, 0]
    pos = np.arange(6, dtype=np.int32)[None, None]
    got = np.asarray(jax.jit(redundancy, static_argnums=3)(k, pos, jnp.int32(6), 0.5))[0, 0]
    # Slots 0, 2, 4 are equal. Row 0 zeroes S[0,4] (keeps S[0,2]); row 2 zeroes S[2,4]
    # (keeps S[2,0]); row 4 zeroes S[4,2] (keeps S[4,0]). Column sums: slot 0 -> 2, slot 2 -> 1.
    mean = np.array([2, 0, 1, 0, 0, 0]) / 6.0
    np.testing.assert_allclose(got, _softmax(mean), rtol=1e-6)


@pytest.mark.parametrize("shape", SHAPES)
def test_streaming_matches_numpy(shape):
    w = shape[5]
    for sinks, padding in ((0, False), (2, False), (2, True), (3, True)):
        q, k, pos, index = _case(shape, padding, seed=3)
        cfg = CompressionConfig(method="streaming", eviction=EvictionConfig(
            budget=w + 2, buffer=4, window=w, num_sinks=sinks))
        z = np.asarray(jax.jit(lambda *a: slot_scores(cfg, *a))(q, k, pos, jnp.int32(index)))
        ref = ref_streaming(pos, index, w, sinks)
        np.testing.assert_array_equal(np.isfinite(z), np.isfinite(ref))
        fin = np.isfinite(ref)
        sink = ref[fin] >= 1e12
        np.testing.assert_array_equal(z[fin] >= 2**30, sink)  # sinks above every position
        np.testing.assert_array_equal(z[fin][~sink], ref[fin][~sink])  # the rest by position
        assert np.all(z[pos < 0] == -np.inf)


def test_fully_padded_row_gives_no_nan():
    """A row with no valid key gives no NaN anywhere, only -inf scores."""
    q, k, pos, index = _case(SHAPES[0], False, seed=1)
    pos[0] = -1
    for importance in ("sparse_rl", "kvpress_snapkv"):
        cfg = CompressionConfig(method="rkv", eviction=EvictionConfig(
            budget=8, buffer=4, window=4, importance=importance))
        z = np.asarray(jax.jit(lambda *a: slot_scores(cfg, *a))(q, k, pos, jnp.int32(index)))
        assert not np.isnan(z).any()
        assert np.all(z[0] == -np.inf) and np.isfinite(z[1, :, : index - 4]).all()


@pytest.mark.parametrize("hkv,group,window,kernel", [(2, 1, 4, 5), (1, 2, 8, 3), (2, 7, 64, 5)])
def test_kvpress_snapkv_scores_match_kvpress(hkv, group, window, kernel):
    import torch
    from kvpress import SnapKVPress

    b, d = 2, 16
    t = window + 37
    hq = hkv * group
    rng = np.random.default_rng(hkv * 100 + group)
    q = rng.normal(size=(b, hq, window, d)).astype(np.float32)
    k = rng.normal(size=(b, hkv, t, d)).astype(np.float32)
    pos = np.broadcast_to(np.arange(t, dtype=np.int32), (b, hkv, t)).copy()

    # Causal attention of the window queries (positions t-w..t-1) in PyTorch; other rows unused.
    qt, kt = torch.from_numpy(q), torch.from_numpy(k).repeat_interleave(group, dim=1)
    logits = qt @ kt.transpose(-1, -2) / math.sqrt(d)
    causal = torch.arange(t)[None, :] > torch.arange(t - window, t)[:, None]
    attn = torch.zeros(b, hq, t, t)
    attn[:, :, -window:] = torch.softmax(logits.masked_fill(causal, float("-inf")), dim=-1)
    module = SimpleNamespace(config=SimpleNamespace(num_attention_heads=hq))
    press = SnapKVPress(window_size=window, kernel_size=kernel)
    want = press.score(
        module, torch.zeros(b, t, 1), torch.from_numpy(k), torch.from_numpy(k), attn, {}
    ).numpy()

    cfg = CompressionConfig(method="snapkv", eviction=EvictionConfig(
        budget=window + 1, buffer=40, window=window, importance="kvpress_snapkv",
        pool_kernel=kernel))
    got = np.asarray(slot_scores(cfg, q, k, pos, jnp.int32(t)))
    np.testing.assert_allclose(got[..., : t - window], want[..., : t - window], rtol=1e-5, atol=1e-7)
    assert np.all(got[..., t - window :] == -np.inf)
