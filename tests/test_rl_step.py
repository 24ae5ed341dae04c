"""The two public halves of an RL step on a tiny policy: ``collect`` returns a consistent
batch (shapes, masks, advantages from the rewards, dense scores equal to ``score``), and
``update`` applies exactly the optimizer step of ``jax.grad`` of ``grpo_loss``."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import models
from sparse_rl_jax.kv.page_sparsity import PageRecord
from sparse_rl_jax.rl.grpo_loss import grpo_loss, loss_norm
from sparse_rl_jax.rl.loss_config import CorrectionConfig
from sparse_rl_jax.rl.update_step import init_optimizer, jit_update_step
from sparse_rl_jax.rollout.scoring import response_logprobs, score
from sparse_rl_jax.training.collect_rounds import collect_rollouts
from sparse_rl_jax.training.rl_step import batch_sharding, collect, learner_batch, update
from tiny_rl import G, MAX_NEW, PROMPTS, hash_reward, step_context, tiny_task_policy

N = PROMPTS * G
POSITION = 3


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return tiny_task_policy(tmp_path_factory.mktemp("rl_step"), dtype=jnp.float32)


@pytest.fixture(scope="module")
def collected(policy):
    """``(ctx, (batch, metrics, seconds))`` of one collect from data cursor ``POSITION``; the
    whole rollout is one minibatch."""
    ctx = step_context(policy, f"trainer.minibatch_size={N}")
    return ctx, collect(ctx, policy[3], POSITION)


def test_collect_batch_shapes_and_masks_are_consistent(collected):
    ctx, (batch, metrics, seconds) = collected
    prompt, prompt_mask, response = (np.asarray(x) for x in batch[:3])
    assert response.shape == (N, MAX_NEW) and prompt.shape == prompt_mask.shape
    assert prompt.shape[0] == N
    assert batch.record is None  # sparse_rl scores densely: no record kept
    loss = batch.loss
    assert loss.advantages.shape == loss.seq_mask.shape == (N,) and loss.logp_ref is None
    for leaf in (loss.logp_old_dense, loss.loss_mask, loss.is_weights, loss.token_mask):
        assert leaf.shape == (N, MAX_NEW)
    # left-padded prompts, one per group of G samples
    assert (np.diff(prompt_mask, axis=1) >= 0).all() and prompt_mask.any(axis=1).all()
    assert (prompt[prompt_mask == 0] == ctx.sampling.pad_id).all()
    groups = prompt.reshape(PROMPTS, G, -1)
    assert (groups == groups[:, :1]).all()
    # the loss mask is each response up to its end; corrections act inside it only
    loss_mask = np.asarray(batch.loss.loss_mask).astype(bool)
    assert (np.diff(loss_mask.astype(int), axis=1) <= 0).all() and loss_mask[:, 0].all()
    assert not np.asarray(batch.loss.token_mask)[~loss_mask].any()
    assert metrics["collect_rounds"] == 1 and metrics["prompts_consumed"] == PROMPTS
    assert set(seconds) == {"rollout", "reward", "score"} and min(seconds.values()) >= 0


def test_collect_advantages_are_the_group_normalised_rewards(collected):
    ctx, (batch, _, _) = collected
    completions = ctx.tokenizer.decode(batch.response, batch.loss.loss_mask)
    groups = hash_reward(completions, None).astype(np.float64).reshape(PROMPTS, G)
    want = (groups - groups.mean(1, keepdims=True)) / (
        groups.std(1, ddof=1, keepdims=True) + ctx.cfg.advantage.eps)
    assert np.ptp(groups, axis=1).any(), "some group must carry a signal"
    np.testing.assert_allclose(np.asarray(batch.loss.advantages), want.ravel(), atol=1e-6)


def test_collect_old_logprobs_are_the_dense_scores(collected, policy):
    ctx, (batch, _, _) = collected
    graphdef, params = policy[2:]
    dense = score(graphdef, params, batch.prompt, batch.prompt_mask, batch.response,
                  chunk_size=5).logp  # another chunking and one call for all rows
    mask = np.asarray(batch.loss.loss_mask).astype(bool)
    np.testing.assert_allclose(np.asarray(batch.loss.logp_old_dense)[mask],
                               np.asarray(dense)[mask], rtol=1e-5, atol=1e-5)


def _update(ctx, params, batch, optimizer, low_r_share=False):
    """``rl_step.update`` with ``optimizer`` over the one-device mesh; params are copied
    first (update donates them)."""
    mesh = models.make_mesh()
    params = jax.device_put(jax.tree.map(jnp.copy, params),
                            models.param_shardings(params, mesh))
    opt_state, opt_shardings = init_optimizer(optimizer, params, mesh)
    step = jit_update_step(
        ctx.graphdef, loss_cfg=ctx.cfg.loss, optimizer=optimizer,
        param_shardings=jax.tree.map(lambda x: x.sharding, params),
        opt_shardings=opt_shardings, batch_sharding=batch_sharding(mesh),
        chunk_size=ctx.cfg.trainer.logp_chunk, low_r_share=low_r_share,
        temperature=ctx.cfg.sampling.temperature)  # as the trainer builds it
    return update(dataclasses.replace(ctx, update=step, mesh=mesh), params, opt_state, batch,
                  step=0)


def test_ppo_behaviour_takes_the_ratio_to_the_sampler_with_no_correction(policy):
    """``correction.kind: ppo_behaviour``: the PPO ratio's denominator is the sampler's own
    log-probs, every weight 1, nothing rejected; ``none`` keeps the proximal (dense) one."""
    ctx = step_context(policy, f"trainer.minibatch_size={N}", "correction.kind=ppo_behaviour")
    rows, _, _ = collect_rollouts(ctx, policy[3], POSITION)
    full, _, _ = learner_batch(ctx, policy[3], rows, rows.logp_old)
    np.testing.assert_array_equal(full.loss.logp_old_dense, rows.logp_sparse)
    assert (np.asarray(full.loss.is_weights) == 1).all() and np.asarray(full.loss.seq_mask).all()
    mask = np.asarray(rows.loss_mask).astype(bool)
    assert (np.asarray(full.loss.token_mask)[mask]).all()
    none = CorrectionConfig(kind="none")
    naive = dataclasses.replace(ctx, cfg=dataclasses.replace(ctx.cfg, correction=none))
    full, _, _ = learner_batch(naive, policy[3], rows, rows.logp_old)
    np.testing.assert_array_equal(full.loss.logp_old_dense, rows.logp_old)
    assert not np.array_equal(np.asarray(rows.logp_old)[mask], np.asarray(rows.logp_sparse)[mask])


def test_update_with_zero_learning_rate_leaves_params_unchanged(collected, policy):
    ctx, (batch, _, _) = collected
    params = policy[3]
    new, _, metrics = _update(ctx, params, batch, optax.sgd(0.0))
    jax.tree.map(np.testing.assert_array_equal, new, params)
    assert metrics["grad_norm"] > 0 and metrics["skipped_updates"] == 0


def test_sgd_update_is_one_step_down_the_loss_gradient(collected, policy):
    ctx, (batch, _, _) = collected
    graphdef, params = policy[2:]
    lr = 0.05

    def loss(p):
        logp = response_logprobs(nnx.merge(graphdef, p), batch.prompt, batch.prompt_mask,
                                 batch.response).logp
        return grpo_loss(logp, batch.loss, ctx.cfg.loss)[0]

    grads = jax.grad(loss)(params)  # the whole batch: its row order does not change the loss
    new, _, metrics = _update(ctx, params, batch, optax.sgd(lr))
    assert metrics["skipped_updates"] == 0
    want = jax.tree.map(lambda p, g: p - lr * g, params, grads)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), new, want)
    assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads)) > 1e-4


def test_a_tempered_dense_rollout_is_on_policy_for_the_learner(policy):
    """Sampling at temperature 0.5 records ``log softmax(logits / 0.5)``; the old-policy
    scores, the corrections and the update's PPO ratio take the same tempered policy, so a
    dense rollout has no sampler/learner mismatch (k3 0, ratio 1, nothing clipped), and the
    update is ``jax.grad`` of ``grpo_loss`` over the tempered log-probs. Scored at
    temperature 1 the same tokens are off by far more than the tolerance."""
    ctx = step_context(policy, "sampling.temperature=0.5", "compression.method=none",
                       f"trainer.minibatch_size={N}")
    graphdef, params = policy[2:]
    batch, metrics, _ = collect(ctx, params, POSITION)
    mask = np.asarray(batch.loss.loss_mask).astype(bool)
    untempered = score(graphdef, params, batch.prompt, batch.prompt_mask, batch.response).logp
    assert np.abs(np.asarray(untempered) - np.asarray(batch.loss.logp_old_dense))[mask].max() > 0.1
    assert float(metrics["mismatch_k3"]) < 1e-6
    assert np.asarray(batch.loss.seq_mask).all() and float(metrics["rejection_rate"]) == 0

    lr = 0.05

    def loss(p):
        logp = response_logprobs(nnx.merge(graphdef, p), batch.prompt, batch.prompt_mask,
                                 batch.response, temperature=0.5).logp
        return grpo_loss(logp, batch.loss, ctx.cfg.loss)[0]

    grads = jax.grad(loss)(params)
    new, _, metrics = _update(ctx, params, batch, optax.sgd(lr))
    assert abs(float(metrics["ratio_mean"]) - 1) < 1e-5 and float(metrics["clip_fraction"]) == 0
    want = jax.tree.map(lambda p, g: p - lr * g, params, grads)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), new, want)


def test_sparrow_shadow_mask_step_replays_the_rollouts_pages(policy):
    """Shadow-mask training with sparrow: the batch carries the rollouts' page record, which
    replays the sampler's log-probs (the PPO ratio's behaviour policy), and the first update
    is on-policy (ratio 1)."""
    ctx = step_context(policy, "compression.method=sparrow", "compression.page_size=4",
                       "compression.sparrow.budget_schedule=[[0, 1]]", "compression.sparrow.dense_layers=[]",
                       "correction.kind=shadow_mask", "loss.distill_coef=0.1",
                       f"trainer.minibatch_size={N}")
    graphdef, params = policy[2:]
    batch, _, _ = collect(ctx, params, POSITION)
    assert isinstance(batch.record, PageRecord)
    mask = np.asarray(batch.loss.loss_mask).astype(bool)
    replay = score(graphdef, params, batch.prompt, batch.prompt_mask, batch.response,
                   batch.record).logp
    behaviour = np.asarray(batch.loss.logp_old_dense)
    np.testing.assert_allclose(np.asarray(replay)[mask], behaviour[mask], atol=1e-4)
    dense = score(graphdef, params, batch.prompt, batch.prompt_mask, batch.response).logp
    assert np.abs(np.asarray(dense) - behaviour)[mask].max() > 1e-2  # really sparse
    _, _, metrics = _update(ctx, params, batch, optax.sgd(0.0))
    assert float(metrics["log_ratio_abs_max"]) <= 1e-4


@pytest.mark.parametrize("micro", [None, N // 2])
def test_low_r_grad_share_is_the_flagged_sequences_part_of_the_update(collected, policy, micro):
    """With ``low_r_share`` the update is unchanged, and the logged ratio and share are those
    of ``g_low = g - g_rest``: the full gradient minus the gradient with the flagged
    sequences dropped (same denominators), computed here by ``jax.grad`` of ``grpo_loss``."""
    ctx, (batch, _, _) = collected
    graphdef, params = policy[2:]
    if micro is not None:
        ctx = dataclasses.replace(ctx, cfg=dataclasses.replace(
            ctx.cfg, trainer=dataclasses.replace(ctx.cfg.trainer, micro_batch_size=micro)))
    flags = np.zeros(N, bool)
    flags[[0, 3, N - 2]] = True
    batch = batch._replace(loss=batch.loss.replace(low_r=jnp.asarray(flags)))
    norm = loss_norm(batch.loss, ctx.cfg.loss)

    def grads(loss_batch):
        def loss(p):
            logp = response_logprobs(nnx.merge(graphdef, p), batch.prompt, batch.prompt_mask,
                                     batch.response).logp
            return grpo_loss(logp, loss_batch, ctx.cfg.loss, norm=norm)[0]
        return np.concatenate([np.ravel(np.asarray(g, np.float64))
                               for g in jax.tree.leaves(jax.grad(loss)(params))])

    g = grads(batch.loss)
    g_low = g - grads(batch.loss.replace(seq_mask=batch.loss.seq_mask & ~jnp.asarray(flags)))
    assert np.linalg.norm(g_low) > 1e-3 * np.linalg.norm(g) > 0
    plain, _, want = _update(ctx, params, batch, optax.sgd(0.05))
    new, _, metrics = _update(ctx, params, batch, optax.sgd(0.05), low_r_share=True)
    jax.tree.map(np.testing.assert_array_equal, new, plain)
    assert metrics["grad_norm"] == want["grad_norm"]
    np.testing.assert_allclose(metrics["low_r_grad_norm_ratio"],
                               np.linalg.norm(g_low) / np.linalg.norm(g), rtol=1e-4)
    np.testing.assert_allclose(metrics["low_r_grad_share"], g_low @ g / (g @ g), rtol=1e-4,
                               atol=1e-6)
