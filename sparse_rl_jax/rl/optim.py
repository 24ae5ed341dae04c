"""The optimizer: AdamW with warmup, an optional cosine decay and global-norm clipping."""

from __future__ import annotations

import dataclasses
from typing import Literal

import optax

from sparse_rl_jax.core.config_checks import check, check_choice, check_int, check_number


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW settings (defaults: the official Sparse-RL runs).

    Attributes:
      lr: peak learning rate (> 0).
      b1, b2: Adam betas in [0, 1).
      weight_decay: decoupled weight decay (>= 0).
      eps: Adam epsilon.
      grad_clip: global gradient-norm clip; 0 disables it.
      warmup_steps: linear warmup over this many optimizer updates.
      schedule: ``constant`` after warmup, or ``cosine`` decay to ``lr * min_lr_ratio`` at
        ``decay_steps`` optimizer updates.
      decay_steps: length of the cosine schedule in optimizer updates (needed for cosine).
      min_lr_ratio: final fraction of the peak lr for cosine.
    """

    lr: float = 1e-6
    b1: float = 0.9
    b2: float = 0.98
    weight_decay: float = 0.1
    eps: float = 1e-8
    grad_clip: float = 1.0
    warmup_steps: int = 0
    schedule: Literal["constant", "cosine"] = "constant"
    decay_steps: int = 0
    min_lr_ratio: float = 0.0

    def __post_init__(self):
        check_number(self, "lr", gt=0)
        check_number(self, "b1", ge=0, lt=1)
        check_number(self, "b2", ge=0, lt=1)
        check_number(self, "weight_decay", ge=0)
        check_number(self, "eps", gt=0)
        check_number(self, "grad_clip", ge=0, rule="must be >= 0 (0 disables clipping)")
        check_int(self, "warmup_steps", 0)
        check_choice(self, "schedule", ("constant", "cosine"))
        check_int(self, "decay_steps", 0)
        check(self.schedule != "cosine" or self.decay_steps > self.warmup_steps, self,
              "decay_steps", f"must exceed warmup_steps={self.warmup_steps} for the cosine "
                             "schedule")
        check_number(self, "min_lr_ratio", ge=0, le=1)


def learning_rate(cfg: OptimConfig) -> optax.Schedule:
    """The learning-rate schedule over optimizer updates."""
    if cfg.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(
            0.0, cfg.lr, cfg.warmup_steps, cfg.decay_steps, end_value=cfg.lr * cfg.min_lr_ratio
        )
    if cfg.warmup_steps:
        return optax.join_schedules(
            [optax.linear_schedule(0.0, cfg.lr, cfg.warmup_steps), optax.constant_schedule(cfg.lr)],
            [cfg.warmup_steps],
        )
    return optax.constant_schedule(cfg.lr)


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    """AdamW (decoupled weight decay) preceded by global-norm clipping when enabled."""
    adamw = optax.adamw(
        learning_rate(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay
    )
    if cfg.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw)
    return adamw
