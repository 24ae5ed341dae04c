"""The cache, expiry and mask paths of the one attention function.

Oracles: `transformers` full forwards (incl. a custom 4D mask) and a NumPy attention.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from models.attention_backends import attention
from tiny_hf import hf_logits, left_padded_batch, load_hf, make_tiny_hf, positions_from_mask

NEVER = 2**30


WIDTH, PREFILL, CAPACITY = 10, 6, 12  # shared by the tests so the jitted functions compile once


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny fp32 Qwen3 (q/k norm, GQA 2) checkpoint, its model, jitted step and forward."""
    path = make_tiny_hf(tmp_path_factory.mktemp("cache"), "qwen3")
    model = models.load_pretrained(path, dtype=jnp.float32)
    return path, model, cached_step(model), full_forward(model)


def cached_step(model):
    """Jitted ``(cache, tokens, positions) -> (logits via unembed, cache)``."""
    graphdef, params = nnx.split(model)

    @jax.jit
    def step(params, cache, tokens, positions):
        m = nnx.merge(graphdef, params)
        out = m(tokens, positions, kv=cache, return_logits=False)
        return m.unembed(out.hidden), out.kv

    return lambda cache, tokens, positions: step(params, cache, tokens, positions)


def full_forward(model):
    """Jitted no-cache ``(tokens, positions, view) -> logits``; ``view`` None, an
    ``ExpiryRecord`` or a ``MaskRecord``."""
    graphdef, params = nnx.split(model)
    fwd = jax.jit(lambda p, t, pos, kv: nnx.merge(graphdef, p)(t, pos, kv=kv).logits)
    return lambda tokens, positions, view=None: np.asarray(fwd(params, tokens, positions, view))


def new_cache(model, batch, capacity):
    cfg = model.config
    return models.init_cache(cfg.num_layers, batch, cfg.num_kv_heads, capacity, cfg.head_dim,
                             jnp.float32)


def test_incremental_decode_matches_full_forward(tiny):
    path, model, step, _ = tiny
    tokens, mask = left_padded_batch(np.random.default_rng(0), [10, 6], WIDTH)
    positions = positions_from_mask(mask)
    ref = hf_logits(path, tokens, mask)
    cache = new_cache(model, batch=2, capacity=CAPACITY)  # two slots stay empty throughout

    logits, cache = step(cache, tokens[:, :PREFILL], positions[:, :PREFILL])
    prefilled = mask[:, :PREFILL] == 1
    np.testing.assert_allclose(np.asarray(logits)[prefilled], ref[:, :PREFILL][prefilled],
                               atol=1e-4, rtol=0)
    for col in range(PREFILL, WIDTH):
        logits, cache = step(cache, tokens[:, col:col + 1], positions[:, col:col + 1])
        np.testing.assert_allclose(np.asarray(logits)[:, 0], ref[:, col], atol=1e-4, rtol=0)

    assert int(cache.index) == 10
    expected_pos = np.concatenate([positions, np.full((2, 2), -1)], axis=1)
    np.testing.assert_array_equal(np.asarray(cache.pos),
                                  np.broadcast_to(expected_pos[None, :, None], cache.pos.shape))


def test_evicting_decode_equals_expiry_replay(tiny):
    """Dropping slots mid-decode (pos := -1) equals a teacher-forced forward replaying the
    expiry times (``ExpiryRecord``)."""
    _, model, step, forward = tiny
    cfg = model.config
    rng = np.random.default_rng(1)
    tokens, mask = left_padded_batch(rng, [10, 7], WIDTH)
    positions = positions_from_mask(mask)
    cache = new_cache(model, batch=2, capacity=CAPACITY)
    expiry = np.full((cfg.num_layers, 2, cfg.num_kv_heads, WIDTH), NEVER, np.int32)

    logits, cache = step(cache, tokens[:, :PREFILL], positions[:, :PREFILL])
    decoded = [np.asarray(logits)]
    for col in range(PREFILL, WIDTH):
        pos = np.array(cache.pos)
        for l, b, h in np.ndindex(cfg.num_layers, 2, cfg.num_kv_heads):
            slot = rng.integers(0, col)
            if rng.random() < 0.6 and pos[l, b, h, slot] >= 0:
                pos[l, b, h, slot] = -1
                expiry[l, b, h, slot] = positions[b, col]  # first query that no longer sees it
        cache = cache.replace(pos=jnp.asarray(pos))
        logits, cache = step(cache, tokens[:, col:col + 1], positions[:, col:col + 1])
        decoded.append(np.asarray(logits))
    decoded = np.concatenate(decoded, axis=1)

    replay = forward(tokens, positions, models.ExpiryRecord(jnp.asarray(expiry)))
    np.testing.assert_allclose(decoded[mask == 1], replay[mask == 1], atol=1e-5, rtol=0)
    dense = forward(tokens, positions, models.ExpiryRecord(jnp.full(expiry.shape, NEVER, jnp.int32)))
    assert np.abs(dense - replay)[mask == 1].max() > 1e-3  # the evictions mattered


def test_expiry_and_mask_match_transformers_custom_mask(tiny):
    """A layer/head-uniform expiry (and the same visibility as `mask`) equals HF's 4D mask."""
    path, model, _, forward = tiny
    cfg = model.config
    rng = np.random.default_rng(2)
    tokens, mask = left_padded_batch(rng, [10, 5], WIDTH)
    positions = positions_from_mask(mask)
    expiry_row = np.where(rng.random((2, WIDTH)) < 0.4,
                          positions + rng.integers(1, 4, (2, WIDTH)), NEVER)
    qpos, kpos = positions[:, :, None], positions[:, None, :]
    visible = (kpos >= 0) & (kpos <= qpos) & (qpos < expiry_row[:, None, :])  # [B, T, S]

    # HF's additive mask turns a row with nothing visible into NaN that leaks through the next
    # layer's keys, so padding queries see themselves there (they are not compared).
    hf_visible = visible | (np.eye(WIDTH, dtype=bool) & (mask == 0)[:, :, None])
    ref = hf_logits(load_hf(path), tokens, mask, attn_mask_4d=hf_visible[:, None])
    expiry = np.broadcast_to(expiry_row[None, :, None],
                             (cfg.num_layers, 2, cfg.num_kv_heads, WIDTH))
    got = forward(tokens, positions, models.ExpiryRecord(jnp.asarray(expiry.astype(np.int32))))
    np.testing.assert_allclose(got[mask == 1], ref[mask == 1], atol=1e-4, rtol=0)
    layer_mask = np.broadcast_to(visible[None, :, None], (cfg.num_layers, 2, 1, WIDTH, WIDTH))
    got = forward(tokens, positions, models.MaskRecord(jnp.asarray(layer_mask)))
    np.testing.assert_allclose(got[mask == 1], ref[mask == 1], atol=1e-4, rtol=0)


def numpy_attention(q, k, v, q_pos, k_pos, expiry, mask):
    """Reference: loop over rows/heads/queries; softmax over the visible keys only."""
    b, t, hq, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    out = np.zeros_like(q)
    for i, h, j in np.ndindex(b, hq, t):
        g = h // (hq // hkv)
        keys = [c for c in range(s) if 0 <= k_pos[i, g, c] <= q_pos[i, j]
                and q_pos[i, j] < expiry[i, g, c] and mask[i, g, j, c]]
        if keys:
            logits = k[i, g, keys] @ q[i, j, h] / np.sqrt(d)
            p = np.exp(logits - logits.max())
            out[i, j, h] = (p / p.sum()) @ v[i, g, keys]
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_attention_matches_numpy(seed):
    rng = np.random.default_rng(seed)
    b, t, s, hq, hkv, d = 2, 5, 7, 6, 2, 8  # GQA ratio 3
    q = rng.normal(size=(b, t, hq, d)).astype(np.float32)
    k, v = (rng.normal(size=(b, hkv, s, d)).astype(np.float32) for _ in range(2))
    q_pos = rng.integers(-1, 8, (b, t)).astype(np.int32)
    q_pos[0, 0] = -1  # a padding query
    k_pos = rng.integers(-1, 8, (b, hkv, s)).astype(np.int32)
    expiry = rng.integers(0, 10, (b, hkv, s)).astype(np.int32)
    mask = rng.random((b, hkv, t, s)) < 0.8
    def total(q):
        out = attention(q, k, v, q_pos, k_pos, k_expiry=expiry, mask=mask)
        return out.sum(), out

    grads, got = jax.jit(jax.grad(total, has_aux=True))(jnp.asarray(q))
    ref = numpy_attention(q, k, v, q_pos, k_pos, expiry, mask)
    np.testing.assert_allclose(np.asarray(got), ref, atol=1e-5, rtol=0)
    assert np.isfinite(np.asarray(grads)).all()


def test_bad_shapes_and_overflow_are_rejected_before_compute(tiny):
    _, model, _, _ = tiny
    tokens = np.zeros((2, 5), np.int32)
    with pytest.raises(ValueError, match="exceeds capacity 4"):
        model(tokens, kv=new_cache(model, batch=2, capacity=4))
    with pytest.raises(ValueError, match=r"KVCache.k: expected \[L, B, Hkv, C, D\] = "
                                         r"\[2, 2, 2, \*, 16\], got \[2, 3, 2, 8, 16\]"):
        model(tokens, kv=new_cache(model, batch=3, capacity=8))
    with pytest.raises(ValueError, match="'fused' needs a full forward"):
        model(tokens, kv=new_cache(model, batch=2, capacity=8), attention_backend="fused")
    expiry_error = (r"ExpiryRecord.expiry: expected \[L, B, Hkv, S\] = \[2, 2, 2, 5\], "
                    r"got \[2, 2, 2, 4\]")
    with pytest.raises(ValueError, match=expiry_error):
        model(tokens, kv=models.ExpiryRecord(np.zeros((2, 2, 2, 4), np.int32)))
    with pytest.raises(ValueError, match="ExpiryRecord: attention_backend='fused'"):
        model(tokens, kv=models.ExpiryRecord(np.zeros((2, 2, 2, 5), np.int32)),
              attention_backend="fused")
    mask_error = (r"MaskRecord.mask: expected \[L, B, Hkv, T, S\] = \[2, 2, 1\|2, 5, 5\], "
                  r"got \[2, 2, 1, 5, 6\]")
    with pytest.raises(ValueError, match=mask_error):
        model(tokens, kv=models.MaskRecord(np.ones((2, 2, 1, 5, 6), bool)))
