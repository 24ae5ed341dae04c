"""The memory planner: analytic sizes against real buffers, the compiled score's footprint,
and the before-compile error naming the estimate and the largest batch that fits."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from benchmarks.kit.update_cells import compiled_update, update_model, xla_peak_bytes
from sparse_rl_jax.kv.compression_config import CompressionConfig
from sparse_rl_jax.kv.compression_sections import EvictionConfig, SparrowConfig
from sparse_rl_jax.kv.page_sparsity import PageRecord
from sparse_rl_jax.kv.state import init_state
from sparse_rl_jax.rl.lora_config import LoraConfig
from sparse_rl_jax.rl.optim import OptimConfig, make_optimizer
from sparse_rl_jax.rollout.engine_state import slot_state
from sparse_rl_jax.rollout.scoring import score
from sparse_rl_jax.training import memory_plan, update_memory

CONFIGS = [
    models.ModelConfig("qwen2", 96, 32, 48, 2, num_heads=4, num_kv_heads=2, head_dim=8,
                       attention_bias=True),
    models.ModelConfig("qwen3", 96, 32, 48, 3, num_heads=4, num_kv_heads=1, head_dim=16,
                       qk_norm=True, tie_word_embeddings=True),
    models.ModelConfig("llama", 96, 32, 48, 1, num_heads=2, num_kv_heads=2, head_dim=16,
                       attention_bias=True, o_proj_bias=True, mlp_bias=True),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.model_type)
def test_param_count_and_weight_bytes_equal_the_model(cfg):
    model = nnx.eval_shape(lambda: models.Decoder(cfg, dtype=jnp.bfloat16,
                                                  param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert memory_plan.param_count(cfg) == sum(x.size for x in leaves)
    est = memory_plan.estimate("score", cfg, batch=2, prompt_len=8, new_tokens=8,
                               dtype=jnp.bfloat16)
    assert est.parts["weights"] == sum(x.size * 2 for x in leaves)


@pytest.mark.parametrize("method,layout", [("none", None), ("none", "dense"), ("rkv", None)])
def test_rollout_kv_terms_equal_the_sampler_state(method, layout):
    cfg = CONFIGS[0]
    comp = CompressionConfig(method=method, layout=layout, page_size=5,
                             eviction=EvictionConfig(budget=8, buffer=4, window=2))
    n, p, m = 6, 8, 24
    state = jax.eval_shape(lambda: init_state(
        comp, num_layers=cfg.num_layers, batch=n, num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, max_len=p + m))
    est = memory_plan.estimate("rollout", cfg, batch=n, prompt_len=p, new_tokens=m,
                               compression=comp, num_samples=2)
    cache = state.cache
    per_row_cache = sum(x.size * x.dtype.itemsize for x in (cache.k, cache.v, cache.pos)) // n
    assert est.parts["kv_cache"] == per_row_cache * (n + n // 2)  # fanned out + prefill rows
    ring = getattr(state.cache, "queries", None)  # the paged cache (none's own) has none
    assert est.parts["query_ring"] == (0 if ring is None else ring.size * 4)
    assert (ring is None) == (method == "none")
    assert est.parts["record"] == state.evicted_at.size * 4


def test_score_estimate_covers_the_compiled_score():
    cfg = CONFIGS[0]
    model = models.Decoder(cfg, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    n, p, m = 4, 16, 48
    ints = jax.ShapeDtypeStruct((n, p), jnp.int32)
    compiled = score.lower(graphdef, params, ints, ints, jax.ShapeDtypeStruct((n, m), jnp.int32),
                           chunk_size=16).compile().memory_analysis()
    used = compiled.temp_size_in_bytes + compiled.argument_size_in_bytes
    used += compiled.output_size_in_bytes
    est = memory_plan.estimate("score", cfg, batch=n, prompt_len=p, new_tokens=m,
                               logp_chunk=16).total
    assert used <= est <= 8 * used


def test_score_estimate_covers_the_compiled_page_replay():
    """Scoring with a ``sparrow`` page record: the estimate counts the per-query selection it
    replays (the record's size over prompt + response columns) and covers the compiled call."""
    cfg = CONFIGS[0]
    model = models.Decoder(cfg, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    n, p, m = 4, 16, 48
    sparrow = CompressionConfig(method="sparrow", page_size=4,
                                sparrow=SparrowConfig(budget_schedule=((0, 3),)))
    selected = 3 + 3  # top-3 + sink + 2 newest, with 16 pages of 4 tokens
    record = jax.ShapeDtypeStruct((n, cfg.num_layers, cfg.num_kv_heads, m, selected), jnp.int32)
    ints = jax.ShapeDtypeStruct((n, p), jnp.int32)
    compiled = score.lower(graphdef, params, ints, ints, jax.ShapeDtypeStruct((n, m), jnp.int32),
                           PageRecord(record, 4), chunk_size=16).compile()
    stats = compiled.memory_analysis()
    used = stats.temp_size_in_bytes + stats.argument_size_in_bytes + stats.output_size_in_bytes
    est = memory_plan.estimate("score", cfg, batch=n, prompt_len=p, new_tokens=m,
                               logp_chunk=16, compression=sparrow)
    replay = est.parts["page_replay"]
    assert replay >= cfg.num_layers * n * cfg.num_kv_heads * (p + m) * selected * 4
    assert used <= est.total <= 8 * used
    assert memory_plan.estimate("score", cfg, batch=n, prompt_len=p, new_tokens=m,
                                compression=sparrow, record_evictions=False
                                ).parts["page_replay"] == 0


def _nbytes(tree) -> int:
    return sum(x.size * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_update_trainable_terms_equal_the_model_and_optax_state(dtype):
    """Gradients and optimizer state cover the trainable params (every weight, or the
    adapters of ``model.lora``), the state in the dtype optax gives it (bf16 moments for
    bf16 params): the sizes of the model's own leaves and of ``optax``'s ``init``."""
    cfg = CONFIGS[0]
    lora = LoraConfig(rank=3, targets=("q_proj", "v_proj", "down_proj"))

    def adapted():
        model = update_model(cfg, dtype=dtype)
        models.add_lora(model, lora.rank, lora.alpha, lora.targets, rngs=nnx.Rngs(1))
        return model

    weights = nnx.state(nnx.eval_shape(lambda: update_model(cfg, dtype=dtype)))
    adapters = models.split_trainable(nnx.state(nnx.eval_shape(adapted)))[0]
    assert update_memory.lora_param_count(cfg, lora) == sum(
        x.size for x in jax.tree.leaves(adapters))
    init = make_optimizer(OptimConfig()).init
    kw = dict(prompt_len=8, new_tokens=8, dtype=dtype, accumulate=True)
    for trainable, lora_cfg in ((weights, None), (adapters, lora)):
        parts = memory_plan.estimate("update", cfg, batch=2, lora=lora_cfg, **kw).parts
        assert parts["optimizer"] == _nbytes(jax.eval_shape(init, trainable))
        assert parts["accumulator"] == sum(x.size for x in jax.tree.leaves(trainable)) * 4
    moments = jax.eval_shape(init, adapters)[1][0]
    assert {x.dtype for x in jax.tree.leaves((moments.mu, moments.nu))} == {jnp.dtype(dtype)}


def _ratio(cfg, n, p, m, chunk, dtype, lora_rank, micro) -> float:
    """The update plan over XLA's peak (``memory_analysis()``) of one update of ``n`` x
    (``p`` + ``m``), ``micro`` rows per micro-batch, compiled from abstract inputs."""
    stats = compiled_update(cfg, n, p, m, dtype=dtype, lora_rank=lora_rank,
                            micro=0 if micro == n else micro, chunk_size=chunk).memory_analysis()
    plan = memory_plan.estimate(
        "update", cfg, batch=micro, prompt_len=p, new_tokens=m, dtype=jnp.dtype(dtype),
        logp_chunk=chunk, lora=LoraConfig(rank=lora_rank) if lora_rank else None,
        accumulate=micro < n).total
    return plan / xla_peak_bytes(stats)


SMALL = models.ModelConfig("qwen2", 8192, 256, 1024, 2, num_heads=4, num_kv_heads=2,
                           head_dim=64, attention_bias=True)


@pytest.mark.parametrize("cfg,dtype,lora_rank,micro", [
    (CONFIGS[0], "float32", 0, 4), (CONFIGS[0], "bfloat16", 4, 2),
    (SMALL, "float32", 0, 1), (SMALL, "bfloat16", 4, 4)],
    ids=["tiny-f32-full-whole", "tiny-bf16-lora-micro2", "small-f32-full-micro1",
         "small-bf16-lora-whole"])
def test_update_plan_brackets_the_compiled_update(cfg, dtype, lora_rank, micro):
    """0.95 <= plan / XLA's peak <= 1.25 for one update of 4 sequences, whole or in
    micro-batches of 2 or 1 (the float32 accumulator), full or LoRA, f32 or bf16: at the
    tiny shape (activations dominate) and at a 6M-parameter one (vocab 8192, 32 + 96
    tokens), where a full update peaks in its optimizer step and a LoRA one in its
    backward."""
    p, m, chunk = (16, 48, 16) if cfg is CONFIGS[0] else (32, 96, 32)
    assert 0.95 <= _ratio(cfg, 4, p, m, chunk, dtype, lora_rank, micro) <= 1.25


def test_request_over_the_limit_fails_naming_estimate_and_largest_batch():
    cfg = CONFIGS[1]
    kw = dict(prompt_len=32, new_tokens=96, dtype=jnp.float32)
    limit = memory_plan.estimate("update", cfg, batch=10, **kw).total
    fits = memory_plan.largest_batch("update", cfg, limit, **kw)
    assert fits >= 10
    assert memory_plan.estimate("update", cfg, batch=fits, **kw).total <= limit
    assert memory_plan.estimate("update", cfg, batch=fits + 1, **kw).total > limit
    memory_plan.check_fits("update", cfg, batch=fits, limit=limit, **kw)
    est = memory_plan.estimate("update", cfg, batch=64, **kw).total
    with pytest.raises(memory_plan.MemoryPlanError,
                       match=rf"update of batch 64 x 32\+96 tokens needs an estimated "
                             rf"{est / 2**30:.2f} GiB .* the largest batch that fits is {fits}$"):
        memory_plan.check_fits("update", cfg, batch=64, limit=limit, **kw)
    with pytest.raises(memory_plan.MemoryPlanError, match="no batch fits"):
        memory_plan.check_fits("rollout", cfg, batch=8, limit=1000, num_samples=2, step=2, **kw)


def test_cpu_reports_no_device_limit_and_bad_arguments_are_named():
    assert memory_plan.device_memory_limit() is None  # XLA:CPU: the limit must be configured
    with pytest.raises(ValueError, match="kind: must be one of"):
        memory_plan.estimate("train", CONFIGS[0], batch=1, prompt_len=1, new_tokens=1)
    with pytest.raises(ValueError, match="new_tokens: must be an int >= 1, got 0"):
        memory_plan.estimate("score", CONFIGS[0], batch=1, prompt_len=1, new_tokens=0)
    assert np.isfinite(memory_plan.estimate("score", CONFIGS[0], batch=0, prompt_len=1,
                                            new_tokens=1).total)


def test_engine_pool_terms_equal_the_engine_state():
    """``kv_pool`` is the pool's keys/values; ``kv_cache`` the prefill rows' paged cache plus
    each slot's positions and page table (``engine_state.slot_state`` with a pool)."""
    cfg, comp = CONFIGS[0], CompressionConfig(method="none", page_size=5)
    s, p, m, pool_pages = 6, 8, 24, 13
    state = jax.eval_shape(lambda: slot_state(comp, cfg, slots=s, max_len=p + m,
                                              dtype=jnp.float32, record=False,
                                              pool_pages=pool_pages))
    prefill = jax.eval_shape(lambda: init_state(
        comp, num_layers=cfg.num_layers, batch=s // 2, num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, max_len=p + m)).cache
    est = memory_plan.estimate("rollout", cfg, batch=s, prompt_len=p, new_tokens=m,
                               compression=comp, num_samples=2, pool_pages=pool_pages)
    nbytes = lambda *xs: sum(x.size * x.dtype.itemsize for x in xs)  # noqa: E731
    assert est.parts["kv_pool"] == nbytes(state.cache.k, state.cache.v)
    assert est.parts["kv_cache"] == (nbytes(prefill.k, prefill.v, prefill.pos)
                                     + nbytes(state.cache.pos, state.cache.pages))
    rkv = CompressionConfig(method="rkv", eviction=EvictionConfig(budget=8, buffer=4, window=2))
    assert memory_plan.estimate("rollout", cfg, batch=s, prompt_len=p, new_tokens=m,
                                compression=rkv, pool_pages=9).parts["kv_pool"] == 0


def test_engine_sizes_fill_the_limit_with_twice_the_slots_and_a_pool():
    cfg, comp = CONFIGS[0], CompressionConfig(method="none", page_size=4)
    kw = dict(prompt_len=16, new_tokens=48, dtype=jnp.float32, num_samples=4)
    row_pages = 16
    limit = memory_plan.estimate("rollout", cfg, batch=8, compression=comp, **kw).total
    dense = memory_plan.largest_batch("rollout", cfg, limit, compression=comp, **kw)
    slots, pool = memory_plan.engine_sizes(cfg, limit, rows=64, compression=comp, **kw)
    assert slots == 2 * dense and row_pages <= pool <= slots * row_pages
    fits = lambda n: memory_plan.estimate("rollout", cfg, batch=slots, compression=comp,  # noqa: E731
                                          pool_pages=n, **kw).total <= limit
    assert fits(pool) and (pool == slots * row_pages or not fits(pool + 1))
    assert memory_plan.engine_sizes(cfg, limit, rows=3, compression=comp, **kw)[0] == 3
    rkv = CompressionConfig(method="rkv", eviction=EvictionConfig(budget=8, buffer=4, window=2))
    rkv_dense = memory_plan.largest_batch("rollout", cfg, limit, compression=rkv, **kw)
    assert memory_plan.engine_sizes(cfg, limit, rows=64, compression=rkv, **kw) == (
        min(64, rkv_dense), 0)
    with pytest.raises(memory_plan.MemoryPlanError, match="no batch fits"):
        memory_plan.engine_sizes(cfg, 1000, rows=64, compression=comp, **kw)


def test_collect_sizes_the_unset_engine_from_the_device_limit(monkeypatch):
    """``collect_prompts``' sizing (``collect._sized_engine``): where the device reports a
    limit, unset ``slots`` / ``pool_pages`` of the continuous engine are ``engine_sizes``'s;
    set ones, the static engine and a device without a limit are left as given."""
    from sparse_rl_jax.rollout.sampling_config import SamplingConfig
    from sparse_rl_jax.training import collect
    cfg, comp = CONFIGS[0], CompressionConfig(method="none", page_size=4)
    plan = dict(prompt_len=16, new_tokens=48, dtype=jnp.float32, logp_chunk=16)
    limit = memory_plan.estimate("rollout", cfg, batch=8, compression=comp, **plan).total
    sampling = SamplingConfig(max_new_tokens=48, num_samples=4, engine="continuous",
                              record_evictions=False)
    assert collect._sized_engine(sampling, comp, cfg, plan, 64) is sampling  # CPU: no limit
    monkeypatch.setattr(memory_plan, "device_memory_limit", lambda: limit)
    sized = collect._sized_engine(sampling, comp, cfg, plan, 64)
    assert (sized.slots, sized.pool_pages) == memory_plan.engine_sizes(
        cfg, limit, rows=64, compression=comp, num_samples=4, record_evictions=False, **plan)
    given = dataclasses.replace(sampling, slots=3, pool_pages=20)
    assert collect._sized_engine(given, comp, cfg, plan, 64) is given
    static = dataclasses.replace(sampling, engine="static")
    assert collect._sized_engine(static, comp, cfg, plan, 64) is static
