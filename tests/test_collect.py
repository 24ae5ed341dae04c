"""collect_rollouts(): dynamic sampling (DAPO) fills the update batch from kept groups with static
shapes, deterministically; overlong shaping and truncation masking reach the batch."""

from __future__ import annotations

import numpy as np
import pytest

from sparse_rl_jax.collect import collect_rollouts, group_filter
from sparse_rl_jax.overlong import OverlongConfig, overlong_penalty
from tiny_rl import G, PROMPTS, step_context, tiny_task_policy


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return tiny_task_policy(tmp_path_factory.mktemp("collect"))


def test_group_filter_drops_equal_rewards_and_groups_short_of_two_sequences():
    rewards = np.array([1, 1, 0, 1, 0, 1, 0.5, 0.5, 0, 1], np.float32)
    in_loss = np.array([1, 1, 1, 1, 1, 0, 1, 1, 1, 1], bool)
    np.testing.assert_array_equal(group_filter(rewards, in_loss, 2),
                                  [False, True, False, False, True])


def test_dynamic_sampling_fills_the_batch_with_kept_groups(policy):
    params = policy[3]
    ctx = step_context(policy, "data.dynamic_sampling=true", "data.max_collect_rounds=8")
    batch, metrics, _ = collect_rollouts(ctx, params, position=5)
    rounds = int(metrics["collect_rounds"])
    assert rounds >= 2  # half the groups of a round are dropped on average
    assert metrics["prompts_consumed"] == rounds * PROMPTS
    assert metrics["groups_kept"] == PROMPTS and batch.valid.all()
    groups = batch.rewards.reshape(PROMPTS, G)
    assert np.all(groups.min(1) < groups.max(1))  # no all-equal group made it in
    assert batch.response.shape == (PROMPTS * G, 12) and batch.prompt.shape[0] == PROMPTS * G

    # The kept groups are the first kept groups of rounds position, position + 1, ... in order.
    rows = []
    for r in range(rounds):
        single, _, _ = collect_rollouts(step_context(policy), params, position=5 + r)
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
