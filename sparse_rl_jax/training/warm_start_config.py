"""The ``warm_start`` config section: the embedded default model and its supervised start."""

from __future__ import annotations

import dataclasses

from sparse_rl_jax.core.config_checks import check, check_choice, check_int, check_number
from sparse_rl_jax.training.supervised import SCHEDULES


@dataclasses.dataclass(frozen=True)
class WarmStartConfig:
    """The embedded default model and its supervised warm start on the shipped task
    (``warm_start.build_default_model``).

    The shipped task needs an induction-style lookup (find the label, copy its digit). With
    the labels always in alphabetical order a label's *place* in the prompt also gives its
    digit, so a small model learns a positional shortcut for some labels, and whether the
    content lookup forms by a fixed step is a matter of seed and machine. The recipe removes
    the shortcut and the plateau: a curriculum that starts at one labelled digit, a share of
    rows with shuffled labels (their next-label targets masked), a constant learning rate,
    and a held-out check that stops once the task is solved.

    Attributes:
      hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size: Qwen2-shaped
        architecture of the tiny model.
      steps: the most supervised steps (>= 2); the check below usually stops far earlier.
      batch_size, lr: rows per step; AdamW learning rate (weight decay 0.01, clip 1.0).
      warmup_steps: linear warmup from 0 over ``min(warmup_steps, steps // 10 + 1)`` steps.
      lr_schedule: after the warmup, ``constant`` (the check decides when to stop) or
        ``cosine`` (decays to 5% at ``steps``: the recipe before the check existed, which the
        walk configs keep); ``supervised.SCHEDULES``.
      curriculum_steps: the task's ``n_max`` ramps from 1 to its own value over these steps,
        with ``n_min`` 1 until then (0 = the task's distribution from the first step).
      shuffled_fraction: share of each batch drawn with random label order (0 <= f < 1): the
        label's place then says nothing, so the lookup must match the label itself. Their
        next-label targets are masked (the order is random). Tasks without a label order (the
        walk) ignore it.
      check_every: steps between held-out checks (teacher-forced, ``check_problems`` problems
        drawn with their own seed: neither the training nor the eval set).
      check_problems: held-out problems per check.
      target_accuracy: stop at the first check where this share of the held-out solutions is
        predicted token for token (every argmax right, so greedy decoding solves at least that
        share); null runs all ``steps``. A warm start that ends below it says so.
      seed: initialisation and data seed of the warm start.
    """

    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 8
    num_kv_heads: int = 4
    intermediate_size: int = 256
    steps: int = 1500
    batch_size: int = 32
    lr: float = 3e-3
    warmup_steps: int = 50
    lr_schedule: str = "constant"
    curriculum_steps: int = 200
    shuffled_fraction: float = 0.5
    check_every: int = 50
    check_problems: int = 256
    target_accuracy: float | None = 0.95
    seed: int = 0

    def __post_init__(self):
        for field in ("hidden_size", "num_layers", "num_heads", "num_kv_heads",
                      "intermediate_size", "batch_size", "check_every", "check_problems"):
            check_int(self, field, 1)
        check_int(self, "steps", 2, "must be an int >= 2 (the schedule warms up for at least "
                                    "one step)")
        check_int(self, "warmup_steps", 1)
        check_int(self, "curriculum_steps", 0)
        check(self.num_heads % self.num_kv_heads == 0, self, "num_heads",
              f"must be a multiple of num_kv_heads={self.num_kv_heads}")
        check(self.hidden_size % self.num_heads == 0, self, "hidden_size",
              f"must be a multiple of num_heads={self.num_heads}")
        check_number(self, "lr", gt=0)
        check_choice(self, "lr_schedule", tuple(SCHEDULES))
        check_number(self, "shuffled_fraction", ge=0, lt=1)
        check_number(self, "target_accuracy", gt=0, le=1, optional=True)
        check_int(self, "seed", 0)
