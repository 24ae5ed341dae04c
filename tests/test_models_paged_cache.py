"""The paged KV cache (``models.paged_cache``) against a NumPy attention over exactly the keys
it must show: a prefill then decode steps and a multi-token step, called the way the decoder
calls a view (``begin_forward``, ``attend`` at one layer, ``end_forward``), over page sizes,
chunk sizes (the last chunk overlapping), left padding and GQA groupings; plus what it writes,
what it never reads, and the inputs it rejects."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import ModelConfig
from models.paged_cache import init_paged_cache
from test_models_kv_view import np_attention

L, B, D = 3, 2, 8
LAYER = 1


def _config(hq, hkv):
    return ModelConfig("llama", 64, hq * D, 32, L, num_heads=hq, num_kv_heads=hkv, head_dim=D)


def _forward(cache, cfg, layer, q, k, v, q_pos, backend="blockwise"):
    """One forward of the decoder at ``layer``: begin, attend, end."""
    cache.check(cfg, q.shape[0], q.shape[1], backend)
    out, cache = _jit_forward(cache, jnp.asarray(layer), jnp.asarray(q), jnp.asarray(k),
                              jnp.asarray(v), jnp.asarray(q_pos), backend)
    return np.asarray(out), cache


@functools.partial(jax.jit, static_argnames="backend")
def _jit_forward(cache, layer, q, k, v, q_pos, backend):
    cache = cache.begin_forward(q_pos)
    out, cache = cache.attend(layer, q, k, v, q_pos, backend)
    return out, cache.end_forward(q.shape[1])


@pytest.mark.parametrize("page_size,chunk_pages,hq,hkv", [
    (4, 1, 4, 2), (4, 3, 4, 1), (16, 2, 2, 2), (3, 2, 6, 2), (1, 5, 4, 4)])
def test_attention_equals_numpy_over_the_keys_it_holds(page_size, chunk_pages, hq, hkv):
    rng = np.random.default_rng(page_size * 10 + chunk_pages)
    cfg = _config(hq, hkv)
    width, steps = 7, [1, 1, 1, 5, 1, 1]  # prefill, decode steps, a 5-token step, decode
    max_len = width + sum(steps)
    cache = init_paged_cache(L, B, hkv, max_len, D, page_size=page_size,
                             chunk_pages=chunk_pages)
    assert cache.capacity == -(-max_len // page_size) * page_size
    lengths = np.array([7, 3])  # row 1 left-padded by 4
    q_pos = np.where(np.arange(width) >= width - lengths[:, None],
                     np.arange(width) - (width - lengths[:, None]), -1).astype(np.int32)
    held_k, held_v, held_pos = (np.zeros((B, hkv, 0, D), np.float32),) * 2 + (
        np.zeros((B, 0), np.int32),)
    nxt = lengths.copy()
    for t in [width] + steps:
        if t != width or held_pos.shape[1]:
            q_pos = (nxt[:, None] + np.arange(t)).astype(np.int32)
            nxt = nxt + t
        q = rng.normal(size=(B, t, hq, D)).astype(np.float32)
        k, v = (rng.normal(size=(B, hkv, t, D)).astype(np.float32) for _ in range(2))
        out, cache = _forward(cache, cfg, LAYER, q, k, v, q_pos)
        held_k, held_v = np.concatenate([held_k, k], 2), np.concatenate([held_v, v], 2)
        held_pos = np.concatenate([held_pos, q_pos], 1)
        kp = held_pos[:, None, None, :]
        visible = np.broadcast_to((kp >= 0) & (kp <= q_pos[:, None, :, None]),
                                  (B, hkv, t, held_pos.shape[1]))
        np.testing.assert_allclose(out, np_attention(q, held_k, held_v, visible), atol=1e-5,
                                   err_msg=f"step of {t} tokens at column {held_pos.shape[1] - t}")
    assert int(cache.index) == held_pos.shape[1]
    # what it wrote: positions once for every layer, this layer's keys/values, each token at
    # the slot of its position (rows' pages are positions, whatever their left padding)
    want_pos = np.full((B, cache.capacity), -1)
    want_k, want_v = (np.zeros((B, hkv, cache.capacity, D), np.float32) for _ in range(2))
    for i, j in zip(*np.nonzero(held_pos >= 0)):
        p = held_pos[i, j]
        want_pos[i, p], want_k[i, :, p], want_v[i, :, p] = p, held_k[i, :, j], held_v[i, :, j]
    np.testing.assert_array_equal(np.asarray(cache.pos), want_pos)
    np.testing.assert_array_equal(np.asarray(cache.k)[LAYER], want_k)
    np.testing.assert_array_equal(np.asarray(cache.v)[LAYER], want_v)
    other = [l for l in range(L) if l != LAYER]
    assert not np.asarray(cache.k)[other].any()  # other layers untouched


@pytest.mark.parametrize("chunk_pages", [1, 2])
def test_decode_reads_only_the_chunks_holding_filled_slots(chunk_pages):
    """NaN keys and values in every slot past the chunk that holds the newest token would
    poison the output if the loop read them (a zero probability times NaN is NaN)."""
    rng = np.random.default_rng(3)
    ps, hq, hkv, c = 4, 4, 2, 48
    cache = init_paged_cache(L, B, hkv, c, D, page_size=ps, chunk_pages=chunk_pages)
    filled = 9  # the step writes slot 9: chunks up to slot 12 (1 page) or 16 (2 pages)
    end = -(-(filled + 1) // (ps * chunk_pages)) * ps * chunk_pages
    k_all, v_all = (rng.normal(size=(L, B, hkv, c, D)).astype(np.float32) for _ in range(2))
    k_all[:, :, :, end:] = np.nan
    v_all[:, :, :, end:] = np.nan
    pos = np.full((B, c), -1, np.int32)
    pos[:, :filled] = np.arange(filled)
    cache = cache.replace(k=jnp.asarray(k_all), v=jnp.asarray(v_all), pos=jnp.asarray(pos),
                          index=jnp.asarray(filled, jnp.int32))
    q = rng.normal(size=(B, 1, hq, D)).astype(np.float32)
    k, v = (rng.normal(size=(B, hkv, 1, D)).astype(np.float32) for _ in range(2))
    q_pos = np.full((B, 1), filled, np.int32)
    out, _ = _forward(cache, _config(hq, hkv), LAYER, q, k, v, q_pos)
    held_k = np.concatenate([k_all[LAYER, :, :, :filled], k], 2)
    held_v = np.concatenate([v_all[LAYER, :, :, :filled], v], 2)
    visible = np.ones((B, hkv, 1, filled + 1), bool)
    np.testing.assert_allclose(out, np_attention(q, held_k, held_v, visible), atol=1e-5)
    # the reference backend reads every slot: the NaNs show, so they were there to be read
    ref, _ = _forward(cache, _config(hq, hkv), LAYER, q, k, v, q_pos, backend="reference")
    assert np.isnan(ref).any()


def test_paged_cache_rejects_what_does_not_fit():
    cfg = _config(4, 2)
    cache = init_paged_cache(L, B, 2, 10, D, page_size=4)
    with pytest.raises(ValueError, match=r"cache: writing 13 tokens at index 0 exceeds "
                                         r"capacity 12"):
        cache.check(cfg, B, 13, "blockwise")
    with pytest.raises(ValueError, match="'fused' needs a full forward"):
        cache.check(cfg, B, 1, "fused")
    with pytest.raises(ValueError, match=r"PagedKVCache.pos: expected"):
        cache.replace(pos=cache.pos[:, :8]).check(cfg, B, 1, "blockwise")
    with pytest.raises(ValueError, match=r"PagedKVCache.k: expected"):
        cache.check(_config(4, 4), B, 1, "blockwise")
    with pytest.raises(ValueError, match="capacity 10 is not a whole number of pages"):
        cache.replace(k=cache.k[:, :, :, :10], v=cache.v[:, :, :, :10],
                      pos=cache.pos[:, :10]).check(cfg, B, 1, "blockwise")
    with pytest.raises(ValueError, match="page_size=0 must be an int >= 1"):
        init_paged_cache(L, B, 2, 10, D, page_size=0)
