"""Config validation: bad values fail on construction with the field and the allowed values."""

from __future__ import annotations

import pytest

from sparse_rl_jax.rl.loss_config import LOG_RATIO_CLAMP, CorrectionConfig, GRPOLossConfig


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (
            {"kind": "ice_pop"},
            r"CorrectionConfig\.kind='ice_pop' must be one of "
            r"\('none', 'tis', 'mis', 'sparse_rl', 'shadow_mask', 'ppo_behaviour', 'disabled', "
            r"'decoupled_token_is', .*'pg_rs', 'icepop', 'opsm', .*'seq-mask-tis', .*"
            r"'adaptive_k3_rs_token_tis'\)",
        ),
        ({"anchor": "old"}, r"CorrectionConfig\.anchor='old' must be one of "
                            r"\('proximal', 'behaviour'\)"),
        ({"loss": "reinforce"}, r"CorrectionConfig\.loss='reinforce' must be one of "
                                r"\('ppo', 'pg'\)"),
        ({"is_mode": "clip"}, r"CorrectionConfig\.is_mode='clip' must be one of "
                              r"\('truncate', 'mask', 'raw'\)"),
        ({"rs_level": "seq"}, r"CorrectionConfig\.rs_level='seq' must be one of "
                              r"\('none', 'token', 'sequence', 'geometric'\)"),
        ({"kind": "decoupled_geo_rs_veto", "rs_lower": 1.0005},
         r"CorrectionConfig\.rs_lower=1\.0005 must be <= 1 with rs_level=geometric"),
        ({"kind": "decoupled_geo_rs_veto", "rs_lower": 0.9, "rs_upper": 0.95},
         r"CorrectionConfig\.rs_upper=0\.95 must be >= 1 with rs_level=geometric"),
        ({"opsm_delta": -0.1}, r"CorrectionConfig\.opsm_delta=-0\.1 must be >= 0"),
        ({"veto": 1}, r"CorrectionConfig\.veto=1 must be true or false"),
        (
            {"level": "tokens"},
            r"CorrectionConfig\.level='tokens' must be one of \('token', 'sequence', 'geometric'\)",
        ),
        ({"is_upper": 0.0}, r"CorrectionConfig\.is_upper=0\.0 must be > 0"),
        ({"is_lower": -1.0}, r"CorrectionConfig\.is_lower=-1\.0 must be > 0"),
        ({"is_lower": 2.0, "is_upper": 1.5},
         r"CorrectionConfig\.is_lower=2\.0 must be < is_upper=1\.5"),
        ({"rs_lower": 1.2, "rs_upper": 1.1},
         r"CorrectionConfig\.rs_lower=1\.2 must be < rs_upper=1\.1"),
        ({"kind": "sparse_rl", "rs_lower": 1.6},
         r"CorrectionConfig\.rs_lower=1\.6 must be < rs_upper=1\.5"),
        ({"rs_upper": float("nan")}, r"CorrectionConfig\.rs_upper=nan must be a finite number"),
        ({"veto_threshold": 1.5}, r"CorrectionConfig\.veto_threshold=1\.5 must be in "
                                  r"\(exp\(-LOG_RATIO_CLAMP\)="),
        ({"veto_threshold": 1e-12}, r"CorrectionConfig\.veto_threshold=1e-12 must be in"),
        ({"normalize": "yes"}, r"CorrectionConfig\.normalize='yes' must be true or false"),
    ],
)
def test_correction_config_errors_name_the_field(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        CorrectionConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"eps_low": 0.0}, r"GRPOLossConfig\.eps_low=0\.0 must be in \(0, 1\)"),
        ({"eps_low": -0.2}, r"GRPOLossConfig\.eps_low=-0\.2 must be in \(0, 1\)"),
        ({"eps_low": 1.0}, r"GRPOLossConfig\.eps_low=1\.0 must be in \(0, 1\)"),
        ({"eps_high": 0.0}, r"GRPOLossConfig\.eps_high=0\.0 must be > 0"),
        (
            {"aggregation": "mean"},
            r"GRPOLossConfig\.aggregation='mean' must be one of "
            r"\('seq_mean_token_mean', 'token_mean', 'seq_mean_token_sum', "
            r"'seq_mean_token_sum_norm'\)",
        ),
        ({"kl_coef": -1e-4}, r"GRPOLossConfig\.kl_coef=-0\.0001 must be >= 0"),
        ({"policy_loss": "grpo"}, r"GRPOLossConfig\.policy_loss='grpo' must be one of "
                                  r"\('ppo_clip', 'cispo', 'pg'\)"),
        ({"ratio_level": "seq"}, r"GRPOLossConfig\.ratio_level='seq' must be one of "
                                 r"\('token', 'sequence'\)"),
        ({"clip_c": 1.0}, r"GRPOLossConfig\.clip_c=1\.0 must be None or > 1"),
        ({"clip_c": 3.0, "policy_loss": "cispo"},
         r"GRPOLossConfig\.clip_c=3\.0 \(dual-clip\) applies to policy_loss='ppo_clip' only"),
        ({"eps_low": 10.0}, r"GRPOLossConfig\.eps_low=10\.0 must be in \(0, 1\)"),
        ({"eps_low": 0.0, "policy_loss": "cispo"}, r"GRPOLossConfig\.eps_low=0\.0 must be > 0"),
        ({"entropy_coef": -0.01}, r"GRPOLossConfig\.entropy_coef=-0\.01 must be >= 0"),
        ({"distill_coef": -1.0}, r"GRPOLossConfig\.distill_coef=-1\.0 must be >= 0"),
        ({"distill_kind": "reverse"}, r"GRPOLossConfig\.distill_kind='reverse' must be one of"),
        (
            {"seq_denominator": "global"},
            r"GRPOLossConfig\.seq_denominator='global' must be one of \('all', 'kept'\)",
        ),
        ({"kl_kind": "k4"}, r"GRPOLossConfig\.kl_kind='k4' must be one of \('k1', 'k2', 'k3'\)"),
        ({"eps_high": "0.2"}, r"GRPOLossConfig\.eps_high='0\.2' must be a finite number"),
    ],
)
def test_grpo_config_errors_name_the_field(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        GRPOLossConfig(**kwargs)


def test_defaults_and_resolution():
    cfg = GRPOLossConfig()
    assert (cfg.eps_low, cfg.eps_high, cfg.aggregation, cfg.kl_coef, cfg.kl_kind) == (
        0.2, 0.2, "seq_mean_token_mean", 0.0, "k3"
    )
    assert GRPOLossConfig(eps_high=0.28).eps_high == 0.28
    c = CorrectionConfig(is_lower=0.6, is_upper=2.0)
    assert (c.rs_lower, c.rs_upper) == (0.6, 2.0)  # rejection bounds default to the IS bounds
    assert CorrectionConfig(kind="mis", normalize=True).normalize is True
    assert CorrectionConfig(kind="sparse_rl", veto=False).veto is False
    assert CorrectionConfig(kind="sparse_rl").veto is True
    # frozen and hashable: usable as a static jit argument
    assert hash(CorrectionConfig()) == hash(CorrectionConfig())
    with pytest.raises(AttributeError):
        cfg.eps_low = 0.1  # type: ignore[misc]
    # one clamp for every log ratio, stated once
    assert cfg.log_ratio_clamp == c.log_ratio_clamp == LOG_RATIO_CLAMP == 20.0


def test_correction_loss_pg_makes_the_policy_term_plain_policy_gradient():
    from sparse_rl_jax.core.config_io import ConfigError, load_config
    from sparse_rl_jax.training.run_config import RunConfig

    cfg = load_config(RunConfig, None, ["correction.kind=pg_rs"])
    assert (cfg.correction.loss, cfg.loss.policy_loss) == ("pg", "pg")
    again = load_config(RunConfig, None, ["correction.kind=pg_rs", "loss.policy_loss=pg"])
    assert again == cfg  # what a saved config.yaml holds reloads as it ran
    with pytest.raises(ConfigError, match=r"correction\.loss='pg' =pg replaces "
                                          r"loss\.policy_loss, which is 'cispo'"):
        load_config(RunConfig, None, ["correction.loss=pg", "loss.policy_loss=cispo"])
    with pytest.raises(ConfigError, match=r"loss\.policy_loss='pg' pg is set by "
                                          r"correction\.loss=pg"):
        load_config(RunConfig, None, ["loss.policy_loss=pg"])
    with pytest.raises(ConfigError, match=r"correction\.kind='nope' must be one of \('none', "):
        load_config(RunConfig, None, ["correction.kind=nope"])


def test_pg_gradient_is_minus_weight_times_advantage_per_token():
    """Plain policy gradient: d loss / d logp_new = -w A / n over kept tokens (token_mean),
    however far the ratio is from 1 (no clipping)."""
    import jax
    import numpy as np

    from sparse_rl_jax.rl.corrections import compute_corrections
    from sparse_rl_jax.rl.grpo_loss import LossBatch, grpo_loss

    rng = np.random.default_rng(0)
    old = rng.normal(-1.0, 0.5, (3, 4)).astype(np.float32)
    sparse = (old + rng.normal(0.0, 0.8, (3, 4))).astype(np.float32)
    new = (old + rng.normal(0.0, 1.0, (3, 4))).astype(np.float32)  # far from old: no clip
    mask = np.ones((3, 4), bool)
    mask[2, 3] = False
    adv = np.array([1.0, -0.5, 2.0], np.float32)
    corr = compute_corrections(old, sparse, mask, CorrectionConfig(kind="decoupled_token_is"))
    batch = LossBatch.from_corrections(old, adv, mask, corr)
    cfg = GRPOLossConfig(policy_loss="pg", aggregation="token_mean")
    grad = jax.grad(lambda x: grpo_loss(x, batch, cfg)[0])(new)
    w = np.minimum(np.exp(old - sparse), 2.0)
    want = np.where(mask, -w * adv[:, None] / mask.sum(), 0.0)
    np.testing.assert_allclose(np.asarray(grad), want, rtol=1e-5, atol=1e-7)


def test_run_py_config_prints_the_parts_a_preset_resolves_to(capsys):
    import yaml

    import run

    assert run.main(["config", "correction.kind=pg_rs"]) == 0
    section = yaml.safe_load(capsys.readouterr().out)["correction"]
    assert {k: section[k] for k in ("kind", "anchor", "loss", "rs_level", "veto")} == {
        "kind": "pg_rs", "anchor": "behaviour", "loss": "pg", "rs_level": "geometric",
        "veto": True}
    assert run.main(["config", "correction.kind=nope"]) == 2
    assert "correction.kind='nope' must be one of ('none', 'tis'" in capsys.readouterr().err


def test_every_preset_and_every_part_override_hashes_differently():
    """The config hash reads the correction in its flat form of before the parts (old runs
    resume: tests/test_kv_config.py), yet every preset and every part set away from its
    preset's value gives a run its own hash, so a run never resumes one that trains
    differently."""
    from sparse_rl_jax.rl.correction_presets import CORRECTION_PRESETS
    from sparse_rl_jax.training.run_config import RunConfig
    from sparse_rl_jax.training.trainer import config_hash

    def run_hash(**correction):
        return config_hash(RunConfig(correction=CorrectionConfig(**correction)))

    presets = {name: run_hash(kind=name) for name in CORRECTION_PRESETS.names()}
    # presets that resolve to the same parts train alike and may share a hash; no others
    by_parts = {}
    for name in presets:
        cfg = CorrectionConfig(kind=name)
        by_parts.setdefault(tuple(getattr(cfg, p) for p in cfg.__dataclass_fields__
                                  if p != "kind"), set()).add(presets[name])
    assert len(set(presets.values())) >= len(by_parts)
    base = run_hash(kind="sparse_rl")
    overrides = {"anchor": "behaviour", "is_level": "sequence", "is_mode": "mask",
                 "rs_level": "geometric", "veto": False, "normalize": False, "opsm": True,
                 "opsm_delta": 0.5, "replay": True, "is_upper": 2.0, "rs_lower": 0.8,
                 "veto_threshold": 1e-3,  # the measures need their threshold beside them
                 "rs": {"rs": "seq_mean_k3", "rs_threshold": 0.01},
                 "rs_threshold": {"rs": "seq_mean_k3", "rs_threshold": 0.02},
                 "rs_target_rate": {"rs": "seq_mean_k3", "rs_threshold": 0.01,
                                    "rs_target_rate": 0.1}}
    hashes = {part: run_hash(kind="sparse_rl", **(value if isinstance(value, dict)
                                                  else {part: value}))
              for part, value in overrides.items()}
    assert base not in hashes.values()
    assert len(set(hashes.values())) == len(hashes)
