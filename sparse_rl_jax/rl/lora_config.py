"""The ``model.lora`` config section: low-rank adapters trained in place of the weights."""

from __future__ import annotations

import dataclasses

from models.lora import LORA_TARGETS
from sparse_rl_jax.core.config_checks import check, check_int, check_number


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """LoRA on the policy (``models.lora``): the base weights are frozen and only the
    adapters are trained (the optimizer state covers them alone); rollouts, scoring and the
    update all run the adapted model; the export is merged (plus the adapter alone, in PEFT
    format, under ``final/lora_adapter``). Leave ``model.lora`` out to train every weight.

    Attributes:
      rank: adapter rank ``r`` (an int >= 1).
      alpha: scale numerator: the adapter adds ``(alpha / rank) * x @ A @ B`` (> 0).
      targets: the projections adapted in every layer, among :data:`LORA_TARGETS`.
      dropout: adapter input dropout rate in [0, 1), applied in the learner's forward of
        each optimizer update only (rollouts, the old-policy and reference scores and eval
        stay deterministic); its keys derive from ``trainer.seed``, the RL step and the
        minibatch (``train_step.dropout_key``), so a resumed run draws the same masks.
    """

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = LORA_TARGETS
    dropout: float = 0.0

    def __post_init__(self):
        check_int(self, "rank", 1,
                  "must be an int >= 1 (leave model.lora out to train every weight)")
        check_number(self, "alpha", gt=0)
        unknown = [name for name in self.targets if name not in LORA_TARGETS]
        check(bool(self.targets) and not unknown and len(set(self.targets)) == len(self.targets),
              self, "targets", f"must be distinct projection names among {list(LORA_TARGETS)}"
              + (f"; {unknown} name no module" if unknown else ""))
        check_number(self, "dropout", ge=0, lt=1)
