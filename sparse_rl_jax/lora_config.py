"""The ``model.lora`` config section: low-rank adapters trained in place of the weights."""

from __future__ import annotations

import dataclasses

from models.lora import LORA_TARGETS


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
      dropout: adapter input dropout; only 0.0 is supported (rollouts, scoring and the
        update must compute the same policy, and the update has no dropout rng).
    """

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = LORA_TARGETS
    dropout: float = 0.0

    def __post_init__(self):
        unknown = [name for name in self.targets if name not in LORA_TARGETS]
        rules = {
            "rank": (isinstance(self.rank, int) and not isinstance(self.rank, bool)
                     and self.rank >= 1,
                     "must be an int >= 1 (leave model.lora out to train every weight)"),
            "alpha": (self.alpha > 0, "must be > 0"),
            "targets": (bool(self.targets) and not unknown
                        and len(set(self.targets)) == len(self.targets),
                        f"must be distinct projection names among {list(LORA_TARGETS)}"
                        + (f"; {unknown} name no module" if unknown else "")),
            "dropout": (0 <= self.dropout < 1, "must be in [0, 1)"),
        }
        for field, (ok, why) in rules.items():
            if not ok:
                raise ValueError(f"model.lora.{field}={getattr(self, field)!r} {why}")
        if self.dropout:
            raise ValueError(f"model.lora.dropout={self.dropout!r} is not supported: only 0.0 "
                             "(the update has no dropout rng, and rollouts, scoring and the "
                             "update must compute the same policy)")
