"""Named off-policy corrections (``correction.kind``): each one a combination of the parts
of :class:`~sparse_rl_jax.rl.loss_config.CorrectionConfig`.

A correction is built from orthogonal parts, after verl's rollout correction
(``rollout_corr_helper.py``, ``core_algos.py``):

  anchor     the PPO ratio's denominator: ``proximal`` (dense scores under the learner's
             params at the update; the ratio to them is ~1 at the first update) or
             ``behaviour`` (the sampler's own log-probs: verl's bypass mode).
  loss       ``ppo`` (the loss section's clipped objective) or ``pg`` (plain policy
             gradient, ``-w A log pi``: verl's bypass REINFORCE).
  is_level / is_mode / is_lower / is_upper
             the IS weight from ``r = proximal / behaviour`` at ``token``, ``sequence``
             (product) or ``geometric`` (mean log) level, ``none`` for weight 1; ``truncate``
             (TIS: ``min(r, is_upper)``) or ``mask`` (IcePop: ``r`` inside ``[is_lower,
             is_upper]``, 0 outside, the token kept in the loss's denominators).
  rs_level / rs_lower / rs_upper
             rejection: tokens (``token``) or whole sequences (``sequence``, ``geometric``)
             whose ratio leaves ``[rs_lower, rs_upper]`` leave the loss.
  veto / veto_threshold
             drop a sequence holding a token with ``r_t < veto_threshold``.
  normalize  divide the IS weights by their batch mean.
  opsm / opsm_delta
             DeepSeek-V3.2's off-policy sequence masking: drop a sequence whose advantage
             is negative and whose mean ``log(behaviour / proximal)`` exceeds ``opsm_delta``.
  replay     the learner scores the tokens under the rollout's own eviction record
             (shadow-mask training; the ratio is then to the sampler's log-probs).

A preset names the parts it sets; every other part takes :data:`BASE`'s value, and a config
that sets a part itself overrides the preset. ``python run.py config`` prints what a preset
resolves to. A new preset is one ``CORRECTION_PRESETS.register(name, Preset(...))``.

Numbers read from the sources: verl's presets truncate at 2.0, reject at the sequence level
in ``[0.5, 2.0]``, and put the geometric band at ``[1/1.001, 1.001]`` with a ``1e-4`` veto;
verl's IcePop band is ``[0.5, 5.0]``; slime's OPSM delta defaults to ``1e-4``; Sparse-RL's
official code (slime ``mis.yaml``) truncates and rejects at ``[0.5, 1.5]`` with a ``1e-4``
veto and batch normalisation.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from models.registry import Registry

BASE: dict[str, Any] = {
    "anchor": "proximal", "loss": "ppo",
    "is_level": "none", "is_mode": "truncate", "is_lower": 0.5, "is_upper": 1.5,
    "rs_level": "none", "rs_lower": None, "rs_upper": None,
    "veto": False, "veto_threshold": 1e-4, "normalize": False,
    "opsm": False, "opsm_delta": 1e-4, "replay": False,
}
"""Every part's value where a preset does not set it (``rs_lower`` / ``rs_upper`` None: the
IS bounds)."""

PARTS = tuple(BASE)
"""The part fields of ``CorrectionConfig``, in order."""

SWITCHES = ("anchor", "loss", "is_level", "rs_level", "veto", "normalize", "opsm", "replay")
"""The parts that turn a piece of a correction on (the others are its numbers): what
:meth:`Preset.count` counts."""


@dataclasses.dataclass(frozen=True)
class Preset:
    """A named correction: the parts it sets (the rest are :data:`BASE`'s).

    Attributes:
      parts: part name -> value; every name must be one of :data:`PARTS`.
      summary: one line saying what it is and where it comes from.
    """

    parts: dict[str, Any]
    summary: str

    def __post_init__(self) -> None:
        unknown = sorted(set(self.parts) - set(PARTS))
        if unknown:
            raise ValueError(f"correction preset parts {unknown} are not parts; "
                             f"parts: {list(PARTS)}")

    def value(self, part: str) -> Any:
        """The preset's value of ``part`` (:data:`BASE`'s where the preset sets none)."""
        return self.parts.get(part, BASE[part])

    def count(self) -> int:
        """How many pieces the preset turns on (its :data:`SWITCHES` that differ from
        :data:`BASE`; ties in the corrections study go to the preset with fewer)."""
        return sum(self.value(p) != BASE[p] for p in SWITCHES)


CORRECTION_PRESETS: Registry[Preset] = Registry("correction preset")

_VERL_GEO = {"rs_level": "geometric", "rs_lower": 1 / 1.001, "rs_upper": 1.001,
             "veto": True, "veto_threshold": 1e-4}
_BYPASS = {"anchor": "behaviour"}

for _name, _preset in (
    # the project's kinds (their behaviour before parts existed, bit for bit)
    ("none", Preset({}, "naive: weight 1, nothing rejected, ratio to the proximal policy")),
    ("tis", Preset({"is_level": "token"}, "truncated IS min(r, is_upper)")),
    ("mis", Preset({"is_level": "token", "is_mode": "mask", "rs_level": "token"},
                   "masked IS: weight r, tokens with r outside [is_lower, is_upper] rejected")),
    ("sparse_rl", Preset({"is_level": "token", "rs_level": "token", "veto": True,
                          "normalize": True},
                         "Sparse-RL (arXiv 2601.10079): veto r < 1e-4, reject r outside "
                         "[0.5, 1.5], TIS min(r, 1.5), weights normalised")),
    ("shadow_mask", Preset({"replay": True},
                           "shadow-mask training: the learner replays the rollout's eviction "
                           "record (its ratio is then to the sampler's log-probs)")),
    ("ppo_behaviour", Preset(_BYPASS, "standard PPO with the sampler's log-probs as the old "
                                      "policy (verl's bypass, AReaL's naive PPO)")),
    # verl's presets (rollout_correction, the names before its refactor #4511)
    ("disabled", Preset({}, "verl: no correction (the same as none)")),
    ("decoupled_token_is", Preset({"is_level": "token", "is_upper": 2.0},
                                  "verl: token TIS at 2.0")),
    ("decoupled_seq_is", Preset({"is_level": "sequence", "is_upper": 2.0},
                                "verl: sequence TIS at 2.0")),
    ("decoupled_seq_is_rs", Preset({"is_level": "sequence", "is_upper": 2.0,
                                    "rs_level": "sequence", "rs_lower": 0.5, "rs_upper": 2.0},
                                   "verl: sequence TIS at 2.0 + sequence rejection outside "
                                   "[0.5, 2.0] (sequence MIS)")),
    ("decoupled_geo_rs", Preset(dict(_VERL_GEO), "verl: geometric rejection outside "
                                                 "[1/1.001, 1.001] + veto 1e-4, no IS")),
    ("ppo_is_bypass", Preset(dict(_BYPASS), "verl: PPO with the ratio to the sampler's "
                                            "log-probs (its IS weights are 1 there)")),
    ("pg_is", Preset({**_BYPASS, "loss": "pg", "is_level": "sequence", "is_upper": 2.0},
                     "verl: plain policy gradient with sequence TIS at 2.0, bypass")),
    ("pg_rs", Preset({**_BYPASS, "loss": "pg", **_VERL_GEO},
                     "verl: plain policy gradient with geometric rejection + veto, bypass")),
    # IcePop and DeepSeek-V3.2
    ("icepop", Preset({"is_level": "token", "is_mode": "mask", "is_lower": 0.5,
                       "is_upper": 5.0},
                      "IcePop (token MIS): weight r inside [0.5, 5.0], 0 outside")),
    ("opsm", Preset({"opsm": True}, "DeepSeek-V3.2 off-policy sequence masking: drop "
                                    "negative-advantage sequences whose mean "
                                    "log(behaviour / proximal) exceeds 1e-4")),
):
    CORRECTION_PRESETS.register(_name, _preset)
