"""The rule of the corrections study at real lengths (issue 53), fixed before any run of its
regime: which corrections are eligible, which one leads, and so which one ships as
``CorrectionConfig``'s default.

The study asks which correction holds when the sampler/learner mismatch is diffuse over long
responses (a real LLM's, SmolLM2-135M under R-KV) as well as spiky (the walk regime). Its
evidence, per correction preset:

  regime     ``LENGTHS_REGIME``: the regime whose untrained rollouts match SmolLM2's mismatch
             statistics (docs/results/lengths_regime/), 5 seeds, held-out eval as in the walk
             study, against its own dense arm.
  walk       the walk regime (R-KV 32 on walk_local2, 80 steps): the runs of
             ``LENGTHS_WALK`` (docs/results/lengths_walk/), or where a preset has none there,
             the issue-47 study's runs (``WALK_STORED``) of a preset with exactly the same
             parts, under whatever name they ran (``study_rule.STORED_AS`` names the preset an old
             arm's name meant then). Dense reference: the walk setting's own dense arm where it has
             every seed, else the issue-47 regime's.
  SmolLM2    ``correction_stats`` on SmolLM2-135M's R-KV rollouts at 64, 96 and 128 slots
             (docs/results/lengths_smol/budget<k>.json: every preset on one fresh batch per
             budget; no training).

The rule, in order:
  1. eligible: 0 collapsed and 0 degraded seeds in the regime and in the walk, and on
     SmolLM2's statistics Kish ESS >= ``SMOL_MIN_ESS`` and kept tokens >= ``SMOL_MIN_KEPT``
     at every budget of ``SMOL_BUDGETS`` (a missing setting or budget makes it ineligible);
  2. the leader is the eligible preset with the highest mean held-out dense pass@1 in the
     regime;
  3. every eligible preset whose seed-paired gap to the leader is within ``TIE_SE`` standard
     errors ties with it, and of the tied ones the fewest parts (``Preset.count``) wins, then
     the higher mean;
  4. the shipped default is the winner.
If nothing is eligible, the outcome says so and the same steps 2-4 run over the presets that
pass the most criteria, compared in the order regime, walk, SmolLM2 (a preset that passes the
regime and the walk beats one that passes the walk and SmolLM2).
"""

from __future__ import annotations

from experiments.kit.results_data import Experiment, degraded, mean_se, pass1
from experiments.kit.study_rule import TIE_SE, beats, stored_preset, study_arm

LENGTHS_REGIME = "lengths_regime"
LENGTHS_WALK = "lengths_walk"
WALK_STORED = "corrections_regime"
LENGTHS_ARMS = (
    "sparse_rl", "decoupled_seq_is", "decoupled_token_is", "decoupled_token_icepop",
    "decoupled_seq_is_rs", "decoupled_geo_rs", "decoupled_geo_rs_token_tis", "decoupled_k3_rs",
    "decoupled_k3_rs_token_tis", "seq-mask-tis", "areal_geo_is", "bypass_ppo_clip",
    "adaptive_k3_rs_token_tis")
"""The corrections the study trains (with a dense arm) in the regime, 5 seeds each; those
that pass the regime and the SmolLM2 screen also run in the walk where no stored run has
their parts."""
SMOL_BUDGETS = (64, 96, 128)
SMOL_MIN_ESS = 0.3
SMOL_MIN_KEPT = 0.5
LENGTHS_SEEDS = 5
CRITERIA = ("regime", "walk", "SmolLM2")


def resolved_parts(name: str) -> dict:
    """The parts the preset ``name`` resolves to (every part field of ``CorrectionConfig``)."""
    from sparse_rl_jax.rl.correction_presets import PARTS
    from sparse_rl_jax.rl.loss_config import CorrectionConfig
    cfg = CorrectionConfig(kind=name)
    return {part: getattr(cfg, part) for part in PARTS}


def walk_runs(settings: dict[str, Experiment | None], preset: str) -> tuple[list[dict], str]:
    """``preset``'s walk-regime runs and where they come from: ``LENGTHS_WALK``'s arm, else
    the issue-47 regime's arm whose stored preset has the same parts; ``([], "not run")``
    without either."""
    own = study_arm(settings[LENGTHS_WALK], preset) if settings.get(LENGTHS_WALK) else []
    if own:
        return own, LENGTHS_WALK
    stored = settings.get(WALK_STORED)
    if stored is not None:
        parts = resolved_parts(preset)
        for label in stored.arms():
            name = label.split()[0]
            if name != "dense" and label.split()[1:2] != ["none"] \
                    and resolved_parts(stored_preset(name)) == parts:
                return stored.arm(label), f"{WALK_STORED} as {name}"
    return [], "not run"


def trained(runs: list[dict], dense: list[dict], where: str) -> tuple[bool, str]:
    """Whether ``runs`` (one setting's seeds) have 0 collapsed and 0 degraded seeds, in words."""
    if not runs:
        return False, f"{where}: not run"
    collapsed, bad = sum(r["collapsed"] for r in runs), sum(degraded(runs, dense))
    return (collapsed == 0 and bad == 0,
            f"{where}: {collapsed}/{len(runs)} collapse, {bad}/{len(runs)} degrade")


def smol_screen(stats: dict[int, dict], preset: str) -> tuple[bool, str]:
    """Whether ``preset``'s SmolLM2 statistics (``{budget: budget<k>.json}``) hold Kish ESS
    >= ``SMOL_MIN_ESS`` and kept tokens >= ``SMOL_MIN_KEPT`` at every budget, in words."""
    ok, words = True, []
    for budget in SMOL_BUDGETS:
        row = stats.get(budget, {}).get("corrections", {}).get(preset)
        if row is None:
            ok = False
            words.append(f"{budget}: not measured")
            continue
        ess, kept = row["is_ess"], row["kept_token_fraction"]
        ok = ok and ess >= SMOL_MIN_ESS and kept >= SMOL_MIN_KEPT
        words.append(f"{budget}: ESS {ess:.2f}, kept {kept:.2f}")
    return ok, "SmolLM2 " + "; ".join(words)


def criteria(settings: dict[str, Experiment | None], dense: dict[str, list[dict]],
             stats: dict[int, dict], preset: str) -> tuple[tuple[bool, bool, bool], str]:
    """``preset``'s pass/fail on ``CRITERIA`` (regime, walk, SmolLM2) and the evidence."""
    regime = settings.get(LENGTHS_REGIME)
    in_regime = trained(study_arm(regime, preset) if regime else [],
                        dense.get(LENGTHS_REGIME, []), LENGTHS_REGIME)
    runs, where = walk_runs(settings, preset)
    in_walk = trained(runs, dense.get(where.split()[0], []), f"walk ({where})") if runs \
        else (False, "walk: not run")
    screen = smol_screen(stats, preset)
    passed = (in_regime[0], in_walk[0], screen[0])
    return passed, "; ".join(w for _, w in (in_regime, in_walk, screen))


def lengths_recommend(settings: dict[str, Experiment | None], dense: dict[str, list[dict]],
                      stats: dict[int, dict], presets: list[str], parts: dict[str, int]
                      ) -> dict:
    """The rule (module docstring) over ``presets``: ``dense`` maps a setting name
    (``LENGTHS_REGIME``, ``LENGTHS_WALK``, ``WALK_STORED``) to its dense reference runs;
    ``parts`` maps a preset to ``Preset.count()``. Returns the winner (``recommended``, which
    the default follows), whether any preset was eligible, the leader and the tied, and per
    preset its criteria, evidence and regime mean."""
    table = {p: criteria(settings, dense, stats, p) for p in presets}
    regime = settings.get(LENGTHS_REGIME)
    means = {p: mean_se(pass1(r, "dense") for r in study_arm(regime, p))[0]
             for p in presets if regime is not None and study_arm(regime, p)}
    eligible = [p for p in presets if all(table[p][0])]
    pool = eligible
    if not eligible:
        ranked = [p for p in presets if p in means]
        # the most criteria passed; among equal counts, regime before walk before SmolLM2
        best_criteria = max((table[p][0] for p in ranked), key=lambda c: (sum(c), c),
                            default=None)
        pool = [p for p in ranked if table[p][0] == best_criteria]
    out = {"eligible_any": bool(eligible), "criteria": table, "means": means,
           "recommended": None, "leader": None, "tied": []}
    if not pool:
        out["why"] = "no correction ran in the regime"
        return out
    leader = max(pool, key=lambda p: means[p])
    tied = [p for p in pool
            if p == leader or not beats(study_arm(regime, leader), study_arm(regime, p))[0]]
    best = min(tied, key=lambda p: (parts[p], -means[p]))
    passed = [c for c, ok in zip(CRITERIA, table[best][0]) if ok]
    why = ("eligible: passes the regime, the walk and SmolLM2's screen" if eligible else
           f"no correction is eligible; the best by the rule's order passes "
           f"{', '.join(passed) or 'no criterion'}")
    out.update(recommended=best, leader=leader, tied=tied,
               why=f"{why} (ties within {TIE_SE:g} SE go to the fewest parts)")
    return out
