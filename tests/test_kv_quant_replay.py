"""Quantized rollouts (``compression.quant``) against the replay of their record: the sampler's
log-probs equal a teacher-forced forward that quantizes its own keys and values the same way,
and differ from the full-precision replay (the learner's dense view stays full precision). Equal up to
rounding-boundary flips: a code one step off where the two forwards' keys straddle a rounding
boundary (see the test's comment)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from sparse_rl_jax.core.config_checks import ConfigError
from sparse_rl_jax.kv import state as kv_state
from sparse_rl_jax.kv.compression_config import CompressionConfig
from sparse_rl_jax.kv.compression_sections import EvictionConfig, SparrowConfig
from sparse_rl_jax.rollout.engine import generate_continuous
from sparse_rl_jax.rollout.sampler import generate
from sparse_rl_jax.rollout.sampling_config import SamplingConfig
from sparse_rl_jax.rollout.scoring import score
from tiny_hf import left_padded_batch, make_tiny_hf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_hf(tmp_path_factory.mktemp("quant"), "qwen2", tokenizer=False, std=0.2)
    graphdef, params = nnx.split(models.load_pretrained(path, dtype=jnp.float32))
    prompt, mask = left_padded_batch(np.random.default_rng(1), [9, 5, 7], width=9)
    return graphdef, params, prompt, mask


def _max_diff(a, b, mask):
    return float(jnp.max(jnp.where(mask.astype(bool), jnp.abs(a - b), 0.0)))


EVICT = EvictionConfig(budget=12, buffer=4, window=4)
SPARROW = SparrowConfig(budget_schedule=((0, 1), (32, 3)), dense_layers=(0,))
CASES = [("rkv", None, "int8"), ("snapkv", None, "fp8"), ("streaming", None, "int4"),
         ("none", "dense", "int8"), ("none", "paged", "fp8"), ("sparrow", None, "int4"),
         ("sparrow", None, "int8")]


def _compression(method, layout, quant):
    """The tests' config: eviction every few steps, or Sparrow on 4-token pages."""
    return CompressionConfig(method=method, layout=layout, quant=quant, eviction=EVICT,
                             page_size=4, sparrow=SPARROW)


@pytest.mark.parametrize("method,layout,quant", CASES)
def test_quantized_rollout_equals_its_replay(tiny, method, layout, quant):
    graphdef, params, prompt, mask = tiny
    sampling = SamplingConfig(max_new_tokens=16, num_samples=2, prompt_bucket=4,
                              record_evictions=True)
    compression = _compression(method, layout, quant)
    rollout = generate(graphdef, params, prompt, mask, jax.random.key(3), sampling, compression)
    assert rollout.record.quant == quant
    replay = score(graphdef, params, rollout.prompt, rollout.prompt_mask, rollout.response,
                   rollout.record)
    exact = score(graphdef, params, rollout.prompt, rollout.prompt_mask, rollout.response,
                  dataclasses.replace(rollout.record, quant="none")
                  if method != "none" else None)
    on = np.asarray(rollout.response_mask) > 0
    replay_err = np.abs(np.asarray(replay.logp - rollout.logp))[on]
    exact_err = np.abs(np.asarray(exact.logp - rollout.logp))[on]
    # The replay quantizes keys computed by another forward (float summation order ~1e-7):
    # where one lands on a rounding boundary its code differs by one step, and the tokens
    # that attend to it differ by ~1e-3 (int8, whose steps are finest, on a few % of tokens).
    assert np.median(replay_err) <= 1e-5
    assert np.mean(replay_err <= 1e-4) >= 0.85
    # the same record at full precision is another policy, far from the sampler's
    assert exact_err.max() > 1e-2 and replay_err.max() <= 0.05 * exact_err.max()
    if method in ("rkv", "snapkv", "streaming"):
        assert int(rollout.num_compressions) >= 3
    if method == "sparrow":  # some decode steps left middle pages out
        pages = np.asarray(rollout.record.pages)[:, 1:]
        assert (pages[..., 1:-2] == -1).any() and (pages[..., 1:-2] >= 1).any()


def test_quantized_cache_stores_codes_and_scales():
    state = kv_state.init_state(CompressionConfig(method="rkv", quant="int4", eviction=EVICT),
                                num_layers=2, batch=3, num_heads=4, num_kv_heads=2,
                                head_dim=8, max_len=40)
    cache = state.cache
    assert cache.k.dtype == jnp.uint8 and cache.k.shape == (2, 3, 2, 16, 4)
    assert cache.k_scale.shape == (2, 3, 2, 16) and cache.k_scale.dtype == jnp.bfloat16


def test_bad_quant_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError, match="quant.*must be one of.*'int8'"):
        CompressionConfig(method="rkv", quant="int2")
    with pytest.raises(ValueError, match="head_dim divisible by 2, got 7"):
        kv_state.init_state(CompressionConfig(method="rkv", quant="int4", eviction=EVICT),
                            num_layers=1, batch=1, num_heads=2, num_kv_heads=1, head_dim=7,
                            max_len=20)


def test_memory_plan_counts_codes_and_scales():
    from models.config import ModelConfig
    from sparse_rl_jax.training.memory_plan import kv_cache_bytes
    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=256, intermediate_size=64, num_layers=2,
                      num_heads=2, num_kv_heads=2, head_dim=128)
    positions = 4 * 10 * 2 * 2  # int32 per slot, layer and KV head
    vectors = 2 * 2 * 4 * 2 * 10  # keys + values of every layer, row, KV head and slot
    for quant, per_vector in (("none", 256), ("int8", 130), ("fp8", 130), ("int4", 66)):
        got = kv_cache_bytes(cfg, 4, 10, jnp.bfloat16, quant=quant)
        assert got == vectors * per_vector + 4 * positions, quant


@pytest.mark.parametrize("method,layout,quant", [("rkv", None, "int8"), ("none", "dense", "int4"),
                                                 ("none", "paged", "int8"),
                                                 ("sparrow", None, "int4")])
def test_engine_rows_equal_static_rows_on_a_quantized_cache(tmp_path, method, layout, quant):
    """Slots, and the page pool (layout ``paged``: ``none``, ``sparrow``) holding codes and
    scales."""
    from test_engine import SAMPLING, assert_rows_match  # the engine tests' oracle
    path = make_tiny_hf(tmp_path, "qwen2", tokenizer=False, std=0.2)
    graphdef, params = nnx.split(models.load_pretrained(path, dtype=jnp.float32))
    prompt, mask = left_padded_batch(np.random.default_rng(0), [11, 5, 8], width=11)
    compression = _compression(method, layout, quant)
    sampling = dataclasses.replace(SAMPLING, top_p=0.95,
                                   pool_pages=12 if layout == "paged" or method == "sparrow" else 0)
    static = generate(graphdef, params, prompt, mask, jax.random.key(2), sampling, compression)
    engine = generate_continuous(graphdef, params, prompt, mask, jax.random.key(2), sampling,
                                 compression)
    assert_rows_match(graphdef, params, static, engine, compression)
