"""Gradient accumulation: an update over micro-batches equals the unsplit update (params and
metrics), for every aggregation, sequence denominator and correction kind, shadow-mask
training included; a micro-batch size that does not divide the minibatch is a config error.

Oracle: the unsplit ``update_step`` (itself checked against NumPy in test_loss_grpo and
test_shadow_mask). SGD with lr 1 makes the param change the negative gradient."""

from __future__ import annotations

from functools import cache, partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import models
from sparse_rl_jax.core.config_io import ConfigError, load_config
from sparse_rl_jax.kv.state import EvictionRecord, NEVER
from sparse_rl_jax.rl.corrections import compute_corrections
from sparse_rl_jax.rl.grpo_loss import LossBatch, combine_metrics, grpo_loss, loss_norm
from sparse_rl_jax.rl.loss_config import AGGREGATIONS, CorrectionConfig, GRPOLossConfig
from sparse_rl_jax.rl.update_step import Minibatch, update_step
from sparse_rl_jax.training import memory_plan
from sparse_rl_jax.training.run_config import RunConfig
from tiny_hf import left_padded_batch, tiny_policy

SGD = optax.sgd(1.0)
N, M, MICRO = 8, 10, 2
KINDS = ("none", "tis", "mis", "sparse_rl")

_update = jax.jit(update_step, static_argnames=("graphdef", "loss_cfg", "optimizer",
                                                 "chunk_size", "micro_batch_size"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_policy(tmp_path_factory.mktemp("micro"))


@cache
def _batch(kind: str) -> Minibatch:
    """8 left-padded prompts, responses of varying length, old/sparse log-probs far enough
    apart that ``kind`` rejects tokens (mis, sparse_rl) and vetoes sequences (sparse_rl), a
    reference policy for the KL term."""
    rng = np.random.default_rng(0)
    prompt, prompt_mask = left_padded_batch(rng, [6, 3, 5, 2, 6, 4, 1, 6], width=6)
    response = jnp.asarray(rng.integers(3, 100, (N, M)), jnp.int32)
    lengths = np.array([10, 4, 7, 1, 9, 10, 3, 6])
    loss_mask = jnp.asarray(np.arange(M)[None] < lengths[:, None], jnp.int32)
    logp_old = -rng.uniform(2.0, 6.0, (N, M)).astype(np.float32)
    logp_sparse = logp_old + rng.normal(0, 0.5, (N, M)).astype(np.float32)
    logp_sparse[3, 0] += 12.0  # r far below the veto threshold: sparse_rl drops sequence 3
    corrections = compute_corrections(jnp.asarray(logp_old), jnp.asarray(logp_sparse),
                                      loss_mask, CorrectionConfig(kind=kind))
    advantages = jnp.asarray(rng.normal(0, 1, N), jnp.float32)
    logp_ref = jnp.asarray(logp_old + rng.normal(0, 0.2, (N, M)), jnp.float32)
    loss = LossBatch.from_corrections(jnp.asarray(logp_old), advantages, loss_mask,
                                      corrections, logp_ref)
    return Minibatch(jnp.asarray(prompt), jnp.asarray(prompt_mask), response, loss)


def _update_delta(graphdef, params, batch, cfg, micro):
    new, _, metrics = _update(graphdef, params, SGD.init(params), batch, loss_cfg=cfg,
                              optimizer=SGD, chunk_size=4, micro_batch_size=micro)
    return jax.tree.map(lambda a, b: np.asarray(a - b), new, params), jax.device_get(metrics)


def _assert_same_metrics(split, whole):
    assert sorted(split) == sorted(whole)
    for name in whole:
        np.testing.assert_allclose(split[name], whole[name], rtol=2e-5, atol=1e-5, err_msg=name)


def _assert_same_update(split, whole):
    (delta_s, metrics_s), (delta_w, metrics_w) = split, whole
    _assert_same_metrics(metrics_s, metrics_w)
    assert metrics_w["effective_tokens"] > 0
    assert max(np.abs(x).max() for x in jax.tree.leaves(delta_w)) > 1e-4  # a real update
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
                 delta_s, delta_w)


def _loss_terms(n, m, seed=2):
    """Per-token arrays of the current policy: log-probs, entropy, dense log-probs and the
    vocabulary KL of shadow-mask training, ``[n, m]`` each."""
    rng = np.random.default_rng(seed)
    logp = jnp.asarray(-rng.uniform(2.0, 6.0, (n, m)), jnp.float32)
    return (logp, jnp.asarray(rng.uniform(0.5, 3.0, (n, m)), jnp.float32),
            logp + jnp.asarray(rng.normal(0, 0.3, (n, m)), jnp.float32),
            jnp.asarray(rng.uniform(0.0, 0.5, (n, m)), jnp.float32))


@partial(jax.jit, static_argnames=("cfg", "micro"))
def _loss_and_grads(terms, loss_batch, cfg, micro):
    """Loss, metrics and gradients w.r.t. every per-token input; ``micro`` splits the rows
    into micro-batches that use the whole batch's ``loss_norm``, summing losses and gradients
    and merging metrics with ``combine_metrics``."""
    def loss(terms, batch, norm):
        logp, entropy, logp_dense, kl_full = terms
        return grpo_loss(logp, batch, cfg, entropy=entropy, logp_dense=logp_dense,
                         kl_full=kl_full, norm=norm)

    grad = jax.value_and_grad(loss, has_aux=True)
    if micro is None:
        (value, metrics), grads = grad(terms, loss_batch, None)
        return value, metrics, grads
    norm = loss_norm(loss_batch, cfg)
    k = N // micro
    rows = [np.arange(N)[j::k] for j in range(k)]
    parts = [grad(jax.tree.map(lambda x: x[r], terms), jax.tree.map(lambda x: x[r], loss_batch),
                  norm) for r in rows]
    grads = [jnp.zeros_like(t) for t in terms]
    for r, (_, g) in zip(rows, parts):
        grads = [acc.at[r].set(gi) for acc, gi in zip(grads, g)]
    metrics = combine_metrics({name: jnp.stack([m[name] for (_, m), _ in parts])
                               for name in parts[0][0][1]})
    return sum(v for (v, _), _ in parts), metrics, tuple(grads)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_micro_batch_losses_sum_to_the_minibatch_loss(aggregation):
    """For every aggregation x sequence denominator x correction kind (with the KL,
    entropy and (full-vocabulary) distillation terms on), micro-batch losses under the minibatch's
    ``loss_norm`` sum to its loss, their gradients are its gradients, and the merged
    metrics are its metrics."""
    terms = _loss_terms(N, M)
    for denominator in ("all", "kept"):
        cfg = GRPOLossConfig(aggregation=aggregation, kl_coef=0.1,
                             seq_denominator=denominator, entropy_coef=0.01,
                             distill_coef=0.3, distill_kind="full")
        for kind in KINDS + ("shadow_mask",):
            loss_batch = _batch(kind).loss
            value, metrics, grads = _loss_and_grads(terms, loss_batch, cfg, None)
            value_s, metrics_s, grads_s = _loss_and_grads(terms, loss_batch, cfg, MICRO)
            np.testing.assert_allclose(value_s, value, rtol=1e-5, atol=1e-7)
            _assert_same_metrics(metrics_s, metrics)
            assert max(float(jnp.abs(g).max()) for g in grads) > 1e-3
            for g_s, g in zip(grads_s, grads):
                np.testing.assert_allclose(g_s, g, rtol=1e-5, atol=1e-8)


def test_micro_batched_update_equals_unsplit(tiny):
    """The jitted update over micro-batches (lax.scan, fp32 accumulation) changes the params
    as the unsplit update does, with the same metrics, for every correction kind."""
    graphdef, params = tiny
    cfg = GRPOLossConfig(kl_coef=0.1)
    for kind in KINDS:
        batch = _batch(kind)
        if kind == "sparse_rl":  # rejection really happens, unevenly over micro-batches
            assert not bool(batch.loss.seq_mask[3])
        whole = _update_delta(graphdef, params, batch, cfg, None)
        _assert_same_update(_update_delta(graphdef, params, batch, cfg, MICRO), whole)


def test_micro_batched_shadow_mask_update_equals_unsplit(tiny):
    """Shadow-mask training: each micro-batch replays its own rows of the eviction record
    (sequence axis first), and the update equals the unsplit one."""
    graphdef, params = tiny
    batch = _batch("shadow_mask")
    n, p = batch.prompt.shape
    total = p + M
    rng = np.random.default_rng(3)
    layers, kv_heads = 1, 1  # the tiny model's
    position = np.arange(total)[None, None, None]
    evict = position + rng.integers(2, 8, (n, layers, kv_heads, total))
    record = np.where(rng.random(evict.shape) < 0.3, evict, NEVER).astype(np.int32)
    batch = batch._replace(record=EvictionRecord(jnp.asarray(record)))
    cfg = GRPOLossConfig(distill_coef=0.5, aggregation="token_mean")
    _assert_same_update(_update_delta(graphdef, params, batch, cfg, MICRO),
                        _update_delta(graphdef, params, batch, cfg, None))


def test_micro_batch_size_must_divide_the_minibatch(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("trainer: {minibatch_size: 128, micro_batch_size: 48}\n")
    with pytest.raises((ConfigError, ValueError), match="trainer.micro_batch_size"):
        load_config(RunConfig, path)
    with pytest.raises(ValueError, match="trainer.micro_batch_size"):
        update_step(None, nnx.State({}), {}, _batch("none"), loss_cfg=GRPOLossConfig(),
                    optimizer=SGD, micro_batch_size=3)


def test_planner_picks_the_whole_minibatch_or_the_largest_divisor_that_fits():
    config = models.ModelConfig(model_type="qwen2", vocab_size=512, hidden_size=64,
                                intermediate_size=128, num_layers=16, num_heads=4,
                                num_kv_heads=2, head_dim=16, attention_bias=True)
    kw = dict(prompt_len=64, new_tokens=192, logp_chunk=64)
    whole = memory_plan.estimate("update", config, batch=32, **kw).total
    assert memory_plan.micro_batch_size(config, 32, limit=whole, **kw) == 32
    limit = memory_plan.estimate("update", config, batch=12, accumulate=True, **kw).total
    assert memory_plan.micro_batch_size(config, 32, limit=limit, **kw) == 8  # 12 fits, 16 not
    assert memory_plan.micro_batch_size(config, 32, limit=limit, step=4, **kw) == 8
    # full remat keeps one hidden state per layer for the backward: here all 32 fit at once
    assert memory_plan.estimate("update", config, batch=32, remat="full", **kw).total <= limit
    assert memory_plan.micro_batch_size(config, 32, limit=limit, remat="full", **kw) == 32
    tight = memory_plan.estimate("update", config, batch=3, accumulate=True, **kw).total
    with pytest.raises(memory_plan.MemoryPlanError,
                       match=r"micro-batch 4 x 64\+192 tokens needs an estimated .* the largest "
                             r"micro-batch that fits is 3"):
        memory_plan.micro_batch_size(config, 32, limit=tight, step=4, **kw)
