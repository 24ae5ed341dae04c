"""compute_corrections vs a plain NumPy (float64, per-sequence loop) reference."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from sparse_rl_jax.rl.correction_kinds import CORRECTION_KINDS
from sparse_rl_jax.rl.corrections import compute_corrections
from sparse_rl_jax.rl.loss_config import CORRECTION_LEVELS, CorrectionConfig

# reference comparisons run eagerly (one XLA compilation per config would dominate the suite);
# the hand-checked cases below go through jit
corrections_jit = jax.jit(compute_corrections, static_argnames="cfg")


def np_corrections(old, sparse, mask, cfg):
    """Reference written from the method's description (docs/method.md), one sequence at a time."""
    b, t = old.shape
    c = cfg.log_ratio_clamp
    weights = np.zeros((b, t))
    token_mask = np.zeros((b, t), bool)
    seq_mask = np.ones(b, bool)
    veto = np.zeros(b, bool)
    level_ratio = np.zeros((b, t))
    tok_lr = np.zeros((b, t))
    seq_weight = []
    for i in range(b):
        idx = np.flatnonzero(mask[i])
        if len(idx) == 0:
            continue
        lr = np.clip(old[i, idx] - sparse[i, idx], -c, c)
        tok_lr[i, idx] = lr
        if cfg.level == "token":
            lv = lr
        elif cfg.level == "sequence":
            lv = np.full(len(idx), np.clip(lr.sum(), -c, c))
        else:
            lv = np.full(len(idx), np.clip(lr.mean(), -c, c))
        r = np.exp(lv)
        level_ratio[i, idx] = r
        # weight 1, nothing rejected (shadow_mask: the learner is on-policy; ppo_behaviour: the
        # PPO ratio itself is to the sampler)
        if cfg.kind in ("none", "shadow_mask", "ppo_behaviour"):
            w, rej = np.ones_like(r), np.zeros(len(idx), bool)
        elif cfg.kind == "tis":
            w, rej = np.minimum(r, cfg.is_upper), np.zeros(len(idx), bool)
        elif cfg.kind == "mis":
            w, rej = r, (r < cfg.is_lower) | (r > cfg.is_upper)
        else:
            w, rej = np.minimum(r, cfg.is_upper), (r < cfg.rs_lower) | (r > cfg.rs_upper)
            if cfg.veto_threshold is not None:
                veto[i] = bool(np.any(np.exp(lr) < cfg.veto_threshold))
        weights[i, idx] = w
        seq_weight.append(w.mean())
        if cfg.level == "token":
            token_mask[i, idx] = ~rej
        else:
            token_mask[i, idx] = True
            if rej.any():
                seq_mask[i] = False
        if veto[i]:
            seq_mask[i] = False
    factor = 1.0
    if cfg.normalize:
        mean = weights[mask].mean() if cfg.level == "token" else np.mean(seq_weight)
        if mean >= 1e-8:
            factor = mean
    weights = weights / factor

    nonempty = mask.any(1)
    kept = token_mask & seq_mask[:, None]
    lr_valid = tok_lr[mask]
    metrics = {
        "rejection_rate": (~seq_mask[nonempty]).mean(),
        "veto_fraction": veto[nonempty].mean(),
        "token_mask_fraction": (~token_mask[mask]).mean(),
        "kept_token_fraction": kept[mask].mean(),
        "is_truncated_fraction": (level_ratio[mask] > cfg.is_upper).mean()
        if cfg.kind in ("tis", "sparse_rl")
        else 0.0,
        "mismatch_k3": np.mean(np.exp(lr_valid) - lr_valid - 1),
        "log_ratio_mean": lr_valid.mean(),
        "log_ratio_max": lr_valid.max(),
        "log_ratio_min": lr_valid.min(),
        "is_weight_mean": weights[kept].mean() if kept.any() else 0.0,
        "is_norm_factor": factor,
        "low_r_token_fraction": (np.exp(lr_valid) < 1e-4).mean(),
        "low_r_sequence_fraction": np.mean([np.any(np.exp(tok_lr[i][mask[i]]) < 1e-4)
                                            for i in np.flatnonzero(nonempty)]),
    }
    return weights, token_mask, seq_mask, metrics


def random_rollout(seed: int, b: int = 8, t: int = 7):
    """Log-probs whose per-sequence mismatch scale varies from tiny to large; one empty row and
    a few catastrophic tokens, so every branch (accept, reject, truncate, veto) is visited."""
    rng = np.random.default_rng(seed)
    old = rng.normal(-1.5, 0.7, (b, t))
    scale = np.geomspace(0.02, 1.0, b)[rng.permutation(b)][:, None]
    sparse = old + rng.normal(0.0, 1.0, (b, t)) * scale
    mask = rng.random((b, t)) < 0.8
    mask[0] = False
    mask[1, :3] = True
    sparse[1, 1] = old[1, 1] + 12.0  # r = e^-12 < 1e-4: veto in sparse_rl
    garbage = ~mask
    old[garbage] = rng.choice([np.nan, np.inf, -np.inf], size=garbage.sum())
    sparse[garbage] = rng.choice([np.nan, np.inf, -np.inf], size=garbage.sum())
    return old.astype(np.float32), sparse.astype(np.float32), mask


def check_against_reference(old, sparse, mask, cfg):
    out = compute_corrections(old, sparse, mask, cfg)
    w, tm, sm, metrics = np_corrections(
        old.astype(np.float64), sparse.astype(np.float64), mask, cfg
    )
    np.testing.assert_allclose(np.asarray(out.weights), w, rtol=2e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(out.token_mask), tm)
    np.testing.assert_array_equal(np.asarray(out.seq_mask), sm)
    assert set(out.metrics) == set(metrics)
    for k, v in metrics.items():
        np.testing.assert_allclose(float(out.metrics[k]), v, rtol=2e-5, atol=1e-6, err_msg=k)
    return out


@pytest.mark.parametrize("level", CORRECTION_LEVELS)
@pytest.mark.parametrize("kind", CORRECTION_KINDS.names())
def test_matches_numpy_reference(kind, level):
    for seed in range(3):
        old, sparse, mask = random_rollout(seed)
        check_against_reference(old, sparse, mask, CorrectionConfig(kind=kind, level=level))


@pytest.mark.parametrize(
    "cfg",
    [
        CorrectionConfig(kind="tis", normalize=True),
        CorrectionConfig(kind="sparse_rl", normalize=False),
        CorrectionConfig(kind="sparse_rl", veto_threshold=None),
        CorrectionConfig(kind="sparse_rl", rs_lower=0.8, rs_upper=1.25, is_upper=2.0),
        CorrectionConfig(kind="mis", is_lower=0.7, is_upper=1.3, level="geometric"),
        CorrectionConfig(kind="sparse_rl", level="sequence", veto_threshold=0.01),
    ],
)
def test_options_match_numpy_reference(cfg):
    old, sparse, mask = random_rollout(7)
    check_against_reference(old, sparse, mask, cfg)


def test_sparse_rl_defaults_are_the_official_ones():
    cfg = CorrectionConfig()
    assert (cfg.kind, cfg.level, cfg.is_upper, cfg.rs_lower, cfg.rs_upper) == (
        "sparse_rl", "token", 1.5, 0.5, 1.5
    )
    assert cfg.veto_threshold == 1e-4 and cfg.log_ratio_clamp == 20.0 and cfg.normalize is True
    assert CorrectionConfig(kind="tis").normalize is False


def test_sparse_rl_token_semantics_by_hand():
    # one sequence, ratios [1.0, 2.0, 0.25, 1.2]: token 1 and 2 rejected, token 1 truncated
    r = np.array([[1.0, 2.0, 0.25, 1.2]])
    old = np.log(r).astype(np.float32)
    sparse = np.zeros_like(old)
    mask = np.ones_like(old, bool)
    out = corrections_jit(old, sparse, mask, cfg=CorrectionConfig())
    raw = np.array([1.0, 1.5, 0.25, 1.2])
    np.testing.assert_allclose(np.asarray(out.weights)[0], raw / raw.mean(), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(out.token_mask)[0], [True, False, False, True])
    assert bool(out.seq_mask[0])
    assert float(out.metrics["token_mask_fraction"]) == 0.5
    assert float(out.metrics["is_truncated_fraction"]) == 0.25


def test_veto_drops_whole_sequence_on_one_catastrophic_token():
    old = np.zeros((2, 5), np.float32)
    sparse = np.zeros((2, 5), np.float32)
    sparse[0, 3] = -np.log(0.9e-4)  # log r = log(0.9e-4): below the 1e-4 veto threshold
    sparse[1, 2] = -np.log(1.1e-4)  # just above the veto threshold: token rejected, not vetoed
    mask = np.ones((2, 5), bool)
    out = corrections_jit(old, sparse, mask, cfg=CorrectionConfig())
    np.testing.assert_array_equal(np.asarray(out.seq_mask), [False, True])
    assert not bool(out.token_mask[1, 2])
    assert float(out.metrics["rejection_rate"]) == 0.5
    assert float(out.metrics["veto_fraction"]) == 0.5


@pytest.mark.parametrize("kind", CORRECTION_KINDS.names())
def test_masked_positions_never_leak(kind):
    old, sparse, mask = random_rollout(3)
    cfg = CorrectionConfig(kind=kind)
    a = corrections_jit(old, sparse, mask, cfg=cfg)
    old2, sparse2 = old.copy(), sparse.copy()
    old2[~mask] = 123.0
    sparse2[~mask] = -7.0
    b = corrections_jit(old2, sparse2, mask, cfg=cfg)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert np.all(np.asarray(a.weights)[~mask] == 0)


def test_normalisation_skipped_when_mean_is_tiny():
    # every ratio e^-19 -> weight mean ~ 5.6e-9 < 1e-8: no division
    old = np.full((2, 3), -19.0, np.float32)
    sparse = np.zeros((2, 3), np.float32)
    mask = np.ones((2, 3), bool)
    out = corrections_jit(old, sparse, mask, cfg=CorrectionConfig(kind="tis", normalize=True))
    assert float(out.metrics["is_norm_factor"]) == 1.0
    np.testing.assert_allclose(np.asarray(out.weights), np.exp(-19.0), rtol=1e-5)


def test_extreme_inputs_at_valid_tokens_are_finite_and_catastrophic():
    old = np.array([[-np.inf, 0.0, -1.0, -np.inf, 1e4]], np.float32)
    sparse = np.array([[-1.0, np.inf, -1.0, -np.inf, -1e4]], np.float32)
    mask = np.ones_like(old, bool)
    for kind in CORRECTION_KINDS.names():
        for level in CORRECTION_LEVELS:
            out = compute_corrections(old, sparse, mask, CorrectionConfig(kind=kind, level=level))
            for leaf in jax.tree.leaves(out):
                assert np.all(np.isfinite(np.asarray(leaf, np.float64))), (kind, level)
    out = corrections_jit(old, sparse, mask, cfg=CorrectionConfig())
    assert not bool(out.seq_mask[0])  # -inf dense log-prob and inf - inf both veto
    np.testing.assert_allclose(float(out.metrics["log_ratio_min"]), -20.0)
    np.testing.assert_allclose(float(out.metrics["log_ratio_max"]), 20.0)


def test_shape_errors_name_the_tensor():
    x = np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match="logp_sparse"):
        compute_corrections(x, np.zeros((2, 4), np.float32), x, CorrectionConfig())
    with pytest.raises(ValueError, match="loss_mask"):
        compute_corrections(x, x, np.zeros((3,), bool), CorrectionConfig())
