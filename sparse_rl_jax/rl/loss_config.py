"""Static configuration of the off-policy corrections and the GRPO objective.

Both dataclasses are frozen and hashable, so they can be passed to `jax.jit` as static arguments.
The allowed correction kinds, policy losses and KL estimators are the registered ones
(`correction_kinds.CORRECTION_KINDS`, `loss_terms.POLICY_LOSSES`, `loss_terms.KL_ESTIMATORS`).
Defaults follow the official Sparse-RL code (slime `mis.yaml` / `loss.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sparse_rl_jax.core.config_checks import check, check_bool, check_choice, check_number, reject
from sparse_rl_jax.rl.correction_kinds import CORRECTION_KINDS
from sparse_rl_jax.rl.loss_terms import KL_ESTIMATORS, POLICY_LOSSES

CORRECTION_LEVELS = ("token", "sequence", "geometric")
AGGREGATIONS = ("seq_mean_token_mean", "token_mean", "seq_mean_token_sum",
                "seq_mean_token_sum_norm")
RATIO_LEVELS = ("token", "sequence")
SEQ_DENOMINATORS = ("all", "kept")
DISTILL_KINDS = ("k3", "full")

# Every log ratio (the correction's `log(pi_old_dense / pi_sparse)`, the loss's
# `log(pi_theta / pi_old)` and `log(pi_theta / pi_ref)`) is clamped to `[-c, c]` before
# exponentiation.
LOG_RATIO_CLAMP = 20.0


@dataclass(frozen=True)
class CorrectionConfig:
    """How the sampler/learner mismatch `r_t = pi_old_dense(o_t) / pi_sparse(o_t)` is corrected.

    kind: a registered kind (`correction_kinds.CORRECTION_KINDS`): `none` (naive sparse:
      weights 1, nothing rejected), `tis` (truncated IS weight `min(r, is_upper)`), `mis`
      (masked IS / IcePop: reject where `r` is outside `[is_lower, is_upper]`, weight `r`
      inside), `sparse_rl` (sequence veto + rejection outside `[rs_lower, rs_upper]` +
      truncated IS weight `min(r, is_upper)`), `shadow_mask` (no weights, nothing rejected:
      the learner scores with the rollout's `Rollout.record`, so its PPO ratio is against the
      sampler's own log-probs; distillation to the dense policy is `loss.distill_coef`; see
      `grpo_loss`), `ppo_behaviour` (standard PPO on the sampler's rows: no weights, nothing
      rejected, the PPO ratio taken to the sampler's own log-probs; the plain baseline of
      async training).
    level: which ratio the weight/rejection uses: `token` (per token), `sequence` (product over
      the response, `exp(sum log r)`), `geometric` (`exp(mean log r)`). Non-token levels reject
      whole sequences.
    is_lower, is_upper: IS bounds (`is_upper` truncates; both bound the `mis` acceptance band).
    rs_lower, rs_upper: rejection band of `sparse_rl`; None -> the IS bounds.
    veto_threshold: `sparse_rl` drops a sequence when any valid token has `r_t` below it
      (None disables the veto). Must exceed `exp(-LOG_RATIO_CLAMP)` to be reachable.
    normalize: divide the IS weights by their batch mean over all response tokens (before
      rejection; skipped when that mean < 1e-8). None -> the kind's own: on for `sparse_rl`,
      off otherwise.
    """

    kind: str = "sparse_rl"
    level: str = "token"
    is_lower: float = 0.5
    is_upper: float = 1.5
    rs_lower: float | None = None
    rs_upper: float | None = None
    veto_threshold: float | None = 1e-4
    normalize: bool | None = None

    def __post_init__(self) -> None:
        check_choice(self, "kind", CORRECTION_KINDS.names())
        check_choice(self, "level", CORRECTION_LEVELS)
        check_number(self, "is_lower", gt=0)
        check_number(self, "is_upper", gt=0)
        check(self.is_lower < self.is_upper, self, "is_lower",
              f"must be < is_upper={self.is_upper!r}")
        if self.rs_lower is None:
            object.__setattr__(self, "rs_lower", self.is_lower)
        if self.rs_upper is None:
            object.__setattr__(self, "rs_upper", self.is_upper)
        check_number(self, "rs_lower", gt=0)
        check_number(self, "rs_upper", gt=0)
        check(self.rs_lower < self.rs_upper, self, "rs_lower",
              f"must be < rs_upper={self.rs_upper!r}")
        floor = math.exp(-LOG_RATIO_CLAMP)
        check_number(self, "veto_threshold", gt=floor, lt=1, optional=True,
                     rule=f"must be None or in (exp(-LOG_RATIO_CLAMP)={floor:.3g}, 1)")
        check_bool(self, "normalize", optional=True)
        if self.normalize is None:
            object.__setattr__(self, "normalize", CORRECTION_KINDS.get(self.kind).normalizes)

    @property
    def log_ratio_clamp(self) -> float:
        """The clamp `c` of `log r` (:data:`LOG_RATIO_CLAMP`)."""
        return LOG_RATIO_CLAMP


@dataclass(frozen=True)
class GRPOLossConfig:
    """The PPO-clipped GRPO objective.

    eps_low, eps_high: ratio clip band `[1 - eps_low, 1 + eps_high]` (DAPO-style eps_high 0.28
      allowed); eps_high > 0, eps_low in (0, 1) (cispo: any eps_low > 0; >= 1 means no lower
      bound, verl's CISPO example uses 10). Both are offsets from 1, never absolute caps
      (TRL's CISPO `epsilon_high` is an absolute cap: its 5.0 is our eps_high 4.0).
    policy_loss: a registered policy loss (`loss_terms.POLICY_LOSSES`): `ppo_clip` (PPO's
      clipped surrogate) or `cispo` (MiniMax-M1: clipped, stop-gradient IS weight times
      `A log pi`; clipped tokens still get a gradient).
    ratio_level: `token` (PPO/GRPO) or `sequence` (GSPO, in verl's GSPO-token form; use small
      eps, e.g. eps_low 3e-4, eps_high 4e-4 as in the paper).
    clip_c: dual-clip constant (> 1, e.g. 3.0) bounding the loss of negative-advantage tokens
      at `-clip_c A`; None disables it; ppo_clip only.
    entropy_coef: entropy bonus, `loss -= entropy_coef * aggregate(entropy)` (0 = off).
    aggregation: `seq_mean_token_mean` (official default), `token_mean`, `seq_mean_token_sum`,
      `seq_mean_token_sum_norm` (Dr.GRPO: token sums / the response width, summed over
      sequences and divided by the minibatch's sequence count of `seq_denominator`).
    seq_denominator: what the aggregation divides by. `all` (official default): every sequence
      of the minibatch with a loss-mask token (`seq_mean_*`), or every loss-mask token
      (`token_mean`), rejected or not, so rejection removes terms but never scales the rest
      up; for `seq_mean_token_sum_norm` every row of the minibatch, rows without a loss-mask
      token included (TRL's fixed batch size; masked rows never change it). `kept`: only
      sequences / tokens that survive rejection (the project's behaviour before issue 13;
      effectively a larger learning rate at high rejection rates).
    kl_coef, kl_kind: optional KL-to-reference penalty (a registered estimator,
      `loss_terms.KL_ESTIMATORS`: `k1`, `k2` or `k3`), off at 0.
    distill_coef, distill_kind: shadow-mask distillation of the sparse policy toward the dense
      one, `distill_coef * KL` (0 = off; only with `correction.kind: shadow_mask`). `k3`: the
      k3 estimate of KL(sparse || dense) at the sampled tokens; `full`: the exact forward
      KL(dense || sparse) over the vocabulary, chunked like the scorer.
    """

    eps_low: float = 0.2
    eps_high: float = 0.2
    policy_loss: str = "ppo_clip"
    ratio_level: str = "token"
    clip_c: float | None = None
    entropy_coef: float = 0.0
    aggregation: str = "seq_mean_token_mean"
    seq_denominator: str = "all"
    kl_coef: float = 0.0
    kl_kind: str = "k3"
    distill_coef: float = 0.0
    distill_kind: str = "k3"

    def __post_init__(self) -> None:
        check_choice(self, "policy_loss", POLICY_LOSSES.names())
        check_choice(self, "ratio_level", RATIO_LEVELS)
        loss = POLICY_LOSSES.get(self.policy_loss)
        check_number(self, "eps_low", gt=0, lt=loss.eps_low_max)
        check_number(self, "clip_c", gt=1, optional=True)
        if self.clip_c is not None and not loss.dual_clip:
            takers = " or ".join(f"policy_loss={name!r}" for name in POLICY_LOSSES.names()
                                 if POLICY_LOSSES.get(name).dual_clip)
            reject(self, "clip_c", f"(dual-clip) applies to {takers} only, not "
                                   f"{self.policy_loss!r}")
        check_number(self, "entropy_coef", ge=0)
        check_number(self, "eps_high", gt=0)
        check_choice(self, "aggregation", AGGREGATIONS)
        check_choice(self, "seq_denominator", SEQ_DENOMINATORS)
        check_number(self, "kl_coef", ge=0)
        check_choice(self, "kl_kind", KL_ESTIMATORS.names())
        check_number(self, "distill_coef", ge=0)
        check_choice(self, "distill_kind", DISTILL_KINDS)

    @property
    def log_ratio_clamp(self) -> float:
        """The clamp `c` of `log(pi_theta / pi_old)` and `log(pi_theta / pi_ref)`
        (:data:`LOG_RATIO_CLAMP`)."""
        return LOG_RATIO_CLAMP
