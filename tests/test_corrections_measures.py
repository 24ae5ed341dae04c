"""The rejection measures (``correction.rs`` / ``rs_threshold`` / ``rs_target_rate``) against
plain NumPy written here from verl's ``rollout_corr_helper.py`` (k1 = -log r with a
``lower_upper`` band on exp(k1), k2 / k3 upper bounds, at token / sum / mean / max), their
combination, the grammar's errors, and the adaptive threshold (``np.quantile``)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from correction_reference import random_rollout
from sparse_rl_jax.core.config_checks import ConfigError, FieldError
from sparse_rl_jax.core.config_io import load_config
from sparse_rl_jax.core.masked_math import masked_quantile
from sparse_rl_jax.rl.corrections import compute_corrections
from sparse_rl_jax.rl.loss_config import CorrectionConfig
from sparse_rl_jax.rl.rejection_measures import measure_names
from sparse_rl_jax.training.run_config import RunConfig

corrections_jit = jax.jit(compute_corrections, static_argnames="cfg")
VERL_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
                "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")


def np_log_ratio(old, sparse, mask):
    """The clamped token log ratios, 0 off the mask (NaN differences count as -20)."""
    with np.errstate(invalid="ignore"):  # inf - inf off the mask
        diff = old.astype(np.float64) - sparse.astype(np.float64)
    diff = np.clip(np.where(np.isnan(diff), -20.0, diff), -20.0, 20.0)
    return np.where(mask, diff, 0.0)


def np_value(lr, mask, option):
    """The option's value: ``[B, T]`` for a token option, ``[B]`` (0 for empty rows) else."""
    agg, div = option.rsplit("_", 1)
    token = {"k1": -lr, "k2": lr * lr / 2, "k3": np.expm1(lr) - lr}[div]
    if agg == "token":
        return token
    masked = np.ma.masked_array(token, ~mask)
    return getattr(masked, {"seq_sum": "sum", "seq_mean": "mean", "seq_max": "max"}[agg])(
        axis=1).filled(0.0)


def np_kept(lr, mask, option, lower, upper):
    """verl's kept mask ``[B, T]`` of one option (k1: lower <= exp(value) <= upper)."""
    value = np_value(lr, mask, option)
    if lower is None:
        keep = value <= upper
    else:
        keep = (value >= np.log(lower)) & (value <= np.log(upper))
    return mask & (keep if keep.ndim == 2 else keep[:, None])


def between(values, q):
    """A threshold halfway between two neighbouring values near the ``q`` quantile (so no
    value sits on it and float32 and float64 agree)."""
    s = np.unique(values)
    k = min(int(q * (len(s) - 1)), len(s) - 2)
    return float((s[k] + s[k + 1]) / 2)


def kept(out):
    return np.asarray(out.token_mask) & np.asarray(out.seq_mask)[:, None]


def test_the_measures_are_verls_eleven():
    assert measure_names() == VERL_OPTIONS


@pytest.mark.parametrize("option", VERL_OPTIONS)
def test_every_divergence_at_every_aggregation_matches_numpy(option):
    for seed in range(2):
        old, sparse, mask, _ = random_rollout(seed, b=16, t=9)
        lr = np_log_ratio(old, sparse, mask)
        value = np_value(lr, mask, option)
        valid = value[mask] if value.ndim == 2 else value[mask.any(1)]
        if option.endswith("k1"):  # a band on exp(value)
            lower, upper = (float(np.exp(between(valid, q))) for q in (0.25, 0.75))
            spec = f"{lower!r}_{upper!r}"
        else:
            lower, upper = None, between(valid, 0.6)
            spec = upper
        cfg = CorrectionConfig(kind="none", rs=option, rs_threshold=spec)
        out = compute_corrections(old, sparse, mask, cfg)
        want = np_kept(lr, mask, option, lower, upper)
        np.testing.assert_array_equal(kept(out), want)
        assert want.any() and (mask & ~want).any(), option  # it keeps some, rejects some
        if option.startswith("seq"):  # whole sequences: the token mask is untouched
            np.testing.assert_array_equal(np.asarray(out.token_mask), mask)


def test_k1_band_is_on_the_inverse_ratio_as_in_verl():
    """"0.999_1.001" keeps a geometric ratio in [1/1.001, 1/0.999] (not [0.999, 1.001]: it
    keeps 1.0010005 and drops 0.9990005); one number u: [1/u, u]."""
    ratios = np.array([1.0005, 1.0010005, 1.0011, 0.9995, 0.9990005, 0.9989])
    old = np.repeat(np.log(ratios)[:, None], 5, axis=1).astype(np.float32)
    zeros, mask = np.zeros_like(old), np.ones(old.shape, bool)
    out = corrections_jit(old, zeros, mask, cfg=CorrectionConfig(kind="decoupled_geo_rs"))
    np.testing.assert_array_equal(np.asarray(out.seq_mask), [True, True, False, True, False,
                                                             False])
    ratios = np.array([[1.9, 2.1, 0.55, 0.45]])
    cfg = CorrectionConfig(kind="none", rs="token_k1", rs_threshold=2.0)
    out = corrections_jit(np.log(ratios).astype(np.float32), np.zeros((1, 4), np.float32),
                          np.ones((1, 4), bool), cfg=cfg)
    np.testing.assert_array_equal(np.asarray(out.token_mask)[0], [True, False, True, False])


def test_criteria_combine_a_token_or_sequence_leaves_when_any_rejects():
    """Each of three criteria removes tokens the other two keep: row 0's r = 1.3 token (a
    token_k1 band to 1.25), row 1's tokens (its r = 1.9 token has k3 0.258 > 0.25, its k2 sum
    0.206 < 0.3), row 2's (16 tokens at r = 1.24: k2 sum 0.37 > 0.3); row 3 (r = 1) stays."""
    r = np.ones((4, 16))
    r[0, 3], r[1, 5], r[2] = 1.3, 1.9, 1.24
    old, sparse, mask = np.log(r).astype(np.float32), np.zeros((4, 16), np.float32), r > 0
    parts = {"token_k1": "0.8_1.25", "seq_max_k3": 0.25, "seq_sum_k2": 0.3}
    alone = [kept(compute_corrections(old, sparse, mask, CorrectionConfig(
        kind="none", rs=option, rs_threshold=spec))) for option, spec in parts.items()]
    cfg = CorrectionConfig(kind="none", rs=",".join(parts),
                           rs_threshold=",".join(str(v) for v in parts.values()))
    both = kept(compute_corrections(old, sparse, mask, cfg))
    want = np.ones((4, 16), bool)
    want[0, 3] = want[1] = want[2] = False
    np.testing.assert_array_equal(both, want)
    np.testing.assert_array_equal(both, alone[0] & alone[1] & alone[2])
    for i, a in enumerate(alone):  # each removes what the others keep
        others = np.logical_and.reduce([b for j, b in enumerate(alone) if j != i])
        assert (others & ~a).any(), list(parts)[i]
    old, sparse, mask, _ = random_rollout(4, b=16, t=9)
    # one threshold for all, duplicates dropped, and the ratio-band rs_level on top
    shared = CorrectionConfig(kind="none", rs="seq_mean_k2, seq_max_k3,seq_mean_k2",
                              rs_threshold=0.05)
    each = [kept(compute_corrections(old, sparse, mask, CorrectionConfig(
        kind="none", rs=o, rs_threshold=0.05))) for o in ("seq_mean_k2", "seq_max_k3")]
    np.testing.assert_array_equal(kept(compute_corrections(old, sparse, mask, shared)),
                                  each[0] & each[1])
    band = kept(compute_corrections(old, sparse, mask, CorrectionConfig(
        kind="none", rs_level="token", rs_lower=0.7, rs_upper=1.4)))
    with_band = CorrectionConfig(kind="none", rs_level="token", rs_lower=0.7, rs_upper=1.4,
                                 rs="seq_max_k3", rs_threshold=0.05)
    np.testing.assert_array_equal(kept(compute_corrections(old, sparse, mask, with_band)),
                                  band & each[1])


@pytest.mark.parametrize("kwargs, field, words", [
    ({"rs": "seq_max_k1", "rs_threshold": 2.0}, "rs", "comma-separated list of"),
    ({"rs": "seq_mean_k4", "rs_threshold": 2.0}, "rs", "'seq_max_k3'"),
    ({"rs": ",", "rs_threshold": 2.0}, "rs", "must be 'none' or"),
    ({"rs": 3}, "rs", "must be a string"),
    ({"rs": "seq_mean_k3"}, "rs_threshold", "must be set with rs='seq_mean_k3'"),
    ({"rs": "seq_mean_k3", "rs_threshold": "0.5_2.0"}, "rs_threshold", "takes one upper bound"),
    ({"rs": "token_k1", "rs_threshold": 0.5}, "rs_threshold", "lower bound 2 exceeds"),
    ({"rs": "token_k1", "rs_threshold": "2.0_0.5"}, "rs_threshold", "lower bound 2 exceeds"),
    ({"rs": "seq_mean_k3", "rs_threshold": -0.1}, "rs_threshold", "positive finite"),
    ({"rs": "seq_mean_k3", "rs_threshold": "abc"}, "rs_threshold", "not a number"),
    ({"rs": "seq_mean_k3,token_k1", "rs_threshold": "0.1,2.0,3.0"}, "rs_threshold",
     "one per measure (2"),
    ({"rs": "seq_mean_k3", "rs_threshold": True}, "rs_threshold", "must be a number"),
    ({"rs": "seq_mean_k3", "rs_threshold": 0.01, "rs_target_rate": 1.0}, "rs_target_rate",
     "in (0, 1)"),
    ({"rs": "seq_mean_k1", "rs_threshold": 2.0, "rs_target_rate": 0.1}, "rs_target_rate",
     "one sequence-level k2/k3 measure"),
    ({"rs": "token_k3", "rs_threshold": 2.0, "rs_target_rate": 0.1}, "rs_target_rate",
     "one sequence-level"),
    ({"rs": "seq_mean_k3,seq_max_k3", "rs_threshold": 2.0, "rs_target_rate": 0.1},
     "rs_target_rate", "one sequence-level"),
    ({"rs_target_rate": 0.1}, "rs_target_rate", "needs a rejection measure"),
])
def test_rejection_errors_name_the_field(kwargs, field, words):
    with pytest.raises(FieldError) as err:
        CorrectionConfig(kind="none", **kwargs)
    assert err.value.field == field
    assert str(err.value).startswith(f"CorrectionConfig.{field}=")
    assert words in str(err.value)


def test_yamls_digit_separators_are_caught_on_the_command_line():
    """``0.5_2`` is the YAML number 0.52: a k1 band of [1/0.52, 0.52], refused with a hint."""
    with pytest.raises(ConfigError, match=r"correction\.rs_threshold=0\.52 .*write 0\.5_2\.0"):
        load_config(RunConfig, None, ["correction.rs=seq_mean_k1",
                                      "correction.rs_threshold=0.5_2"])
    cfg = load_config(RunConfig, None, ["correction.rs=token_k1,seq_max_k3",
                                        "correction.rs_threshold=0.5_2.0,0.3"])
    assert [(c.option, c.lower, c.upper) for c in cfg.correction.rejection] == [
        ("token_k1", 0.5, 2.0), ("seq_max_k3", None, 0.3)]


def test_the_hash_form_holds_the_rejection_parts_only_where_they_are_set():
    """A config of before the measures hashes as it did (its runs resume); a measure set
    away from the preset's enters the hash (test_loss_config.py hashes every part)."""
    for kind in ("sparse_rl", "decoupled_seq_is", "pg_rs", "icepop", "decoupled_geo_rs_veto"):
        assert not {"rs", "rs_threshold", "rs_target_rate"} & set(
            CorrectionConfig(kind=kind).hash_form())
    form = CorrectionConfig(kind="sparse_rl", rs="seq_max_k3", rs_threshold=0.01).hash_form()
    assert (form["rs"], form["rs_threshold"]) == ("seq_max_k3", 0.01)


def test_masked_quantile_is_numpys_linear_quantile():
    rng = np.random.default_rng(0)
    quantile = jax.jit(masked_quantile, static_argnames="q")
    for n in (1, 2, 7, 50):
        x = rng.normal(size=64).astype(np.float32)
        mask = np.zeros(64, bool)
        mask[rng.choice(64, n, replace=False)] = True
        for q in (0.0, 0.1, 0.5, 0.9, 1.0):
            np.testing.assert_allclose(float(quantile(x, mask, q=q)),
                                       np.quantile(x[mask].astype(np.float64), q),
                                       rtol=1e-6, atol=1e-6)
    assert float(quantile(np.ones(4, np.float32), np.zeros(4, bool), q=0.9)) == 0.0


def mismatched(seed, b, t, scale):
    """``b`` rows of random length with per-row log-ratio scales ``scale`` ``[b]``; the first
    two rows empty."""
    rng = np.random.default_rng(seed)
    old = rng.normal(-1.0, 0.5, (b, t)).astype(np.float32)
    sparse = (old + rng.normal(0.0, 1.0, (b, t)) * scale[:, None]).astype(np.float32)
    lengths = rng.integers(1, t + 1, b)
    mask = np.arange(t)[None, :] < lengths[:, None]
    mask[:2] = False
    return old, sparse, mask


def np_seq_mean_k3(old, sparse, mask):
    lr = np_log_ratio(old, sparse, mask)
    return np_value(lr, mask, "seq_mean_k3")


def test_the_adaptive_threshold_rejects_the_target_rate_above_the_floor():
    cfg = CorrectionConfig(kind="adaptive_k3_rs_token_tis")
    assert (cfg.rs, cfg.rs_threshold, cfg.rs_target_rate, cfg.is_level, cfg.is_upper) == (
        "seq_mean_k3", 0.01, 0.1, "token", 2.0)
    for seed in range(3):
        b = 402
        scale = np.random.default_rng(seed).uniform(0.2, 0.8, b)  # mean k3 ~ 0.02-0.3
        old, sparse, mask = mismatched(seed, b, 12, scale)
        out = corrections_jit(old, sparse, mask, cfg=cfg)
        value = np_seq_mean_k3(old, sparse, mask)[2:]
        threshold = max(0.01, np.quantile(value, 0.9))
        np.testing.assert_allclose(float(out.metrics["rs_adaptive_threshold"]), threshold,
                                   rtol=1e-5)
        np.testing.assert_array_equal(np.asarray(out.seq_mask)[2:], value <= threshold)
        assert float(out.metrics["rejection_rate"]) == pytest.approx(0.1, abs=1 / 400)
        assert np.asarray(out.seq_mask)[:2].all()  # empty rows neither count nor leave


def test_the_adaptive_threshold_rejects_nothing_below_the_floor():
    cfg = CorrectionConfig(kind="adaptive_k3_rs_token_tis")
    b = 100
    old, sparse, mask = mismatched(5, b, 10, np.full(b, 1e-2))  # mean k3 ~ 5e-5
    out = corrections_jit(old, sparse, mask, cfg=cfg)
    assert np.asarray(out.seq_mask).all() and float(out.metrics["rejection_rate"]) == 0.0
    assert float(out.metrics["rs_adaptive_threshold"]) == pytest.approx(0.01)
    # 5 of 100 far above the floor: the 0.9 quantile is under it, so the floor rejects those 5
    scale = np.full(b, 1e-2)
    scale[[10, 20, 30, 40, 50]] = 1.0
    old, sparse, mask = mismatched(5, b, 10, scale)
    mask[[10, 20, 30, 40, 50], :4] = True
    out = corrections_jit(old, sparse, mask, cfg=cfg)
    assert np.flatnonzero(~np.asarray(out.seq_mask)).tolist() == [10, 20, 30, 40, 50]
    assert float(out.metrics["rs_adaptive_threshold"]) == pytest.approx(0.01)
    fixed = corrections_jit(old, sparse, mask, cfg=CorrectionConfig(
        kind="decoupled_k3_rs_token_tis"))
    assert "rs_adaptive_threshold" not in fixed.metrics  # logged only where it adapts
    np.testing.assert_array_equal(np.asarray(fixed.seq_mask), np.asarray(out.seq_mask))


@pytest.mark.parametrize("correction", [
    {"kind": "decoupled_geo_rs"}, {"kind": "adaptive_k3_rs_token_tis"},
    {"kind": "none", "rs": "token_k1,seq_max_k3", "rs_threshold": "0.5_2.0,0.3"},
    {"kind": "none", "rs": "seq_mean_k1", "rs_threshold": "0.5_2"},  # quoted in the file
])
def test_a_saved_config_reloads_its_measures_as_they_ran(tmp_path, correction):
    from sparse_rl_jax.core.config_io import save_config

    cfg = RunConfig(correction=CorrectionConfig(**correction))
    save_config(cfg, tmp_path / "config.yaml")
    again = load_config(RunConfig, tmp_path / "config.yaml")
    assert again.correction == cfg.correction
    assert again.correction.rejection == cfg.correction.rejection
