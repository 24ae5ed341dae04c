"""Named off-policy corrections (``correction.kind``): each one a combination of the parts
of :class:`~sparse_rl_jax.rl.loss_config.CorrectionConfig`.

A correction is built from orthogonal parts, after verl's rollout correction
(``rollout_corr_helper.py``, ``core_algos.py``):

  anchor     the PPO ratio's denominator: ``proximal`` (dense scores under the learner's
             params at the update; the ratio to them is ~1 at the first update) or
             ``behaviour`` (the sampler's own log-probs: verl's bypass mode).
  loss       ``ppo`` (the loss section's clipped objective) or ``pg`` (plain policy
             gradient, ``-w A log pi``: verl's bypass ``reinforce``).
  is_level / is_mode / is_lower / is_upper
             the IS weight from ``r = proximal / behaviour`` at ``token``, ``sequence``
             (product) or ``geometric`` (mean log) level, ``none`` for weight 1; ``truncate``
             (TIS: ``min(r, is_upper)``), ``mask`` (IcePop: ``r`` inside ``[is_lower,
             is_upper]``, 0 outside, the token kept in the loss's denominators) or ``raw``.
  rs_level / rs_lower / rs_upper
             ratio-band rejection: tokens (``token``) or whole sequences (``sequence``,
             ``geometric``) whose ratio leaves ``[rs_lower, rs_upper]`` leave the loss.
  rs / rs_threshold / rs_target_rate
             verl 0.9's rejection measures (``rejection_measures``): ``token``, ``seq_sum``,
             ``seq_mean`` or ``seq_max`` of k1 (a band), k2 or k3 (upper bounds), several at
             once; ``rs_target_rate`` sets one sequence k2/k3 threshold per batch.
  veto / veto_threshold
             drop a sequence holding a token with ``r_t < veto_threshold``.
  normalize  divide the IS weights by their batch mean.
  opsm / opsm_delta
             DeepSeek-V3.2's off-policy sequence masking: drop a sequence whose advantage
             is negative and whose mean ``log(behaviour / proximal)`` exceeds ``opsm_delta``.
  replay     the learner scores the tokens under the rollout's eviction record
             (shadow-mask training; the ratio is then to the sampler's log-probs).

A preset names the parts it sets; every other part takes :data:`BASE`'s value, and a config
that sets a part itself overrides the preset. An alias is another name of a preset (its
summary says which); ``python run.py config`` prints what a name resolves to. A new preset is
one ``CORRECTION_PRESETS.register(name, Preset(...))``. docs/corrections.md tabulates them.

Sources and their numbers (verl-project/verl 1dda039 ``algorithm.py``, NVIDIA-NeMo/RL
``docs/guides/prorlv2.md``, inclusionAI/AReaL ``areal/api/cli_args.py``):
  verl 0.9   the 19 factory presets under their names: IS truncated at 2.0, IcePop band
             "0.5_5.0", sequence rejection "0.5_2.0" (seq_sum_k1), geometric rejection
             "0.999_1.001" (seq_mean_k1, no veto), k3 rejection 0.01 (seq_mean_k3).
  pre-0.9    verl's names before its refactor (#4511): ``ppo_is_bypass``, ``pg_is`` and
             ``icepop`` are aliases of their 0.9 presets; ``pg_rs`` and
             ``decoupled_geo_rs_veto`` keep the old geometric band ``[1/1.001, 1.001]`` with
             a 1e-4 veto. The stored walk-study runs under the name ``decoupled_geo_rs``
             (docs/results/corrections_*, correction_stats) ran those old numbers, which are
             now ``decoupled_geo_rs_veto``.
  NeMo-RL    ``seq-mask-tis``: raw token IS, sequences whose geometric mean ratio leaves
             [0.999, 1.002] dropped.
  AReaL      ``areal_geo_is``: rejection_sampling level sequence, metric ratio, agg mean,
             action mask, upper 5.0: the geometric-mean ratio as the sequence's weight,
             sequences above 5.0 dropped, no lower bound.
  Sparse-RL  slime ``mis.yaml``: truncate and reject at [0.5, 1.5], 1e-4 veto, normalised.
  ours       ``adaptive_k3_rs_token_tis``: token TIS at 2.0 + seq_mean_k3 rejection at
             max(0.01, the batch's 0.9 quantile), i.e. about 10% of a batch above 0.01.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from models.registry import Registry

BASE: dict[str, Any] = {
    "anchor": "proximal", "loss": "ppo",
    "is_level": "none", "is_mode": "truncate", "is_lower": 0.5, "is_upper": 1.5,
    "rs_level": "none", "rs_lower": None, "rs_upper": None,
    "rs": "none", "rs_threshold": None, "rs_target_rate": None,
    "veto": False, "veto_threshold": 1e-4, "normalize": False,
    "opsm": False, "opsm_delta": 1e-4, "replay": False,
}
"""Every part's value where a preset does not set it (``rs_lower`` / ``rs_upper`` None: the
IS bounds)."""

PARTS = tuple(BASE)
"""The part fields of ``CorrectionConfig``, in order."""

SWITCHES = ("anchor", "loss", "is_level", "rs_level", "rs", "rs_target_rate", "veto",
            "normalize", "opsm", "replay")
"""The parts that turn a piece of a correction on (the others are its numbers): what
:meth:`Preset.count` counts."""


@dataclasses.dataclass(frozen=True)
class Preset:
    """A named correction: the parts it sets (the rest are :data:`BASE`'s).

    Attributes:
      parts: part name -> value; every name must be one of :data:`PARTS`.
      summary: one line saying what it is, and where its numbers differ from its source's.
      source: where it comes from (``verl 0.9``, ``pre-0.9``, ``NeMo-RL``, ``AReaL``, ...).
      alias_of: for an alias, the preset whose parts it has; None otherwise.
    """

    parts: dict[str, Any]
    summary: str
    source: str = "sparse-rl-jax"
    alias_of: str | None = None

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


def describe(name: str) -> str:
    """One line on the preset ``name``: its summary and source (an alias's says what it
    resolves to)."""
    preset = CORRECTION_PRESETS.get(name)
    return f"{name}: {preset.summary} [{preset.source}]"


VERL = "verl 0.9"
_TOKEN_TIS = {"is_level": "token", "is_upper": 2.0}
_SEQ_TIS = {"is_level": "sequence", "is_upper": 2.0}
_TOKEN_ICEPOP = {"is_level": "token", "is_mode": "mask", "is_lower": 0.5, "is_upper": 5.0}
_GEO_RS = {"rs": "seq_mean_k1", "rs_threshold": "0.999_1.001"}
_K3_RS = {"rs": "seq_mean_k3", "rs_threshold": 0.01}
_BYPASS = {"anchor": "behaviour"}
_BYPASS_PG = {"anchor": "behaviour", "loss": "pg"}
_PRE09_GEO = {"rs_level": "geometric", "rs_lower": 1 / 1.001, "rs_upper": 1.001,
              "veto": True, "veto_threshold": 1e-4}
_GEO_WORDS = "geometric rejection seq_mean_k1 '0.999_1.001' (keeps 1/1.001 <= r_geo <= 1/0.999)"
_K3_WORDS = "rejection of sequences whose mean k3 exceeds 0.01 (seq_mean_k3)"

VERL_09: dict[str, Preset] = {name: Preset(parts, summary, VERL) for name, parts, summary in (
    ("decoupled_token_is", _TOKEN_TIS, "token TIS at 2.0"),
    ("decoupled_seq_is", _SEQ_TIS, "sequence TIS at 2.0"),
    ("decoupled_token_icepop", _TOKEN_ICEPOP, "token IcePop: weight r inside [0.5, 5.0], "
                                              "0 outside (threshold '0.5_5.0')"),
    ("decoupled_seq_is_rs", {**_SEQ_TIS, "rs_level": "sequence", "rs_lower": 0.5,
                             "rs_upper": 2.0},
     "sequence TIS at 2.0 + sequence rejection outside [0.5, 2.0] (verl's seq_sum_k1 "
     "'0.5_2.0', written as our ratio band as before 0.9)"),
    ("decoupled_geo_rs", _GEO_RS, f"{_GEO_WORDS}, no IS, no veto (before 0.9 the band was "
                                  "[1/1.001, 1.001] + veto 1e-4: decoupled_geo_rs_veto)"),
    ("decoupled_geo_rs_seq_tis", {**_SEQ_TIS, **_GEO_RS}, f"sequence TIS at 2.0 + {_GEO_WORDS}"),
    ("decoupled_geo_rs_token_tis", {**_TOKEN_TIS, **_GEO_RS}, f"token TIS at 2.0 + {_GEO_WORDS}"),
    ("decoupled_k3_rs", _K3_RS, f"{_K3_WORDS}, no IS"),
    ("decoupled_k3_rs_seq_tis", {**_SEQ_TIS, **_K3_RS}, f"sequence TIS at 2.0 + {_K3_WORDS}"),
    ("decoupled_k3_rs_token_tis", {**_TOKEN_TIS, **_K3_RS}, f"token TIS at 2.0 + {_K3_WORDS}"),
    ("bypass_ppo_clip", _BYPASS, "PPO with the ratio to the sampler's log-probs, no IS"),
    ("bypass_ppo_clip_geo_rs", {**_BYPASS, **_GEO_RS}, f"bypass PPO + {_GEO_WORDS}"),
    ("bypass_ppo_clip_k3_rs", {**_BYPASS, **_K3_RS}, f"bypass PPO + {_K3_WORDS}"),
    ("bypass_pg_is", {**_BYPASS_PG, **_SEQ_TIS}, "bypass plain policy gradient (verl's "
                                                 "reinforce) with sequence TIS at 2.0"),
    ("bypass_pg_token_icepop", {**_BYPASS_PG, **_TOKEN_ICEPOP},
     "bypass plain policy gradient with token IcePop [0.5, 5.0]"),
    ("bypass_pg_geo_rs", {**_BYPASS_PG, **_GEO_RS},
     f"bypass plain policy gradient + {_GEO_WORDS} (pg_rs before 0.9, with another band)"),
    ("bypass_pg_geo_rs_seq_tis", {**_BYPASS_PG, **_SEQ_TIS, **_GEO_RS},
     f"bypass plain policy gradient + sequence TIS at 2.0 + {_GEO_WORDS}"),
    ("bypass_pg_geo_rs_token_tis", {**_BYPASS_PG, **_TOKEN_TIS, **_GEO_RS},
     f"bypass plain policy gradient + token TIS at 2.0 + {_GEO_WORDS}"),
    ("disabled", {}, "no correction"),
)}
"""verl 0.9's 19 factory presets (``RolloutCorrectionConfig``), in its order, its numbers."""


def alias(canonical: str, note: str, source: str) -> Preset:
    """Another name of the preset ``canonical`` (a verl 0.9 preset or a registered one): its
    parts, a summary saying what it resolves to, and the name's own ``source``."""
    target = VERL_09.get(canonical) or CORRECTION_PRESETS.get(canonical)
    return Preset(dict(target.parts), f"alias of {canonical} ({note})", source, canonical)


for _name, _preset in (
    # the project's kinds and the names before verl 0.9, in their order (bit for bit as before)
    ("none", alias("disabled", "naive: weight 1, nothing rejected, ratio to the proximal "
                               "policy", "sparse-rl-jax")),
    ("tis", Preset({"is_level": "token"}, "truncated IS min(r, is_upper)")),
    ("mis", Preset({"is_level": "token", "is_mode": "mask", "rs_level": "token"},
                   "masked IS: weight r, tokens with r outside [is_lower, is_upper] rejected")),
    ("sparse_rl", Preset({"is_level": "token", "rs_level": "token", "veto": True,
                          "normalize": True},
                         "Sparse-RL (arXiv 2601.10079): veto r < 1e-4, reject r outside "
                         "[0.5, 1.5], TIS min(r, 1.5), weights normalised", "Sparse-RL")),
    ("shadow_mask", Preset({"replay": True},
                           "shadow-mask training: the learner replays the rollout's eviction "
                           "record (its ratio is then to the sampler's log-probs)",
                           "Shadow Mask Distillation")),
    ("ppo_behaviour", alias("bypass_ppo_clip", "standard PPO with the sampler's log-probs as "
                                               "the old policy; AReaL's naive PPO",
                            "sparse-rl-jax")),
    ("disabled", VERL_09["disabled"]),
    ("decoupled_token_is", VERL_09["decoupled_token_is"]),
    ("decoupled_seq_is", VERL_09["decoupled_seq_is"]),
    ("decoupled_seq_is_rs", VERL_09["decoupled_seq_is_rs"]),
    ("decoupled_geo_rs", VERL_09["decoupled_geo_rs"]),
    ("ppo_is_bypass", alias("bypass_ppo_clip", "verl's name before 0.9", "pre-0.9")),
    ("pg_is", alias("bypass_pg_is", "verl's name before 0.9", "pre-0.9")),
    ("pg_rs", Preset({**_BYPASS_PG, **_PRE09_GEO},
                     "verl's name before 0.9: bypass plain policy gradient + geometric "
                     "rejection outside [1/1.001, 1.001] + veto 1e-4; 0.9's nearest is "
                     "bypass_pg_geo_rs, which has no veto and band '0.999_1.001'", "pre-0.9")),
    ("icepop", alias("decoupled_token_icepop", "IcePop (token MIS), the same band",
                     "IcePop")),
    ("opsm", Preset({"opsm": True}, "DeepSeek-V3.2 off-policy sequence masking: drop "
                                    "negative-advantage sequences whose mean "
                                    "log(behaviour / proximal) exceeds 1e-4", "DeepSeek-V3.2")),
    ("decoupled_geo_rs_veto", Preset(dict(_PRE09_GEO),
                                     "decoupled_geo_rs before 0.9 (the stored walk study's "
                                     "decoupled_geo_rs runs): geometric rejection outside "
                                     "[1/1.001, 1.001] + veto 1e-4, no IS; 0.9's "
                                     "decoupled_geo_rs has no veto and band '0.999_1.001'",
                                     "pre-0.9")),
):
    CORRECTION_PRESETS.register(_name, _preset)

for _name, _preset in VERL_09.items():  # the rest of verl 0.9's set, in its order
    if _name not in CORRECTION_PRESETS:
        CORRECTION_PRESETS.register(_name, _preset)

CORRECTION_PRESETS.register("seq-mask-tis", Preset(
    {"is_level": "token", "is_mode": "raw", "rs_level": "geometric", "rs_lower": 0.999,
     "rs_upper": 1.002},
    "NeMo-RL's seq-mask-tis (ProRL v2.1): raw token IS r, sequences whose geometric mean "
    "ratio leaves [0.999, 1.002] dropped", "NeMo-RL"))
CORRECTION_PRESETS.register("seq_mask_tis", alias("seq-mask-tis", "underscore spelling",
                                                  "NeMo-RL"))
CORRECTION_PRESETS.register("areal_geo_is", Preset(
    {"is_level": "geometric", "is_mode": "raw", "rs_level": "geometric", "rs_lower": 0.0,
     "rs_upper": 5.0},
    "AReaL's geometric-mean sequence IS (rejection_sampling level sequence, metric ratio, "
    "agg mean, action mask, upper 5.0): weight exp(mean log r), sequences above 5.0 dropped",
    "AReaL"))
CORRECTION_PRESETS.register("adaptive_k3_rs_token_tis", Preset(
    {**_TOKEN_TIS, **_K3_RS, "rs_target_rate": 0.1},
    "ours: token TIS at 2.0 + seq_mean_k3 rejection above max(0.01, the batch's 0.9 "
    "quantile): about 10% of a batch above verl's 0.01 rejected, none below",
    "sparse-rl-jax (ours)"))
