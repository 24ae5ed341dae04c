"""The decoupled objective (behaviour / proximal / current) against a NumPy reference: the PPO
ratio is current / proximal, the correction weights and rejection act on proximal / behaviour,
and the mismatch splits into a compression part and a lag part."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from loss_reference import np_loss
from sparse_rl_jax.rl.decoupled import decoupled_loss_batch, mismatch_split
from sparse_rl_jax.rl.grpo_loss import grpo_loss
from sparse_rl_jax.rl.loss_config import CorrectionConfig, GRPOLossConfig


def _policies(seed, b=6, t=7):
    """Float32-rounded behaviour, rollout-dense, proximal, current log-probs, mask, advantages."""
    rng = np.random.default_rng(seed)
    behaviour = rng.normal(-1.3, 0.5, (b, t))
    rollout_dense = behaviour + rng.normal(0.0, 0.3, (b, t))  # compression mismatch
    proximal = rollout_dense + rng.normal(0.0, 0.3, (b, t))  # lag: a few updates later
    current = proximal + rng.normal(0.0, 0.3, (b, t))
    mask = rng.random((b, t)) < 0.8
    adv = rng.normal(0.0, 1.0, b)
    f32 = lambda x: np.asarray(x, np.float32).astype(np.float64)  # noqa: E731
    return [f32(x) for x in (behaviour, rollout_dense, proximal, current)] + [mask, f32(adv)]


def _np_correction(proximal, behaviour, mask, cfg: CorrectionConfig):
    """NumPy token-level TIS / MIS on r = proximal / behaviour: (weights, kept tokens)."""
    r = np.exp(proximal - behaviour)
    if cfg.kind == "tis":
        return np.minimum(r, cfg.is_upper), mask
    inside = (r >= cfg.is_lower) & (r <= cfg.is_upper)
    return r, mask & inside


@pytest.mark.parametrize("kind", ["tis", "mis"])
def test_decoupled_loss_is_ppo_around_proximal_with_weights_on_proximal_over_behaviour(kind):
    behaviour, _, proximal, current, mask, adv = _policies(3)
    cfg = CorrectionConfig(kind=kind, is_lower=0.7, is_upper=1.3)
    loss_cfg = GRPOLossConfig()
    batch, corrections = decoupled_loss_batch(
        jnp.asarray(behaviour, jnp.float32), jnp.asarray(proximal, jnp.float32),
        jnp.asarray(adv, jnp.float32), jnp.asarray(mask), cfg)
    loss, _ = grpo_loss(jnp.asarray(current, jnp.float32), batch, loss_cfg)
    weights, kept = _np_correction(proximal, behaviour, mask, cfg)
    assert 0 < kept.sum() < mask.sum() or kind == "tis"  # the band rejects some tokens
    expected = np_loss(current, proximal, adv, kept, weights, loss_cfg, valid=mask)
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5, atol=1e-6)
    # the naive objective (ratio to the sampler, no weights) is another number
    naive = np_loss(current, behaviour, adv, mask, np.ones_like(weights), loss_cfg, valid=mask)
    assert abs(naive - expected) > 1e-3


def test_mismatch_split_is_compression_then_lag():
    behaviour, rollout_dense, proximal, _, mask, _ = _policies(5)
    out = mismatch_split(*(jnp.asarray(x, jnp.float32)
                           for x in (behaviour, rollout_dense, proximal)), jnp.asarray(mask))

    def k3(log_r):
        return float(np.mean((np.exp(log_r) - log_r - 1)[mask]))

    np.testing.assert_allclose(float(out["async/compression_mismatch_k3"]),
                               k3(rollout_dense - behaviour), rtol=1e-5)
    np.testing.assert_allclose(float(out["async/lag_mismatch_k3"]),
                               k3(proximal - rollout_dense), rtol=1e-5)


@pytest.mark.parametrize("kind", ["ppo_behaviour", "pg_rs", "decoupled_geo_rs"])
def test_the_anchor_picks_the_ratio_denominator(kind):
    """``anchor: behaviour`` (bypass) takes the PPO ratio to the sampler's log-probs,
    ``proximal`` to the dense ones; the correction acts on proximal / behaviour either way."""
    behaviour, _, proximal, _, mask, adv = _policies(4)
    cfg = CorrectionConfig(kind=kind)
    batch, corrections = decoupled_loss_batch(
        jnp.asarray(behaviour, jnp.float32), jnp.asarray(proximal, jnp.float32),
        jnp.asarray(adv, jnp.float32), jnp.asarray(mask), cfg)
    anchor = behaviour if cfg.anchor == "behaviour" else proximal
    np.testing.assert_array_equal(np.asarray(batch.logp_old_dense), anchor.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(batch.seq_mask), np.asarray(corrections.seq_mask))


def test_rows_without_sampler_log_probs_train_only_on_the_proximal_anchor():
    _, _, proximal, _, mask, adv = _policies(6)
    args = (jnp.asarray(proximal, jnp.float32), jnp.asarray(adv, jnp.float32), jnp.asarray(mask))
    batch, corrections = decoupled_loss_batch(None, *args, CorrectionConfig(kind="sparse_rl"))
    assert float(corrections.metrics["rejection_rate"]) == 0.0  # r = 1: nothing to correct
    np.testing.assert_array_equal(np.asarray(batch.logp_old_dense), np.asarray(args[0]))
    for cfg, replayed in ((CorrectionConfig(kind="ppo_behaviour"), False),
                          (CorrectionConfig(kind="none", anchor="behaviour"), False),
                          (CorrectionConfig(kind="shadow_mask"), True)):
        with pytest.raises(ValueError, match=r"correction\.anchor=.* needs the sampler's "
                                             r"log-probs \(behaviour_NxM\)"):
            decoupled_loss_batch(None, *args, cfg, replayed=replayed)
