"""Static configuration of the off-policy corrections and the GRPO objective.

Both dataclasses are frozen and hashable, so they can be passed to `jax.jit` as static arguments.
The allowed correction presets, ratio levels, IS modes, policy losses and KL estimators are the
registered ones (`correction_presets.CORRECTION_PRESETS`, `correction_parts.RATIO_LEVELS` and
`IS_MODES`, `loss_terms.POLICY_LOSSES`, `loss_terms.KL_ESTIMATORS`).
Defaults follow the official Sparse-RL code (slime `mis.yaml` / `loss.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sparse_rl_jax.core.config_checks import (check, check_bool, check_choice, check_int,
                                               check_number, reject)
from sparse_rl_jax.rl.correction_parts import IS_MODES
from sparse_rl_jax.rl.correction_parts import RATIO_LEVELS as _CORRECTION_LEVELS
from sparse_rl_jax.rl.correction_presets import CORRECTION_PRESETS, PARTS
from sparse_rl_jax.rl.loss_terms import KL_ESTIMATORS, POLICY_LOSSES
from sparse_rl_jax.rl.rejection_measures import Criterion, RejectionSpecError, parse_rejection

AGGREGATIONS = ("seq_mean_token_mean", "token_mean", "seq_mean_token_sum",
                "seq_mean_token_sum_norm")
RATIO_LEVELS = ("token", "sequence")
SEQ_DENOMINATORS = ("all", "kept")
DISTILL_KINDS = ("k3", "full")
CORRECTION_LEVELS = _CORRECTION_LEVELS.names()
ANCHORS = ("proximal", "behaviour")
CORRECTION_LOSSES = ("ppo", "pg")
LOW_ESS_ACTIONS = ("warn", "stop")

# Every log ratio (the correction's `log(pi_old_dense / pi_sparse)`, the loss's
# `log(pi_theta / pi_old)` and `log(pi_theta / pi_ref)`) is clamped to `[-c, c]` before
# exponentiation.
LOG_RATIO_CLAMP = 20.0


@dataclass(frozen=True)
class CorrectionConfig:
    """How the sampler/learner mismatch `r_t = pi_proximal(o_t) / pi_behaviour(o_t)` (dense
    scores over the sampler's own log-probs) is corrected: a named preset and its parts.

    kind: a registered preset or alias (`correction_presets.CORRECTION_PRESETS`, tabulated
      with its parts and source in docs/corrections.md; `python run.py config` prints the
      parts a name resolves to). The default, `decoupled_token_icepop` (PPO anchored on the
      learner's dense log-probs, each token weighted by its ratio inside [0.5, 5] and masked
      outside), is the outcome of the study at real lengths (docs/results.md, "The study at
      real lengths"): no preset was eligible, and it is the best by the study's rule (it
      holds on the walk and on SmolLM2-135M's rollouts and degrades in the diffuse regime).
      verl 0.9's 19 presets by their names and numbers (`decoupled_*`, `bypass_*`,
      `disabled`); their names before 0.9
      (`ppo_is_bypass`, `pg_is`, `icepop` are aliases; `pg_rs` and `decoupled_geo_rs_veto`
      keep the old geometric band with a veto; the stored walk study's `decoupled_geo_rs`
      runs are `decoupled_geo_rs_veto`); NeMo-RL's `seq-mask-tis` (alias `seq_mask_tis`);
      AReaL's `areal_geo_is`; the project's `none` (naive), `tis`, `mis`, `sparse_rl`
      (Sparse-RL's: veto r < 1e-4, reject r outside [0.5, 1.5], TIS min(r, 1.5),
      normalised; the default before the study), `shadow_mask` (the learner replays the
      rollout's eviction record; distillation is `loss.distill_coef`), `ppo_behaviour`,
      `opsm` (DeepSeek-V3.2) and `adaptive_k3_rs_token_tis` (token TIS at 2 + a seq_mean_k3
      rejection threshold set per batch, `rs_target_rate`).
    Every part below left unset (None) takes the preset's value; a part set here overrides it.
    anchor: the PPO ratio's denominator: `proximal` (dense under the learner's params at the
      update) or `behaviour` (the sampler's own log-probs: verl's bypass).
    loss: `ppo` (the loss section's `policy_loss`) or `pg` (plain policy gradient
      `-w A log pi`, verl's bypass `reinforce`: `loss.policy_loss` becomes `pg`).
    is_level: the IS weight's ratio: `none` (weight 1), `token`, `sequence` (product over the
      response) or `geometric` (`exp(mean log r)`).
    is_mode: `truncate` (`min(r, is_upper)`), `mask` (`r` inside `[is_lower, is_upper]`, 0
      outside; the token stays in the loss's denominators, as in IcePop and verl's
      `"lower_upper"` IS threshold) or `raw` (`r` itself; bounds unused).
    is_lower, is_upper: the IS bounds.
    rs_level: ratio-band rejection: `none`, `token` (tokens leave the loss), `sequence` or
      `geometric` (whole sequences leave it) when the ratio of that level leaves `[rs_lower,
      rs_upper]` (verl's k1 measures at token / seq_sum / seq_mean, in ratio space).
    rs_lower, rs_upper: the rejection band (unset in the preset too: the IS bounds);
      `rs_lower` 0: no lower bound. A geometric band must hold 1.
    rs: verl 0.9's rejection measures (`rejection_measures`): `none` or a comma-separated
      list of `<aggregation>_<divergence>`, aggregation `token`, `seq_sum`, `seq_mean` or
      `seq_max`, divergence `k1` (`-log r`), `k2` (`(log r)^2 / 2`) or `k3` (`r - 1 - log
      r`), e.g. `seq_mean_k3` or `token_k1,seq_max_k3` (no `seq_max_k1`); a token or
      sequence leaves the loss when any measure rejects it. It adds to `rs_level`.
    rs_threshold: one entry for all of `rs`'s measures or one per measure, comma-separated:
      a k1 band `"lower_upper"` on `exp(k1) = 1 / r` (verl's grammar: `"0.999_1.001"` keeps
      `1/1.001 <= r <= 1/0.999`; one number `u` means `1/u_u`), a k2/k3 upper bound. Quote
      it in YAML or write decimals (`0.5_2.0`): YAML reads `0.5_2` as 0.52.
    rs_target_rate: None (fixed thresholds) or a rate in (0, 1) (ours): one sequence-level
      k2/k3 measure then rejects, each batch, the sequences above `max(rs_threshold, the (1 -
      rs_target_rate) quantile of the batch's non-empty sequences' values)`; logged as
      `rs_adaptive_threshold`.
    veto, veto_threshold: drop a sequence holding a loss-mask token with `r_t <
      veto_threshold` (which must exceed `exp(-LOG_RATIO_CLAMP)` to be reachable).
    normalize: divide the IS weights by their batch mean (over loss-mask tokens at the token
      level, over non-empty sequences' means otherwise, rejected ones included; skipped
      below 1e-8): verl's `rollout_is_batch_normalize`, which also takes the mean before
      rejection (in bypass mode per minibatch).
    opsm, opsm_delta: off-policy sequence masking (DeepSeek-V3.2): drop a sequence whose
      advantage is negative and whose mean `log(pi_behaviour / pi_proximal)` over its response
      exceeds `opsm_delta` (>= 0).
    replay: the learner scores the sampled tokens under the rollout's eviction record
      (shadow-mask training; needs `sampling.record_evictions`), so its ratio is to the
      sampler's log-probs, which the replay equals.
    level: shorthand for older configs: sets `is_level` and `rs_level` (where the preset's is
      not `none` and the config sets neither); resolved into them, then None.
    min_ess: the low-ESS guard (`training.ess_guard`; not a part, not in the config hash):
      when `is_ess` or `kept_token_fraction` stays below it for `low_ess_steps` RL steps in a
      row, the trainer says so once (per such episode), naming the correction, the measured
      values and what to try. In [0, 1]; 0 or null turns the guard off. The default, 0.1,
      lies below every walk-study arm's mean ESS (0.255 at the lowest) and above the failing
      corrections' on SmolLM2-135M (`decoupled_seq_is` 0.02 at 64 slots, `decoupled_seq_is_rs`
      0.09 at 96): under it a handful of sequences carry the update.
    on_low_ess: `warn` (one line, the run goes on) or `stop` (the run ends cleanly at that
      step: its checkpoint committed, metrics flushed; `python run.py` exits with 3).
    low_ess_steps: RL steps in a row below `min_ess` before the guard speaks (an int >= 1; 5
      rides out a batch's chance dip).

    Conventions: a rejected or masked sequence stays in the loss's sequence denominator
    (`loss.seq_denominator: all`, Sparse-RL's official code; verl's rejection removes it, which
    is `seq_denominator: kept`). Every ratio is computed once per rollout, before the
    minibatches; verl's bypass mode recomputes IS and rejection from the current policy in
    every minibatch, which is the same value at the first one (one minibatch per rollout, as
    in the walk experiments, makes them equal).
    """

    kind: str = "decoupled_token_icepop"
    anchor: str | None = None
    loss: str | None = None
    is_level: str | None = None
    is_mode: str | None = None
    is_lower: float | None = None
    is_upper: float | None = None
    rs_level: str | None = None
    rs_lower: float | None = None
    rs_upper: float | None = None
    rs: str | None = None
    rs_threshold: str | float | None = None
    rs_target_rate: float | None = None
    veto: bool | None = None
    veto_threshold: float | None = None
    normalize: bool | None = None
    opsm: bool | None = None
    opsm_delta: float | None = None
    replay: bool | None = None
    level: str | None = None
    min_ess: float | None = 0.1
    on_low_ess: str = "warn"
    low_ess_steps: int = 5

    def __post_init__(self) -> None:
        check_choice(self, "kind", CORRECTION_PRESETS.names())
        check_choice(self, "level", _CORRECTION_LEVELS.names(), optional=True)
        preset = CORRECTION_PRESETS.get(self.kind)
        unset = {part for part in PARTS if getattr(self, part) is None}
        for part in unset:
            object.__setattr__(self, part, preset.value(part))
        if self.level is not None:
            for part in ("is_level", "rs_level"):
                if part in unset and preset.value(part) != "none":
                    object.__setattr__(self, part, self.level)
            object.__setattr__(self, "level", None)
        self._check_parts()
        if self.rs_lower is None:
            object.__setattr__(self, "rs_lower", self.is_lower)
        if self.rs_upper is None:
            object.__setattr__(self, "rs_upper", self.is_upper)
        self._check_bands()
        check_number(self, "min_ess", ge=0, le=1, optional=True)
        check_choice(self, "on_low_ess", LOW_ESS_ACTIONS)
        check_int(self, "low_ess_steps", minimum=1)

    def _check_parts(self) -> None:
        check_choice(self, "anchor", ANCHORS)
        check_choice(self, "loss", CORRECTION_LOSSES)
        check_choice(self, "is_level", ("none", *_CORRECTION_LEVELS.names()))
        check_choice(self, "is_mode", IS_MODES.names())
        check_choice(self, "rs_level", ("none", *_CORRECTION_LEVELS.names()))
        for flag in ("veto", "normalize", "opsm", "replay"):
            check_bool(self, flag)
        check(isinstance(self.rs, str), self, "rs", "must be a string ('none', or measures "
              "such as 'seq_mean_k3' or 'token_k1,seq_max_k3')")
        check_number(self, "rs_target_rate", gt=0, lt=1, optional=True)
        try:
            parse_rejection(self.rs, self.rs_threshold, self.rs_target_rate)
        except RejectionSpecError as e:
            reject(self, e.field, e.rule)
        floor = math.exp(-LOG_RATIO_CLAMP)
        check_number(self, "veto_threshold", gt=floor, lt=1,
                     rule=f"must be in (exp(-LOG_RATIO_CLAMP)={floor:.3g}, 1)")
        check_number(self, "opsm_delta", ge=0)

    def _check_bands(self) -> None:
        check_number(self, "is_lower", gt=0)
        check_number(self, "is_upper", gt=0)
        check(self.is_lower < self.is_upper, self, "is_lower",
              f"must be < is_upper={self.is_upper!r}")
        check_number(self, "rs_lower", ge=0)
        check_number(self, "rs_upper", gt=0)
        check(self.rs_lower < self.rs_upper, self, "rs_lower",
              f"must be < rs_upper={self.rs_upper!r}")
        if self.rs_level == "geometric":
            check(self.rs_lower <= 1, self, "rs_lower", "must be <= 1 with rs_level=geometric "
                  "(the band of a geometric mean ratio must hold 1)")
            check(self.rs_upper >= 1, self, "rs_upper", "must be >= 1 with rs_level=geometric "
                  "(the band of a geometric mean ratio must hold 1)")

    def hash_form(self) -> dict:
        """The correction as the run's config hash reads it: the flat form of before the parts
        (``kind``, ``level``, the bands, ``veto_threshold``, ``normalize``, as resolved), plus
        every part that differs from what that flat
        form resolves to. A run of a config from before the parts keeps its hash and resumes;
        configs that train differently hash differently."""
        flat = {key: getattr(self, key) for key in ("kind", "is_lower", "is_upper", "rs_lower",
                                                    "rs_upper", "veto_threshold", "normalize")}
        flat["level"] = "token"
        for level in CORRECTION_LEVELS:  # the shorthand that reproduces the levels, if one does
            implied = CorrectionConfig(kind=self.kind, level=level)
            if (implied.is_level, implied.rs_level) == (self.is_level, self.rs_level):
                flat["level"] = level
                break
        implied = CorrectionConfig(**flat)
        return flat | {part: getattr(self, part) for part in PARTS
                       if part not in flat and getattr(self, part) != getattr(implied, part)}

    @property
    def rejection(self) -> tuple[Criterion, ...]:
        """The rejection measures of `rs` with their `rs_threshold` entries (`()` for
        `none`; `rejection_measures.parse_rejection`)."""
        return parse_rejection(self.rs, self.rs_threshold, self.rs_target_rate)

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
