"""The ``warm_start`` config section: the embedded default model and its supervised start."""

from __future__ import annotations

import dataclasses

from sparse_rl_jax.config_checks import check, check_int, check_number


@dataclasses.dataclass(frozen=True)
class WarmStartConfig:
    """The embedded default model and its supervised warm start on the shipped task
    (``warm_start.build_default_model``).

    Attributes:
      hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size: Qwen2-shaped
        architecture of the tiny model.
      steps, batch_size, lr: the supervised stage (AdamW, linear warmup then cosine decay;
        steps >= 2). 650 steps leave a policy that solves about half the held-out problems
        greedily (1000 solve nearly all), so the default RL run has something to improve.
      seed: initialisation and data seed of the warm start.
    """

    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    steps: int = 650
    batch_size: int = 32
    lr: float = 3e-3
    seed: int = 0

    def __post_init__(self):
        for field in ("hidden_size", "num_layers", "num_heads", "num_kv_heads",
                      "intermediate_size", "batch_size"):
            check_int(self, field, 1)
        check_int(self, "steps", 2, "must be an int >= 2 (the schedule warms up for at least "
                                    "one step, then decays)")
        check(self.num_heads % self.num_kv_heads == 0, self, "num_heads",
              f"must be a multiple of num_kv_heads={self.num_kv_heads}")
        check(self.hidden_size % self.num_heads == 0, self, "hidden_size",
              f"must be a multiple of num_heads={self.num_heads}")
        check_number(self, "lr", gt=0)
        check_int(self, "seed", 0)
