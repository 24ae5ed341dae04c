"""The rollout sampler against transformers' greedy generate, the dense scorer and the
eviction-record replay, plus sampling-distribution and recompilation checks."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import models
from benchmarks.kit.compile_count import count_compiles
from sparse_rl_jax.kv import state as kv_state
from sparse_rl_jax.kv.compression_config import CompressionConfig
from sparse_rl_jax.kv.compression_sections import EvictionConfig
from sparse_rl_jax.rollout.sampler import bucket_prompts, generate
from sparse_rl_jax.rollout.sampling_config import SamplingConfig
from sparse_rl_jax.rollout.scoring import score
from sparse_rl_jax.rollout.token_sampling import sample_tokens
from tiny_hf import left_padded_batch, load_hf, make_tiny_hf

EOS = 2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_hf(tmp_path_factory.mktemp("sampler"), "qwen2", tokenizer=False, std=0.2)
    model = models.load_pretrained(path, dtype=jnp.float32)
    graphdef, params = nnx.split(model)
    prompt, mask = left_padded_batch(np.random.default_rng(0), [11, 5, 8], width=11)
    return path, graphdef, params, prompt, mask


def _masked_max_diff(a, b, mask):
    return float(jnp.max(jnp.where(mask.astype(bool), jnp.abs(a - b), 0.0)))


@pytest.mark.parametrize("layout", ["paged", "dense"])  # method none's own, the slot cache
def test_dense_greedy_matches_transformers_generate(tiny, layout):
    path, graphdef, params, prompt, mask = tiny
    sampling = SamplingConfig(max_new_tokens=12, greedy=True, eos_ids=(EOS,), prompt_bucket=4)
    rollout = generate(graphdef, params, prompt, mask, jax.random.key(0), sampling,
                       CompressionConfig(method="none", layout=layout, page_size=4))
    hf = load_hf(path)
    with torch.no_grad():
        out = hf.generate(
            input_ids=torch.as_tensor(prompt, dtype=torch.long),
            attention_mask=torch.as_tensor(mask, dtype=torch.long),
            max_new_tokens=12, do_sample=False, eos_token_id=EOS, pad_token_id=0,
        )
    expected = out[:, prompt.shape[1]:].numpy()
    got = np.asarray(rollout.response)
    lengths = np.asarray(rollout.response_mask).sum(1)
    for row in range(prompt.shape[0]):
        n = lengths[row]
        np.testing.assert_array_equal(got[row, :n], expected[row, :n], err_msg=f"row {row}")
        if n < 12:  # stopped at EOS exactly where transformers did
            assert got[row, n - 1] == EOS and expected[row, n - 1] == EOS


@pytest.mark.parametrize("layout", ["paged", "dense"])
def test_dense_sampler_logprobs_equal_scorer(tiny, layout):
    _, graphdef, params, prompt, mask = tiny
    sampling = SamplingConfig(max_new_tokens=16, num_samples=2, eos_ids=(EOS,), prompt_bucket=4)
    rollout = generate(graphdef, params, prompt, mask, jax.random.key(1), sampling,
                       CompressionConfig(method="none", layout=layout, page_size=4))
    assert rollout.response.shape == (6, 16)
    dense = score(graphdef, params, rollout.prompt, rollout.prompt_mask, rollout.response)
    assert _masked_max_diff(dense.logp, rollout.logp, rollout.response_mask) <= 1e-4
    # No compression: the KV statistics equal the dense ones.
    np.testing.assert_allclose(rollout.kv_peak, rollout.dense_kv_peak)
    np.testing.assert_allclose(rollout.kv_mean, rollout.dense_kv_mean)


def test_paged_layout_samples_the_dense_layouts_tokens(tiny):
    """A sampled (temperature 1, top-p) run: the paged cache draws the same tokens as the slot
    cache from the same key, its log-probs within float summation order, across pages of 4
    and a prompt bucket that is not a whole number of pages."""
    _, graphdef, params, prompt, mask = tiny
    sampling = SamplingConfig(max_new_tokens=30, num_samples=2, top_p=0.95, prompt_bucket=6)
    key = jax.random.key(7)
    runs = {layout: generate(graphdef, params, prompt, mask, key, sampling,
                             CompressionConfig(method="none", layout=layout, page_size=4))
            for layout in ("dense", "paged")}
    np.testing.assert_array_equal(runs["paged"].response, runs["dense"].response)
    np.testing.assert_array_equal(runs["paged"].response_mask, runs["dense"].response_mask)
    assert int(runs["paged"].response_mask.sum()) > 60  # long enough to cross many pages
    assert _masked_max_diff(runs["paged"].logp, runs["dense"].logp,
                            runs["dense"].response_mask) <= 1e-5


@pytest.mark.parametrize("method", ["rkv", "snapkv"])
def test_sparse_logprobs_equal_replayed_scorer_not_dense(tiny, method):
    _, graphdef, params, prompt, mask = tiny
    sampling = SamplingConfig(max_new_tokens=40, num_samples=2, prompt_bucket=4,
                              record_evictions=True)
    compression = CompressionConfig(method=method,
                                    eviction=EvictionConfig(budget=12, buffer=4, window=4))
    rollout = generate(graphdef, params, prompt, mask, jax.random.key(2), sampling, compression)
    assert int(rollout.num_compressions) >= 5
    record = rollout.record
    assert isinstance(record, kv_state.EvictionRecord)
    replay = score(graphdef, params, rollout.prompt, rollout.prompt_mask, rollout.response,
                   record)
    dense = score(graphdef, params, rollout.prompt, rollout.prompt_mask, rollout.response)
    assert _masked_max_diff(replay.logp, rollout.logp, rollout.response_mask) <= 1e-4
    assert _masked_max_diff(dense.logp, rollout.logp, rollout.response_mask) > 1e-2
    # The cache never holds more than budget + buffer tokens; the dense one grows past it.
    assert float(jnp.max(rollout.kv_peak)) <= compression.capacity
    assert float(jnp.max(rollout.dense_kv_peak)) > compression.capacity


def test_default_keeps_no_record_same_rollout_and_replay_is_refused(tiny):
    """SamplingConfig's default (record_evictions None: as needed, which the sampler alone
    reads as off) keeps no record and changes nothing else."""
    _, graphdef, params, prompt, mask = tiny
    sampling = SamplingConfig(max_new_tokens=24, num_samples=2, prompt_bucket=4,
                              record_evictions=True)
    compression = CompressionConfig(method="rkv",
                                    eviction=EvictionConfig(budget=12, buffer=4, window=4))
    key = jax.random.key(5)
    kept = generate(graphdef, params, prompt, mask, key, sampling, compression)
    dropped = generate(graphdef, params, prompt, mask, key,
                       dataclasses.replace(sampling, record_evictions=None), compression)
    assert int(dropped.num_compressions) >= 2
    assert dropped.record is None
    assert int(jnp.min(kept.record.evicted_at)) < kv_state.NEVER  # the kept one records
    for name in ("response", "response_mask", "logp", "kv_peak", "kv_mean"):
        np.testing.assert_array_equal(getattr(dropped, name), getattr(kept, name), err_msg=name)
    empty = kv_state.EvictionRecord(kept.record.evicted_at[..., :0])
    with pytest.raises(ValueError, match="record_evictions=True"):
        score(graphdef, params, dropped.prompt, dropped.prompt_mask, dropped.response, empty)
    with pytest.raises(TypeError, match="record: expected a replay record"):  # a bare array
        score(graphdef, params, kept.prompt, kept.prompt_mask, kept.response,
              kept.record.evicted_at)


@pytest.mark.parametrize("compression", [
    CompressionConfig(method="snapkv", eviction=EvictionConfig(budget=12, buffer=4, window=4)),
    CompressionConfig(method="none", page_size=4)], ids=["snapkv", "none-paged"])
def test_repeated_calls_with_same_bucket_do_not_recompile(tiny, compression):
    _, graphdef, params, prompt, mask = tiny
    sampling = SamplingConfig(max_new_tokens=6, prompt_bucket=16)
    with count_compiles() as first:
        generate(graphdef, params, prompt, mask, jax.random.key(3), sampling, compression)
    shorter = np.where(mask[:, 2:] > 0, prompt[:, 2:] + 1, 0).astype(np.int32)
    with count_compiles() as again:
        generate(graphdef, params, shorter, mask[:, 2:], jax.random.key(4), sampling, compression)
    assert first["jit(prefill)"] <= 1 and first["jit(decode_loop)"] <= 1
    assert again["jit(prefill)"] == 0 and again["jit(decode_loop)"] == 0, again


def test_prompt_longer_than_capacity_is_an_error(tiny):
    _, graphdef, params, prompt, mask = tiny
    with pytest.raises(ValueError, match=r"prompt length 11 exceeds the KV cache capacity \(budget 6 \+ buffer 4 = 10"):
        generate(graphdef, params, prompt, mask, jax.random.key(0), SamplingConfig(),
                 CompressionConfig(method="rkv",
                                   eviction=EvictionConfig(budget=6, buffer=4, window=2)))


def test_bucket_prompts_pads_left_and_rejects_right_padding():
    prompt = np.array([[0, 5, 6], [7, 8, 9]])
    mask = np.array([[0, 1, 1], [1, 1, 1]])
    out, out_mask = bucket_prompts(prompt, mask, bucket=4)
    np.testing.assert_array_equal(out, [[0, 0, 5, 6], [0, 7, 8, 9]])
    np.testing.assert_array_equal(out_mask, [[0, 0, 1, 1], [0, 1, 1, 1]])
    with pytest.raises(ValueError, match="left-padded"):
        bucket_prompts(prompt, np.array([[1, 1, 0], [1, 1, 1]]), bucket=4)


def _reference_distribution(logits, temperature, top_k, top_p):
    """Straightforward NumPy construction: temperature, then top-k, then the nucleus of what
    is left (a token is kept while the mass of the tokens ranked before it is < top_p)."""
    z = logits / temperature
    order = np.argsort(-z, kind="stable")
    kept = order[:top_k] if top_k else order
    p = np.exp(z[kept] - z.max())
    p /= p.sum()
    out = np.zeros_like(z)
    mass = 0.0
    for idx, pi in zip(kept, p):
        if mass >= top_p:
            break
        out[idx] = pi
        mass += pi
    return out / out.sum()


@pytest.mark.parametrize(
    "temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 4, 1.0), (1.0, 0, 0.8),
                                (1.0, 6, 0.7)]
)
def test_sampling_frequencies_match_distribution(temperature, top_k, top_p):
    vocab, draws = 12, 20000
    logits = np.random.default_rng(7).normal(size=vocab).astype(np.float32) * 1.5
    cfg = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    keys = jax.random.split(jax.random.key(11), draws)
    tokens, logp = jax.jit(jax.vmap(lambda k: sample_tokens(k, jnp.asarray(logits)[None], cfg)))(
        keys)
    freq = np.bincount(np.asarray(tokens)[:, 0], minlength=vocab) / draws
    expected = _reference_distribution(logits.astype(np.float64), temperature, top_k, top_p)
    tv = 0.5 * np.abs(freq - expected).sum()
    assert tv < 0.02, (freq, expected)
    assert np.all(freq[expected == 0] == 0)
    # The recorded log-prob is under the temperature-scaled (untruncated) policy.
    full = logits / temperature - np.log(np.exp(logits / temperature).sum())
    np.testing.assert_allclose(np.asarray(logp)[:, 0], full[np.asarray(tokens)[:, 0]],
                               rtol=1e-5, atol=1e-5)
