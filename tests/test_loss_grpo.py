"""grpo_loss vs a NumPy reference (values, and gradients by float64 central differences)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loss_reference import np_grad, np_loss, random_batch
from sparse_rl_jax.rl.advantages import group_advantages
from sparse_rl_jax.rl.correction_presets import CORRECTION_PRESETS
from sparse_rl_jax.rl.corrections import compute_corrections
from sparse_rl_jax.rl.grpo_loss import LossBatch, grpo_loss
from sparse_rl_jax.rl.loss_config import (AGGREGATIONS, CORRECTION_LEVELS, SEQ_DENOMINATORS,
                                          CorrectionConfig, GRPOLossConfig)
from sparse_rl_jax.rl.loss_terms import KL_ESTIMATORS, POLICY_LOSSES

loss_and_grad = jax.jit(jax.value_and_grad(grpo_loss, has_aux=True), static_argnames="cfg")
corrections_jit = jax.jit(compute_corrections, static_argnames="cfg")

# every aggregation x denominator without KL, and with KL (each KL kind once, DAPO eps_high)
CASES = [GRPOLossConfig(aggregation=agg, seq_denominator=den)
         for agg in AGGREGATIONS for den in SEQ_DENOMINATORS] + [
    GRPOLossConfig(aggregation=agg, eps_high=0.28, kl_coef=0.5, kl_kind=kk)
    for agg, kk in zip(AGGREGATIONS, KL_ESTIMATORS.names())
]


@pytest.mark.parametrize(
    "cfg", CASES, ids=lambda c: f"{c.aggregation}-{c.seq_denominator}-{c.kl_kind}-{c.kl_coef}")
def test_value_and_grad_match_numpy(cfg):
    with_ref = cfg.kl_coef > 0
    new, batch, (old, adv, eff, w), ref, valid = random_batch(11, with_ref=with_ref)
    (loss, metrics), grad = loss_and_grad(jnp.asarray(new, jnp.float32), batch, cfg=cfg)
    expected = np_loss(new, old, adv, eff, w, cfg, ref, valid)
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5, atol=1e-6)
    expected_grad = np_grad(new, old, adv, eff, w, cfg, ref, valid=valid)
    np.testing.assert_allclose(np.asarray(grad), expected_grad, rtol=1e-4, atol=1e-6)
    assert np.all(np.asarray(grad)[~eff] == 0)

    # metrics vs NumPy token means over effective tokens
    rho = np.exp(new - old)[eff]
    a = np.broadcast_to(adv[:, None], new.shape)[eff]
    clipped = -np.clip(rho, 1 - cfg.eps_low, 1 + cfg.eps_high) * a
    m = {k: float(v) for k, v in metrics.items()}
    np.testing.assert_allclose(m["clip_fraction"], np.mean(clipped > -rho * a), atol=1e-7)
    np.testing.assert_allclose(m["ppo_kl"], np.mean((old - new)[eff]), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(float(metrics["ratio_mean"]), rho.mean(), rtol=1e-5)
    assert float(metrics["effective_tokens"]) == eff.sum()
    assert float(metrics["effective_sequences"]) == eff.any(1).sum()
    assert float(metrics["all_rejected"]) == 0.0
    assert 0.0 < float(metrics["clip_fraction"]) < 1.0  # the inputs do exercise both branches


def test_kl_metric_reported_even_when_coef_zero_and_loss_unchanged():
    new, batch, (old, adv, eff, w), _, valid = random_batch(3, with_ref=True)
    cfg = GRPOLossConfig(kl_coef=0.0)
    loss, metrics = grpo_loss(jnp.asarray(new, jnp.float32), batch, cfg)
    np.testing.assert_allclose(float(loss), np_loss(new, old, adv, eff, w, cfg, valid=valid),
                               rtol=1e-5)
    assert float(metrics["kl_loss"]) > 0.0  # k3 of a nonzero gap


def test_gradient_flows_to_logp_new_only():
    new, batch, *_ = random_batch(5, with_ref=True)
    cfg = GRPOLossConfig(kl_coef=0.1)
    grads = jax.grad(lambda b: grpo_loss(jnp.asarray(new, jnp.float32), b, cfg)[0], allow_int=True)(
        batch
    )
    for name in ("logp_old_dense", "advantages", "is_weights", "logp_ref"):
        assert np.all(np.asarray(getattr(grads, name)) == 0), name


def test_end_to_end_with_corrections_and_advantages():
    """rewards -> advantages, logps -> corrections -> loss, against the composed NumPy pieces."""
    rng = np.random.default_rng(0)
    b, t, g = 8, 6, 4
    old = rng.normal(-1.0, 0.5, (b, t)).astype(np.float32)
    sparse = (old + rng.normal(0, 0.3, (b, t))).astype(np.float32)
    new = (old + rng.normal(0, 0.2, (b, t))).astype(np.float32)
    mask = rng.random((b, t)) < 0.9
    rewards = rng.integers(0, 2, b).astype(np.float32)
    adv = group_advantages(jnp.asarray(rewards), g)
    corr = corrections_jit(old, sparse, mask, cfg=CorrectionConfig(kind="sparse_rl"))
    batch = LossBatch.from_corrections(old, adv, mask, corr)
    cfg = GRPOLossConfig()
    (loss, _), grad = loss_and_grad(jnp.asarray(new), batch, cfg=cfg)
    eff = mask & np.asarray(corr.token_mask) & np.asarray(corr.seq_mask)[:, None]
    f64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
    args = (f64(old), f64(adv), eff, f64(corr.weights), cfg, None, mask)
    np.testing.assert_allclose(float(loss), np_loss(f64(new), *args), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(grad), np_grad(f64(new), *args), rtol=1e-4, atol=1e-6)


def test_minimal_case_rejected_sequence_stays_in_the_denominator():
    """Row 1 is vetoed (r = e^-10 < 1e-4); row 0 keeps its token with IS weight 1 / mean(1, e^-10)
    after normalisation. Official (all): -w0 / 2 sequences; kept: -w0 / 1 sequence."""
    old = np.array([[-1.0], [-1.0]], np.float32)
    sparse = np.array([[-1.0], [9.0]], np.float32)
    mask = np.ones((2, 1), bool)
    corr = corrections_jit(old, sparse, mask, cfg=CorrectionConfig(kind="sparse_rl"))
    assert list(np.asarray(corr.seq_mask)) == [True, False]
    batch = LossBatch.from_corrections(old, np.array([1.0, -1.0], np.float32), mask, corr)
    w0 = 1.0 / ((1.0 + np.exp(-10.0)) / 2.0)
    values = {}
    for den in SEQ_DENOMINATORS:
        for agg in AGGREGATIONS:
            cfg = GRPOLossConfig(aggregation=agg, seq_denominator=den)
            values[agg, den] = float(grpo_loss(jnp.asarray(old), batch, cfg)[0])
    print("one kept and one vetoed row:", values)
    for agg in AGGREGATIONS:  # one token per row: every aggregation agrees
        np.testing.assert_allclose(values[agg, "all"], -w0 / 2, rtol=1e-6)
        np.testing.assert_allclose(values[agg, "kept"], -w0, rtol=1e-6)
    assert round(values["seq_mean_token_mean", "all"], 5) == -0.99995
    assert round(values["seq_mean_token_mean", "kept"], 5) == -1.99991
    assert GRPOLossConfig().seq_denominator == "all"


# Hand-made batch, new == old (rho = 1), so each kept token contributes -w * A:
#   row 0: valid [1 1 0], kept [1 1 0], A = 1,  w = [1, .5] -> terms -1, -0.5
#   row 1: valid [1 1 1], token 1 rejected,  A = -2, w = 1  -> terms  2, 2
#   row 2: valid [1 1 0], sequence rejected (veto), A = 3    -> no terms
#   row 3: no valid token (an empty row),            A = 5   -> not a sample
# Sums: seq token means -0.75 + 2 = 1.25; seq token sums -1.5 + 4 = 2.5; token sum 2.5.
# Denominators: all = 3 sequences / 7 tokens; kept = 2 sequences / 4 tokens.
HAND = {
    ("seq_mean_token_mean", "all"): 1.25 / 3, ("seq_mean_token_mean", "kept"): 1.25 / 2,
    ("seq_mean_token_sum", "all"): 2.5 / 3, ("seq_mean_token_sum", "kept"): 2.5 / 2,
    ("token_mean", "all"): 2.5 / 7, ("token_mean", "kept"): 2.5 / 4,
}


@pytest.mark.parametrize("agg, den", sorted(HAND))
def test_aggregation_and_denominator_hand_computed(agg, den):
    valid = np.array([[1, 1, 0], [1, 1, 1], [1, 1, 0], [0, 0, 0]], bool)
    token_mask = valid.copy()
    token_mask[1, 1] = False
    batch = LossBatch(
        logp_old_dense=jnp.full((4, 3), -0.7),
        advantages=jnp.array([1.0, -2.0, 3.0, 5.0]),
        loss_mask=jnp.asarray(valid),
        is_weights=jnp.asarray(np.where(valid, [[1.0, 0.5, 1.0]] * 4, 0.0), jnp.float32),
        token_mask=jnp.asarray(token_mask),
        seq_mask=jnp.array([True, True, False, True]),
    )
    cfg = GRPOLossConfig(aggregation=agg, seq_denominator=den)
    loss, metrics = grpo_loss(jnp.full((4, 3), -0.7), batch, cfg)
    np.testing.assert_allclose(float(loss), HAND[agg, den], rtol=1e-6)
    assert float(metrics["effective_sequences"]) == 2 and float(metrics["effective_tokens"]) == 4


# Property tests run eagerly at fixed shapes (variable lengths come from the masks): every
# (config, shape) pair would otherwise cost an XLA compilation.
B, T = 4, 5
EXTREME = st.sampled_from([-np.inf, np.inf, 1e4, -1e4, 0.0, -0.3, -2.0, -40.0])


def arrays(elements, dtype):
    return st.lists(elements, min_size=B * T, max_size=B * T).map(
        lambda v: np.array(v, dtype).reshape(B, T)
    )


@settings(max_examples=15, deadline=None)
@given(
    old=arrays(EXTREME, np.float32),
    sparse=arrays(EXTREME, np.float32),
    new=arrays(EXTREME, np.float32),
    ref=arrays(EXTREME, np.float32),
    dense=arrays(EXTREME, np.float32),
    mask=arrays(st.booleans(), bool),
    adv=st.lists(st.floats(-3, 3, width=32), min_size=B, max_size=B),
    kind=st.sampled_from(CORRECTION_PRESETS.names()),
    level=st.sampled_from(CORRECTION_LEVELS),
    agg=st.sampled_from(AGGREGATIONS),
    kl_kind=st.sampled_from(KL_ESTIMATORS.names()),
    distill_kind=st.sampled_from(["k3", "full"]),
    policy_loss=st.sampled_from(POLICY_LOSSES.names()),
)
def test_extreme_log_prob_gaps_stay_finite(
    old, sparse, new, ref, dense, mask, adv, kind, level, agg, kl_kind, distill_kind,
    policy_loss,
):
    """Also the shadow-mask distillation term, against an extreme teacher (a vocabulary KL
    from float32 logits is finite, however large), and CISPO's unclamped `log rho`."""
    corr = compute_corrections(old, sparse, mask, CorrectionConfig(kind=kind, level=level),
                               advantages=np.array(adv, np.float32))
    batch = LossBatch.from_corrections(old, np.array(adv, np.float32), mask, corr, logp_ref=ref)
    cfg = GRPOLossConfig(aggregation=agg, kl_kind=kl_kind, kl_coef=1e-4, distill_coef=0.5,
                         distill_kind=distill_kind, policy_loss=policy_loss)
    value_and_grad = jax.value_and_grad(grpo_loss, has_aux=True)
    (loss, metrics), grad = value_and_grad(jnp.asarray(new), batch, cfg, logp_dense=dense,
                                           kl_full=np.minimum(np.abs(dense), 1e4))
    assert np.isfinite(float(loss))
    assert np.all(np.isfinite(np.asarray(grad)))
    for k, v in {**metrics, **corr.metrics}.items():
        assert np.isfinite(float(v)), k
    assert np.all(np.isfinite(np.asarray(corr.weights)))


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), agg=st.sampled_from(AGGREGATIONS))
def test_all_vetoed_batch_is_a_zero_update(seed, agg):
    rng = np.random.default_rng(seed)
    old = rng.normal(-1.0, 0.5, (B, T)).astype(np.float32)
    sparse = old.copy()
    mask = rng.random((B, T)) < 0.6  # rows may be empty
    mask[0, 0] = True
    for i in np.flatnonzero(mask.any(1)):  # each sequence gets a catastrophic token (r = e^-10)
        j = rng.choice(np.flatnonzero(mask[i]))
        sparse[i, j] = old[i, j] + 10.0
    new = old + rng.normal(0, 0.5, (B, T)).astype(np.float32)
    adv = rng.normal(0, 1, B).astype(np.float32)
    corr = corrections_jit(old, sparse, mask, cfg=CorrectionConfig(kind="sparse_rl"))
    batch = LossBatch.from_corrections(old, adv, mask, corr, logp_ref=old - 0.5)
    cfg = GRPOLossConfig(aggregation=agg, kl_coef=1e-4)
    (loss, metrics), grad = loss_and_grad(jnp.asarray(new), batch, cfg=cfg)
    assert float(loss) == 0.0
    assert np.all(np.asarray(grad) == 0.0)
    assert float(metrics["all_rejected"]) == 1.0
    assert float(metrics["effective_tokens"]) == 0.0
    assert float(corr.metrics["rejection_rate"]) == 1.0
    assert float(corr.metrics["veto_fraction"]) == 1.0


def test_shape_errors_name_the_tensor():
    new, batch, *_ = random_batch(0)
    with pytest.raises(ValueError, match=r"batch\.advantages: expected \[B\] = \[6\], got \[2\]"):
        grpo_loss(jnp.asarray(new), batch.replace(advantages=jnp.zeros((2,))), GRPOLossConfig())
    with pytest.raises(ValueError, match=r"entropy: expected \[B, T\] = \[6, 5\], got \[1, 1\]"):
        grpo_loss(jnp.asarray(new), batch, GRPOLossConfig(), entropy=jnp.zeros((1, 1)))


def test_entropy_metric_is_masked_mean():
    new, batch, (_, _, eff, _), *_ = random_batch(9)
    ent = np.random.default_rng(1).uniform(0, 3, new.shape).astype(np.float32)
    _, metrics = grpo_loss(jnp.asarray(new), batch, GRPOLossConfig(), entropy=jnp.asarray(ent))
    np.testing.assert_allclose(float(metrics["entropy"]), ent[eff].mean(), rtol=1e-6)
