"""The corrections study at real lengths (issue 53), laid out from its stored evidence: the
diffuse regime's runs (``docs/results/lengths_regime/``), the walk regime's
(``docs/results/lengths_walk/`` and the issue-47 runs of presets with the same parts), and
SmolLM2-135M's correction statistics (``docs/results/lengths_smol/budget<k>.json``). The rule
is ``lengths_rule.lengths_recommend``, fixed before any run of the regime; this module only
lays out what it and the evidence say, and which preset the shipped default must be."""

from __future__ import annotations

import json
from pathlib import Path

from experiments.kit.lengths_rule import (CRITERIA, LENGTHS_ARMS, LENGTHS_REGIME, LENGTHS_SEEDS,
                                          LENGTHS_WALK, SMOL_BUDGETS, SMOL_MIN_ESS,
                                          SMOL_MIN_KEPT, WALK_STORED, lengths_recommend,
                                          walk_runs)
from experiments.kit.results_corrections import setting_table
from experiments.kit.results_data import (RESULTS, Experiment, count, degraded, load, mean_se,
                                          pass1, provenance)
from experiments.kit.study_rule import TIE_SE, stored_preset, study_arm
from sparse_rl_jax.rl.correction_presets import CORRECTION_PRESETS

SMOL = "lengths_smol"
SETTINGS = (LENGTHS_REGIME, LENGTHS_WALK, WALK_STORED)


def load_lengths(root: Path = RESULTS) -> tuple[dict[str, Experiment | None], dict[int, dict]]:
    """The stored settings by name and SmolLM2's statistics by budget."""
    stats = {}
    for budget in SMOL_BUDGETS:
        path = root / SMOL / f"budget{budget}.json"
        if path.is_file():
            stats[budget] = json.loads(path.read_text())
    return {name: load(name, root) for name in SETTINGS}, stats


def dense_references(settings: dict[str, Experiment | None]) -> dict[str, list[dict]]:
    """Per setting, its dense-trained reference: its own dense arm where it covers every seed
    the setting ran, else (the walk settings share one config and seeds) the issue-47
    regime's."""
    stored = settings.get(WALK_STORED)
    fallback = stored.arm("dense") if stored else []
    out = {}
    for name, exp in settings.items():
        if exp is not None:
            own = exp.arm("dense")
            out[name] = own if own and len(own) == len(exp.seeds()) else fallback
    return out


def parts_of(preset: str) -> int:
    """How many parts ``preset`` switches on (``Preset.count``): the rule's tie-breaker."""
    return CORRECTION_PRESETS.get(stored_preset(preset)).count()


def outcome(settings: dict[str, Experiment | None], stats: dict[int, dict]) -> dict:
    """``lengths_recommend`` over ``LENGTHS_ARMS``, plus what is still missing for the outcome
    to be final (``missing``: words; empty when every arm has its seeds everywhere)."""
    out = lengths_recommend(settings, dense_references(settings), stats, list(LENGTHS_ARMS),
                            {p: parts_of(p) for p in LENGTHS_ARMS})
    regime = settings.get(LENGTHS_REGIME)
    missing = []
    if regime is None:
        missing.append(f"{LENGTHS_REGIME} not stored")
    else:
        short = [p for p in ("dense", *LENGTHS_ARMS) if len(_regime_runs(regime, p))
                 < LENGTHS_SEEDS]
        if short:
            missing.append(f"{LENGTHS_REGIME}: {len(short)} of {len(LENGTHS_ARMS) + 1} arms "
                           f"have fewer than {LENGTHS_SEEDS} seeds")
    absent = [b for b in SMOL_BUDGETS if b not in stats]
    if absent:
        missing.append(f"SmolLM2 statistics missing at {', '.join(map(str, absent))} slots")
    unwalked = [p for p in LENGTHS_ARMS if out["criteria"][p][0][0] and out["criteria"][p][0][2]
                and len(walk_runs(settings, p)[0]) < LENGTHS_SEEDS]
    if unwalked:
        missing.append("walk runs missing for " + ", ".join(f"`{p}`" for p in unwalked))
    return {**out, "missing": missing}


def _regime_runs(regime: Experiment, preset: str) -> list[dict]:
    return regime.arm("dense") if preset == "dense" else study_arm(regime, preset)


def shipped_default(settings: dict[str, Experiment | None], stats: dict[int, dict],
                    before: str) -> str:
    """The preset ``CorrectionConfig``'s default must be: the rule's winner once the evidence
    is complete, else ``before`` (the issue-47 study's outcome)."""
    out = outcome(settings, stats)
    return before if out["missing"] or out["recommended"] is None else out["recommended"]


def smol_table(stats: dict[int, dict]) -> str:
    """One row per study arm: its SmolLM2 ESS and kept-token fraction at every budget, and
    whether it passes the screen."""
    budgets = [b for b in SMOL_BUDGETS if b in stats]
    head = ("| correction | " + " | ".join(f"ESS / kept at {b}" for b in budgets)
            + f" | screen (ESS >= {SMOL_MIN_ESS:g}, kept >= {SMOL_MIN_KEPT:g}) |")
    lines = [head, "|" + "---|" * (len(budgets) + 2)]
    for preset in LENGTHS_ARMS:
        cells, ok = [], True
        for b in budgets:
            row = stats[b]["corrections"].get(preset)
            if row is None:
                cells.append("–")
                ok = False
                continue
            ess, kept = row["is_ess"], row["kept_token_fraction"]
            ok = ok and ess >= SMOL_MIN_ESS and kept >= SMOL_MIN_KEPT
            cells.append(f"{ess:.2f} / {kept:.2f}")
        word = "pass" if ok else "fail"
        if word == "pass" and len(budgets) < len(SMOL_BUDGETS):
            word = "pending (" + ", ".join(str(b) for b in SMOL_BUDGETS if b not in stats) \
                + " not measured)"
        lines.append(f"| `{preset}` | " + " | ".join(cells) + f" | {word} |")
    batches = "; ".join(
        f"{b} slots: k3 {stats[b]['batch']['mismatch_k3']:.3f}, "
        f"{stats[b]['batch']['response_length_mean']:.0f} tokens" for b in budgets)
    return "\n".join(lines + ["", f"Each budget is one fresh batch of "
                                  f"{stats[budgets[0]]['batch']['rows']} rows ({batches})."]) \
        if budgets else "No SmolLM2 statistics stored yet."


def walk_table(settings: dict[str, Experiment | None]) -> str:
    """Per study arm: where its walk-regime runs come from and their collapse/degrade
    counts against that setting's dense reference."""
    dense = dense_references(settings)
    lines = ["| correction | walk runs from | collapse | degrade |", "|---|---|---|---|"]
    for preset in LENGTHS_ARMS:
        runs, where = walk_runs(settings, preset)
        if not runs:
            lines.append(f"| `{preset}` | not run | – | – |")
            continue
        ref = dense.get(where.split()[0], [])
        lines.append(f"| `{preset}` | {where} | {count(r['collapsed'] for r in runs)} | "
                     f"{count(degraded(runs, ref))} |")
    return "\n".join(lines)


def verdict(settings: dict[str, Experiment | None], stats: dict[int, dict]) -> str:
    """The rule's outcome in words, flagged provisional while evidence is missing."""
    out = outcome(settings, stats)
    lines = []
    if out["missing"]:
        lines.append("- **Provisional** (" + "; ".join(out["missing"])
                     + "): the outcome below can still change, and the default does not move.")
    passes = {p: ", ".join(c for c, ok in zip(CRITERIA, out["criteria"][p][0]) if ok) or "none"
              for p in LENGTHS_ARMS}
    eligible = [p for p in LENGTHS_ARMS if all(out["criteria"][p][0])]
    lines.append("- Eligible (the regime, the walk and SmolLM2's screen): "
                 + (", ".join(f"`{p}`" for p in eligible) or "none") + ".")
    if out["recommended"] is None:
        return "\n".join(lines + [f"- {out['why']}."])
    if not eligible:
        lines.append("- Criteria passed: " + "; ".join(f"`{p}` {passes[p]}"
                                                       for p in LENGTHS_ARMS) + ".")
    lines += [f"- Highest mean held-out pass@1 in the regime among "
              f"{'them' if eligible else 'the best by the rule order'}: `{out['leader']}` "
              f"({out['means'][out['leader']]:.3f}); tied with it (seed-paired gap within "
              f"{TIE_SE:g} SE): {', '.join(f'`{p}`' for p in out['tied'])}.",
              f"- **By the rule: `{out['recommended']}`**: {out['why']}."]
    return "\n".join(lines)


def lengths_block(settings: dict[str, Experiment | None], stats: dict[int, dict]) -> str:
    """docs/results.md's block: the regime's table, the walk evidence, SmolLM2's screen and
    the rule's outcome."""
    text = []
    regime = settings.get(LENGTHS_REGIME)
    if regime is not None:
        seeds = len(regime.seeds())
        text += [f"#### The diffuse regime: R-KV 22 on `configs/walk/diffuse.yaml` ({seeds} "
                 f"seed{'' if seeds == 1 else 's'})", "", provenance(regime), "",
                 setting_table(regime, dense_references(settings)[LENGTHS_REGIME]), ""]
    own_walk = settings.get(LENGTHS_WALK)
    text += ["#### The walk regime: R-KV 32 on `walk_local2`", ""]
    if own_walk is not None:
        text += [provenance(own_walk), ""]
    text += [walk_table(settings), "", "#### SmolLM2-135M's R-KV rollouts (no training)", "",
             smol_table(stats), "", "#### The outcome", "", verdict(settings, stats)]
    return "\n".join(text)


def readme_table(settings: dict[str, Experiment | None], stats: dict[int, dict]) -> str:
    """README's short form: per study arm its parts, the diffuse regime's held-out pass@1
    and degraded seeds, the walk's degraded seeds, SmolLM2's lowest ESS over the budgets, and
    the criteria it passes."""
    dense = dense_references(settings)
    regime = settings.get(LENGTHS_REGIME)
    out = outcome(settings, stats)
    reference = dense.get(LENGTHS_REGIME, [])
    ref_mean, ref_se = mean_se(pass1(r, "dense") for r in reference) if reference else (0, 0)
    lines = [f"| correction | parts | diffuse regime: held-out pass@1 (dense-trained "
             f"{ref_mean:.3f} ± {ref_se:.3f}) | degraded there | degraded on the walk | "
             f"SmolLM2: lowest ESS / kept over {', '.join(map(str, SMOL_BUDGETS))} slots | "
             f"passes |", "|---|---|---|---|---|---|---|"]
    for preset in LENGTHS_ARMS:
        runs = study_arm(regime, preset) if regime else []
        mean, se = mean_se(pass1(r, "dense") for r in runs) if runs else (None, None)
        walk, where = walk_runs(settings, preset)
        rows = [stats[b]["corrections"].get(preset) for b in SMOL_BUDGETS if b in stats]
        rows = [r for r in rows if r]
        smol = (f"{min(r['is_ess'] for r in rows):.2f} / "
                f"{min(r['kept_token_fraction'] for r in rows):.2f}" if rows else "–")
        passed = ", ".join(c for c, ok in zip(CRITERIA, out["criteria"][preset][0]) if ok)
        lines.append(
            f"| `{preset}` | {parts_of(preset)} | "
            + (f"{mean:.3f} ± {se:.3f}" if runs else "not run") + " | "
            + (count(degraded(runs, reference)) if runs else "–") + " | "
            + (count(degraded(walk, dense.get(where.split()[0], []))) if walk else "not run")
            + f" | {smol} | {passed or 'none'} |")
    return "\n".join(lines + ["", verdict(settings, stats)])
