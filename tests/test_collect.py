"""collect_prompts(): rewards of the decoded samples, dense scores and corrections equal to
computing each part by hand. collect_rollouts(): dynamic sampling (DAPO) fills the update batch
from kept groups with static shapes, deterministically; overlong shaping and truncation masking
reach the batch."""

from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_rl_jax.rl.corrections import compute_corrections
from sparse_rl_jax.rl.overlong import OverlongConfig, overlong_penalty
from sparse_rl_jax.rollout.scoring import score
from sparse_rl_jax.training.collect import collect_prompts
from sparse_rl_jax.training.collect_rounds import collect_rollouts, group_filter
from tiny_rl import G, MAX_NEW, PROMPTS, step_context, tiny_task_policy


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return tiny_task_policy(tmp_path_factory.mktemp("collect"))


@pytest.fixture(scope="module")
def policy32(tmp_path_factory):
    return tiny_task_policy(tmp_path_factory.mktemp("collect32"), dtype=jnp.float32)


def answer_reward(completions, answers):
    """A reward that depends on the completion and on its own gold answer."""
    return np.array([float((zlib.crc32(c.encode()) + int(a)) % 2)
                     for c, a in zip(completions, answers)], np.float32)


def test_collect_prompts_matches_decoding_rewarding_and_scoring_by_hand(policy32):
    _, tokenizer, graphdef, params = policy32
    rollout_policy = dataclasses.replace(step_context(policy32).policy, reward_fn=answer_reward)
    prompts, answers = ["12+3=", "4+45=", "7+7="], ["15", "49", "14"]
    key = jax.random.key(1)
    out = collect_prompts(rollout_policy, params, prompts, answers, key)
    r, n = out.rollout, len(prompts) * G
    assert r.response.shape == (n, MAX_NEW) and out.rewards.shape == (n,)

    texts = tokenizer.decode(r.response, r.response_mask)
    want = [answer_reward([texts[i]], [answers[i // G]])[0] for i in range(n)]  # prompt-major
    np.testing.assert_array_equal(out.rewards, want)
    assert 0 < out.rewards.mean() < 1
    dense = score(graphdef, params, r.prompt, r.prompt_mask, r.response,
                  chunk_size=5).logp  # another chunking, one call for all rows
    on = np.asarray(r.response_mask, bool)
    np.testing.assert_allclose(np.asarray(out.logp_old)[on], np.asarray(dense)[on],
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out.loss_mask), np.asarray(r.response_mask))
    corr = compute_corrections(dense, r.logp, r.response_mask, rollout_policy.correction)
    np.testing.assert_array_equal(np.asarray(out.corrections.seq_mask), np.asarray(corr.seq_mask))
    np.testing.assert_allclose(np.asarray(out.corrections.weights), np.asarray(corr.weights),
                               rtol=1e-4, atol=1e-6)
    assert set(out.seconds) == {"rollout", "reward", "score"}

    rewards_only = collect_prompts(rollout_policy, params, prompts, answers, key, score=False)
    np.testing.assert_array_equal(np.asarray(rewards_only.rollout.response),
                                  np.asarray(r.response))
    np.testing.assert_array_equal(rewards_only.rewards, out.rewards)
    assert rewards_only.logp_old is None and rewards_only.corrections is None
    assert rewards_only.seconds["score"] == 0.0


def test_a_training_round_is_collect_prompts_at_the_cursor_with_its_key(policy):
    """Round ``position`` samples prompt batch ``position`` with ``fold_in(key(seed),
    position)``: what a resumed run relies on."""
    ctx, params = step_context(policy, "trainer.seed=3"), policy[3]
    batch, _, _ = collect_rollouts(ctx, params, position=2)
    prompts = ctx.source.batch(2)
    out = collect_prompts(ctx.policy, params, prompts.prompts, prompts.answers,
                          jax.random.fold_in(jax.random.key(3), 2))
    np.testing.assert_array_equal(np.asarray(batch.response), np.asarray(out.rollout.response))
    np.testing.assert_array_equal(batch.rewards, out.rewards)
    np.testing.assert_array_equal(np.asarray(batch.logp_old), np.asarray(out.logp_old))


def test_group_filter_drops_equal_rewards_and_groups_short_of_two_sequences():
    rewards = np.array([1, 1, 0, 1, 0, 1, 0.5, 0.5, 0, 1], np.float32)
    in_loss = np.array([1, 1, 1, 1, 1, 0, 1, 1, 1, 1], bool)
    np.testing.assert_array_equal(group_filter(rewards, in_loss, 2),
                                  [False, True, False, False, True])


def test_dynamic_sampling_fills_the_batch_with_kept_groups(policy):
    params = policy[3]
    ctx = step_context(policy, "data.dynamic_sampling=true", "data.max_collect_rounds=8")
    for position in range(5, 12):  # the first cursor whose batch takes several rounds
        batch, metrics, _ = collect_rollouts(ctx, params, position=position)
        rounds = int(metrics["collect_rounds"])
        if rounds >= 2:
            break
    assert rounds >= 2  # half the groups of a round are dropped on average
    assert metrics["prompts_consumed"] == rounds * PROMPTS
    assert metrics["groups_kept"] == PROMPTS and batch.valid.all()
    groups = batch.rewards.reshape(PROMPTS, G)
    assert np.all(groups.min(1) < groups.max(1))  # no all-equal group made it in
    assert batch.response.shape == (PROMPTS * G, 12) and batch.prompt.shape[0] == PROMPTS * G

    # The kept groups are the first kept groups of rounds position, position + 1, ... in order.
    rows = []
    for r in range(rounds):
        single, _, _ = collect_rollouts(step_context(policy), params, position=position + r)
        for k in np.flatnonzero(group_filter(single.rewards, np.ones(PROMPTS * G, bool), G)):
            rows.append(single.response[k * G:(k + 1) * G])
    np.testing.assert_array_equal(np.asarray(batch.response),
                                  np.concatenate(rows)[: PROMPTS * G])


def test_round_limit_pads_with_masked_groups(policy):
    ctx = step_context(policy, "data.dynamic_sampling=true", "data.max_collect_rounds=1")
    batch, metrics, _ = collect_rollouts(ctx, policy[3], position=1)
    kept = int(metrics["groups_kept"])
    assert metrics["collect_rounds"] == 1 and kept < PROMPTS  # seed-dependent, checked here
    valid = batch.valid.reshape(PROMPTS, G)
    assert valid[:kept].all() and not valid[kept:].any()
    mask = np.asarray(batch.loss_mask)
    assert mask[batch.valid].any(axis=1).all() and not mask[~batch.valid].any()


def test_overlong_penalty_values():
    cfg = OverlongConfig(buffer_len=4, penalty=2.0)
    got = overlong_penalty(np.array([1, 8, 9, 10, 12]), max_len=12, cfg=cfg)
    # 0 up to 12 - 4 = 8 tokens, then -(L - 8) / 4 * 2, reaching -2 at the cap
    np.testing.assert_allclose(got, [0.0, 0.0, -0.5, -1.0, -2.0])
    assert np.all(overlong_penalty(np.array([12]), 12, OverlongConfig()) == 0.0)


def test_overlong_shaping_and_truncation_mask_reach_the_batch(policy):
    ctx = step_context(policy, "overlong.buffer_len=4", "overlong.penalty=0.5",
               "overlong.mask_truncated=true")
    batch, metrics, _ = collect_rollouts(ctx, policy[3], position=2)
    plain, _, _ = collect_rollouts(step_context(policy), policy[3], position=2)
    lengths = np.asarray(plain.loss_mask).sum(1)
    want = plain.rewards + np.minimum(-(lengths - 8) / 4 * 0.5, 0.0)
    np.testing.assert_allclose(batch.rewards, want, rtol=1e-6)
    truncated = lengths == 12  # the tiny policy rarely emits EOS: most rows are truncated
    assert truncated.any()
    mask = np.asarray(batch.loss_mask)
    assert not mask[truncated].any() and (mask[~truncated] == np.asarray(
        plain.loss_mask)[~truncated]).all()
    assert metrics["overlong_penalty_mean"] == pytest.approx(float(np.mean(want - plain.rewards)))
