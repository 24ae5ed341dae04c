"""experiments/correction_stats.py's core (``experiments/kit/correction_batch.py``) on a tiny
random policy, against independent computations: every correction's statistics against the
NumPy reference of tests/correction_reference.py on the same log-probs, and the gradient share
computed over row subsets (rows without a gradient skipped, columns cut after the longest
response, micro-batches padded) against ``jax.grad`` of the whole batch's loss with and without
the low-r rows."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from correction_reference import np_corrections
from experiments.kit import correction_batch as measure
from experiments.kit.arms import correction_arm
from experiments.kit.results_correction_stats import COLUMNS, format_table
from sparse_rl_jax.rl.advantages import compute_advantages
from sparse_rl_jax.rl.grpo_loss import grpo_loss, loss_norm
from models.lora import split_trainable
from sparse_rl_jax.rl.update_step import loss_grads, low_r_grad_metrics
from sparse_rl_jax.rollout.scoring import response_logprobs
from tiny_rl import MAX_NEW, hash_reward, step_context, tiny_task_policy

SAMPLES = 4
SETTING = ("sampling.record_evictions=true", "compression.alpha.metric='off'",
           f"sampling.num_samples={SAMPLES}")


@pytest.fixture(scope="module")
def rolled(tmp_path_factory):
    """``(policy, cfg_for, batch, low)``: one rolled-out batch of 4 prompts x 4 samples, its
    loss masks cut to varied lengths, and the rows ``low`` (two with a nonzero advantage, one
    without if a group has none) given a token whose sampler log-prob is e^12 times the dense
    one (r = e^-12 < 1e-4)."""
    policy = tiny_task_policy(tmp_path_factory.mktemp("correction_stats"), dtype=jnp.float32)
    ctx = step_context(policy, *SETTING)
    prompts = ctx.source.batch(0)
    batch, stats = measure.roll_out(ctx.cfg, policy[2], policy[3], policy[1], hash_reward,
                                   prompts.prompts, prompts.answers, seed=0)
    assert stats["rows"] == 4 * SAMPLES and set(measure.STATS) >= {"rejection_rate", "is_ess"}
    rng = np.random.default_rng(0)
    lengths = rng.integers(3, MAX_NEW + 1, batch.loss_mask.shape[0])
    mask = np.asarray(batch.loss_mask) * (np.arange(MAX_NEW)[None] < lengths[:, None])
    advantages = np.asarray(compute_advantages(jnp.asarray(batch.rewards), SAMPLES,
                                               ctx.cfg.advantage, mask, batch.valid))
    signal, flat = np.flatnonzero(advantages != 0), np.flatnonzero(advantages == 0)
    low = [*signal[:2], *flat[:1]]
    sparse = np.array(batch.logp_sparse)
    sparse[low, 1] = np.asarray(batch.logp_old)[low, 1] + 12.0
    batch = batch._replace(loss_mask=mask.astype(np.int32), logp_sparse=sparse)

    def cfg_for(name):
        return step_context(policy, *SETTING, *correction_arm(name)).cfg
    return policy, cfg_for, batch, low


@pytest.mark.parametrize("name", ["none", "sparse_rl", "decoupled_seq_is_rs", "icepop", "opsm",
                                  "ppo_behaviour", "pg_rs", "shadow_mask"])
def test_statistics_match_the_numpy_reference(rolled, name):
    (_, tokenizer, graphdef, params), cfg_for, batch, low = rolled
    cfg = cfg_for(name)
    full, stats = measure.correction_batch(cfg, batch, graphdef, params, tokenizer)
    assert (full.record is not None) == (name == "shadow_mask")
    mask = np.asarray(batch.loss_mask).astype(bool)
    _, _, seq_mask, want = np_corrections(
        np.asarray(batch.logp_old, np.float64), np.asarray(batch.logp_sparse, np.float64),
        mask, cfg.correction, advantages=np.asarray(full.loss.advantages))
    np.testing.assert_array_equal(np.asarray(full.loss.seq_mask), seq_mask)
    for key in measure.STATS:
        np.testing.assert_allclose(stats[key], want[key], rtol=1e-4, atol=1e-6, err_msg=key)
    assert stats["low_r_sequence_fraction"] == pytest.approx(len(low) / mask.shape[0])


@functools.partial(jax.jit, static_argnames=("graphdef", "loss_cfg", "temperature"))
def _flat_grad(graphdef, params, tokens, loss_batch, norm, *, loss_cfg, temperature):
    """``jax.grad`` of ``grpo_loss`` over dense scores of ``tokens`` (prompt, its mask,
    response), flattened."""
    def loss(p):
        logp = response_logprobs(nnx.merge(graphdef, p), *tokens, temperature=temperature).logp
        return grpo_loss(logp, loss_batch, loss_cfg, norm=norm)[0]
    return jnp.concatenate([jnp.ravel(g) for g in jax.tree.leaves(jax.grad(loss)(params))])


@functools.partial(jax.jit, static_argnames=("graphdef", "loss_cfg", "chunk_size",
                                             "temperature"))
def _trainer_share(graphdef, params, full, **kw):
    """The trainer's diagnostic: the whole batch's gradient, then a second backward with the
    other rows masked (``update_step.low_r_grad_metrics``)."""
    trainable, frozen = split_trainable(params)
    _, _, grads = loss_grads(graphdef, trainable, frozen, full, **kw)
    return low_r_grad_metrics(graphdef, trainable, frozen, full, grads,
                              **kw)["low_r_grad_share"]


def _reference_share(policy, cfg, full) -> float:
    """``<g_low, g> / |g|^2`` from ``jax.grad`` of the whole batch's loss (dense scoring) and
    of it with the low-r rows' sequence mask off, under the same denominators; for a replaying
    correction, the trainer's second-backward diagnostic."""
    graphdef, params = policy[2], policy[3]
    temperature = cfg.sampling.temperature
    if full.record is not None:
        return float(_trainer_share(graphdef, params, full, loss_cfg=cfg.loss,
                                    chunk_size=cfg.trainer.logp_chunk, temperature=temperature))
    norm = loss_norm(full.loss, cfg.loss)
    tokens = (full.prompt, full.prompt_mask, full.response)

    def flat(loss_batch):
        return np.asarray(_flat_grad(graphdef, params, tokens, loss_batch, norm,
                                     loss_cfg=cfg.loss, temperature=temperature), np.float64)

    g = flat(full.loss)
    g_low = g - flat(full.loss.replace(seq_mask=full.loss.seq_mask & ~full.loss.low_r))
    return float(g_low @ g / (g @ g))


@pytest.mark.parametrize("names", [("icepop", "decoupled_seq_is", "pg_is", "sparse_rl"),
                                   ("shadow_mask",)])
def test_grad_share_over_row_subsets_matches_two_whole_batch_gradients(rolled, names):
    policy, cfg_for, batch, _ = rolled
    tokenizer, graphdef, params = policy[1:]
    seen = []
    for name in names:
        cfg = cfg_for(name)
        full, _ = measure.correction_batch(cfg, batch, graphdef, params, tokenizer)
        got = measure.grad_stats(cfg, full, jnp.asarray(batch.logp_old), graphdef, params,
                                micro=3, seen=seen, bucket=6)
        if name == "sparse_rl":  # the veto drops every low-r row: g_low = 0, nothing computed
            assert got["low_r_grad_share"] == 0.0 and got["grad_norm"] is None
            continue
        if name == "pg_is":  # plain PG at ratio 1 = PPO at ratio 1: the same cotangent
            assert got["same_as"] == "decoupled_seq_is" and got["grad_seconds"] == 0
            continue
        want = _reference_share(policy, cfg, full)
        # a sequence IS weight of ~e^-12 all but removes the low-r rows; not a token weight
        assert abs(want) > 1e-3 or name == "decoupled_seq_is", name
        np.testing.assert_allclose(got["low_r_grad_share"], want, rtol=2e-3, atol=1e-5,
                                   err_msg=name)
        # distillation gives every kept row a gradient; elsewhere only rows with A != 0 count
        rows = got["grad_rows_low"] + got["grad_rows_rest"]
        assert rows == (16 if name == "shadow_mask" else int(np.sum(full.loss.advantages != 0)))


def test_table_marks_what_was_not_computed_or_reused():
    record = {"corrections": {"none": {k: 0.5 for k, _ in COLUMNS},
                              "pg_is": {k: 0.25 for k, _ in COLUMNS} | {"same_as": "none"},
                              "tis": {"rejection_rate": 0.25}}}
    lines = format_table(record).splitlines()
    assert lines[2].startswith("| none | 0.500 |")
    assert lines[3].startswith("| pg_is (gradient = none's) | 0.250 |")
    assert lines[4].count("–") == len(COLUMNS) - 1
