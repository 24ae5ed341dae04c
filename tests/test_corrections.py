"""compute_corrections vs a plain NumPy (float64, per-sequence loop) reference written from the
sources (tests/correction_reference.py): every preset, every part, rejection at each level,
padding, OPSM; the project's older kinds against their own definitions."""

from __future__ import annotations

import dataclasses
import itertools

import jax
import numpy as np
import pytest

from correction_reference import np_corrections, random_rollout
from sparse_rl_jax.rl.correction_presets import CORRECTION_PRESETS, PARTS
from sparse_rl_jax.rl.corrections import compute_corrections
from sparse_rl_jax.rl.loss_config import CORRECTION_LEVELS, CorrectionConfig

# every preset but the aliases (an alias has its preset's parts: test_corrections_verl.py)
PRESETS = [n for n in CORRECTION_PRESETS.names() if CORRECTION_PRESETS.get(n).alias_of is None]

# reference comparisons run eagerly (one XLA compilation per config would dominate the suite);
# the hand-checked cases below go through jit
corrections_jit = jax.jit(compute_corrections, static_argnames="cfg")


def check_against_reference(old, sparse, mask, cfg, advantages=None):
    out = compute_corrections(old, sparse, mask, cfg, advantages=advantages)
    w, tm, sm, metrics = np_corrections(
        old.astype(np.float64), sparse.astype(np.float64), mask, cfg, advantages)
    np.testing.assert_allclose(np.asarray(out.weights), w, rtol=2e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(out.token_mask), tm)
    np.testing.assert_array_equal(np.asarray(out.seq_mask), sm)
    assert set(out.metrics) == set(metrics)
    for k, v in metrics.items():
        np.testing.assert_allclose(float(out.metrics[k]), v, rtol=2e-5, atol=1e-6, err_msg=k)
    return out


@pytest.mark.parametrize("kind", PRESETS)
def test_every_preset_matches_the_reference(kind):
    for seed in range(3):
        old, sparse, mask, adv = random_rollout(seed)
        check_against_reference(old, sparse, mask, CorrectionConfig(kind=kind), adv)


def test_every_level_of_every_part_matches_the_reference():
    """IS level x mode, rejection level, veto, normalisation and OPSM in combination."""
    old, sparse, mask, adv = random_rollout(5)
    grid = itertools.product(("none", *CORRECTION_LEVELS), ("truncate", "mask", "raw"),
                             ("none", *CORRECTION_LEVELS), (False, True), (False, True))
    for is_level, is_mode, rs_level, veto, normalize in grid:
        cfg = CorrectionConfig(kind="none", is_level=is_level, is_mode=is_mode,
                               is_lower=0.6, is_upper=1.6, rs_level=rs_level, rs_lower=0.7,
                               rs_upper=1.4, veto=veto, veto_threshold=1e-3,
                               normalize=normalize, opsm=veto, opsm_delta=0.05)
        check_against_reference(old, sparse, mask, cfg, adv)


def test_each_level_rejects_rows_in_the_test_data():
    """The reference comparisons above see rejection at every level (not vacuous)."""
    old, sparse, mask, adv = random_rollout(5)
    for level in CORRECTION_LEVELS:
        cfg = CorrectionConfig(kind="none", rs_level=level, rs_lower=0.7, rs_upper=1.4)
        out = compute_corrections(old, sparse, mask, cfg)
        rejected = (~np.asarray(out.token_mask)[mask]).any() if level == "token" else (
            ~np.asarray(out.seq_mask)[mask.any(1)]).any()
        assert rejected, level
        assert np.asarray(out.seq_mask)[mask.any(1)].any(), level  # and keeps some


@pytest.mark.parametrize("kind", PRESETS)
def test_a_preset_is_its_parts_spelled_out(kind):
    """A preset trains bit for bit as its parts written explicitly under another name."""
    named = CorrectionConfig(kind=kind)
    spelled = CorrectionConfig(kind="none", **{p: getattr(named, p) for p in PARTS})
    old, sparse, mask, adv = random_rollout(11)
    a = corrections_jit(old, sparse, mask, cfg=named, advantages=adv)
    b = corrections_jit(old, sparse, mask, cfg=spelled, advantages=adv)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def legacy(old, sparse, mask, kind, level, **bounds):
    """The project's kinds as they were defined before parts (docs/method.md): ``none``,
    ``shadow_mask``, ``ppo_behaviour`` weight 1; ``tis`` min(r, is_upper); ``mis`` weight r,
    reject r outside [is_lower, is_upper]; ``sparse_rl`` min(r, is_upper), reject outside
    [rs_lower, rs_upper] (the IS bounds by default), veto r_t < 1e-4, weights normalised."""
    lo, hi = bounds.get("is_lower", 0.5), bounds.get("is_upper", 1.5)
    b = old.shape[0]
    weights, token_mask, seq_mask = np.zeros(old.shape), np.zeros(old.shape, bool), np.ones(b, bool)
    for i in range(b):
        idx = np.flatnonzero(mask[i])
        if not len(idx):
            continue
        diff = old[i, idx] - sparse[i, idx]
        lr = np.clip(np.where(np.isnan(diff), -20, diff), -20, 20)
        r = np_level(lr, level)
        w, rej = {"tis": (np.minimum(r, hi), r < 0), "mis": (r, (r < lo) | (r > hi)),
                  "sparse_rl": (np.minimum(r, hi), (r < lo) | (r > hi))}.get(
                      kind, (np.ones_like(r), r < 0))
        weights[i, idx] = w
        token_mask[i, idx] = ~rej if level == "token" else True
        seq_mask[i] = not (level != "token" and rej.any()) and not (
            kind == "sparse_rl" and np.any(np.exp(lr) < 1e-4))
    if kind == "sparse_rl":
        if level == "token":
            weights = weights / weights[mask].mean()
        else:
            weights = weights / np.mean([weights[i][mask[i]].mean() for i in range(b)
                                         if mask[i].any()])
    return weights, token_mask, seq_mask


def np_level(lr, level):
    if level == "token":
        return np.exp(lr)
    return np.full(len(lr), np.exp(np.clip(lr.sum() if level == "sequence" else lr.mean(),
                                           -20, 20)))


@pytest.mark.parametrize("level", CORRECTION_LEVELS)
@pytest.mark.parametrize("kind", ["none", "tis", "mis", "sparse_rl", "shadow_mask",
                                  "ppo_behaviour"])
def test_the_older_kinds_keep_their_definitions(kind, level):
    for seed in range(2):
        old, sparse, mask, _ = random_rollout(seed)
        out = compute_corrections(old, sparse, mask, CorrectionConfig(kind=kind, level=level))
        w, tm, sm = legacy(old.astype(np.float64), sparse.astype(np.float64), mask, kind, level)
        kept = tm & sm[:, None]
        # weights matter where tokens stay in the loss (mis's rejected ones are masked)
        np.testing.assert_allclose(np.asarray(out.weights)[kept], w[kept], rtol=2e-5, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(out.token_mask), tm)
        np.testing.assert_array_equal(np.asarray(out.seq_mask), sm)


def test_sparse_rl_defaults_are_the_official_ones():
    cfg = CorrectionConfig(kind="sparse_rl")
    assert (cfg.kind, cfg.is_level, cfg.rs_level, cfg.is_upper, cfg.rs_lower, cfg.rs_upper) == (
        "sparse_rl", "token", "token", 1.5, 0.5, 1.5)
    assert cfg.veto and cfg.veto_threshold == 1e-4 and cfg.normalize is True
    assert cfg.log_ratio_clamp == 20.0 and cfg.anchor == "proximal" and cfg.loss == "ppo"
    assert CorrectionConfig(kind="tis").normalize is False


def test_verl_presets_carry_verl_numbers():
    """The numbers of before verl 0.9 (test_corrections_verl.py holds 0.9's)."""
    geo = CorrectionConfig(kind="decoupled_geo_rs_veto")
    assert (geo.rs_level, geo.rs_upper, geo.veto, geo.is_level) == ("geometric", 1.001, True, "none")
    np.testing.assert_allclose(geo.rs_lower, 1 / 1.001)
    pg_rs = CorrectionConfig(kind="pg_rs")
    assert (pg_rs.anchor, pg_rs.loss, pg_rs.rs_level) == ("behaviour", "pg", "geometric")
    assert CorrectionConfig(kind="decoupled_token_is").is_upper == 2.0
    seq_rs = CorrectionConfig(kind="decoupled_seq_is_rs")
    assert (seq_rs.is_level, seq_rs.rs_level, seq_rs.rs_lower, seq_rs.rs_upper) == (
        "sequence", "sequence", 0.5, 2.0)
    ice = CorrectionConfig(kind="icepop")
    assert (ice.is_mode, ice.is_lower, ice.is_upper, ice.rs_level) == ("mask", 0.5, 5.0, "none")


def test_a_part_set_in_the_config_overrides_the_preset():
    cfg = CorrectionConfig(kind="decoupled_geo_rs_veto", veto=False, rs_upper=1.01)
    assert (cfg.veto, cfg.rs_upper, cfg.rs_level) == (False, 1.01, "geometric")
    assert CorrectionConfig(kind="tis", level="sequence").is_level == "sequence"
    assert CorrectionConfig(kind="tis", level="sequence").rs_level == "none"  # preset's is off
    assert CorrectionConfig(kind="tis", level="sequence").level is None  # resolved away
    again = CorrectionConfig(**dataclasses.asdict(CorrectionConfig(kind="pg_rs")))
    assert again == CorrectionConfig(kind="pg_rs")  # a saved config reloads as it ran


def test_sparse_rl_token_semantics_by_hand():
    # one sequence, ratios [1.0, 2.0, 0.25, 1.2]: token 1 and 2 rejected, token 1 truncated
    r = np.array([[1.0, 2.0, 0.25, 1.2]])
    old = np.log(r).astype(np.float32)
    sparse = np.zeros_like(old)
    mask = np.ones_like(old, bool)
    out = corrections_jit(old, sparse, mask, cfg=CorrectionConfig(kind="sparse_rl"))
    raw = np.array([1.0, 1.5, 0.25, 1.2])
    np.testing.assert_allclose(np.asarray(out.weights)[0], raw / raw.mean(), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(out.token_mask)[0], [True, False, False, True])
    assert bool(out.seq_mask[0])
    assert float(out.metrics["token_mask_fraction"]) == 0.5
    assert float(out.metrics["is_truncated_fraction"]) == 0.25


def test_icepop_zeroes_weights_but_keeps_tokens_in_the_mask():
    r = np.array([[1.0, 6.0, 0.25, 4.0]])
    out = corrections_jit(np.log(r).astype(np.float32), np.zeros((1, 4), np.float32),
                          np.ones((1, 4), bool), cfg=CorrectionConfig(kind="icepop"))
    np.testing.assert_allclose(np.asarray(out.weights)[0], [1.0, 0.0, 0.0, 4.0], rtol=1e-6)
    assert np.asarray(out.token_mask).all() and bool(out.seq_mask[0])
    assert float(out.metrics["is_masked_fraction"]) == 0.5
    # Kish ESS of [1, 0, 0, 4] over 4 tokens: 25 / (4 * 17)
    np.testing.assert_allclose(float(out.metrics["is_ess"]), 25 / 68, rtol=1e-6)


def test_veto_drops_whole_sequence_on_one_catastrophic_token():
    old = np.zeros((2, 5), np.float32)
    sparse = np.zeros((2, 5), np.float32)
    sparse[0, 3] = -np.log(0.9e-4)  # log r = log(0.9e-4): below the 1e-4 veto threshold
    sparse[1, 2] = -np.log(1.1e-4)  # just above the veto threshold: token rejected, not vetoed
    mask = np.ones((2, 5), bool)
    out = corrections_jit(old, sparse, mask, cfg=CorrectionConfig(kind="sparse_rl"))
    np.testing.assert_array_equal(np.asarray(out.seq_mask), [False, True])
    assert not bool(out.token_mask[1, 2])
    assert float(out.metrics["rejection_rate"]) == 0.5
    assert float(out.metrics["veto_fraction"]) == 0.5


def test_opsm_masks_only_negative_advantage_rows_over_delta():
    # rows: mean log(behaviour / proximal) = 0.2, 0.2, 0.01, 0.2, -0.3 (0 tokens in row 5)
    drift = np.array([0.2, 0.2, 0.01, 0.2, -0.3, 0.0], np.float32)
    sparse = np.zeros((6, 4), np.float32)
    old = np.repeat(-drift[:, None], 4, axis=1)
    mask = np.ones((6, 4), bool)
    mask[5] = False
    adv = np.array([-1.0, 1.0, -1.0, 0.0, -1.0, -1.0], np.float32)
    cfg = CorrectionConfig(kind="opsm", opsm_delta=0.1)
    out = corrections_jit(old, sparse, mask, cfg=cfg, advantages=adv)
    # only row 0: negative advantage and drift 0.2 > 0.1 (row 1 positive, row 2 under delta,
    # row 3 zero advantage, row 4 drifts the other way, row 5 has no tokens)
    np.testing.assert_array_equal(np.asarray(out.seq_mask), [False, True, True, True, True, True])
    np.testing.assert_allclose(float(out.metrics["opsm_fraction"]), 1 / 5)
    with pytest.raises(ValueError, match="correction.opsm needs the advantages"):
        compute_corrections(old, sparse, mask, cfg)


@pytest.mark.parametrize("kind", PRESETS)
def test_masked_positions_never_leak(kind):
    old, sparse, mask, adv = random_rollout(3)
    cfg = CorrectionConfig(kind=kind)
    a = corrections_jit(old, sparse, mask, cfg=cfg, advantages=adv)
    old2, sparse2 = old.copy(), sparse.copy()
    old2[~mask] = 123.0
    sparse2[~mask] = -7.0
    b = corrections_jit(old2, sparse2, mask, cfg=cfg, advantages=adv)
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
    adv = np.array([-1.0], np.float32)
    for kind in PRESETS:
        for level in CORRECTION_LEVELS:
            out = compute_corrections(old, sparse, mask, CorrectionConfig(kind=kind, level=level),
                                      advantages=adv)
            for leaf in jax.tree.leaves(out):
                assert np.all(np.isfinite(np.asarray(leaf, np.float64))), (kind, level)
    out = corrections_jit(old, sparse, mask, cfg=CorrectionConfig(kind="sparse_rl"))
    assert not bool(out.seq_mask[0])  # -inf dense log-prob and inf - inf both veto
    np.testing.assert_allclose(float(out.metrics["log_ratio_min"]), -20.0)
    np.testing.assert_allclose(float(out.metrics["log_ratio_max"]), 20.0)


def test_shape_errors_name_the_tensor():
    x = np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match="logp_sparse"):
        compute_corrections(x, np.zeros((2, 4), np.float32), x, CorrectionConfig(kind="sparse_rl"))
    with pytest.raises(ValueError, match="loss_mask"):
        compute_corrections(x, x, np.zeros((3,), bool), CorrectionConfig(kind="sparse_rl"))
    with pytest.raises(ValueError, match="advantages"):
        compute_corrections(x, x, x, CorrectionConfig(kind="opsm"), advantages=np.zeros(3))
