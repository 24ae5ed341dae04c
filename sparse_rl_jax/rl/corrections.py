"""Off-policy corrections for sparse rollouts: IS weights, rejection, veto and off-policy
sequence masking, from the parts of a `CorrectionConfig`.

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
from sparse_rl_jax.rl.correction_parts import IS_MODES, is_sequence_level, level_log_ratio
from sparse_rl_jax.rl.loss_config import CorrectionConfig
from sparse_rl_jax.rl.rejection_measures import rejections

NORMALIZE_MIN_MEAN = 1e-8
LOW_RATIO = 1e-4
"""A token with `r_t` below this is one the dense policy all but rules out (a bad eviction);
the `low_r_*` metrics count such tokens in every correction kind, so arms compare on them."""


@struct.dataclass
class Corrections:
    """Output of `compute_corrections` (a pytree; every array is stop-gradient).

    weights: `[B, T]` float32 IS weights, 0 at positions outside the loss mask.
    token_mask: `[B, T]` bool, loss mask minus tokens rejected individually (token level).
    seq_mask: `[B]` bool, False for sequences dropped whole (veto, rejection at the
      sequence/geometric level, OPSM).
    low_r: `[B]` bool, sequences holding a loss-mask token with `r_t < LOW_RATIO` (what a
      `sparse_rl` veto at 1e-4 drops), in every correction.
    metrics: scalar float32 diagnostics, see `compute_corrections`.
    """

    weights: jax.Array
    token_mask: jax.Array
    seq_mask: jax.Array
    low_r: jax.Array
    metrics: dict[str, jax.Array]


def _weights(log_r_tok: jax.Array, valid: jax.Array, cfg: CorrectionConfig
             ) -> tuple[jax.Array, jax.Array]:
    """`(weights, altered)` `[B, T]`: the IS weight of `cfg.is_level` / `cfg.is_mode` (1 at
    level `none`) and the loss-mask positions whose weight the mode truncated or zeroed."""
    if cfg.is_level == "none":
        return jnp.ones_like(log_r_tok), jnp.zeros(log_r_tok.shape, jnp.bool_)
    r = jnp.exp(level_log_ratio(log_r_tok, valid, cfg.is_level, cfg.log_ratio_clamp))
    weights, altered = IS_MODES.get(cfg.is_mode)(r, cfg.is_lower, cfg.is_upper)
    return weights, altered & valid


def _rejected(log_r_tok: jax.Array, valid: jax.Array, cfg: CorrectionConfig) -> jax.Array:
    """`[B, T]` bool: loss-mask positions whose ratio of `cfg.rs_level` leaves `[rs_lower,
    rs_upper]` (all False at level `none`)."""
    if cfg.rs_level == "none":
        return jnp.zeros(log_r_tok.shape, jnp.bool_)
    r = jnp.exp(level_log_ratio(log_r_tok, valid, cfg.rs_level, cfg.log_ratio_clamp))
    return valid & ((r < cfg.rs_lower) | (r > cfg.rs_upper))


def _veto(log_r_tok: jax.Array, valid: jax.Array, cfg: CorrectionConfig) -> jax.Array:
    """`[B]` bool: sequences with a valid token whose `r_t < veto_threshold` (`cfg.veto`)."""
    if not cfg.veto:
        return jnp.zeros(valid.shape[:1], jnp.bool_)
    return jnp.any(valid & (log_r_tok < math.log(cfg.veto_threshold)), axis=1)


def _opsm(log_r_tok: jax.Array, valid: jax.Array, advantages: jax.Array | None,
          cfg: CorrectionConfig) -> jax.Array:
    """`[B]` bool: sequences off-policy sequence masking drops (`cfg.opsm`): advantage < 0
    and mean over the response of `log(pi_behaviour / pi_proximal)` above `opsm_delta`."""
    if not cfg.opsm:
        return jnp.zeros(valid.shape[:1], jnp.bool_)
    if advantages is None:
        raise ValueError("correction.opsm needs the advantages (compute_corrections(..., "
                         "advantages=...)): it drops only negative-advantage sequences")
    check_shape("advantages", advantages, B=valid.shape[0])
    drift = masked_mean(-log_r_tok, valid, axis=1)
    return jnp.any(valid, axis=1) & (advantages < 0) & (drift > cfg.opsm_delta)


def _normalize(weights: jax.Array, valid: jax.Array, cfg: CorrectionConfig
               ) -> tuple[jax.Array, jax.Array]:
    """`(weights / factor, factor)`: with `cfg.normalize` the factor is the weights' mean
    (over loss-mask tokens, or over non-empty sequences' means off the token level), 1 when
    that mean is below `NORMALIZE_MIN_MEAN` or normalisation is off."""
    if not cfg.normalize:
        return weights, jnp.ones((), jnp.float32)
    if cfg.is_level in ("none", "token"):
        mean = masked_mean(weights, valid)
    else:
        mean = masked_mean(masked_mean(weights, valid, axis=1), jnp.any(valid, axis=1))
    factor = jnp.where(mean < NORMALIZE_MIN_MEAN, 1.0, mean)
    return weights / factor, factor


def kish_ess(weights: jax.Array, valid: jax.Array) -> jax.Array:
    """Kish's effective sample fraction `(sum w)^2 / (n sum w^2)` over the `n` positions of
    `valid` (1 when every weight is equal; 0 when all are 0)."""
    w = jnp.where(valid, weights, 0.0)
    total_sq = jnp.sum(w * w)
    n = jnp.sum(valid)
    return jnp.where(total_sq > 0, jnp.sum(w) ** 2 / (jnp.maximum(n, 1) * total_sq), 0.0)


def _metrics(cfg: CorrectionConfig, log_r_tok, weights, altered, valid, token_mask, seq_mask,
             veto, opsm, low) -> dict[str, jax.Array]:
    """`compute_corrections`'s metrics except `is_norm_factor` (see there); arrays `[B, T]`
    (`veto`, `opsm`, `seq_mask`: `[B]`; `low`: loss-mask tokens with `r_t < LOW_RATIO`)."""
    has_tokens = jnp.any(valid, axis=1)
    kept = token_mask & seq_mask[:, None]
    zero = jnp.zeros((), jnp.float32)
    altered_fraction = masked_mean(altered, valid)
    return {
        "rejection_rate": masked_mean(~seq_mask, has_tokens),
        "veto_fraction": masked_mean(veto, has_tokens),
        "opsm_fraction": masked_mean(opsm, has_tokens),
        "token_mask_fraction": masked_mean(~token_mask, valid),
        "kept_token_fraction": masked_mean(kept, valid),
        "is_truncated_fraction": altered_fraction if cfg.is_mode == "truncate" else zero,
        "is_masked_fraction": altered_fraction if cfg.is_mode == "mask" else zero,
        "is_ess": kish_ess(jnp.where(kept, weights, 0.0), valid),
        "mismatch_k3": masked_mean(jnp.exp(log_r_tok) - log_r_tok - 1.0, valid),
        "log_ratio_mean": masked_mean(log_r_tok, valid),
        "log_ratio_max": masked_max(log_r_tok, valid),
        "log_ratio_min": masked_min(log_r_tok, valid),
        "is_weight_mean": masked_mean(weights, kept),
        "low_r_token_fraction": masked_mean(low, valid),
        "low_r_sequence_fraction": masked_mean(jnp.any(low, axis=1), has_tokens),
    }


def compute_corrections(
    logp_old_dense: jax.Array, logp_sparse: jax.Array, loss_mask: jax.Array,
    cfg: CorrectionConfig, advantages: jax.Array | None = None,
) -> Corrections:
    """Correction weights and masks for one rollout batch. Inputs `[B, T]`; `cfg` is static.

    logp_old_dense: log pi_proximal(o_t), the dense teacher-forced scores.
    logp_sparse: log pi_behaviour(o_t) recorded by the sparse sampler.
    loss_mask: nonzero/True on response tokens that enter the loss.
    advantages: `[B]` per-sequence advantages; needed only by `cfg.opsm`.

    The parts of `cfg` (`CorrectionConfig`; a preset names a combination), from the token
    log ratio `log r_t = clamp(logp_old_dense - logp_sparse)`:
      IS weight: `cfg.is_mode` (`truncate`: `min(r, is_upper)`; `mask`: `r` inside
        `[is_lower, is_upper]`, 0 outside; `raw`: `r`) at the ratio of `cfg.is_level`
        (`token`; `sequence`: `prod_t r_t`; `geometric`: `exp(mean_t log r_t)`), weight 1
        at `none`;
      rejection: positions whose ratio of `cfg.rs_level` leaves `[rs_lower, rs_upper]` leave
        `token_mask` (token level) or drop their sequence (`seq_mask`, other levels); so do
        the tokens and sequences any measure of `cfg.rs` rejects (`rejection_measures`);
      veto: drops a sequence with a valid token `r_t < veto_threshold`;
      OPSM: drops a sequence with advantage < 0 and mean `-log r_t` above `opsm_delta`;
      normalize: divides the weights by their mean over all loss-mask tokens (token level or
        none) or over the per-sequence weights of non-empty sequences (other levels), unless
        that mean is below 1e-8.
    Every per-token log ratio is clamped before the level aggregate (so +-inf inputs cannot
    produce inf - inf), and the aggregate is clamped again. A wrongly shaped input raises
    ValueError naming it.

    metrics (float32 scalars; "sequences" are those with at least one loss-mask token):
      rejection_rate        fraction of sequences dropped whole (seq_mask False)
      veto_fraction         fraction of sequences vetoed
      opsm_fraction         fraction of sequences OPSM dropped
      token_mask_fraction   fraction of loss-mask tokens rejected individually
      kept_token_fraction   fraction of loss-mask tokens surviving token_mask and seq_mask
      is_truncated_fraction fraction of loss-mask tokens whose weight was truncated (truncate)
      is_masked_fraction    fraction of loss-mask tokens whose weight was zeroed (mask)
      is_ess                Kish's effective sample fraction of the final weights over the
                            loss-mask tokens, rejected ones at weight 0 (`kish_ess`)
      mismatch_k3           mean over loss-mask tokens of `r_t - log r_t - 1` (token r, the slime
                            `k3_kl` metric; under samples from pi_sparse it estimates
                            KL(pi_sparse || pi_old_dense))
      log_ratio_mean/max/min  of the clamped token log ratio over loss-mask tokens
      is_weight_mean        mean final weight over kept tokens
      low_r_token_fraction  fraction of loss-mask tokens with token `r_t < LOW_RATIO` (1e-4)
      low_r_sequence_fraction  fraction of sequences holding such a token (what a 1e-4 veto
                            would drop; logged for every correction)
      is_norm_factor        the divisor applied by normalisation (1 when off or skipped)
      rs_adaptive_threshold with `cfg.rs_target_rate` only: the threshold the adaptive
                            measure chose for this batch
    """
    check_shape("logp_old_dense", logp_old_dense, dtype=float, B=None, T=None)
    b, t = logp_old_dense.shape
    check_shape("logp_sparse", logp_sparse, dtype=float, B=b, T=t)
    check_shape("loss_mask", loss_mask, B=b, T=t)
    valid = as_mask(loss_mask)
    clamp = float(cfg.log_ratio_clamp)

    log_r_tok = jax.lax.stop_gradient(safe_log_ratio(logp_old_dense, logp_sparse, valid, clamp))
    weights, altered = _weights(log_r_tok, valid, cfg)
    reject = _rejected(log_r_tok, valid, cfg)
    veto = _veto(log_r_tok, valid, cfg)
    opsm = _opsm(log_r_tok, valid, advantages, cfg)
    if is_sequence_level(cfg.rs_level):
        token_mask, seq_mask = valid, ~(veto | opsm | jnp.any(reject, axis=1))
    else:
        token_mask, seq_mask = valid & ~reject, ~(veto | opsm)
    measured = {}
    if cfg.rejection:
        tokens, sequences, measured = rejections(log_r_tok, valid, cfg.rejection,
                                                 cfg.rs_target_rate)
        token_mask, seq_mask = token_mask & ~tokens, seq_mask & ~sequences
    weights, norm_factor = _normalize(jnp.where(valid, weights, 0.0), valid, cfg)
    low = valid & (log_r_tok < math.log(LOW_RATIO))
    metrics = _metrics(cfg, log_r_tok, weights, altered, valid, token_mask, seq_mask, veto,
                       opsm, low)
    metrics["is_norm_factor"] = norm_factor
    metrics.update(measured)
    return Corrections(
        weights=jax.lax.stop_gradient(weights.astype(jnp.float32)),
        token_mask=token_mask,
        seq_mask=seq_mask,
        low_r=jnp.any(low, axis=1),
        metrics={k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()},
    )
