"""The PPO-clipped GRPO objective with correction weights/masks and an optional reference KL."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from sparse_rl_jax.corrections import Corrections
from sparse_rl_jax.loss_config import GRPOLossConfig
from sparse_rl_jax.masked_math import (
    as_mask,
    check_shape,
    masked_count,
    masked_mean,
    masked_sum,
    safe_log_ratio,
)


@struct.dataclass
class LossBatch:
    """Everything the loss needs besides `logp_new`; every leaf has leading axis B, so a
    minibatch is `jax.tree.map(lambda x: x[idx], batch)`. None of it receives gradients.

    logp_old_dense: `[B, T]` log pi_old_dense (behaviour policy of the PPO ratio).
    advantages: `[B]` per-sequence advantages.
    loss_mask: `[B, T]` response tokens (nonzero/True = valid).
    is_weights: `[B, T]` correction weights (`Corrections.weights`).
    token_mask: `[B, T]` correction token mask (`Corrections.token_mask`).
    seq_mask: `[B]` correction sequence mask (`Corrections.seq_mask`).
    logp_ref: `[B, T]` log pi_ref for the KL penalty, or None.
    """

    logp_old_dense: jax.Array
    advantages: jax.Array
    loss_mask: jax.Array
    is_weights: jax.Array
    token_mask: jax.Array
    seq_mask: jax.Array
    logp_ref: jax.Array | None = None

    @classmethod
    def from_corrections(
        cls,
        logp_old_dense: jax.Array,
        advantages: jax.Array,
        loss_mask: jax.Array,
        corrections: Corrections,
        logp_ref: jax.Array | None = None,
    ) -> LossBatch:
        """Assemble a batch from the rollout arrays and `compute_corrections` output."""
        return cls(
            logp_old_dense=logp_old_dense,
            advantages=advantages,
            loss_mask=loss_mask,
            is_weights=corrections.weights,
            token_mask=corrections.token_mask,
            seq_mask=corrections.seq_mask,
            logp_ref=logp_ref,
        )


def aggregate(
    per_token: jax.Array, kept: jax.Array, valid: jax.Array, mode: str, denominator: str
) -> jax.Array:
    """Reduce per-token values `[B, T]` over the kept tokens to a scalar; 0 when none is kept.

    kept: `[B, T]` bool, the tokens that enter the loss (after rejection).
    valid: `[B, T]` bool, the loss mask before rejection (`kept` is a subset of it).
    mode:
      seq_mean_token_mean: mean over each sequence's kept tokens, then over sequences.
      seq_mean_token_sum: sum over each sequence's kept tokens, then mean over sequences.
      token_mean: sum over kept tokens / a token count.
    denominator: which sequences / tokens divide the sum.
      all (official): sequences with at least one `valid` token (a vetoed or fully rejected
        sequence still counts, so rejection never scales the gradient up), and for
        token_mean the `valid` tokens.
      kept: only sequences with a kept token / only kept tokens (rejection renormalises).
    The batch is whatever the caller passes: in training, one optimizer minibatch (the
    official "global batch"). A row with no `valid` token at all (padding, or a response the
    data pipeline excluded from the loss) is not a sample and never counts.
    """
    base = valid if denominator == "all" else kept
    if mode == "token_mean":
        return masked_sum(per_token, kept) / jnp.maximum(masked_count(base), 1.0)
    per_seq = masked_sum(per_token, kept, axis=1)
    if mode == "seq_mean_token_mean":
        per_seq = per_seq / jnp.maximum(masked_count(kept, axis=1), 1.0)
    return jnp.sum(per_seq) / jnp.maximum(masked_count(jnp.any(base, axis=1)), 1.0)


def kl_penalty(log_ratio: jax.Array, kind: str) -> jax.Array:
    """Per-token KL estimators from `d = log pi_theta - log pi_ref` (samples from pi_theta).

    k1 = d; k2 = d^2 / 2; k3 = exp(-d) - 1 + d (non-negative, low variance).
    """
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio * log_ratio
    return jnp.exp(-log_ratio) - 1.0 + log_ratio


def grpo_loss(
    logp_new: jax.Array,
    batch: LossBatch,
    cfg: GRPOLossConfig,
    entropy: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """GRPO loss (scalar) and metrics; differentiable w.r.t. `logp_new` `[B, T]` only.

    Per token: `w_t * max(-rho_t A, -clip(rho_t, 1 - eps_low, 1 + eps_high) A)` with
    `rho_t = exp(clamp(logp_new - logp_old_dense))`, aggregated by `cfg.aggregation` over the
    effective mask `loss_mask * token_mask * seq_mask` and divided as `cfg.seq_denominator`
    says (see `aggregate`; default `all`: rejected sequences/tokens stay in the denominator,
    as in the official code), plus `kl_coef * KL(pi_theta || pi_ref)`
    aggregated the same way when `logp_ref` is given and `kl_coef > 0`. When no token is valid
    (e.g. every sequence rejected) the loss is exactly 0 with zero gradient and
    `metrics["all_rejected"] == 1`. `cfg` is static under jit.

    entropy: optional `[B, T]` per-token entropy of the current policy, reported only.
    metrics (float32 scalars, token means over effective tokens unless stated):
      loss, pg_loss, kl_loss (with a reference), clip_fraction (tokens where the clipped branch
      is strictly larger), ppo_kl (mean of logp_old - logp_new), ratio_mean, advantage_mean,
      entropy (if given), effective_tokens / effective_sequences (counts), all_rejected (0/1).
    """
    b, t = logp_new.shape
    check_shape("batch.logp_old_dense", batch.logp_old_dense, (b, t))
    check_shape("batch.advantages", batch.advantages, (b,))
    check_shape("batch.loss_mask", batch.loss_mask, (b, t))
    check_shape("batch.is_weights", batch.is_weights, (b, t))
    check_shape("batch.token_mask", batch.token_mask, (b, t))
    check_shape("batch.seq_mask", batch.seq_mask, (b,))
    if batch.logp_ref is not None:
        check_shape("batch.logp_ref", batch.logp_ref, (b, t))
    if entropy is not None:
        check_shape("entropy", entropy, (b, t))

    sg = jax.lax.stop_gradient
    valid = as_mask(batch.loss_mask)
    mask = valid & as_mask(batch.token_mask) & as_mask(batch.seq_mask)[:, None]
    clamp = float(cfg.log_ratio_clamp)
    adv = jnp.where(mask, sg(batch.advantages).astype(jnp.float32)[:, None], 0.0)
    weights = jnp.where(mask, sg(batch.is_weights).astype(jnp.float32), 0.0)

    log_rho = safe_log_ratio(logp_new, sg(batch.logp_old_dense), mask, clamp)
    rho = jnp.exp(log_rho)
    unclipped = -rho * adv
    clipped = -jnp.clip(rho, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high) * adv
    pg_per_token = weights * jnp.maximum(unclipped, clipped)
    pg_loss = aggregate(pg_per_token, mask, valid, cfg.aggregation, cfg.seq_denominator)
    loss = pg_loss

    n_tokens = masked_count(mask)
    metrics = {
        "pg_loss": pg_loss,
        "clip_fraction": masked_mean(clipped > unclipped, mask),
        "ppo_kl": masked_mean(-log_rho, mask),
        "ratio_mean": masked_mean(rho, mask),
        "advantage_mean": masked_mean(adv, mask),
        "effective_tokens": n_tokens,
        "effective_sequences": masked_count(jnp.any(mask, axis=1)),
        "all_rejected": (n_tokens == 0).astype(jnp.float32),
    }
    if batch.logp_ref is not None:
        log_ref_ratio = safe_log_ratio(logp_new, sg(batch.logp_ref), mask, clamp)
        kl_loss = aggregate(kl_penalty(log_ref_ratio, cfg.kl_kind), mask, valid,
                            cfg.aggregation, cfg.seq_denominator)
        metrics["kl_loss"] = kl_loss
        if cfg.kl_coef > 0:
            loss = loss + cfg.kl_coef * kl_loss
    if entropy is not None:
        metrics["entropy"] = masked_mean(sg(entropy).astype(jnp.float32), mask)
    metrics["loss"] = loss
    metrics = {k: sg(jnp.asarray(v, jnp.float32)) for k, v in metrics.items()}
    return loss, metrics
