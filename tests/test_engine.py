"""The continuous-batching engine against its oracles: the static ``sampler.generate`` for the
same key (row by row: tokens, log-probs, replay records), the replayed ``score`` of its own
rows (the sampler's exactness oracle), and its compile count over a multi-call run."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from benchmarks.kit.compile_count import count_compiles
from sparse_rl_jax.kv.compression_config import CompressionConfig
from sparse_rl_jax.kv.compression_sections import EvictionConfig, SparrowConfig
from sparse_rl_jax.kv.page_sparsity import PageRecord
from sparse_rl_jax.kv.state import NEVER, EvictionRecord
from sparse_rl_jax.rollout import engine as engine_module
from sparse_rl_jax.rollout.engine import generate_continuous, generate_rollout, run_continuous
from sparse_rl_jax.rollout.sampler import generate
from sparse_rl_jax.rollout.sampling_config import SamplingConfig
from sparse_rl_jax.rollout.scoring import score, sequence_positions
from sparse_rl_jax.training.collect import collect_prompts
from tiny_hf import left_padded_batch, make_tiny_hf
from tiny_rl import step_context, tiny_task_policy

EOS = 2
METHODS = {
    "none": CompressionConfig(method="none", page_size=4),
    "none-dense": CompressionConfig(method="none", layout="dense"),
    "rkv": CompressionConfig(method="rkv", eviction=EvictionConfig(budget=12, buffer=4, window=4)),
    "snapkv": CompressionConfig(method="snapkv", eviction=EvictionConfig(budget=12, buffer=4, window=4)),
    "streaming": CompressionConfig(method="streaming", eviction=EvictionConfig(budget=10, buffer=4, window=4)),
    "sparrow": CompressionConfig(method="sparrow", page_size=4, sparrow=SparrowConfig(
        budget_schedule=((0, 1), (32, 3)), dense_layers=(0,))),
}
# 3 prompts x 2 samples = 6 rows through 4 slots: rows are refilled into freed slots.
SAMPLING = SamplingConfig(max_new_tokens=26, num_samples=2, prompt_bucket=4, eos_ids=(EOS,),
                          record_evictions=True, engine="continuous", slots=4, chunk=5)
MODES = {"greedy": dict(greedy=True), "sampled": dict(top_p=0.95)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_hf(tmp_path_factory.mktemp("engine"), "qwen2", tokenizer=False, std=0.2)
    graphdef, params = nnx.split(models.load_pretrained(path, dtype=jnp.float32))
    prompt, mask = left_padded_batch(np.random.default_rng(0), [11, 5, 8], width=11)
    return graphdef, params, prompt, mask


def _policy_logits(graphdef, params, rollout, record) -> np.ndarray:
    """``[N, M, V]`` logits of every response token under the policy that sampled it (the
    rollout's replay record; dense when None)."""
    model = nnx.merge(graphdef, params)
    m, p = rollout.response.shape[1], rollout.prompt.shape[1]
    positions = sequence_positions(rollout.prompt_mask, m)
    view = None if record is None else record.replay_view(
        positions, rollout.prompt_mask.sum(axis=1), m)
    tokens = jnp.concatenate([rollout.prompt, rollout.response], axis=1)
    return np.asarray(model(tokens, positions, kv=view).logits[:, p - 1:p - 1 + m])


def _replay_relevant(record, rollout) -> np.ndarray:
    """The eviction record with what no replay query reads set to ``NEVER``: keys past the
    row's last query (position ``plen + len - 2``) and evictions after it (the static loop
    keeps feeding a finished row; the engine retires it)."""
    end = np.asarray(rollout.prompt_mask.sum(1) + rollout.response_mask.sum(1) - 1)
    end = end[:, None, None, None]  # the record is rows first: [N, L, Hkv, T]
    record = np.asarray(record)
    position = np.arange(record.shape[-1])[None, None, None]  # [1, 1, 1, T]
    return np.where((record < end) & (position < end), record, NEVER)


def assert_rows_match(graphdef, params, static, engine, compression):
    """Engine rows == static rows; a row may diverge only at a near-tie (the two top logits
    of the sampling policy within 1e-5), after which the rest of it is not compared."""
    mask = np.asarray(static.response_mask)
    got, want = np.asarray(engine.response), np.asarray(static.response)
    record = static.record
    diverged = set()
    for row in np.flatnonzero(np.any((got != want) & (mask > 0), axis=1)):
        t = int(np.argmax((got[row] != want[row]) & (mask[row] > 0)))
        top2 = np.sort(_policy_logits(graphdef, params, static, record)[row, t])[-2:]
        assert top2[1] - top2[0] <= 1e-5, f"row {row} token {t}: not a near-tie ({top2})"
        diverged.add(int(row))
    same = np.asarray([r not in diverged for r in range(len(got))])
    assert same.sum() >= len(got) - 1, "more than one row diverged"
    np.testing.assert_array_equal(engine.response_mask[same], static.response_mask[same])
    np.testing.assert_array_equal(got[same], want[same])
    np.testing.assert_allclose(np.asarray(engine.logp)[same], np.asarray(static.logp)[same],
                               atol=1e-5, rtol=0)
    for name in ("finished", "kv_peak", "kv_mean", "dense_kv_peak", "dense_kv_mean"):
        np.testing.assert_allclose(np.asarray(getattr(engine, name))[same],
                                   np.asarray(getattr(static, name))[same], err_msg=name)
    if not diverged:
        assert int(engine.num_compressions) == int(static.num_compressions)
    assert type(engine.record) is type(static.record)
    if isinstance(static.record, EvictionRecord):
        np.testing.assert_array_equal(
            _replay_relevant(engine.record.evicted_at, engine)[same],
            _replay_relevant(static.record.evicted_at, static)[same])
    if isinstance(static.record, PageRecord):
        np.testing.assert_array_equal(np.asarray(engine.record.pages)[same],
                                      np.asarray(static.record.pages)[same])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("method", METHODS)
def test_engine_rows_equal_static_generate_and_replayed_score(tiny, method, mode):
    graphdef, params, prompt, mask = tiny
    compression, sampling = METHODS[method], dataclasses.replace(SAMPLING, **MODES[mode])
    key = jax.random.key(2)
    static = generate(graphdef, params, prompt, mask, key, sampling, compression)
    engine = generate_continuous(graphdef, params, prompt, mask, key, sampling, compression)
    lengths = np.asarray(engine.response_mask.sum(1))
    assert lengths.min() < lengths.max() == sampling.max_new_tokens  # rows end unevenly
    if compression.compresses:
        assert int(engine.num_compressions) >= 3
    assert_rows_match(graphdef, params, static, engine, compression)
    record = engine.record
    assert (record is None) == (method.startswith("none"))
    replay = score(graphdef, params, engine.prompt, engine.prompt_mask, engine.response, record,
                   temperature=sampling.temperature)
    err = jnp.max(jnp.abs(replay.logp - engine.logp) * engine.response_mask)
    assert float(err) <= 1e-4


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("method,pool_pages", [("none", 10), ("none", 14), ("sparrow", 12)])
def test_paged_rows_through_a_small_page_pool_equal_static_generate(tiny, mode, method,
                                                                   pool_pages):
    """Rows sharing a pool of 10 pages (one max-length row: 12 + 26 positions in pages of
    4; rows wait for pages, and the newest is preempted and re-run when the pool is short)
    or more, against 4 slots x 10 pages of per-slot KV: the static rows (Sparrow's selected
    pages included: it selects among its row's pages, read through the table), the replayed
    score."""
    graphdef, params, prompt, mask = tiny
    compression = METHODS[method]
    sampling = dataclasses.replace(SAMPLING, pool_pages=pool_pages, **MODES[mode])
    key = jax.random.key(2)
    static = generate(graphdef, params, prompt, mask, key, sampling, compression)
    engine, slots, _, schedule = run_continuous(graphdef, params, prompt, mask, key, sampling,
                                                compression)
    assert schedule.peak_pages <= pool_pages < slots * 10
    assert schedule.peak_live >= 2 and schedule.preemptions > 0  # some rows ran twice
    assert_rows_match(graphdef, params, static, engine, compression)
    replay = score(graphdef, params, engine.prompt, engine.prompt_mask, engine.response,
                   engine.record, temperature=sampling.temperature)
    err = jnp.max(jnp.abs(replay.logp - engine.logp) * engine.response_mask)
    assert float(err) <= 1e-4


@pytest.mark.parametrize("method,pool_pages", [("none", 10), ("sparrow", 12)])
def test_a_preempted_rows_reinsert_clears_its_first_runs_outputs(tiny, monkeypatch, method,
                                                                pool_pages):
    """The outputs right after each insert: every inserted row holds its token 0 (the
    rollout's) and nothing after it (``pad_id``, log-prob 0, page record -1), including the
    rows that were preempted after sampling more tokens and are re-inserted."""
    graphdef, params, prompt, mask = tiny
    sampling = dataclasses.replace(SAMPLING, pool_pages=pool_pages, greedy=True, pad_id=7)
    calls, real_insert = [], engine_module.insert

    def recording_insert(*args, **kwargs):
        before = np.array(args[3].response)  # ``out`` is donated: read it before the call
        slots, out = real_insert(*args, **kwargs)
        groups, targets = np.asarray(args[8]), np.asarray(args[9])
        rows = (np.maximum(groups, 0)[:, None] * SAMPLING.num_samples
                + np.arange(SAMPLING.num_samples)).reshape(-1)[targets < len(slots.row)]
        calls.append((before[rows], rows, np.array(out.response), np.array(out.logp),
                      np.array(out.page_record)))
        return slots, out

    monkeypatch.setattr(engine_module, "insert", recording_insert)
    rollout, _, _, schedule = run_continuous(graphdef, params, prompt, mask, jax.random.key(2),
                                             sampling, METHODS[method])
    assert schedule.preemptions > 0
    stale = 0  # inserted rows whose first run had left tokens after token 0
    for before, rows, response, logp, page_record in calls:
        stale += int(np.sum(np.any(before[:, 1:] != sampling.pad_id, axis=1)))
        np.testing.assert_array_equal(response[rows, 0], np.asarray(rollout.response)[rows, 0])
        np.testing.assert_array_equal(response[rows, 1:], sampling.pad_id)
        np.testing.assert_array_equal(logp[rows, 1:], 0.0)
        np.testing.assert_array_equal(page_record[:, rows], -1)
    assert stale > 0


def test_a_pool_that_cannot_hold_one_row_is_an_error_naming_the_smallest(tiny):
    graphdef, params, prompt, mask = tiny
    with pytest.raises(ValueError, match=r"sampling.pool_pages=9 cannot hold one max-length "
                                         r"row of 38 positions .* smallest pool that works is "
                                         r"10 pages"):
        generate_continuous(graphdef, params, prompt, mask, jax.random.key(0),
                            dataclasses.replace(SAMPLING, pool_pages=9), METHODS["none"])
    with pytest.raises(ValueError, match="pool_pages"):
        dataclasses.replace(SAMPLING, pool_pages=-1)


def test_slot_count_and_chunk_do_not_change_rows(tiny):
    """One slot (every row waits for the previous one) and 6 slots (no refill), a chunk of 1
    and of 7: the same rows as the static rollout."""
    graphdef, params, prompt, mask = tiny
    compression = METHODS["rkv"]
    sampling = dataclasses.replace(SAMPLING, max_new_tokens=18)
    static = generate(graphdef, params, prompt, mask, jax.random.key(4), sampling, compression)
    for slots, chunk in ((1, 7), (6, 1)):
        engine = generate_continuous(graphdef, params, prompt, mask, jax.random.key(4),
                                     dataclasses.replace(sampling, slots=slots, chunk=chunk),
                                     compression)
        assert_rows_match(graphdef, params, static, engine, compression)


def test_row_caps_stop_rows_early_with_the_static_prefix(tiny):
    graphdef, params, prompt, mask = tiny
    compression = METHODS["snapkv"]
    static = generate(graphdef, params, prompt, mask, jax.random.key(6), SAMPLING, compression)
    caps = np.array([26, 3, 9, 26, 17, 1], np.int32)
    engine = generate_continuous(graphdef, params, prompt, mask, jax.random.key(6), SAMPLING,
                                 compression, row_caps=caps)
    want_len = np.minimum(np.asarray(static.response_mask.sum(1)), caps)
    np.testing.assert_array_equal(engine.response_mask.sum(1), want_len)
    for row, n in enumerate(want_len):
        np.testing.assert_array_equal(engine.response[row, :n], static.response[row, :n])
        np.testing.assert_allclose(engine.logp[row, :n], static.logp[row, :n], atol=1e-5)
    truncated = want_len < np.asarray(static.response_mask.sum(1))
    assert truncated.any() and not np.asarray(engine.finished)[truncated].any()
    with pytest.raises(ValueError, match=r"row_caps: expected 6 ints in \[1, max_new_tokens=26\], "
                                         r"got row_caps\[0\]=52, row_caps\[3\]=52, "
                                         r"row_caps\[4\]=34$"):
        generate_continuous(graphdef, params, prompt, mask, jax.random.key(6), SAMPLING,
                            compression, row_caps=caps * 2)
    with pytest.raises(ValueError, match=r"row_caps: .* got shape \(6,\) dtype float64: "
                                         r"\[26\. +3\.5"):
        generate_continuous(graphdef, params, prompt, mask, jax.random.key(6), SAMPLING,
                            compression, row_caps=caps + np.array([0, 0.5, 0, 0, 0, 0]))


@pytest.mark.parametrize("method,pool_pages", [("rkv", 0), ("none", 6)])
def test_multi_call_run_compiles_each_function_once(tiny, method, pool_pages):
    """Three calls with new keys and new prompts of the same bucket: the engine's jitted
    functions compile on the first call only (and nothing compiles on the later ones); dense
    rows through a page pool of one max-length row (6 pages of 4), whose tables and
    preemptions the host uploads between chunks."""
    graphdef, params, prompt, mask = tiny
    compression = METHODS[method]
    sampling = dataclasses.replace(SAMPLING, max_new_tokens=12, slots=3, chunk=4,
                                   pool_pages=pool_pages)
    with count_compiles() as first:
        generate_continuous(graphdef, params, prompt, mask, jax.random.key(0), sampling,
                            compression)
    for name in ("init_engine", "insert", "decode_chunk"):
        assert first[f"jit({name})"] == 1, first
    with count_compiles() as again:
        for seed in (1, 2):
            shifted = np.where(mask > 0, (prompt + seed) % 100 + 3, 0).astype(np.int32)
            generate_continuous(graphdef, params, shifted, mask, jax.random.key(seed),
                                sampling, compression)
    assert sum(again.values()) == 0, again


def test_generate_rollout_dispatches_on_the_engine_switch(tiny):
    graphdef, params, prompt, mask = tiny
    compression = METHODS["streaming"]
    sampling = dataclasses.replace(SAMPLING, max_new_tokens=10)
    for engine in ("static", "continuous"):
        with count_compiles() as compiles:
            rollout = generate_rollout(graphdef, params, prompt, mask, jax.random.key(1),
                                       dataclasses.replace(sampling, engine=engine),
                                       compression)
        assert (compiles["jit(decode_chunk)"] > 0) == (engine == "continuous")
        assert rollout.response.shape == (6, 10)


def test_collect_prompts_samples_through_the_engine_switch(tmp_path_factory):
    """``collect_prompts`` (the trainer's and evaluation's rollout path) with
    ``sampling.engine: continuous`` runs the engine and returns the static rollout."""
    policy = tiny_task_policy(tmp_path_factory.mktemp("engine_collect"), dtype=jnp.float32)
    rollout_policy, params = step_context(policy).policy, policy[3]
    prompts, answers, key = ["12+3=", "4+45=", "7+7="], ["15", "49", "14"], jax.random.key(1)
    outs = {}
    for engine in ("static", "continuous"):
        sampling = dataclasses.replace(rollout_policy.sampling, engine=engine, slots=2, chunk=3)
        with count_compiles() as compiles:
            outs[engine] = collect_prompts(rollout_policy, params, prompts, answers, key,
                                           sampling=sampling, score=False)
        assert (compiles["jit(decode_chunk)"] == 1) == (engine == "continuous")
    np.testing.assert_array_equal(outs["continuous"].rollout.response,
                                  outs["static"].rollout.response)
    np.testing.assert_array_equal(outs["continuous"].rewards, outs["static"].rewards)


def test_each_prompt_is_prefilled_once_and_fanned_out(tiny):
    """With room for every row, one insert call prefills all 3 prompts once each and fans
    each out to its 2 samples' slots (``sampling.insert_prompts``); a quarter of 6 slots is
    1 prompt per call, 3 calls; the rows are the static ones either way."""
    graphdef, params, prompt, mask = tiny
    compression = METHODS["rkv"]
    sampling = dataclasses.replace(SAMPLING, max_new_tokens=8, slots=6)
    static = generate(graphdef, params, prompt, mask, jax.random.key(3), sampling, compression)
    for insert_prompts, calls in ((3, 1), (0, 3)):
        profile = {}
        engine = run_continuous(graphdef, params, prompt, mask, jax.random.key(3),
                                dataclasses.replace(sampling, insert_prompts=insert_prompts),
                                compression, profile=profile)[0]
        assert profile["inserts"] == calls, profile
        assert_rows_match(graphdef, params, static, engine, compression)
