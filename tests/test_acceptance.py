"""The acceptance statistic alpha = sum_x min(p_sparse, p_dense) against NumPy, and its
per-bin 5th percentile."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from sparse_rl_jax.rollout.acceptance import acceptance_from_logits, acceptance_percentile_per_bin


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_exact_alpha_matches_numpy_and_is_one_for_equal_policies(temperature):
    rng = np.random.default_rng(0)
    a = rng.normal(size=(3, 5, 37)).astype(np.float32) * 2
    b = a + rng.normal(size=a.shape).astype(np.float32) * 0.5
    got = np.asarray(acceptance_from_logits(jnp.asarray(a), jnp.asarray(b), vocab_chunk=8,
                                            temperature=temperature))
    want = np.minimum(_softmax(a / temperature), _softmax(b / temperature)).sum(-1)
    np.testing.assert_allclose(got, want, atol=1e-6)
    same = np.asarray(acceptance_from_logits(jnp.asarray(a), jnp.asarray(a), vocab_chunk=8))
    np.testing.assert_allclose(same, 1.0, atol=1e-6)
    assert np.all(got < 1.0) and np.all(got > 0.0)


def test_top_k_alpha_is_the_official_lower_bound():
    rng = np.random.default_rng(1)
    a = rng.normal(size=(4, 50)).astype(np.float32) * 3
    b = a + rng.normal(size=a.shape).astype(np.float32)
    got = np.asarray(acceptance_from_logits(jnp.asarray(a), jnp.asarray(b), top_k=20))
    pa, pb = _softmax(a), _softmax(b)
    for i in range(4):
        both = set(np.argsort(-pa[i])[:20]) & set(np.argsort(-pb[i])[:20])
        want = sum(min(pa[i, x], pb[i, x]) for x in both)
        assert got[i] == pytest.approx(want, abs=1e-6)
    exact = np.minimum(pa, pb).sum(-1)
    assert np.all(got <= exact + 1e-6)


def reference_percentile_per_bin(alpha, mask, bin_tokens, q=5.0):
    """Sparrow's rule one token at a time: a row's position counts its valid tokens from 1,
    bin ``position // bin_tokens``, alpha clipped to [0, 1]; ``[M // bin_tokens + 1]``."""
    pooled = [[] for _ in range(alpha.shape[1] // bin_tokens + 1)]
    for row in range(alpha.shape[0]):
        position = 0
        for col in range(alpha.shape[1]):
            if mask[row, col]:
                position += 1
                pooled[position // bin_tokens].append(min(max(alpha[row, col], 0.0), 1.0))
    return np.asarray([np.percentile(v, q) if v else np.nan for v in pooled])


def test_percentile_per_bin_pools_valid_tokens_of_each_response_bin():
    alpha = np.concatenate([np.linspace(0.5, 1.0, 6)[None].repeat(2, 0),
                            np.full((2, 3), 0.9)], axis=1)  # [2, 9]
    mask = np.ones_like(alpha)
    mask[1, 4:] = 0  # row 1 ends inside bin 1; bin 2 only from row 0
    got = acceptance_percentile_per_bin(alpha, mask, bin_tokens=4)
    # 1-based positions: bin 0 = positions 1-3 (columns 0-2), bin 1 = 4-7, bin 2 = 8-9
    want = [np.percentile(alpha[:, :3].ravel(), 5),
            np.percentile(np.r_[alpha[0, 3:7], alpha[1, 3]], 5),
            np.percentile(alpha[0, 7:], 5)]
    np.testing.assert_allclose(got, want)
    np.testing.assert_allclose(got, reference_percentile_per_bin(alpha, mask, 4))
    assert np.isnan(acceptance_percentile_per_bin(alpha, np.zeros_like(mask), bin_tokens=4)).all()


def test_percentile_per_bin_puts_position_2000_in_bin_1():
    alpha = np.full((1, 2001), 0.95)
    alpha[0, 1999] = 0.1  # 1-based position 2000: the first token of bin 1
    mask = np.ones_like(alpha)
    got = acceptance_percentile_per_bin(alpha, mask)
    np.testing.assert_allclose(got, reference_percentile_per_bin(alpha, mask, 2000))
    assert got[0] == pytest.approx(0.95)
    assert got[1] == pytest.approx(np.percentile([0.1, 0.95], 5))


def test_percentile_per_bin_counts_positions_over_valid_tokens_only():
    rng = np.random.default_rng(3)
    alpha = rng.uniform(0.2, 1.0, size=(3, 12))
    mask = np.ones_like(alpha)
    mask[0, 2:5] = 0    # a hole in the middle: column 5 is position 3
    mask[1, :3] = 0     # left padding: column 3 is position 1
    mask[2, 1::2] = 0   # every other token
    got = acceptance_percentile_per_bin(alpha, mask, bin_tokens=4)
    np.testing.assert_allclose(got, reference_percentile_per_bin(alpha, mask, 4))
    # row 0 by hand: columns 0, 1, 5 are positions 1-3 (bin 0); 6-9 are 4-7 (bin 1)
    assert got[0] == pytest.approx(np.percentile(np.r_[alpha[0, [0, 1, 5]], alpha[1, 3:6],
                                                       alpha[2, [0, 2, 4]]], 5))


def test_percentile_per_bin_clips_alpha_to_the_unit_interval():
    alpha = np.array([[-0.5, 0.2, 0.9, 3.0, 1.2, 1.5, 1.1]])  # bin 0: positions 1-3
    mask = np.ones_like(alpha)
    got = acceptance_percentile_per_bin(alpha, mask, bin_tokens=4)
    np.testing.assert_allclose(got, reference_percentile_per_bin(alpha, mask, 4))
    assert got[0] == pytest.approx(np.percentile([0.0, 0.2, 0.9], 5))
    assert got[1] == 1.0  # every value above 1


def test_acceptance_metrics_report_p5_per_bin_and_bins_below_threshold():
    from sparse_rl_jax.rl.rollout_metrics import acceptance_metrics
    rng = np.random.default_rng(2)
    alpha = rng.uniform(0.7, 1.0, size=(3, 4100))
    mask = np.ones_like(alpha)
    mask[2, 3000:] = 0
    got = acceptance_metrics(alpha, mask, threshold=0.9)
    # 1-based positions: bin 0 = columns 0-1998, bin 1 = 1999-3998, bin 2 = 3999-4099
    per_bin = [np.percentile(alpha[:, :1999][mask[:, :1999] > 0], 5),
               np.percentile(alpha[:, 1999:3999][mask[:, 1999:3999] > 0], 5),
               np.percentile(alpha[:, 3999:][mask[:, 3999:] > 0], 5)]
    np.testing.assert_allclose([got[f"alpha_p5_bin{i}"] for i in range(3)], per_bin)
    assert got["alpha_bins_below"] == sum(p < 0.9 for p in per_bin)
    assert got["alpha_mean"] == pytest.approx(alpha[mask > 0].mean())
