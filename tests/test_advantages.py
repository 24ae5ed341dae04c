"""Advantage estimators vs straightforward NumPy references (GRPO, Dr.GRPO, RLOO, REINFORCE++)."""

from __future__ import annotations

import warnings

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_rl_jax.core.config_io import ConfigError, load_config
from sparse_rl_jax.rl.advantages import AdvantageConfig, compute_advantages, group_advantages
from sparse_rl_jax.training.run_config import RunConfig

adv_jit = jax.jit(group_advantages, static_argnames=("group_size", "eps"))
compute_jit = jax.jit(compute_advantages, static_argnames=("group_size", "cfg"))
EPS = 1e-6
ALL = [("grpo", "group"), ("grpo", "batch"), ("grpo", "none"), ("rloo", "none"),
       ("rloo", "group"), ("rloo", "batch"), ("reinforce_pp", "batch"),
       ("reinforce_pp_baseline", "batch")]


def np_advantages(rewards, g, eps=EPS):
    out = np.empty(len(rewards))
    for s in range(0, len(rewards), g):
        grp = np.asarray(rewards[s : s + g], np.float64)
        out[s : s + g] = (grp - grp.mean()) / (grp.std(ddof=1) + eps)
    return out


def np_reference(estimator, scale, rewards, g, mask, valid=None):
    """Per-token definitions, computed token by token (verl core_algos semantics)."""
    r = np.asarray(rewards, np.float64)
    n = len(r)
    valid = np.ones(n, bool) if valid is None else np.asarray(valid)
    base = np.zeros(n)
    for i in range(n):
        grp = [j for j in range(i - i % g, i - i % g + g)]
        others = [j for j in grp if j != i]
        if estimator == "rloo":
            base[i] = r[i] - np.mean(r[others])  # leave-one-out mean
        else:
            base[i] = r[i] - np.mean(r[grp])
    if estimator.startswith("reinforce_pp"):
        x = r if estimator == "reinforce_pp" else base
        # every valid token of sequence i has return x_i (outcome reward, gamma 1)
        tokens = np.concatenate([np.full(int(np.sum(mask[i])), x[i]) for i in range(n)
                                 if valid[i]])
        out = (x - tokens.mean()) / (tokens.std(ddof=1) + EPS)
        return np.where(valid, out, 0.0)
    if scale == "group":
        std = np.array([np.std(r[i - i % g: i - i % g + g], ddof=1) for i in range(n)])
        return np.where(valid, base / (std + EPS), 0.0)
    if scale == "batch":
        return np.where(valid, base / (np.std(r[valid], ddof=1) + EPS), 0.0)
    return np.where(valid, base, 0.0)


def _batch(seed, groups, g, t=7):
    rng = np.random.default_rng(seed)
    rewards = rng.normal(0.3, 1.0, groups * g).astype(np.float32)
    rewards[:g] = rng.integers(0, 2, g)  # a binary group as from a verifier
    lengths = rng.integers(1, t + 1, groups * g)
    mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.int32)
    return rewards, mask


@pytest.mark.parametrize("estimator,scale", ALL)
@pytest.mark.parametrize("g", [2, 3, 8])
def test_every_estimator_matches_numpy(estimator, scale, g):
    rewards, mask = _batch(g, 4, g)
    cfg = AdvantageConfig(estimator=estimator, scale=scale)
    got = np.asarray(compute_jit(rewards, g, cfg, mask))
    np.testing.assert_allclose(got, np_reference(estimator, scale, rewards, g, mask),
                               rtol=2e-5, atol=2e-6)


def test_reinforce_pp_weighs_sequences_by_their_length():
    # Two sequences, rewards 1 and 0: token-weighted mean is 0.9 when the first is 9x longer.
    rewards = np.array([1.0, 0.0], np.float32)
    mask = np.zeros((2, 9), np.int32)
    mask[0, :9], mask[1, :1] = 1, 1
    got = np.asarray(compute_advantages(rewards, 2, AdvantageConfig("reinforce_pp"), mask))
    tokens = np.array([1.0] * 9 + [0.0])
    np.testing.assert_allclose(got, (rewards - 0.9) / (tokens.std(ddof=1) + EPS), rtol=1e-5)
    assert got[0] > 0 > got[1] and abs(got[1]) > abs(got[0])


def test_padding_rows_get_zero_and_leave_batch_statistics():
    rewards, mask = _batch(1, 4, 4)
    valid = np.repeat([True, True, False, True], 4)
    for estimator, scale in ALL:
        cfg = AdvantageConfig(estimator=estimator, scale=scale)
        got = np.asarray(compute_advantages(rewards, 4, cfg, mask, valid))
        want = np_reference(estimator, scale, rewards, 4, mask, valid)
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6, err_msg=estimator)
        assert np.all(got[~valid] == 0.0)


def test_defaults_and_dr_grpo():
    assert AdvantageConfig().scale == "group" and AdvantageConfig("rloo").scale == "none"
    assert AdvantageConfig("reinforce_pp").scale == "batch"
    rewards = np.array([0.0, 1.0, 1.0, 1.0], np.float32)  # Dr.GRPO: no std division
    got = np.asarray(compute_advantages(rewards, 4, AdvantageConfig(scale="none")))
    np.testing.assert_allclose(got, [-0.75, 0.25, 0.25, 0.25], rtol=1e-6)
    rloo = np.asarray(compute_advantages(rewards, 4, AdvantageConfig("rloo")))
    np.testing.assert_allclose(rloo, [-1.0, 1 / 3, 1 / 3, 1 / 3], rtol=1e-6)


def test_std_is_unbiased_not_population():
    # rewards [0, 1]: ddof=1 std = 0.7071 -> A = +-0.7071; the population std would give +-1
    a = np.asarray(group_advantages(np.array([0.0, 1.0], np.float32), 2))
    np.testing.assert_allclose(a, [-1 / np.sqrt(2), 1 / np.sqrt(2)], rtol=1e-5)


@settings(max_examples=25, deadline=None)
@given(
    values=st.lists(st.floats(-1e6, 1e6, width=32), min_size=3, max_size=3),
    g=st.sampled_from([2, 4, 8]),
)
def test_all_equal_rewards_give_exact_zero(values, g):
    rewards = np.repeat(np.array(values, np.float32), g)  # three groups, each constant
    mask = np.ones((3 * g, 5), np.int32)
    assert np.all(np.asarray(adv_jit(rewards, group_size=g)) == 0.0)
    for estimator, scale in ALL:  # group-baselined estimators: each all-equal group is 0
        if estimator == "reinforce_pp":
            continue
        cfg = AdvantageConfig(estimator=estimator, scale=scale)
        got = np.asarray(compute_jit(rewards, g, cfg, mask))
        if estimator == "reinforce_pp_baseline":
            assert np.all(got == 0.0)  # every group centred to 0 -> the batch is all 0
        else:
            assert np.all(got == 0.0), (estimator, scale)
    # REINFORCE++ has no group: only an all-equal *batch* gives 0.
    flat = np.full(3 * g, values[0], np.float32)
    got = np.asarray(compute_jit(flat, g, AdvantageConfig("reinforce_pp"), mask))
    assert np.all(got == 0.0)


def test_constant_group_beside_informative_group():
    rewards = np.array([0.1] * 4 + [0.0, 1.0, 1.0, 0.0], np.float32)
    mask = np.ones((8, 3), np.int32)
    for estimator, scale in ALL:
        if estimator.startswith("reinforce_pp"):
            continue  # batch whitening shifts a constant group by the batch mean
        a = np.asarray(compute_advantages(rewards, 4, AdvantageConfig(estimator, scale), mask))
        assert np.all(a[:4] == 0.0), (estimator, scale)
        np.testing.assert_allclose(a[4:], np_reference(estimator, scale, rewards, 4, mask)[4:],
                                   rtol=1e-5)


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_pp_baseline"])
def test_groups_of_one_give_zero_with_a_warning(estimator):
    rewards = np.array([0.0, 1.0, 0.5], np.float32)
    with pytest.warns(UserWarning, match="groups of one"):
        got = compute_advantages(rewards, 1, AdvantageConfig(estimator), np.ones((3, 2)))
    assert np.all(np.asarray(got) == 0.0)


def test_reinforce_pp_with_groups_of_one_needs_no_group():
    rewards = np.array([0.0, 1.0], np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = compute_advantages(rewards, 1, AdvantageConfig("reinforce_pp"), np.ones((2, 2)))
    tokens = np.array([0.0, 0.0, 1.0, 1.0])  # two tokens per sequence
    np.testing.assert_allclose(np.asarray(got), (rewards - 0.5) / (tokens.std(ddof=1) + EPS),
                               rtol=1e-5)


def test_bad_inputs_name_the_problem():
    with pytest.raises(ValueError, match="not a multiple of group_size 4"):
        group_advantages(np.zeros(6, np.float32), 4)
    with pytest.raises(ValueError, match="group_size must be an int >= 1"):
        group_advantages(np.zeros(6, np.float32), 0)
    with pytest.raises(ValueError, match=r"rewards: expected \[N\] = \[\*\], got \[2, 4\]"):
        group_advantages(np.zeros((2, 4), np.float32), 4)
    with pytest.raises(ValueError, match="needs response_mask"):
        compute_advantages(np.zeros(4, np.float32), 2, AdvantageConfig("reinforce_pp"))


def test_reinforce_pp_with_a_group_scale_is_a_config_error():
    with pytest.raises(ConfigError, match=r"advantage\.scale='group' is not defined"):
        load_config(RunConfig, None, ["advantage.estimator=reinforce_pp",
                                      "advantage.scale=group"])
