"""group_advantages vs NumPy (unbiased group std, like torch.std in slime/verl)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_rl_jax.advantages import group_advantages

adv_jit = jax.jit(group_advantages, static_argnames=("group_size", "eps"))


def np_advantages(rewards, g, eps=1e-6):
    out = np.empty(len(rewards))
    for s in range(0, len(rewards), g):
        grp = np.asarray(rewards[s : s + g], np.float64)
        out[s : s + g] = (grp - grp.mean()) / (grp.std(ddof=1) + eps)
    return out


@pytest.mark.parametrize("g", [2, 3, 8])
def test_matches_numpy_unbiased_std(g):
    rng = np.random.default_rng(g)
    rewards = rng.normal(0.3, 1.0, 4 * g).astype(np.float32)
    rewards[:g] = rng.integers(0, 2, g)  # a binary group as from a verifier
    got = np.asarray(adv_jit(rewards, group_size=g))
    np.testing.assert_allclose(got, np_advantages(rewards, g), rtol=1e-5, atol=1e-6)


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
    a = np.asarray(adv_jit(rewards, group_size=g))
    assert np.all(a == 0.0)


def test_constant_group_beside_informative_group():
    rewards = np.array([0.1] * 4 + [0.0, 1.0, 1.0, 0.0], np.float32)
    a = np.asarray(group_advantages(rewards, 4))
    assert np.all(a[:4] == 0.0)
    np.testing.assert_allclose(a[4:], np_advantages(rewards, 4)[4:], rtol=1e-5)


def test_bad_inputs_name_the_problem():
    with pytest.raises(ValueError, match="not a multiple of group_size 4"):
        group_advantages(np.zeros(6, np.float32), 4)
    with pytest.raises(ValueError, match="group_size must be an int >= 2"):
        group_advantages(np.zeros(6, np.float32), 1)
    with pytest.raises(ValueError, match=r"rewards must have shape \[N\]"):
        group_advantages(np.zeros((2, 4), np.float32), 4)
