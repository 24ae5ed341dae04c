"""rollout_metrics / repetition_flags / kv_token_savings vs plain Python references."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_rl_jax.rl.rollout_metrics import kv_token_savings, repetition_flags, rollout_metrics

N, T = 6, 24
flags_jit = jax.jit(repetition_flags, static_argnames=("max_period", "repeats", "min_span"))


def py_is_repetitive(seq, max_period, repeats, min_span):
    """Reference: some stretch of >= max(repeats * p, min_span) tokens, anywhere in the
    response, repeats its first p tokens (p <= max_period)."""
    seq = list(seq)
    for p in range(1, max_period + 1):
        need = max(repeats * p, min_span)
        for start in range(len(seq)):
            for end in range(start + need, len(seq) + 1):
                if all(seq[i] == seq[i - p] for i in range(start + p, end)):
                    return True
    return False


def py_flags(tokens, mask, max_period, repeats, min_span):
    return np.array([py_is_repetitive(t[m], max_period, repeats, min_span)
                     for t, m in zip(tokens, mask)])


def test_repetition_hand_cases():
    # max_period 3, repeats 3, min_span 9 -> a stretch of 9 tokens
    rows = [
        [5, 1, 2, 3, 1, 2, 3, 1, 2, 3],  # period-3 loop at the end: flagged
        [7, 7, 7, 7, 7, 7, 7, 7, 7, 0],  # period-1 loop then EOS (0): flagged (anywhere)
        [1, 2, 1, 2, 1, 2, 1, 2, 1, 2],  # period 2: flagged
        [1, 2, 3, 4, 1, 2, 3, 4, 1, 2],  # period 4 > max_period: not flagged
        [4, 4, 4, 4, 4, 4, 4, 4, 9, 9],  # only 8 tokens of loop: not flagged
        [1, 2, 3, 1, 2, 4, 1, 2, 3, 1],  # no stretch of 9: not flagged
    ]
    tokens = np.array(rows, np.int32)
    mask = np.ones_like(tokens, bool)
    got = np.asarray(flags_jit(tokens, mask, max_period=3, repeats=3, min_span=9))
    np.testing.assert_array_equal(got, [True, True, True, False, False, False])
    # padding after a short response is ignored; a loop needs min_span real tokens
    short = np.array([[1, 1, 1, 1, 1, 0, 0, 0, 0, 0]], np.int32)
    assert not bool(flags_jit(short, short > 0, max_period=3, repeats=3, min_span=9)[0])
    assert bool(flags_jit(short, short > 0, max_period=3, repeats=3, min_span=5)[0])


@pytest.mark.parametrize("width", [8, 17, 40])
def test_short_loops_flagged_at_every_width(width):
    """The default detector (max_period 16, repeats 3, min_span 16) on batches narrower than
    its old 48-token window: pure loops flagged, non-repeating rows not."""
    rng = np.random.default_rng(width)
    rows, expected = [], []
    for period in (1, 2, 5, 8, 13):
        rows.append(np.resize(rng.integers(10, 99, period), width))  # a pure loop
        expected.append(width >= max(3 * period, 16))
    rows.append(rng.permutation(np.arange(10, 10 + width)))  # no token repeats
    expected.append(False)
    tokens = np.array(rows, np.int32)
    mask = np.ones_like(tokens, bool)
    got = np.asarray(flags_jit(tokens, mask))
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(got, py_flags(tokens, mask, 16, 3, 16))
    assert width < 40 or got[:4].all()  # at width 40 the loops of period <= 13 are flagged


@settings(max_examples=30, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2), min_size=N * T, max_size=N * T),
    mask=st.lists(st.booleans(), min_size=N * T, max_size=N * T),
    loop_rows=st.lists(st.booleans(), min_size=N, max_size=N),
    min_span=st.sampled_from([1, 5, 12]),
    repeats=st.sampled_from([1, 3]),
)
def test_repetition_matches_reference(tokens, mask, loop_rows, min_span, repeats):
    tokens = np.array(tokens, np.int32).reshape(N, T)
    mask = np.array(mask, bool).reshape(N, T)
    for i, loop in enumerate(loop_rows):  # plant loops (over arbitrary masks) in some rows
        if loop:
            mask[i, T // 4 :] = True
            tokens[i, T // 4 :] = np.resize(tokens[i, :3], T - T // 4)
    got = np.asarray(flags_jit(tokens, mask, max_period=4, repeats=repeats, min_span=min_span))
    np.testing.assert_array_equal(got, py_flags(tokens, mask, 4, repeats, min_span))


def test_rollout_metrics_match_numpy():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50, (N, T)).astype(np.int32)
    lengths = np.array([3, 24, 10, 0, 24, 17])
    mask = np.arange(T)[None, :] < lengths[:, None]
    tokens[1, :] = 8  # one degenerate loop that ran to the length limit
    truncated = np.array([False, True, False, False, True, False])
    rewards = rng.normal(0, 1, N).astype(np.float32)
    sparse = rng.uniform(10, 40, N).astype(np.float32)
    dense = sparse + rng.uniform(0, 60, N).astype(np.float32)
    logp = -rng.exponential(1.0, (N, T)).astype(np.float32)
    m = jax.jit(rollout_metrics, static_argnames=("max_period", "repeats", "min_span"))(
        rewards, tokens, mask, truncated, sparse, dense, logp=logp, max_period=4, repeats=3,
        min_span=12
    )
    expected = {
        "reward_mean": rewards.mean(),
        "reward_std": rewards.std(),
        "response_length_mean": lengths.mean(),
        "response_length_max": 24.0,
        "truncated_fraction": 2 / 6,
        "repetition_fraction": py_flags(tokens, mask, 4, 3, 12).mean(),
        "kv_token_savings": 1 - sparse.sum() / dense.sum(),
        "entropy_estimate": -sum(logp[i, :lengths[i]].sum() for i in range(N)) / lengths.sum(),
    }
    assert set(m) == set(expected)
    for k, v in expected.items():
        np.testing.assert_allclose(float(m[k]), v, rtol=1e-5, err_msg=k)
    assert float(m["repetition_fraction"]) > 0


def test_kv_savings_edge_cases_and_errors():
    assert float(kv_token_savings(np.zeros(3), np.zeros(3))) == 0.0
    assert float(kv_token_savings(np.full(3, 5.0), np.full(3, 5.0))) == 0.0
    savings = kv_token_savings(np.array([1.0, 3.0]), np.array([4.0, 4.0]))
    np.testing.assert_allclose(float(savings), 0.5)
    with pytest.raises(ValueError, match="sparse_resident"):
        kv_token_savings(np.zeros(3), np.zeros(4))
    tokens, mask = np.zeros((2, 3), np.int32), np.ones((2, 3))
    with pytest.raises(ValueError, match="given together"):
        rollout_metrics(np.zeros(2), tokens, mask, np.zeros(2, bool), np.zeros(2))
    with pytest.raises(ValueError, match="truncated"):
        rollout_metrics(np.zeros(2), tokens, mask, np.zeros(3, bool))


def test_entropy_estimate_tracks_the_sampling_entropy():
    # Tokens drawn from a known distribution: the mean -log p of the draws estimates H(p).
    rng = np.random.default_rng(1)
    probs = np.array([0.7, 0.2, 0.05, 0.05])
    tokens = rng.choice(4, size=(64, 32), p=probs).astype(np.int32)
    logp = np.log(probs)[tokens].astype(np.float32)
    mask = np.ones_like(tokens)
    m = rollout_metrics(np.zeros(64), tokens, mask, np.zeros(64, bool), logp=logp)
    entropy = -(probs * np.log(probs)).sum()
    np.testing.assert_allclose(float(m["entropy_estimate"]), entropy, rtol=0.05)
    assert "entropy_estimate" not in rollout_metrics(np.zeros(64), tokens, mask,
                                                     np.zeros(64, bool))
    with pytest.raises(ValueError, match="logp"):
        rollout_metrics(np.zeros(64), tokens, mask, np.zeros(64, bool), logp=logp[:, :3])
