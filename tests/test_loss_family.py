"""The GRPO-family variants of grpo_loss (dual-clip, CISPO, GSPO-token, Dr.GRPO, entropy
bonus) and the shadow-mask distillation term, against the NumPy reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from loss_reference import np_grad, np_loss, random_batch
from sparse_rl_jax.rl.grpo_loss import grpo_loss, loss_norm
from sparse_rl_jax.rl.loss_config import SEQ_DENOMINATORS, GRPOLossConfig


@pytest.mark.parametrize("kind", ["k3", "full"])
@pytest.mark.parametrize("den", SEQ_DENOMINATORS)
def test_shadow_distillation_value_and_grad_match_numpy(kind, den):
    new, batch, (old, adv, eff, w), _, valid = random_batch(21)
    rng = np.random.default_rng(4)
    dense = (new + rng.normal(0, 0.4, new.shape)).astype(np.float32).astype(np.float64)
    kl_full = rng.uniform(0, 0.5, new.shape).astype(np.float32).astype(np.float64)
    cfg = GRPOLossConfig(distill_coef=0.3, distill_kind=kind, seq_denominator=den)

    def f(x, kl):
        return grpo_loss(x, batch, cfg, logp_dense=jnp.asarray(dense, jnp.float32), kl_full=kl)

    (loss, metrics), (grad, grad_kl) = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(
        jnp.asarray(new, jnp.float32), jnp.asarray(kl_full, jnp.float32))
    args = (old, adv, eff, w, cfg, None, valid, dense, kl_full)
    np.testing.assert_allclose(float(loss), np_loss(new, *args), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), np_grad(new, *args), rtol=1e-4, atol=1e-6)
    # The vocabulary KL enters with weight distill_coef / denominator (zero for k3).
    g_kl = np.zeros_like(new)
    for idx in zip(*np.nonzero(eff)):
        up, down = kl_full.copy(), kl_full.copy()
        up[idx] += 1e-5
        down[idx] -= 1e-5
        g_kl[idx] = (np_loss(new, *args[:-1], up) - np_loss(new, *args[:-1], down)) / 2e-5
    np.testing.assert_allclose(np.asarray(grad_kl), g_kl, rtol=1e-4, atol=1e-6)
    k3 = np.exp(dense - new) - 1 + (new - dense)
    np.testing.assert_allclose(float(metrics["distill_k3"]), k3[eff].mean(), rtol=1e-5)
    no_distill = np_loss(new, old, adv, eff, w, GRPOLossConfig(seq_denominator=den), None, valid)
    np.testing.assert_allclose(float(metrics["pg_loss"]), no_distill, rtol=1e-5, atol=1e-6)


def test_distillation_is_zero_when_sparse_equals_dense():
    new, batch, *_ = random_batch(2)
    for kind in ("k3", "full"):
        cfg = GRPOLossConfig(distill_coef=1.0, distill_kind=kind)
        x = jnp.asarray(new, jnp.float32)
        (loss, metrics), grad = jax.value_and_grad(grpo_loss, has_aux=True)(
            x, batch, cfg, logp_dense=x, kl_full=jnp.zeros_like(x))
        plain, plain_grad = jax.value_and_grad(
            lambda y: grpo_loss(y, batch, GRPOLossConfig())[0])(x)
        assert float(metrics["distill_kl"]) == 0.0 and float(metrics["distill_k3"]) == 0.0
        assert float(loss) == float(plain)
        np.testing.assert_array_equal(np.asarray(grad), np.asarray(plain_grad))


def test_ratio_spread_metrics():
    new, batch, (old, _, eff, _), *_ = random_batch(7)
    _, metrics = grpo_loss(jnp.asarray(new, jnp.float32), batch, GRPOLossConfig())
    rho = np.exp(new - old)[eff]
    np.testing.assert_allclose(float(metrics["ratio_std"]), rho.std(), rtol=1e-4)
    np.testing.assert_allclose(float(metrics["log_ratio_abs_max"]),
                               np.abs(new - old)[eff].max(), rtol=1e-5)


def test_distillation_needs_the_teacher():
    new, batch, *_ = random_batch(0)
    x = jnp.asarray(new, jnp.float32)
    with pytest.raises(ValueError, match="distill_coef > 0 needs logp_dense"):
        grpo_loss(x, batch, GRPOLossConfig(distill_coef=0.1))
    with pytest.raises(ValueError, match="distill_kind='full' needs kl_full"):
        grpo_loss(x, batch, GRPOLossConfig(distill_kind="full"), logp_dense=x)



# The loss variants, each on the batch with IS weights, rejected tokens, a rejected
# sequence and an empty row (so every variant composes with the corrections).
VARIANTS = {
    "dual_clip": GRPOLossConfig(clip_c=1.2),
    "cispo": GRPOLossConfig(policy_loss="cispo"),
    "cispo_no_lower": GRPOLossConfig(policy_loss="cispo", eps_low=10.0, eps_high=0.2),
    "gspo": GRPOLossConfig(ratio_level="sequence"),
    "gspo_paper_eps": GRPOLossConfig(ratio_level="sequence", eps_low=3e-4, eps_high=4e-4),
    "gspo_cispo": GRPOLossConfig(ratio_level="sequence", policy_loss="cispo"),
    "gspo_dual_clip_token_mean": GRPOLossConfig(ratio_level="sequence", clip_c=1.1,
                                                aggregation="token_mean"),
    "dr_grpo_all": GRPOLossConfig(aggregation="seq_mean_token_sum_norm"),
    "dr_grpo_kept": GRPOLossConfig(aggregation="seq_mean_token_sum_norm", seq_denominator="kept"),
    "entropy": GRPOLossConfig(entropy_coef=0.05),
    "entropy_cispo_token_mean": GRPOLossConfig(entropy_coef=0.05, policy_loss="cispo",
                                               aggregation="token_mean"),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_loss_variants_value_and_grad_match_numpy(name):
    cfg = VARIANTS[name]
    new, batch, (old, adv, eff, w), _, valid = random_batch(13)
    ent = np.random.default_rng(8).uniform(0, 3, new.shape).astype(np.float32).astype(np.float64)

    def f(x, h):
        return grpo_loss(x, batch, cfg, entropy=h)

    (loss, metrics), (grad, grad_ent) = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(
        jnp.asarray(new, jnp.float32), jnp.asarray(ent, jnp.float32))
    args = (old, adv, eff, w, cfg, None, valid)
    expected = np_loss(new, *args, entropy=ent)
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), np_grad(new, *args, entropy=ent),
                               rtol=1e-4, atol=1e-6)
    assert np.all(np.asarray(grad)[~eff] == 0)
    g_ent = np.zeros_like(ent)
    for idx in zip(*np.nonzero(eff)):
        up, down = ent.copy(), ent.copy()
        up[idx] += 1e-5
        down[idx] -= 1e-5
        g_ent[idx] = (np_loss(new, *args, entropy=up) - np_loss(new, *args, entropy=down)) / 2e-5
    np.testing.assert_allclose(np.asarray(grad_ent), g_ent, rtol=1e-4, atol=1e-7)
    assert (np.abs(g_ent).max() > 0) == (cfg.entropy_coef > 0)
    if cfg.entropy_coef > 0:
        assert float(metrics["entropy_loss"]) > 0
    # Each variant changes the default loss's value on this batch (the branch is exercised).
    plain = np_loss(new, old, adv, eff, w, GRPOLossConfig(seq_denominator=cfg.seq_denominator),
                    None, valid)
    assert abs(expected - plain) > 1e-4


def test_gspo_ratio_is_the_sequence_ratio_and_clips_per_sequence():
    new, batch, (old, adv, eff, w), _, valid = random_batch(17)
    cfg = GRPOLossConfig(ratio_level="sequence", eps_low=3e-4, eps_high=4e-4)
    _, metrics = grpo_loss(jnp.asarray(new, jnp.float32), batch, cfg)
    s = np.array([np.exp((new - old)[i][eff[i]].mean()) for i in range(len(eff)) if eff[i].any()])
    counts = eff.sum(1)[eff.any(1)]
    np.testing.assert_allclose(float(metrics["ratio_mean"]), (s * counts).sum() / counts.sum(),
                               rtol=1e-5)



@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
def test_cispo_keeps_the_gradient_of_tokens_beyond_the_log_ratio_clamp(ratio_level):
    """verl clamps `log r` only inside the detached weight: a kept token with `|log r| = 25`
    (past the clamp 20) still gets `d loss / d logp = -w A / denominator`, not 0."""
    new, batch, (old, adv, eff, w), _, valid = random_batch(13)
    extreme = [(2, int(np.flatnonzero(eff[2])[0]), 25.0),
               (4, int(np.flatnonzero(eff[4])[-1]), -25.0)]
    for i, j, log_r in extreme:
        old[i, j] = np.float32(new[i, j] - log_r)
    batch = batch.replace(logp_old_dense=jnp.asarray(old, jnp.float32))
    cfg = GRPOLossConfig(policy_loss="cispo", ratio_level=ratio_level)
    (loss, _), grad = jax.value_and_grad(grpo_loss, has_aux=True)(
        jnp.asarray(new, jnp.float32), batch, cfg)
    # seq_mean_token_mean, seq_denominator all: a kept token of row i weighs
    # 1 / (kept tokens of row i x rows with a valid token)
    denominator = eff.sum(1) * valid.any(1).sum()
    c = cfg.log_ratio_clamp
    log_rho = np.clip(new - old, -c, c)
    if ratio_level == "sequence":
        log_s = np.array([np.clip(log_rho[i][eff[i]].mean(), -c, c) if eff[i].any() else 0.0
                          for i in range(len(eff))])
        log_rho = np.broadcast_to(log_s[:, None], new.shape)
    weight = np.clip(np.exp(log_rho), 1 - cfg.eps_low, 1 + cfg.eps_high)  # detached
    for i, j, _ in extreme:
        want = -w[i, j] * weight[i, j] * adv[i] / denominator[i]
        assert abs(want) > 1e-3
        np.testing.assert_allclose(float(grad[i, j]), want, rtol=1e-5)
    args = (old, adv, eff, w, cfg, None, valid)
    np.testing.assert_allclose(float(loss), np_loss(new, *args), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), np_grad(new, *args), rtol=1e-4, atol=1e-6)
    assert np.all(np.asarray(grad)[~eff] == 0)


@pytest.mark.parametrize("micro", [None, 2])
def test_dr_grpo_divides_by_every_row_of_the_minibatch(micro):
    """Dr.GRPO (TRL `dr_grpo`): the token sums over the response width `T`, summed over rows
    and divided by the batch's row count, fully masked rows (no loss-mask token: padding,
    `mask_truncated`) included; with `micro`, micro-batch losses under the minibatch's
    `loss_norm` sum to it."""
    new, batch, (old, adv, eff, w), _, valid = random_batch(5, b=6, t=5)
    assert not valid[0].any() and eff.any(1).sum() == 4  # an empty row, a rejected row
    cfg = GRPOLossConfig(aggregation="seq_mean_token_sum_norm")
    rho = np.exp(new - old)
    a = adv[:, None]
    per_token = w * np.maximum(-rho * a, -np.clip(rho, 1 - cfg.eps_low, 1 + cfg.eps_high) * a)
    b, t = new.shape
    want = np.sum(np.where(eff, per_token, 0.0).sum(1) / t) / b
    x = jnp.asarray(new, jnp.float32)
    if micro is None:
        loss = grpo_loss(x, batch, cfg)[0]
    else:
        norm = loss_norm(batch, cfg)
        rows = [np.arange(b)[k::b // micro] for k in range(b // micro)]
        loss = sum(grpo_loss(x[r], jax.tree.map(lambda v: v[r], batch), cfg, norm=norm)[0]
                   for r in rows)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5, atol=1e-7)
