"""The PPO-clipped GRPO objective with correction weights/masks and an optional reference KL.

Per token: `w_t * L_t` with `rho_t = exp(clamp(logp_new - logp_old_dense))` and `L_t` the
registered policy loss `cfg.policy_loss` (`loss_terms.POLICY_LOSSES`):
  ppo_clip: `L_t = max(-rho_t A, -clip(rho_t, 1 - eps_low, 1 + eps_high) A)`; with `clip_c`
    (dual-clip) `L_t = min(L_t, -clip_c A)` where `A < 0`.
  cispo: `L_t = -sg(clip(rho_t, 1 - eps_low, 1 + eps_high)) A log rho_t` where only the
    stop-gradient weight uses the clamped `rho_t`; the factor `log rho_t = logp_new -
    logp_old_dense` is unclamped, so every token keeps the gradient `-w A` on its log-prob,
    however far its ratio (as verl's `... * log_prob`, whose value differs by a constant).
  ratio_level sequence (GSPO-token): `rho_t` is replaced by `sg(s) * pi(o_t) / sg(pi(o_t))`
    with `s = exp(mean over the sequence's kept tokens of log rho_t)`: its value is the
    sequence ratio (so clipping is per sequence), its gradient `s * grad log pi(o_t)`; with
    cispo the factor `log rho_t` is likewise `log s` with the gradient `grad log pi(o_t)`.
Corrections compose the same way in every variant: the IS weight `w_t` multiplies `L_t`,
rejected tokens and sequences leave the effective mask (and, for the sequence ratio, the mean
that defines `s`); the KL, distillation and entropy terms use the same mask and aggregation.
The policy term is aggregated by `cfg.aggregation` over the effective mask
`loss_mask * token_mask * seq_mask` and divided as `cfg.seq_denominator` says (see
`aggregate`; default `all`: rejected sequences/tokens stay in the denominator, as in the
official code); plus `kl_coef * KL(pi_theta || pi_ref)` (the registered estimator
`cfg.kl_kind`, `loss_terms.KL_ESTIMATORS`) when `logp_ref` is given and `kl_coef > 0`; minus
the entropy bonus `entropy_coef * aggregate(entropy)`.

Shadow-mask training (`correction.kind: shadow_mask`) passes `logp_new` = the sparse
(eviction-record replay) log-probs under the params being trained and `batch.logp_old_dense`
= the sampler's own log-probs, so the ratio is on-policy at the first update, plus
`logp_dense` for the distillation term `cfg.distill_coef * aggregate(KL)`: `distill_kind: k3`
uses the k3 estimator of KL(pi_sparse || pi_dense) at the sampled tokens, `exp(-d) - 1 + d`
with `d = logp_new - logp_dense`; `full` uses `kl_full`, the exact per-position
KL(pi_dense || pi_sparse) over the vocabulary (`scoring.shadow_logprobs`). The teacher side is
stop-gradient; the KL is aggregated like the policy term.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from models.shapes import check_shape
from sparse_rl_jax.core.masked_math import (as_mask, masked_count, masked_max, masked_mean,
                                            masked_sum, safe_log_ratio, unclamped_log_ratio)
from sparse_rl_jax.rl.corrections import Corrections
from sparse_rl_jax.rl.loss_config import GRPOLossConfig
from sparse_rl_jax.rl.loss_terms import KL_ESTIMATORS, POLICY_LOSSES, k3


@struct.dataclass
class LossBatch:
    """Everything the loss needs besides `logp_new`; every leaf has leading axis B, so a
    minibatch is `jax.tree.map(lambda x: x[idx], batch)`. None of it receives gradients.

    logp_old_dense: `[B, T]` old log-probs of the PPO ratio: log pi_old_dense, or under
      shadow-mask training the sampler's own sparse log-probs (`Rollout.logp`).
    advantages: `[B]` per-sequence advantages.
    loss_mask: `[B, T]` response tokens (nonzero/True = valid).
    is_weights: `[B, T]` correction weights (`Corrections.weights`).
    token_mask: `[B, T]` correction token mask (`Corrections.token_mask`).
    seq_mask: `[B]` correction sequence mask (`Corrections.seq_mask`).
    logp_ref: `[B, T]` log pi_ref for the KL penalty, or None.
    low_r: `[B]` bool, sequences holding a token with `r_t < 1e-4` (`Corrections.low_r`),
      or None; read only by the `low_r_grad_share` diagnostic of `train_step.update_step`.
    """

    logp_old_dense: jax.Array
    advantages: jax.Array
    loss_mask: jax.Array
    is_weights: jax.Array
    token_mask: jax.Array
    seq_mask: jax.Array
    logp_ref: jax.Array | None = None
    low_r: jax.Array | None = None

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
            low_r=corrections.low_r,
        )


@struct.dataclass
class LossNorm:
    """The denominators of the loss aggregation, counted over a whole optimizer minibatch.

    tokens: float32 scalar, the tokens that divide a `token_mean` sum (>= 1).
    sequences: float32 scalar, the sequences that divide a `seq_mean_*` sum (>= 1); for
      `seq_mean_token_sum_norm` under `all`, every row of the minibatch.
    Passing the minibatch's `LossNorm` to `grpo_loss` on each of its micro-batches makes the
    micro-batch losses (and gradients) sum to the minibatch's.
    """

    tokens: jax.Array
    sequences: jax.Array


def norm_from_masks(kept: jax.Array, valid: jax.Array, mode: str, denominator: str
                    ) -> LossNorm:
    """The `LossNorm` of `[B, T]` bool masks `kept` (after rejection) and `valid` (before)
    for aggregation `mode`: `denominator` `all` counts `valid` (Dr.GRPO's sequences: all `B`
    rows), `kept` counts `kept` (see `aggregate`)."""
    base = valid if denominator == "all" else kept
    sequences = masked_count(jnp.any(base, axis=1))
    if mode == "seq_mean_token_sum_norm" and denominator == "all":
        sequences = jnp.asarray(kept.shape[0], jnp.float32)
    return LossNorm(tokens=jnp.maximum(masked_count(base), 1.0),
                    sequences=jnp.maximum(sequences, 1.0))


def _masks(batch: LossBatch) -> tuple[jax.Array, jax.Array]:
    """`(valid, kept)` `[B, T]` bool: the loss mask, and it after token and sequence rejection."""
    valid = as_mask(batch.loss_mask)
    return valid, valid & as_mask(batch.token_mask) & as_mask(batch.seq_mask)[:, None]


def loss_norm(batch: LossBatch, cfg: GRPOLossConfig) -> LossNorm:
    """The `LossNorm` of a whole minibatch `batch` under `cfg.aggregation` and
    `cfg.seq_denominator`."""
    valid, kept = _masks(batch)
    return norm_from_masks(kept, valid, cfg.aggregation, cfg.seq_denominator)


def aggregate(
    per_token: jax.Array, kept: jax.Array, valid: jax.Array, mode: str, denominator: str,
    norm: LossNorm | None = None,
) -> jax.Array:
    """Reduce per-token values `[B, T]` over the kept tokens to a scalar; 0 when none is kept.

    kept: `[B, T]` bool, the tokens that enter the loss (after rejection).
    valid: `[B, T]` bool, the loss mask before rejection (`kept` is a subset of it).
    mode:
      seq_mean_token_mean: mean over each sequence's kept tokens, then over sequences.
      seq_mean_token_sum: sum over each sequence's kept tokens, then mean over sequences.
      seq_mean_token_sum_norm (Dr.GRPO): sum over each sequence's kept tokens divided by the
        constant `T` (the response width, `sampling.max_new_tokens` in training), summed
        over sequences and divided by the sequence count below, under `all` the fixed row
        count `B`: total / (B x T) as in TRL's `dr_grpo` (verl divides the total by `T`
        only, without the sequence count).
      token_mean: sum over kept tokens / a token count.
    denominator: which sequences / tokens divide the sum.
      all (official): sequences with at least one `valid` token (a vetoed or fully rejected
        sequence still counts, so rejection never scales the gradient up), and for
        token_mean the `valid` tokens; for seq_mean_token_sum_norm every row of the batch,
        rows without a `valid` token included (TRL's fixed batch size), so masking whole
        rows (`overlong.mask_truncated`, dynamic-sampling padding) never changes it.
      kept: only sequences with a kept token / only kept tokens (rejection renormalises).
    The batch is whatever the caller passes: in training, one optimizer minibatch (the
    official "global batch"). Except for Dr.GRPO under `all`, a row with no `valid` token
    at all (padding, or a response the data pipeline excluded from the loss) is not a
    sample and never counts.
    norm: the denominators counted over a larger batch this one is part of (a micro-batch
      of a minibatch, see `loss_norm`); None counts them over this batch.
    """
    norm = norm_from_masks(kept, valid, mode, denominator) if norm is None else norm
    if mode == "token_mean":
        return masked_sum(per_token, kept) / norm.tokens
    per_seq = masked_sum(per_token, kept, axis=1)
    if mode == "seq_mean_token_mean":
        per_seq = per_seq / jnp.maximum(masked_count(kept, axis=1), 1.0)
    elif mode == "seq_mean_token_sum_norm":
        per_seq = per_seq / per_token.shape[1]
    return jnp.sum(per_seq) / norm.sequences


def check_loss_batch(batch: LossBatch, b: int, t: int, name: str = "batch") -> None:
    """Raise ValueError naming the leaf of `batch` (`{name}.advantages`, ...) that is not
    `[B, T]` = `[b, t]` (or `[B]` = `[b]` for the per-sequence leaves)."""
    for leaf in ("logp_old_dense", "loss_mask", "is_weights", "token_mask", "logp_ref"):
        check_shape(f"{name}.{leaf}", getattr(batch, leaf), B=b, T=t)
    for leaf in ("advantages", "seq_mask", "low_r"):
        check_shape(f"{name}.{leaf}", getattr(batch, leaf), B=b)


def _check_inputs(logp_new, batch, cfg, entropy, logp_dense, kl_full) -> None:
    """Shapes of `grpo_loss`'s arrays, and the inputs `cfg`'s terms need (ValueError)."""
    check_shape("logp_new", logp_new, dtype=float, B=None, T=None)
    b, t = logp_new.shape
    check_loss_batch(batch, b, t)
    for name, x in (("entropy", entropy), ("logp_dense", logp_dense), ("kl_full", kl_full)):
        check_shape(name, x, B=b, T=t)
    if cfg.entropy_coef > 0 and entropy is None:
        raise ValueError("GRPOLossConfig.entropy_coef > 0 needs the per-token entropy "
                         "(score with with_entropy=True)")
    if cfg.distill_coef > 0 and logp_dense is None:
        raise ValueError("GRPOLossConfig.distill_coef > 0 needs logp_dense (shadow_mask training)")
    if cfg.distill_kind == "full" and logp_dense is not None and kl_full is None:
        raise ValueError("GRPOLossConfig.distill_kind='full' needs kl_full "
                         "(scoring.shadow_logprobs(..., with_kl=True))")


def _with_sequence_value(log_ratio: jax.Array, log_s: jax.Array, mask: jax.Array) -> jax.Array:
    """`[B, T]` per-token log ratios whose value is their row's `log_s` `[B]` (stop-gradient)
    and whose gradient is that of `log_ratio`; 0 at masked positions (GSPO-token)."""
    sg = jax.lax.stop_gradient
    return jnp.where(mask, sg(log_s)[:, None] + log_ratio - sg(log_ratio), 0.0)


def _policy_term(logp_new, batch: LossBatch, mask, cfg: GRPOLossConfig
                 ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """`w_t * L_t` `[B, T]` of `cfg.policy_loss` (module docstring) and the ratio metrics."""
    sg = jax.lax.stop_gradient
    clamp = float(cfg.log_ratio_clamp)
    adv = jnp.where(mask, sg(batch.advantages).astype(jnp.float32)[:, None], 0.0)
    weights = jnp.where(mask, sg(batch.is_weights).astype(jnp.float32), 0.0)
    log_rho = safe_log_ratio(logp_new, sg(batch.logp_old_dense), mask, clamp)
    # CISPO's factor `log rho`: not exponentiated, so unclamped (verl clamps only the weight)
    log_pi_ratio = unclamped_log_ratio(logp_new, sg(batch.logp_old_dense), mask, clamp)
    if cfg.ratio_level == "sequence":  # GSPO-token: value s_i, gradient s_i * grad log pi_t
        log_s = jnp.clip(masked_mean(log_rho, mask, axis=1), -clamp, clamp)
        log_rho = _with_sequence_value(log_rho, log_s, mask)
        log_pi_ratio = _with_sequence_value(log_pi_ratio, log_s, mask)
    rho = jnp.exp(log_rho)
    clipped_rho = jnp.clip(rho, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    policy, clipped = POLICY_LOSSES.get(cfg.policy_loss).term(rho, clipped_rho, adv,
                                                              log_pi_ratio, cfg)
    n_tokens = masked_count(mask)
    metrics = {
        "clip_fraction": masked_mean(clipped, mask),
        "ppo_kl": masked_mean(-log_rho, mask),
        "ratio_mean": masked_mean(rho, mask),
        "ratio_std": jnp.sqrt(masked_mean(jnp.square(rho - masked_mean(rho, mask)), mask)),
        "log_ratio_abs_max": masked_max(jnp.abs(log_rho), mask),
        "advantage_mean": masked_mean(adv, mask),
        "effective_tokens": n_tokens,
        "effective_sequences": masked_count(jnp.any(mask, axis=1)),
        "all_rejected": (n_tokens == 0).astype(jnp.float32),
    }
    return weights * policy, metrics


def _add_penalties(loss, logp_new, batch: LossBatch, mask, cfg: GRPOLossConfig, reduce,
                   entropy, logp_dense, kl_full) -> tuple[jax.Array, dict[str, jax.Array]]:
    """`loss` plus the reference KL and distillation terms, minus the entropy bonus (each
    where its input is given), and their metrics; `reduce` aggregates `[B, T]` values."""
    sg = jax.lax.stop_gradient
    clamp = float(cfg.log_ratio_clamp)
    metrics = {}
    if batch.logp_ref is not None:
        log_ref_ratio = safe_log_ratio(logp_new, sg(batch.logp_ref), mask, clamp)
        metrics["kl_loss"] = reduce(KL_ESTIMATORS.get(cfg.kl_kind)(log_ref_ratio))
        if cfg.kl_coef > 0:
            loss = loss + cfg.kl_coef * metrics["kl_loss"]
    if logp_dense is not None:
        distill_k3 = k3(safe_log_ratio(logp_new, sg(logp_dense), mask, clamp))
        per_token = distill_k3
        if cfg.distill_kind == "full":
            per_token = jnp.where(mask, kl_full.astype(jnp.float32), 0.0)
        metrics["distill_kl"] = reduce(per_token)
        metrics["distill_k3"] = masked_mean(distill_k3, mask)
        metrics["distill_coef"] = jnp.asarray(cfg.distill_coef, jnp.float32)
        if cfg.distill_coef > 0:
            loss = loss + cfg.distill_coef * metrics["distill_kl"]
    if entropy is not None:
        metrics["entropy"] = masked_mean(sg(entropy).astype(jnp.float32), mask)
        if cfg.entropy_coef > 0:
            metrics["entropy_loss"] = reduce(jnp.where(mask, entropy.astype(jnp.float32), 0.0))
            loss = loss - cfg.entropy_coef * metrics["entropy_loss"]
    return loss, metrics


def grpo_loss(
    logp_new: jax.Array,
    batch: LossBatch,
    cfg: GRPOLossConfig,
    entropy: jax.Array | None = None,
    logp_dense: jax.Array | None = None,
    kl_full: jax.Array | None = None,
    norm: LossNorm | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """GRPO loss (scalar) and metrics; differentiable w.r.t. `logp_new` `[B, T]` (and, with
    `entropy_coef`, `entropy`; with `distill_kind: full`, `kl_full`).

    The objective, its variants and the shadow-mask distillation term are in the module
    docstring. When no token is valid (e.g. every sequence rejected) the loss is exactly 0
    with zero gradient and `metrics["all_rejected"] == 1`. `cfg` is static under jit; a
    wrongly shaped array raises ValueError naming it.

    batch: the `LossBatch` of `logp_new`'s rows (leaves `[B, T]` / `[B]`).
    entropy: optional `[B, T]` per-token entropy of the current policy: reported, and with
      `entropy_coef > 0` the (differentiable) bonus.
    logp_dense: optional `[B, T]` dense log-probs of the current policy (the teacher).
    kl_full: optional `[B, T]` differentiable per-token vocabulary KL (needed for `full`).
    norm: the aggregation denominators of the whole minibatch when `logp_new` is one
      micro-batch of it (`loss_norm`); the micro-batch losses then sum to the minibatch's,
      and `combine_metrics` merges their metrics. None: this batch's own.
    metrics (float32 scalars, token means over effective tokens unless stated):
      loss, pg_loss, kl_loss (with a reference), entropy_loss (with entropy_coef),
      clip_fraction (tokens where the clipped branch is strictly larger; cispo: where the
      weight is clipped), ppo_kl (mean of logp_old - logp_new), ratio_mean, ratio_std and
      log_ratio_abs_max (spread of the PPO ratio), advantage_mean, entropy (if given),
      distill_kl (with `logp_dense`: the aggregated KL of `distill_kind`, the sparse-vs-dense
      gap of the current policy), distill_k3 (token mean of the k3 estimate) and distill_coef,
      effective_tokens / effective_sequences (counts), all_rejected (0/1).
    """
    _check_inputs(logp_new, batch, cfg, entropy, logp_dense, kl_full)
    valid, mask = _masks(batch)
    reduce = functools.partial(aggregate, kept=mask, valid=valid, mode=cfg.aggregation,
                               denominator=cfg.seq_denominator, norm=norm)
    pg_per_token, ratio_metrics = _policy_term(logp_new, batch, mask, cfg)
    pg_loss = reduce(pg_per_token)
    loss, penalty_metrics = _add_penalties(pg_loss, logp_new, batch, mask, cfg, reduce,
                                           entropy, logp_dense, kl_full)
    metrics = {"pg_loss": pg_loss, **ratio_metrics, **penalty_metrics, "loss": loss}
    metrics = {k: jax.lax.stop_gradient(jnp.asarray(v, jnp.float32)) for k, v in metrics.items()}
    return loss, metrics


# How `grpo_loss` metrics of micro-batches (losses under the minibatch's `LossNorm`) merge
# into the minibatch's: summed, averaged with the micro-batches' effective tokens as weights,
# or as below (ratio_std, log_ratio_abs_max, all_rejected, distill_coef).
_SUMMED = ("loss", "pg_loss", "kl_loss", "distill_kl", "entropy_loss", "effective_tokens",
           "effective_sequences")
_TOKEN_MEANS = ("clip_fraction", "ppo_kl", "ratio_mean", "advantage_mean", "entropy",
                "distill_k3")


def combine_metrics(parts: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """The minibatch's `grpo_loss` metrics from its micro-batches' (`[K]` per name, each
    computed with the minibatch's `LossNorm`): equal, up to float rounding, to the metrics of
    one `grpo_loss` call over the whole minibatch. An unknown name raises KeyError."""
    tokens = parts["effective_tokens"]
    share = tokens / jnp.maximum(jnp.sum(tokens), 1.0)
    out = {}
    for name, values in parts.items():
        if name in _SUMMED:
            out[name] = jnp.sum(values)
        elif name in _TOKEN_MEANS:
            out[name] = jnp.sum(share * values)
        elif name == "ratio_std":  # pooled: E[rho^2] - E[rho]^2 over all tokens
            mean = jnp.sum(share * parts["ratio_mean"])
            second = jnp.sum(share * (jnp.square(values) + jnp.square(parts["ratio_mean"])))
            out[name] = jnp.sqrt(jnp.maximum(second - jnp.square(mean), 0.0))
        elif name == "log_ratio_abs_max":
            out[name] = jnp.max(values)
        elif name == "all_rejected":
            out[name] = (jnp.sum(tokens) == 0).astype(jnp.float32)
        elif name == "distill_coef":
            out[name] = values[0]
        else:
            raise KeyError(f"combine_metrics: no rule to merge metric {name!r} over micro-batches")
    return out
