"""Rollout KV state, tested by what it keeps (token positions), never by which slot holds
them: compression cadence, the kept set vs a NumPy selection, eviction replay, compile-once."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.kit.compile_count import count_compiles
from sparse_rl_jax.kv import state as kv_state
from sparse_rl_jax.kv.compression_config import CompressionConfig
from sparse_rl_jax.kv.compression_sections import EvictionConfig
from sparse_rl_jax.kv.scores import slot_scores

L, B, HQ, HKV, D = 2, 2, 4, 2, 8


def _write(state, k, v, positions, queries):
    """What the model does with a cache in a forward of T tokens: the positions are written
    once (``KVCache.begin_forward``), every layer stores its keys, values and queries
    (``KVCache.store``), then the index advances.
    k, v ``[L, B, Hkv, T, D]``, queries ``[L, B, Hq, T, D]``, positions ``[B, T]``."""
    cache = state.cache.begin_forward(jnp.asarray(positions))
    for layer in range(L):
        cache = cache.store(jnp.asarray(layer), jnp.asarray(queries[layer]).transpose(0, 2, 1, 3),
                            k[layer], v[layer])
    return state.replace(cache=cache.end_forward(k.shape[3]))


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


class Run(NamedTuple):
    """A prefill + decode run: the final state, the column positions ``cols [B, S]``, per
    query column ``t`` the positions each (layer, row, KV head) saw (``seen[t]``), and every
    compression as ``(state before, state after)``."""

    state: kv_state.SparseKVState
    cols: np.ndarray
    seen: dict
    compressions: list


def _positions(state) -> dict:
    """The resident token positions of each (layer, row, KV head): what the cache holds,
    whatever slots it holds them in."""
    pos = np.asarray(state.cache.pos)
    return {(l, b, h): {int(p) for p in pos[l, b, h] if p >= 0}
            for l in range(L) for b in range(B) for h in range(HKV)}


@functools.lru_cache(maxsize=None)
def _run(cfg, prompt_len, pads, steps, seed=0, max_len=None) -> Run:
    """Prefill a left-padded prompt, decode ``steps`` tokens (see :class:`Run`)."""
    rng = np.random.default_rng(seed)
    max_len = max_len or prompt_len + steps
    state = kv_state.init_state(
        cfg, num_layers=L, batch=B, num_heads=HQ, num_kv_heads=HKV, head_dim=D, max_len=max_len
    )
    cols = np.arange(prompt_len + steps)[None, :] - np.asarray(pads)[:, None]
    cols = np.where(cols >= 0, cols, -1).astype(np.int32)  # [B, S]

    def visible_now(state, qpos):
        return {key: {p for p in held if p <= qpos[key[1]]}
                for key, held in _positions(state).items()}

    def compressed(before, after):
        if not np.array_equal(before.cache.pos, after.cache.pos):
            compressions.append((before, after))
        return after

    seen, compressions = {}, []
    k, v, q = _tokens(rng, prompt_len)
    kv_state.check_prompt_fits(cfg, prompt_len, None if cfg.compresses else max_len)
    state = _write_jit(state, k, v, cols[:, :prompt_len], q)
    for t in range(prompt_len):  # prefill is dense: each prompt query saw the whole prompt prefix
        seen[t] = visible_now(state, cols[:, t])
    state = compressed(state, jax.jit(
        lambda s: kv_state.maybe_compress(s, cfg, after_prefill=True))(state))
    step = _step(cfg)
    for s in range(steps):
        t = prompt_len + s
        k, v, q = _tokens(rng, 1)
        written = _write_jit(state, k, v, cols[:, t : t + 1], q)  # what the model attends over
        seen[t] = visible_now(written, cols[:, t])
        state = compressed(written, step(state, k, v, cols[:, t : t + 1], q))
    return Run(state, cols, seen, compressions)


def _reference_kept(before, cfg) -> dict:
    """What one compression of ``before`` must keep, per (layer, row, KV head), in positions:
    ``(sure, tied)``, the positions it must keep and those it may keep. NumPy selection over
    the engine's eviction scores (``slot_scores``, checked against NumPy references in
    test_kv_scores): the ``window`` newest resident tokens, then the others by score (summed
    over KV heads for ``head_mode: shared``) up to ``budget``; positions scored equal to the
    last one kept are ``tied``."""
    cache = before.cache
    pos = np.asarray(cache.pos)
    z = np.stack([np.asarray(slot_scores(cfg, before.cache.queries[l], cache.k[l], cache.pos[l],
                                         cache.index)) for l in range(L)])
    by_pos = [[[{int(p): float(x) for p, x in zip(pos[l, b, h], z[l, b, h]) if p >= 0}
                for h in range(HKV)] for b in range(B)] for l in range(L)]
    out = {}
    for l, b, h in np.ndindex(L, B, HKV):
        score = by_pos[l][b][h]
        if cfg.eviction.head_mode == "shared":
            score = {p: sum(heads[p] for heads in by_pos[l][b]) for p in score}
        resident = sorted(score)
        window = set(resident[-cfg.eviction.window:])
        ranked = sorted(set(resident) - window, key=lambda p: -score[p])
        room = cfg.eviction.budget - cfg.eviction.window
        if len(ranked) <= room:
            out[l, b, h] = (window | set(ranked), set())
            continue
        last = score[ranked[room - 1]]
        sure = window | {p for p in ranked if score[p] > last}
        out[l, b, h] = (sure, {p for p in ranked if score[p] == last})
    return out


CONFIGS = [
    CompressionConfig(method="snapkv", eviction=EvictionConfig(budget=10, buffer=4, window=3)),
    CompressionConfig(method="rkv", eviction=EvictionConfig(budget=10, buffer=4, window=3,
                                                            head_mode="shared")),
    CompressionConfig(method="rkv", eviction=EvictionConfig(budget=9, buffer=3, window=4,
                                                            importance="kvpress_snapkv")),
    CompressionConfig(method="streaming", eviction=EvictionConfig(budget=10, buffer=4, window=3,
                                                                  num_sinks=2)),
]
REPLAY_RUN = dict(prompt_len=12, pads=(0, 5), steps=14)
config_ids = pytest.mark.parametrize(
    "cfg", CONFIGS, ids=lambda c: f"{c.method}-{c.eviction.head_mode}-{c.eviction.importance}")


@config_ids
def test_eviction_record_replays_visibility(cfg):
    prompt_len, steps = REPLAY_RUN["prompt_len"], REPLAY_RUN["steps"]
    state, cols, seen, _ = _run(cfg, **REPLAY_RUN)
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


@config_ids
def test_each_compression_keeps_the_reference_set_and_records_the_rest(cfg):
    state, _, _, compressions = _run(cfg, **REPLAY_RUN)
    assert len(compressions) >= 3
    record = np.asarray(state.evicted_at)
    for before, after in compressions:
        held, kept = _positions(before), _positions(after)
        for key, (sure, tied) in _reference_kept(before, cfg).items():
            assert sure <= kept[key] <= sure | tied, key
            assert len(kept[key]) == min(cfg.eviction.budget, len(held[key])), key
            # each evicted token's record is the row's next query position at that time
            newest = max(max(held[k]) for k in held if k[:2] == key[:2])
            for p in held[key] - kept[key]:
                assert record[key][p] == newest + 1, (key, p)
        if cfg.eviction.head_mode == "shared":
            assert all(kept[l, b, h] == kept[l, b, 0] for l, b, h in kept)
    if cfg.method == "streaming":  # sinks and recency alone decide: the sinks survive
        sinks = {(l, b, h): set(sorted(p)[:cfg.eviction.num_sinks])
                 for (l, b, h), p in _positions(compressions[0][0]).items()}
        assert all(sinks[key] <= held for key, held in _positions(state).items())


def test_compression_cadence_and_resident_tokens():
    cfg = CompressionConfig(method="snapkv", eviction=EvictionConfig(budget=10, buffer=4, window=3))
    # prompt 8 <= budget: no compression at prefill; decode fills to 14 keys, then the cache
    # holds the 10 kept and the query sees them plus itself
    _, _, seen, compressions = _run(cfg, 8, (0, 3), 12)
    visible = [len(seen[t][0, 0, 0]) for t in range(8, 20)]
    assert visible == [9, 10, 11, 12, 13, 14, 11, 12, 13, 14, 11, 12]
    assert len(compressions) == 2
    # prompt 12 > budget: compressed right after prefill
    state, _, seen, compressions = _run(cfg, 12, (0, 3), 3)
    assert [len(seen[t][0, 0, 0]) for t in range(12, 15)] == [11, 12, 13]
    assert len(compressions) == 1
    resident = (np.asarray(state.cache.pos) >= 0).sum(-1)  # [L, B, Hkv] non-empty slots
    np.testing.assert_array_equal(resident[:, 0], 13)  # 15 tokens seen, 10 kept + 3 new
    np.testing.assert_array_equal(resident[:, 1], 12)  # 3 pads: 12 valid, pads went first
    held = _positions(state)
    assert all({12, 13, 14} <= held[l, 0, h] for l in range(L) for h in range(HKV))


def test_compress_keeps_the_window_and_its_queries():
    cfg = CompressionConfig(method="rkv", eviction=EvictionConfig(budget=10, buffer=4, window=3))
    prompt_len, pads = 14, (0, 2)
    state, _, _, compressions = _run(cfg, prompt_len, pads, 0)
    assert len(compressions) == 1
    for (l, b, h), held in _positions(state).items():
        newest = prompt_len - pads[b]  # one past the row's newest position
        assert len(held) == cfg.eviction.budget, (l, b, h)
        assert set(range(newest - 3, newest)) <= held, (l, b, h)
    # the query ring holds the window's queries, oldest first: the next compression's scores
    _, _, queries = _tokens(np.random.default_rng(0), prompt_len)
    np.testing.assert_array_equal(np.asarray(state.cache.queries),
                                  queries[:, :, :, -cfg.eviction.window:])


def test_repeated_compressions_compile_once():
    cfg = CompressionConfig(method="rkv", eviction=EvictionConfig(budget=10, buffer=2, window=3))
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


def test_none_keeps_every_token_as_written():
    cfg = CompressionConfig(method="none", layout="dense")  # the slot cache (paged: its own)
    prompt_len, pads, total = 6, (0, 2), 20
    state, cols, seen, compressions = _run(cfg, prompt_len, pads, total - prompt_len, seed=3,
                                           max_len=total)
    assert not compressions
    for t in range(total):  # every query sees every valid position up to its own
        for (l, b, h), got in seen[t].items():
            assert got == {int(p) for p in cols[b, : t + 1] if p >= 0}, (t, l, b, h)
    rng = np.random.default_rng(3)  # same draws as _run
    draws = [_tokens(rng, prompt_len)] + [_tokens(rng, 1) for _ in range(total - prompt_len)]
    k, v = (np.concatenate([d[i] for d in draws], axis=3) for i in (0, 1))
    pos, ks, vs = (np.asarray(x) for x in (state.cache.pos, state.cache.k, state.cache.v))
    for l, b, h in np.ndindex(L, B, HKV):  # each position's key and value, wherever held
        slot = {int(p): i for i, p in enumerate(pos[l, b, h]) if p >= 0}
        assert sorted(slot) == list(range(total - pads[b]))
        column = {int(p): i for i, p in enumerate(cols[b]) if p >= 0}
        for p, i in slot.items():
            np.testing.assert_array_equal(ks[l, b, h, i], k[l, b, h, column[p]])
            np.testing.assert_array_equal(vs[l, b, h, i], v[l, b, h, column[p]])
    assert (np.asarray(state.evicted_at) == kv_state.NEVER).all()
    assert state.evicted_at.shape[-1] == 0  # a method that never evicts keeps no record


def test_visibility_from_record_pads_and_out_of_range():
    rec = np.full((1, 1, 1, 4), kv_state.NEVER, np.int32)
    rec[0, 0, 0, 1] = 3
    got = np.asarray(kv_state.visibility_from_record(rec, np.array([[-1, 0, 1, 2, 7]], np.int32)))
    np.testing.assert_array_equal(got[0, 0, 0], [kv_state.NEVER, kv_state.NEVER, 3, kv_state.NEVER, kv_state.NEVER])


def test_query_ring_keeps_last_window_per_layer():
    """The cache's ring holds the last ``window`` queries of each layer, oldest first; only
    the evicting methods get one."""
    cfg = CompressionConfig(method="snapkv", eviction=EvictionConfig(budget=10, buffer=4, window=3))
    state = kv_state.init_state(
        cfg, num_layers=2, batch=1, num_heads=2, num_kv_heads=1, head_dim=2, max_len=8
    )
    seq = np.arange(1, 6, dtype=np.float32)[None, None, :, None, None] * np.ones((2, 1, 5, 2, 2))
    seq[1] *= 10  # layer 1's queries differ from layer 0's

    def ring(cache, layer):  # the queries held, in the order pushed, any empties left out
        held = np.asarray(cache.queries)[layer, 0, 0, :, 0].tolist()
        return [x for x in held if x]

    def store(cache, layer, q):
        kv = np.zeros((1, 1, q.shape[1], 2), np.float32)
        return cache.store(jnp.asarray(layer), q, kv, kv)

    cache = store(state.cache, 0, seq[0, :, :2])
    assert ring(cache, 0) == [1, 2] and ring(cache, 1) == []
    cache = store(store(cache, 1, seq[1, :, :2]), 0, seq[0, :, 2:])
    assert ring(cache, 0) == [3, 4, 5] and ring(cache, 1) == [10, 20]
    none = kv_state.init_state(CompressionConfig(method="none", layout="dense"), num_layers=1,
                               batch=1, num_heads=2, num_kv_heads=1, head_dim=2, max_len=8)
    assert none.cache.queries is None


def test_bad_inputs_raise_clear_errors():
    cfg = CompressionConfig(method="snapkv", eviction=EvictionConfig(budget=10, buffer=4, window=3))
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
    other = CompressionConfig(method="snapkv",
                              eviction=EvictionConfig(budget=12, buffer=4, window=3))
    with pytest.raises(ValueError, match="cache capacity 14 != budget \\+ buffer = 16"):
        kv_state.maybe_compress(state, other)
    with pytest.raises(ValueError, match="never compresses"):
        kv_state.compress(state, CompressionConfig(method="none"))
