"""Rollout KV state: compression cadence, compile-once, dense equivalence, eviction replay."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from models.cache import init_cache
from sparse_rl_jax import kv_state
from sparse_rl_jax.compression_config import CompressionConfig
from sparse_rl_jax.compile_count import count_compiles

L, B, HQ, HKV, D = 2, 2, 4, 2, 8


def _write(state, k, v, positions, queries):
    """What the model does with a cache (write T tokens at index; pos broadcast over heads),
    then ``advance`` with the queries. k, v ``[L, B, Hkv, T, D]``, positions ``[B, T]``."""
    cache = state.cache
    at = (0, 0, 0, cache.index, 0)
    pos = jnp.broadcast_to(positions[None, :, None, :], k.shape[:4]).astype(jnp.int32)
    cache = cache.replace(
        k=lax.dynamic_update_slice(cache.k, k, at),
        v=lax.dynamic_update_slice(cache.v, v, at),
        pos=lax.dynamic_update_slice(cache.pos, pos, at[:4]),
        index=cache.index + k.shape[3],
    )
    return kv_state.advance(state, cache, queries)


def _tokens(rng, t):
    """Random k, v ``[L, B, Hkv, t, D]`` and queries ``[L, B, Hq, t, D]``."""
    kv = rng.normal(size=(2, L, B, HKV, t, D)).astype(np.float32)
    return kv[0], kv[1], rng.normal(size=(L, B, HQ, t, D)).astype(np.float32)


def _step(cfg):
    """One jitted decode step: write one token, then maybe compress."""

    def step(state, k, v, positions, q):
        return kv_state.maybe_compress(_write(state, k, v, positions, q), cfg)

    return jax.jit(step)


_write_jit = jax.jit(_write)


def _run(cfg, prompt_len, pads, steps, seed=0, max_len=None):
    """Prefill a left-padded prompt, decode ``steps`` tokens; returns the final state, the
    column positions ``[B, S]`` and, per query column, the cache's visible positions."""
    rng = np.random.default_rng(seed)
    max_len = max_len or prompt_len + steps
    state = kv_state.init_state(
        cfg, num_layers=L, batch=B, num_heads=HQ, num_kv_heads=HKV, head_dim=D, max_len=max_len
    )
    cols = np.arange(prompt_len + steps)[None, :] - np.asarray(pads)[:, None]
    cols = np.where(cols >= 0, cols, -1).astype(np.int32)  # [B, S]

    def visible_now(state, qpos):
        pos = np.asarray(state.cache.pos)  # [L, B, Hkv, C]
        return {
            (l, b, h): {int(p) for p in pos[l, b, h] if 0 <= p <= qpos[b]}
            for l in range(L) for b in range(B) for h in range(HKV)
        }

    seen = {}
    k, v, q = _tokens(rng, prompt_len)
    kv_state.check_prompt_fits(cfg, prompt_len, None if cfg.compresses else max_len)
    state = _write_jit(state, k, v, cols[:, :prompt_len], q)
    for t in range(prompt_len):  # prefill is dense: each prompt query saw the whole prompt prefix
        seen[t] = visible_now(state, cols[:, t])
    state = jax.jit(lambda s: kv_state.maybe_compress(s, cfg, after_prefill=True))(state)
    step = _step(cfg)
    indices = []
    for s in range(steps):
        t = prompt_len + s
        k, v, q = _tokens(rng, 1)
        written = _write_jit(state, k, v, cols[:, t : t + 1], q)  # what the model attends over
        seen[t] = visible_now(written, cols[:, t])
        state = step(state, k, v, cols[:, t : t + 1], q)
        indices.append(int(state.cache.index))
    return state, cols, seen, indices


CONFIGS = [
    CompressionConfig(method="snapkv", budget=10, buffer=4, window=3),
    CompressionConfig(method="rkv", budget=10, buffer=4, window=3, head_mode="shared"),
    CompressionConfig(method="rkv", budget=9, buffer=3, window=4, importance="kvpress_snapkv"),
    CompressionConfig(method="streaming", budget=10, buffer=4, window=3, num_sinks=2),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.method}-{c.head_mode}-{c.importance}")
def test_eviction_record_replays_visibility(cfg):
    prompt_len, pads, steps = 12, (0, 5), 14
    state, cols, seen, _ = _run(cfg, prompt_len, pads, steps)
    expiry = np.asarray(kv_state.visibility_from_record(state.evicted_at, jnp.asarray(cols)))
    assert expiry.shape == (L, B, HKV, cols.shape[1])
    assert (expiry < kv_state.NEVER).any(), "some token must have been evicted"
    for t in range(prompt_len + steps):
        for (l, b, h), want in seen[t].items():
            qpos = cols[b, t]
            if qpos < 0:
                continue  # padding queries attend to nothing that matters
            got = {int(p) for p, e in zip(cols[b], expiry[l, b, h]) if 0 <= p <= qpos < e}
            assert got == want, (t, l, b, h)
    # the record holds the next query position after the newest token at eviction time
    values = set(np.asarray(state.evicted_at).ravel().tolist()) - {kv_state.NEVER}
    assert values <= set(range(1, prompt_len + steps + 1))


def test_compression_cadence_and_resident_tokens():
    cfg = CompressionConfig(method="snapkv", budget=10, buffer=4, window=3)
    # prompt 8 <= budget: no compression at prefill; decode fills to 14 then back to 10
    state, _, _, indices = _run(cfg, 8, (0, 3), 12)
    assert indices == [9, 10, 11, 12, 13, 10, 11, 12, 13, 10, 11, 12]
    # prompt 12 > budget: compressed right after prefill
    state, _, _, indices = _run(cfg, 12, (0, 3), 3)
    assert indices == [11, 12, 13]
    resident = np.asarray(kv_state.resident_tokens(state.cache))
    np.testing.assert_array_equal(resident[:, 0], 13)  # 15 tokens seen, 10 kept + 3 new
    np.testing.assert_array_equal(resident[:, 1], 12)  # 3 pads: 12 valid, pads went first
    assert (np.asarray(state.cache.pos)[..., 13:] == -1).all()


def test_compress_keeps_window_aligned_with_query_ring():
    cfg = CompressionConfig(method="rkv", budget=10, buffer=4, window=3)
    state, cols, _, _ = _run(cfg, 14, (0, 2), 0)
    pos = np.asarray(state.cache.pos)
    np.testing.assert_array_equal(pos[:, 0, :, 7:10], np.broadcast_to([11, 12, 13], pos[:, 0, :, 7:10].shape))
    np.testing.assert_array_equal(pos[:, 1, :, 7:10], np.broadcast_to([9, 10, 11], pos[:, 1, :, 7:10].shape))
    live = pos[..., :10]
    assert (np.diff(live, axis=-1) > 0).all(), "kept slots in temporal order"
    assert int(state.cache.index) == 10


def test_repeated_compressions_compile_once():
    cfg = CompressionConfig(method="rkv", budget=10, buffer=2, window=3)
    traces = []

    def step(state, k, v, positions, q):
        traces.append(1)  # runs only while tracing
        return kv_state.maybe_compress(_write(state, k, v, positions, q), cfg)

    jstep = jax.jit(step)
    rng = np.random.default_rng(1)
    state = kv_state.init_state(
        cfg, num_layers=L, batch=B, num_heads=HQ, num_kv_heads=HKV, head_dim=D, max_len=64
    )
    compressions = 0
    with count_compiles() as compiles:
        for t in range(30):
            k, v, q = _tokens(rng, 1)
            before = int(state.cache.index)
            state = jstep(state, k, v, np.full((B, 1), t, np.int32), q)
            compressions += int(state.cache.index) <= before
        jcompress = jax.jit(kv_state.compress, static_argnums=1)
        for _ in range(3):
            state = jcompress(state, cfg)
    assert compressions >= 9
    assert len(traces) == 1 and compiles["jit(step)"] == 1
    assert compiles["jit(compress)"] == 1


def test_none_matches_dense_cache():
    cfg = CompressionConfig(method="none")
    total = 20
    state, cols, _, indices = _run(cfg, 6, (0, 2), total - 6, seed=3, max_len=total)
    assert indices == list(range(7, total + 1))
    rng = np.random.default_rng(3)  # same draws as _run
    dense = init_cache(L, B, HKV, total, D)
    k, v, _ = _tokens(rng, 6)
    ks, vs = [k], [v]
    for _ in range(total - 6):
        k, v, _ = _tokens(rng, 1)
        ks.append(k)
        vs.append(v)
    dense = dense.replace(
        k=jnp.concatenate(ks, axis=3),
        v=jnp.concatenate(vs, axis=3),
        pos=jnp.broadcast_to(cols[None, :, None, :], dense.pos.shape),
        index=jnp.int32(total),
    )
    jax.tree.map(np.testing.assert_array_equal, state.cache, dense)
    assert (np.asarray(state.evicted_at) == kv_state.NEVER).all()


def test_visibility_from_record_pads_and_out_of_range():
    rec = np.full((1, 1, 1, 4), kv_state.NEVER, np.int32)
    rec[0, 0, 0, 1] = 3
    got = np.asarray(kv_state.visibility_from_record(rec, np.array([[-1, 0, 1, 2, 7]], np.int32)))
    np.testing.assert_array_equal(got[0, 0, 0], [kv_state.NEVER, kv_state.NEVER, 3, kv_state.NEVER, kv_state.NEVER])


def test_push_queries_keeps_last_window():
    cfg = CompressionConfig(method="snapkv", budget=10, buffer=4, window=3)
    state = kv_state.init_state(
        cfg, num_layers=1, batch=1, num_heads=2, num_kv_heads=1, head_dim=2, max_len=8
    )
    seq = np.arange(5, dtype=np.float32)[None, None, None, :, None] * np.ones((1, 1, 2, 5, 2))
    state = kv_state.push_queries(state, seq[:, :, :, :2])
    np.testing.assert_array_equal(np.asarray(state.queries)[0, 0, 0, :, 0], [0, 0, 1])
    state = kv_state.push_queries(state, seq[:, :, :, 2:])
    np.testing.assert_array_equal(np.asarray(state.queries)[0, 0, 0, :, 0], [2, 3, 4])
    with pytest.raises(ValueError, match="push_queries"):
        kv_state.push_queries(state, np.zeros((1, 1, 3, 1, 2), np.float32))


def test_bad_inputs_raise_clear_errors():
    cfg = CompressionConfig(method="snapkv", budget=10, buffer=4, window=3)
    with pytest.raises(ValueError, match=r"prompt length 15 exceeds .*budget 10 \+ buffer 4 = 14"):
        kv_state.check_prompt_fits(cfg, 15)
    kv_state.check_prompt_fits(cfg, 14)
    with pytest.raises(ValueError, match="dense cache capacity of 20"):
        kv_state.check_prompt_fits(CompressionConfig(method="none"), 21, 20)
    with pytest.raises(ValueError, match="num_heads=3 must be a multiple of num_kv_heads=2"):
        kv_state.init_state(cfg, num_layers=1, batch=1, num_heads=3, num_kv_heads=2, head_dim=4, max_len=8)
    with pytest.raises(ValueError, match="max_len=0"):
        kv_state.init_state(cfg, num_layers=1, batch=1, num_heads=2, num_kv_heads=2, head_dim=4, max_len=0)
    state = kv_state.init_state(
        cfg, num_layers=1, batch=1, num_heads=2, num_kv_heads=2, head_dim=4, max_len=8
    )
    other = CompressionConfig(method="snapkv", budget=12, buffer=4, window=3)
    with pytest.raises(ValueError, match="cache capacity 14 != budget \\+ buffer = 16"):
        kv_state.maybe_compress(state, other)
    with pytest.raises(ValueError, match="never compresses"):
        kv_state.compress(state, CompressionConfig(method="none"))
