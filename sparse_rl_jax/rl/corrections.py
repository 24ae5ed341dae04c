"""Off-policy corrections for sparse rollouts: IS weights, token rejection and sequence veto.

All quantities derive from `log r_t = clamp(logp_old_dense - logp_sparse, -c, c)` (see the
README's "The method in a few lines"), computed once per rollout over the whole batch, before
it is split into minibatches.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct

from models.shapes import check_shape
from sparse_rl_jax.core.masked_math import (as_mask, masked_max, masked_mean, masked_min,
                                            safe_log_ratio)
from sparse_rl_jax.rl.correction_kinds import CORRECTION_KINDS
from sparse_rl_jax.rl.loss_config import CorrectionConfig

NORMALIZE_MIN_MEAN = 1e-8
LOW_RATIO = 1e-4
"""A token with `r_t` below this is one the dense policy all but rules out (a bad eviction);
the `low_r_*` metrics count such tokens in every correction kind, so arms compare on them."""


@struct.dataclass
class Corrections:
    """Output of `compute_corrections` (a pytree; every array is stop-gradient).

    weights: `[B, T]` float32 IS weights, 0 at positions outside the loss mask.
    token_mask: `[B, T]` bool, loss mask minus tokens rejected individually (token level).
    seq_mask: `[B]` bool, False for sequences dropped whole (veto, or rejection at the
      sequence/geometric level).
    low_r: `[B]` bool, sequences holding a loss-mask token with `r_t < LOW_RATIO` (what a
      `sparse_rl` veto at 1e-4 drops), in every kind.
    metrics: scalar float32 diagnostics, see `compute_corrections`.
    """

    weights: jax.Array
    token_mask: jax.Array
    seq_mask: jax.Array
    low_r: jax.Array
    metrics: dict[str, jax.Array]


def _level_log_ratio(log_r_tok: jax.Array, valid: jax.Array, level: str, clamp: float) -> jax.Array:
    """Token log ratios `[B, T]` -> the log ratio of `level`, broadcast to `[B, T]`."""
    if level == "token":
        return log_r_tok
    if level == "sequence":
        per_seq = jnp.sum(log_r_tok, axis=1)  # log prod_t r_t (log_r_tok is 0 off the mask)
    else:  # geometric
        per_seq = masked_mean(log_r_tok, valid, axis=1)
    per_seq = jnp.clip(per_seq, -clamp, clamp)
    return jnp.where(valid, per_seq[:, None], 0.0)


def _veto(log_r_tok: jax.Array, valid: jax.Array, cfg: CorrectionConfig) -> jax.Array:
    """`[B]` bool: sequences with a valid token whose `r_t < veto_threshold`, for a kind that
    vetoes (`sparse_rl`)."""
    if not CORRECTION_KINDS.get(cfg.kind).vetoes or cfg.veto_threshold is None:
        return jnp.zeros(valid.shape[:1], jnp.bool_)
    return jnp.any(valid & (log_r_tok < math.log(cfg.veto_threshold)), axis=1)


def _normalize(weights: jax.Array, valid: jax.Array, cfg: CorrectionConfig
               ) -> tuple[jax.Array, jax.Array]:
    """`(weights / factor, factor)`: with `cfg.normalize` the factor is the weights' mean
    (over loss-mask tokens, or over non-empty sequences' means off the token level), 1 when
    that mean is below `NORMALIZE_MIN_MEAN` or normalisation is off."""
    if not cfg.normalize:
        return weights, jnp.ones((), jnp.float32)
    if cfg.level == "token":
        mean = masked_mean(weights, valid)
    else:
        mean = masked_mean(masked_mean(weights, valid, axis=1), jnp.any(valid, axis=1))
    factor = jnp.where(mean < NORMALIZE_MIN_MEAN, 1.0, mean)
    return weights / factor, factor


def _metrics(cfg: CorrectionConfig, log_r_tok, r, weights, valid, token_mask, seq_mask,
             veto, low) -> dict[str, jax.Array]:
    """`compute_corrections`'s metrics except `is_norm_factor` (see there); arrays `[B, T]`
    (`veto`, `seq_mask`: `[B]`; `low`: loss-mask tokens with `r_t < LOW_RATIO`)."""
    has_tokens = jnp.any(valid, axis=1)
    kept = token_mask & seq_mask[:, None]
    truncates = CORRECTION_KINDS.get(cfg.kind).truncates
    return {
        "rejection_rate": masked_mean(~seq_mask, has_tokens),
        "veto_fraction": masked_mean(veto, has_tokens),
        "token_mask_fraction": masked_mean(~token_mask, valid),
        "kept_token_fraction": masked_mean(kept, valid),
        "is_truncated_fraction": (masked_mean(r > cfg.is_upper, valid) if truncates
                                  else jnp.zeros((), jnp.float32)),
        "mismatch_k3": masked_mean(jnp.exp(log_r_tok) - log_r_tok - 1.0, valid),
        "log_ratio_mean": masked_mean(log_r_tok, valid),
        "log_ratio_max": masked_max(log_r_tok, valid),
        "log_ratio_min": masked_min(log_r_tok, valid),
        "is_weight_mean": masked_mean(weights, kept),
        "low_r_token_fraction": masked_mean(low, valid),
        "low_r_sequence_fraction": masked_mean(jnp.any(low, axis=1), has_tokens),
    }


def compute_corrections(
    logp_old_dense: jax.Array, logp_sparse: jax.Array, loss_mask: jax.Array, cfg: CorrectionConfig
) -> Corrections:
    """Correction weights and masks for one rollout batch. Inputs `[B, T]`; `cfg` is static.

    logp_old_dense: log pi_old_dense(o_t) from the dense teacher-forced scorer.
    logp_sparse: log pi_sparse(o_t) recorded by the sparse sampler.
    loss_mask: nonzero/True on response tokens that enter the loss.

    Per kind (registered in `correction_kinds.CORRECTION_KINDS`; with `r` the ratio of
    `cfg.level`): `none` and `shadow_mask` weight 1; `tis`
    weight `min(r, is_upper)`; `mis` weight `r`, reject `r` outside `[is_lower, is_upper]`;
    `sparse_rl` weight `min(r, is_upper)`, reject `r` outside `[rs_lower, rs_upper]`, veto
    sequences with any valid token `r_t < veto_threshold`. Rejection is per token at the token
    level and per sequence otherwise. With `cfg.normalize` the weights are divided by their
    mean over all loss-mask tokens (token level) or over the per-sequence weights of non-empty
    sequences (sequence / geometric), unless that mean is below 1e-8. Every per-token log ratio
    is clamped before the level aggregate (so +-inf inputs cannot produce inf - inf), and the
    aggregate is clamped again. A wrongly shaped input raises ValueError naming it.

    metrics (float32 scalars; "sequences" are those with at least one loss-mask token):
      rejection_rate        fraction of sequences dropped whole (seq_mask False)
      veto_fraction         fraction of sequences vetoed
      token_mask_fraction   fraction of loss-mask tokens rejected individually
      kept_token_fraction   fraction of loss-mask tokens surviving token_mask and seq_mask
      is_truncated_fraction fraction of loss-mask tokens whose weight was truncated (tis/sparse_rl)
      mismatch_k3           mean over loss-mask tokens of `r_t - log r_t - 1` (token r, the slime
                            `k3_kl` metric; under samples from pi_sparse it estimates
                            KL(pi_sparse || pi_old_dense))
      log_ratio_mean/max/min  of the clamped token log ratio over loss-mask tokens
      is_weight_mean        mean final weight over kept tokens
      low_r_token_fraction  fraction of loss-mask tokens with token `r_t < LOW_RATIO` (1e-4)
      low_r_sequence_fraction  fraction of sequences holding such a token (what a 1e-4 veto
                            would drop; logged for every kind)
      is_norm_factor        the divisor applied by normalisation (1 when off or skipped)
    """
    check_shape("logp_old_dense", logp_old_dense, dtype=float, B=None, T=None)
    b, t = logp_old_dense.shape
    check_shape("logp_sparse", logp_sparse, dtype=float, B=b, T=t)
    check_shape("loss_mask", loss_mask, B=b, T=t)
    valid = as_mask(loss_mask)
    clamp = float(cfg.log_ratio_clamp)

    log_r_tok = jax.lax.stop_gradient(safe_log_ratio(logp_old_dense, logp_sparse, valid, clamp))
    r = jnp.exp(_level_log_ratio(log_r_tok, valid, cfg.level, clamp))
    weights, reject = CORRECTION_KINDS.get(cfg.kind).weigh(r, cfg)
    reject = reject & valid
    veto = _veto(log_r_tok, valid, cfg)
    if cfg.level == "token":
        token_mask, seq_mask = valid & ~reject, ~veto
    else:
        token_mask, seq_mask = valid, ~(veto | jnp.any(reject, axis=1))
    weights, norm_factor = _normalize(jnp.where(valid, weights, 0.0), valid, cfg)
    low = valid & (log_r_tok < math.log(LOW_RATIO))
    metrics = _metrics(cfg, log_r_tok, r, weights, valid, token_mask, seq_mask, veto, low)
    metrics["is_norm_factor"] = norm_factor
    return Corrections(
        weights=jax.lax.stop_gradient(weights.astype(jnp.float32)),
        token_mask=token_mask,
        seq_mask=seq_mask,
        low_r=jnp.any(low, axis=1),
        metrics={k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()},
    )
