"""Config validation: bad values fail on construction with the field and the allowed values."""

from __future__ import annotations

import pytest

from sparse_rl_jax.rl.loss_config import LOG_RATIO_CLAMP, CorrectionConfig, GRPOLossConfig


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (
            {"kind": "icepop"},
            r"CorrectionConfig\.kind='icepop' must be one of "
            r"\('none', 'tis', 'mis', 'sparse_rl', 'shadow_mask', 'ppo_behaviour'\)",
        ),
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
        ({"rs_lower": 1.6}, r"CorrectionConfig\.rs_lower=1\.6 must be < rs_upper=1\.5"),
        ({"rs_upper": float("nan")}, r"CorrectionConfig\.rs_upper=nan must be a finite number"),
        ({"veto_threshold": 1.5}, r"CorrectionConfig\.veto_threshold=1\.5 must be None or in "
                                  r"\(exp\(-LOG_RATIO_CLAMP\)="),
        ({"veto_threshold": 1e-12}, r"CorrectionConfig\.veto_threshold=1e-12 must be None or in"),
        ({"normalize": "yes"}, r"CorrectionConfig\.normalize='yes' must be true, false or null"),
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
                                  r"\('ppo_clip', 'cispo'\)"),
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
    assert CorrectionConfig(veto_threshold=None).veto_threshold is None
    # frozen and hashable: usable as a static jit argument
    assert hash(CorrectionConfig()) == hash(CorrectionConfig())
    with pytest.raises(AttributeError):
        cfg.eps_low = 0.1  # type: ignore[misc]
    # one clamp for every log ratio, stated once
    assert cfg.log_ratio_clamp == c.log_ratio_clamp == LOG_RATIO_CLAMP == 20.0
