"""The named corrections against their sources: verl 0.9's 19 presets (``algorithm.py``'s
factory methods, a table here) resolve to their numbers and compute what NumPy written here
from ``rollout_corr_helper.py`` computes; the names of before 0.9 keep their parts; NeMo-RL's
``seq-mask-tis`` and AReaL's geometric sequence IS against NumPy from their sources; every
name's resolved parts are what ``python run.py config`` prints, and docs/corrections.md
lists them all."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from sparse_rl_jax.core.config_io import to_dict
from sparse_rl_jax.rl.correction_presets import BASE, CORRECTION_PRESETS, PARTS, describe
from sparse_rl_jax.rl.corrections import compute_corrections
from sparse_rl_jax.rl.loss_config import CorrectionConfig

ROOT = Path(__file__).resolve().parents[1]
GEO, K3 = ("seq_mean_k1", "0.999_1.001"), ("seq_mean_k3", 0.01)
# verl-project/verl 1dda039, RolloutCorrectionConfig's factory defaults: (rollout_is,
# rollout_is_threshold, (rollout_rs, rollout_rs_threshold), bypass_mode, loss_type)
VERL_09 = {
    "decoupled_token_is": ("token", 2.0, None, False, "ppo_clip"),
    "decoupled_seq_is": ("sequence", 2.0, None, False, "ppo_clip"),
    "decoupled_token_icepop": ("token", "0.5_5.0", None, False, "ppo_clip"),
    "decoupled_seq_is_rs": ("sequence", 2.0, ("seq_sum_k1", "0.5_2.0"), False, "ppo_clip"),
    "decoupled_geo_rs": (None, 2.0, GEO, False, "ppo_clip"),
    "bypass_ppo_clip": (None, 2.0, None, True, "ppo_clip"),
    "bypass_ppo_clip_geo_rs": (None, 2.0, GEO, True, "ppo_clip"),
    "bypass_ppo_clip_k3_rs": (None, 2.0, K3, True, "ppo_clip"),
    "bypass_pg_is": ("sequence", 2.0, None, True, "reinforce"),
    "bypass_pg_token_icepop": ("token", "0.5_5.0", None, True, "reinforce"),
    "bypass_pg_geo_rs": (None, 2.0, GEO, True, "reinforce"),
    "decoupled_geo_rs_seq_tis": ("sequence", 2.0, GEO, False, "ppo_clip"),
    "decoupled_geo_rs_token_tis": ("token", 2.0, GEO, False, "ppo_clip"),
    "bypass_pg_geo_rs_seq_tis": ("sequence", 2.0, GEO, True, "reinforce"),
    "bypass_pg_geo_rs_token_tis": ("token", 2.0, GEO, True, "reinforce"),
    "decoupled_k3_rs": (None, 2.0, K3, False, "ppo_clip"),
    "decoupled_k3_rs_seq_tis": ("sequence", 2.0, K3, False, "ppo_clip"),
    "decoupled_k3_rs_token_tis": ("token", 2.0, K3, False, "ppo_clip"),
    "disabled": (None, 2.0, None, False, "ppo_clip"),
}
PRE_09_GEO = {"rs_level": "geometric", "rs_lower": 1 / 1.001, "rs_upper": 1.001,
              "veto": True, "veto_threshold": 1e-4}
# every name of before this change with the parts it had (main at d6b5ed2)
OLD_PARTS = {
    "none": {}, "disabled": {}, "tis": {"is_level": "token"},
    "mis": {"is_level": "token", "is_mode": "mask", "rs_level": "token"},
    "sparse_rl": {"is_level": "token", "rs_level": "token", "veto": True, "normalize": True},
    "shadow_mask": {"replay": True}, "ppo_behaviour": {"anchor": "behaviour"},
    "decoupled_token_is": {"is_level": "token", "is_upper": 2.0},
    "decoupled_seq_is": {"is_level": "sequence", "is_upper": 2.0},
    "decoupled_seq_is_rs": {"is_level": "sequence", "is_upper": 2.0, "rs_level": "sequence",
                            "rs_lower": 0.5, "rs_upper": 2.0},
    "decoupled_geo_rs_veto": PRE_09_GEO,  # decoupled_geo_rs's parts before verl 0.9
    "ppo_is_bypass": {"anchor": "behaviour"},
    "pg_is": {"anchor": "behaviour", "loss": "pg", "is_level": "sequence", "is_upper": 2.0},
    "pg_rs": {"anchor": "behaviour", "loss": "pg", **PRE_09_GEO},
    "icepop": {"is_level": "token", "is_mode": "mask", "is_lower": 0.5, "is_upper": 5.0},
    "opsm": {"opsm": True},
}


def resolved(**parts) -> dict:
    """Every part of a config with ``parts`` set and the rest at :data:`BASE`'s values."""
    cfg = CorrectionConfig(kind="disabled", **parts)
    return {p: getattr(cfg, p) for p in PARTS}


def rollout(seed: int, b: int = 48, t: int = 10):
    """Rows whose log-ratio noise scale runs from 1e-4 to 1.5 (random lengths, one empty
    row), so every band and bound above keeps some rows and rejects others."""
    rng = np.random.default_rng(seed)
    old = rng.normal(-1.0, 0.5, (b, t)).astype(np.float32)
    scale = np.geomspace(1e-4, 1.5, b)[rng.permutation(b)]
    sparse = (old + rng.normal(0.0, 1.0, (b, t)) * scale[:, None]).astype(np.float32)
    mask = np.arange(t)[None, :] < rng.integers(1, t + 1, b)[:, None]
    mask[0] = False
    return old, sparse, mask


def verl(old, sparse, mask, rollout_is, is_threshold, rs):
    """verl's (IS weights, modified response mask) of compute_rollout_correction_and_
    rejection_mask, in NumPy: IS at token or sequence level (sum of log ratios, clamped to
    +-20), truncated at a number or zeroed outside a "lower_upper" band; each rejection
    option zeroes the mask where it fails (k1 kept within [log lower, log upper] of -log r)."""
    lr = np.where(mask, old.astype(np.float64) - sparse.astype(np.float64), 0.0)
    weights = np.ones(lr.shape)
    if rollout_is == "token":
        weights = np.exp(np.clip(lr, -20, 20))
    elif rollout_is == "sequence":
        weights = np.repeat(np.exp(np.clip(lr.sum(1), -20, 20))[:, None], lr.shape[1], 1)
    if rollout_is is not None and isinstance(is_threshold, str):
        lower, upper = map(float, is_threshold.split("_"))
        weights = np.where((weights >= lower) & (weights <= upper), weights, 0.0)
    elif rollout_is is not None:
        weights = np.minimum(weights, is_threshold)
    keep = mask.copy()
    if rs is not None:
        option, spec = rs
        agg, div = option.rsplit("_", 1)
        token = {"k1": -lr, "k3": np.exp(lr) - 1 - lr}[div]
        value = token.sum(1) if agg == "seq_sum" else (token * mask).sum(1) / np.maximum(
            mask.sum(1), 1)
        if div == "k1":
            lower, upper = map(float, spec.split("_"))
            ok = (value >= np.log(lower)) & (value <= np.log(upper))
        else:
            ok = value <= spec
        keep &= ok[:, None]
    return weights * mask, keep


def test_the_table_is_verls_nineteen_all_registered():
    assert len(VERL_09) == 19
    for name in VERL_09:
        assert CORRECTION_PRESETS.get(name).alias_of is None
        assert CORRECTION_PRESETS.get(name).source == "verl 0.9"


@pytest.mark.parametrize("name", VERL_09)
def test_each_verl_preset_resolves_to_verls_numbers(name):
    rollout_is, threshold, rs, bypass, loss_type = VERL_09[name]
    want = {"anchor": "behaviour" if bypass else "proximal",
            "loss": "pg" if loss_type == "reinforce" else "ppo",
            "is_level": rollout_is or "none"}
    if rollout_is is not None and isinstance(threshold, str):  # IcePop
        lower, upper = map(float, threshold.split("_"))
        want |= {"is_mode": "mask", "is_lower": lower, "is_upper": upper}
    elif rollout_is is not None:
        want |= {"is_mode": "truncate", "is_upper": threshold}
    cfg = CorrectionConfig(kind=name)
    if rs is not None and cfg.rs == "none":  # a k1 band spelled as our ratio band (1/r):
        option, spec = rs
        lower, upper = map(float, spec.split("_"))
        want |= {"rs_level": {"token_k1": "token", "seq_sum_k1": "sequence",
                              "seq_mean_k1": "geometric"}[option],
                 "rs_lower": 1 / upper, "rs_upper": 1 / lower}
    elif rs is not None:
        want |= {"rs": rs[0], "rs_threshold": rs[1]}
    assert {p: getattr(cfg, p) for p in PARTS} == resolved(**want)


@pytest.mark.parametrize("name", VERL_09)
def test_each_verl_preset_computes_what_verl_computes(name):
    rollout_is, threshold, rs, _, _ = VERL_09[name]
    for seed in range(2):
        old, sparse, mask = rollout(seed)
        out = compute_corrections(old, sparse, mask, CorrectionConfig(kind=name))
        weights, keep = verl(old, sparse, mask, rollout_is, threshold, rs)
        kept = np.asarray(out.token_mask) & np.asarray(out.seq_mask)[:, None]
        np.testing.assert_array_equal(kept, keep)
        np.testing.assert_allclose(np.asarray(out.weights)[kept], weights[kept], rtol=2e-5)
        if rs is not None:
            assert (mask & ~keep).any() and keep.any()  # not vacuous
        if isinstance(threshold, str) and rollout_is is not None:
            assert (weights[mask] == 0).any()


@pytest.mark.parametrize("name", OLD_PARTS)
def test_the_older_names_keep_their_parts(name):
    cfg = CorrectionConfig(kind=name)
    assert {p: getattr(cfg, p) for p in PARTS} == resolved(**OLD_PARTS[name])
    assert CORRECTION_PRESETS.get(name).count() == sum(
        OLD_PARTS[name].get(p, BASE[p]) != BASE[p]
        for p in ("anchor", "loss", "is_level", "rs_level", "veto", "normalize", "opsm",
                  "replay"))


def test_the_aliases_resolve_to_their_presets():
    aliases = {n: CORRECTION_PRESETS.get(n).alias_of for n in CORRECTION_PRESETS.names()
               if CORRECTION_PRESETS.get(n).alias_of}
    assert aliases == {"none": "disabled", "ppo_behaviour": "bypass_ppo_clip",
                       "ppo_is_bypass": "bypass_ppo_clip", "pg_is": "bypass_pg_is",
                       "icepop": "decoupled_token_icepop", "seq_mask_tis": "seq-mask-tis"}
    for name, canonical in aliases.items():
        assert CORRECTION_PRESETS.get(name).parts == CORRECTION_PRESETS.get(canonical).parts
        assert f"alias of {canonical}" in describe(name)
    assert "bypass_pg_geo_rs, which has no veto and band '0.999_1.001'" in describe("pg_rs")


def test_seq_mask_tis_is_nemos():
    """NeMo-RL loss_functions.py: raw token ratios, zeroed for a sequence whose exp(mean log
    ratio) leaves [0.999, 1.002] (ProRL v2.1's bounds); the sequence stays in the mask."""
    for name in ("seq-mask-tis", "seq_mask_tis"):
        old, sparse, mask = rollout(3)
        out = compute_corrections(old, sparse, mask, CorrectionConfig(kind=name))
        lr = np.where(mask, old.astype(np.float64) - sparse, 0.0)
        geo = np.exp(lr.sum(1) / np.maximum(mask.sum(1), 1))
        seq_kept = (geo >= 0.999) & (geo <= 1.002)
        weights = np.exp(lr) * seq_kept[:, None] * mask
        got = np.asarray(out.weights) * np.asarray(out.seq_mask)[:, None]
        np.testing.assert_allclose(got, weights, rtol=2e-5)
        np.testing.assert_array_equal(np.asarray(out.seq_mask)[1:], seq_kept[1:])
        np.testing.assert_array_equal(np.asarray(out.token_mask), mask)
        assert seq_kept[1:].any() and not seq_kept[1:].all()


def test_areal_geo_is_is_areals():
    """AReaL apply_rejection_sampling(level=sequence, metric=ratio, agg=mean, action=mask,
    upper=5.0, lower=None): every token's weight is the sequence's exp(mean log ratio); a
    sequence above 5.0 leaves the mask; no lower bound."""
    old, sparse, mask = rollout(4)
    shift = np.zeros(len(old), np.float32)
    shift[[3, 7]], shift[[5, 9]] = 2.0, -4.0  # geometric ratio ~e^2 > 5 and ~e^-4 (kept)
    old = old + shift[:, None]
    out = compute_corrections(old, sparse, mask, CorrectionConfig(kind="areal_geo_is"))
    lr = np.where(mask, old.astype(np.float64) - sparse, 0.0)
    geo = np.exp(lr.sum(1) / np.maximum(mask.sum(1), 1))
    keep = mask & (geo <= 5.0)[:, None]
    kept = np.asarray(out.token_mask) & np.asarray(out.seq_mask)[:, None]
    np.testing.assert_array_equal(kept, keep)
    np.testing.assert_allclose(np.asarray(out.weights)[keep],
                               np.broadcast_to(geo[:, None], mask.shape)[keep], rtol=2e-5)
    assert not keep[[3, 7]].any() and keep[[5, 9]].any()


def test_run_py_config_prints_what_every_name_resolves_to(capsys):
    import run

    for name in CORRECTION_PRESETS.names():
        assert run.main(["config", f"correction.kind={name}"]) == 0
        out = capsys.readouterr().out
        assert yaml.safe_load(out)["correction"] == to_dict(CorrectionConfig(kind=name))
        assert out.rstrip().splitlines()[-1] == f"# correction.kind {describe(name)}"


def test_docs_corrections_lists_every_name_with_its_source():
    text = (ROOT / "docs" / "corrections.md").read_text()
    for name in CORRECTION_PRESETS.names():
        row = next((line for line in text.splitlines() if line.startswith(f"| `{name}` |")),
                   None)
        assert row is not None, name
        assert CORRECTION_PRESETS.get(name).source.split(" (")[0] in row, name
