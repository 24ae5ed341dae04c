"""The corrections study's rule (issue 47), fixed before any of its runs: which correction
presets are eligible, which one is recommended, and whether the shipped default follows it,
from the study's stored settings. ``results_corrections`` lays out what it says."""

from __future__ import annotations

from experiments.kit.results_data import Experiment, degraded, mean_se, paired_gap, pass1

# The corrections study (issue 47), its rule fixed before any of its runs. Three settings,
# 5 seeds each: the regime (R-KV 32 on walk_local2), outside it (R-KV 40 on walk_local) and
# the positive control (q = 10% on walk_local2's dense rollouts, whose dense-trained reference
# is the regime's dense arm: the same config and seeds).
STUDY_SETTINGS = ("corrections_regime", "corrections_local40", "corrections_control")
STUDY_DEFAULT = "sparse_rl"  # the shipped default the recommendation is measured against
TIE_SE = 2.0  # a seed-paired gap counts only beyond this many standard errors
STUDY_SEEDS = 5  # the seeds each setting is planned with; fewer make the outcome provisional
STORED_AS = {"decoupled_geo_rs": "decoupled_geo_rs_veto"}
"""The study's arm names whose preset has since taken verl 0.9's numbers -> the preset with the
numbers they ran (its stored runs and SmolLM2 statistics under those names)."""


def stored_preset(arm_name: str) -> str:
    """The preset a stored arm (or SmolLM2 statistic) named ``arm_name`` ran."""
    return STORED_AS.get(arm_name, arm_name)


def study_arm(exp: Experiment, preset: str) -> list[dict]:
    """The runs of correction ``preset`` in one study setting (its arm's label starts with
    the preset's name: ``<name> rkv 32``, ``<name> control 0.1``, ``<name> rkv 32 int4``);
    an arm on quantization alone (``<name> none int4``) is not the setting's."""
    labels = [label for label in exp.arms()
              if label.split()[0] == preset and label.split()[1:2] != ["none"]]
    return exp.arm(labels[0]) if labels else []


def study_eligible(settings: dict[str, Experiment], dense: dict[str, list[dict]],
                   preset: str) -> tuple[bool, str]:
    """Whether ``preset`` has 0 collapsed and 0 degraded seeds in every setting (a setting
    where it did not run makes it ineligible), and the counts as words."""
    words, ok = [], True
    for name in STUDY_SETTINGS:
        runs = study_arm(settings[name], preset) if settings.get(name) else []
        if not runs:
            ok = False
            words.append(f"{name}: not run")
            continue
        collapsed = sum(r["collapsed"] for r in runs)
        bad = sum(degraded(runs, dense[name]))
        ok = ok and collapsed == 0 and bad == 0
        words.append(f"{name}: {collapsed}/{len(runs)} collapse, {bad}/{len(runs)} degrade")
    return ok, "; ".join(words)


def beats(a: list[dict], b: list[dict]) -> tuple[bool, float, float]:
    """Whether ``a``'s held-out dense pass@1 exceeds ``b``'s beyond ``TIE_SE`` standard
    errors of the seed-paired gap; and the gap's mean and SE."""
    mean, se = mean_se(paired_gap(a, b))
    return mean > TIE_SE * se and mean > 0, mean, se


def recommend(settings: dict[str, Experiment], dense: dict[str, list[dict]],
              presets: list[str], parts: dict[str, int]) -> dict:
    """The rule, in order: (1) eligible presets have 0 collapse and 0 degrade in all three
    settings; (2) the leader is the eligible preset with the highest mean held-out dense
    pass@1 in the regime; (3) every eligible preset the leader does not beat (``beats``) ties
    with it, and of the tied ones the one with the fewest parts (``Preset.count``) is
    recommended (then the higher mean); (4) the shipped default (``STUDY_DEFAULT``) follows
    the recommendation only if that beats the default by the same rule: the default is not
    eligible, or the recommendation's paired gap over it is beyond ``TIE_SE`` SE, or the two
    tie and the recommendation has fewer parts. Returns the recommendation, the default
    decision, and per preset its eligibility words and regime mean."""
    regime = settings[STUDY_SETTINGS[0]]
    table = {p: study_eligible(settings, dense, p) for p in presets}
    means = {p: mean_se(pass1(r, "dense") for r in study_arm(regime, p))[0]
             for p in presets if study_arm(regime, p)}
    eligible = [p for p in presets if table[p][0]]
    if not eligible:
        return {"recommended": None, "default": STUDY_DEFAULT, "eligible": table,
                "means": means, "why": "no correction is eligible: the default stays"}
    leader = max(eligible, key=lambda p: means[p])
    tied = [p for p in eligible
            if p == leader or not beats(study_arm(regime, leader), study_arm(regime, p))[0]]
    best = min(tied, key=lambda p: (parts[p], -means[p]))
    if best == STUDY_DEFAULT:
        why, default = "the default is the recommendation", STUDY_DEFAULT
    elif not table[STUDY_DEFAULT][0]:
        why, default = f"{STUDY_DEFAULT} is not eligible ({table[STUDY_DEFAULT][1]})", best
    else:
        won, gap, se = beats(study_arm(regime, best), study_arm(regime, STUDY_DEFAULT))
        fewer = parts[best] < parts[STUDY_DEFAULT]
        default = best if won or fewer else STUDY_DEFAULT
        why = (f"paired gap over {STUDY_DEFAULT} {gap:+.3f} ± {se:.3f} "
               f"({'beyond' if won else 'within'} {TIE_SE:g} SE); parts {parts[best]} vs "
               f"{parts[STUDY_DEFAULT]}")
    return {"recommended": best, "default": default, "eligible": table, "means": means,
            "leader": leader, "tied": tied, "why": why}
