"""The corrections study's tables, figure and recommendation (issue 47), from its stored runs
(``docs/results/corrections_<setting>/*.json``, each one ``experiments/reproduce.py
--corrections ...`` call's ``results.json``). The rule is ``study_rule.recommend``,
fixed before the runs; this module only lays out what it and the runs say."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from experiments.kit.results_data import (DEGRADED_BY, EARLY_STEPS, Experiment, cell, count,
                                          degraded, early_mean, load, pass1, provenance)
from experiments.kit.study_rule import (STUDY_DEFAULT, STUDY_SEEDS, STUDY_SETTINGS, TIE_SE,
                                         recommend, stored_preset, study_arm)
from sparse_rl_jax.rl.correction_presets import CORRECTION_PRESETS
from sparse_rl_jax.rl.loss_config import CorrectionConfig

STACKED = ("corrections_int4", "corrections_lag2")
"""The best three stacked with int4 KV and with an async lag of 2 (3 seeds each)."""
WHERE = {"corrections_regime": "the regime: R-KV 32 on `walk_local2`",
         "corrections_local40": "outside the regime: R-KV 40 on `walk_local`",
         "corrections_control": "the positive control: q = 10% on `walk_local2`'s dense "
                                "rollouts (its dense-trained reference is the regime's)",
         "corrections_int4": "the regime on int4 KV (`compression.quant=int4`)",
         "corrections_lag2": "the regime in async mode at lag 2 (`trainer.max_lag=2`)"}


def presets_of(exp: Experiment) -> list[str]:
    """The correction presets that ran in ``exp``, in run order (arm labels start with the
    preset's name)."""
    return list(dict.fromkeys(label.split()[0] for label in exp.arms() if label != "dense"))


def dense_reference(stored: dict[str, Experiment | None]) -> dict[str, list[dict]]:
    """Per setting, the dense-trained runs its arms are measured against: its own dense arm
    where it ran on every seed of the setting, else the regime's (the control and stacked
    settings share its config, and a dense run repeats bit for bit)."""
    regime = stored.get(STUDY_SETTINGS[0])
    fallback = regime.arm("dense") if regime else []
    return {name: (own if len(own := exp.arm("dense")) == len(exp.seeds()) else fallback)
            for name, exp in stored.items() if exp}


def _own_dense(exp: Experiment, dense: list[dict]) -> bool:
    """Whether ``dense``, a setting's reference, is the setting's own dense arm (a table row
    and a curve of its own) rather than the regime's."""
    return bool(dense) and dense == exp.arm("dense")


def _fraction_of_dense(runs: list[dict], dense: list[dict]) -> list[float]:
    ref = {r["seed"]: pass1(r, "dense") for r in dense}
    return [pass1(r, "dense") / ref[r["seed"]] for r in runs]


def _run_mean(runs: list[dict], key: str) -> str:
    values = [r.get(key) for r in runs]
    return "–" if any(v is None for v in values) else cell(values, 3)


def setting_table(exp: Experiment, dense: list[dict]) -> str:
    """One row per correction: collapse and degrade counts, held-out dense pass@1, its
    fraction of the dense-trained policy's, pass@1 under the arm's own compression, and the
    run means of the rejection rate, kept tokens, ESS, mismatch and the early low-r
    gradient share."""
    head = (f"| correction | parts | collapse | degrade (> {DEGRADED_BY} below dense) | "
            "held-out pass@1 (dense inference) | % of dense | pass@1 own compression | "
            "rejected sequences | kept tokens | ESS | mismatch k3 | "
            f"grad share r<1e-4, first {EARLY_STEPS} steps |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    if _own_dense(exp, dense):
        lines.append(f"| dense training | – | {count(r['collapsed'] for r in dense)} | – | "
                     f"{cell(pass1(r, 'dense') for r in dense)} | 100% | – | – | – | – | – | – |")
    for preset in presets_of(exp):
        runs = study_arm(exp, preset)
        own = runs[0]["own_eval"]
        share = [early_mean(r, "low_r_grad_share") for r in runs]
        lines.append(
            f"| `{preset}` | {CORRECTION_PRESETS.get(stored_preset(preset)).count()} | "
            f"{count(r['collapsed'] for r in runs)} | {count(degraded(runs, dense))} | "
            f"{cell([pass1(r, 'dense') for r in runs], 3)} | "
            f"{100 * np.mean(_fraction_of_dense(runs, dense)):.0f}% | "
            f"{'–' if own == 'dense' else cell((pass1(r, own) for r in runs), 3)} | "
            f"{_run_mean(runs, 'rejection_rate')} | {_run_mean(runs, 'kept_token_fraction')} | "
            f"{_run_mean(runs, 'is_ess')} | {_run_mean(runs, 'mismatch_k3')} | "
            f"{'–' if np.isnan(share).any() else cell(share, 3)} |")
    return "\n".join(lines)


def study_outcome(stored: dict[str, Experiment]) -> tuple[list[str], dict]:
    """The presets the study ran and ``study_rule.recommend``'s outcome over them."""
    presets = presets_of(stored[STUDY_SETTINGS[0]])
    parts = {p: CORRECTION_PRESETS.get(stored_preset(p)).count() for p in presets}
    return presets, recommend(stored, dense_reference(stored), presets, parts)


def recommendation(stored: dict[str, Experiment | None]) -> str:
    """The rule's outcome in words, or why it cannot be computed yet."""
    missing = [name for name in STUDY_SETTINGS if stored.get(name) is None]
    if missing:
        return (f"**Not decided yet**: the rule needs all three settings; "
                f"{', '.join(missing)} not stored.")
    presets, out = study_outcome(stored)
    eligible = [p for p in presets if out["eligible"][p][0]]
    lines = [f"- Eligible (0 collapse and 0 degrade in all three settings): "
             f"{', '.join(f'`{p}`' for p in eligible) or 'none'}."]
    short = {name: len(stored[name].seeds()) for name in STUDY_SETTINGS
             if len(stored[name].seeds()) < STUDY_SEEDS}
    if short:
        lines.insert(0, "- **Provisional**: " + ", ".join(
            f"{name} has {k} of {STUDY_SEEDS} seeds" for name, k in short.items())
            + "; the outcome below can still change.")
    if out["recommended"] is None:
        return "\n".join(lines + [f"- {out['why']}."])
    lines += [f"- Highest mean held-out pass@1 in the regime among them: `{out['leader']}` "
              f"({out['means'][out['leader']]:.3f}); tied with it (its seed-paired gap within "
              f"{TIE_SE:g} SE): {', '.join(f'`{p}`' for p in out['tied'])}.",
              f"- **Recommended: `{out['recommended']}`** (the fewest parts among the tied).",
              f"- This study's default (shipped until the study at real lengths) is "
              f"**`{out['default']}`**: {out['why']}." if not short else
              f"- The shipped default stays `{STUDY_DEFAULT}` until every setting has its seeds; "
              f"by the rule so far it would be `{out['default']}`: {out['why']}."]
    return "\n".join(lines)


def study_block(stored: dict[str, Experiment | None]) -> str:
    """docs/results.md's block: the provenance, one table per stored setting, the rule's
    outcome."""
    dense = dense_reference(stored)
    text = []
    for name in (*STUDY_SETTINGS, *STACKED):
        exp = stored.get(name)
        if exp is None:
            continue
        seeds = len(exp.seeds())
        text += [f"#### {WHERE[name][0].upper()}{WHERE[name][1:]} "
                 f"({seeds} seed{'' if seeds == 1 else 's'})",
                 "", provenance(exp), "", setting_table(exp, dense[name]), ""]
    return "\n".join(text + ["#### The recommendation", "", recommendation(stored)])


def load_study() -> dict[str, Experiment | None]:
    """Every stored setting of the study, None where it has no runs yet."""
    return {name: load(name) for name in (*STUDY_SETTINGS, *STACKED)}


def plot_rewards(stored: dict[str, Experiment | None], path: Path, window: int = 8) -> None:
    """One panel per stored setting: each correction's training reward (seed mean, trailing
    mean over ``window`` steps) against the step; dashed: the ratio anchored on the sampler
    (``anchor: behaviour``)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    shown = [(name, exp) for name, exp in stored.items() if exp is not None]
    if not shown:
        return
    fig, axes = plt.subplots(1, len(shown), figsize=(5.5 * len(shown), 4.2), squeeze=False)
    names = list(dict.fromkeys(label.split()[0] for _, exp in shown for label in exp.arms()))
    colors = {name: plt.cm.tab20(i % 20) for i, name in enumerate(names)}
    dense, handles = dense_reference(stored), {}
    for ax, (name, exp) in zip(axes[0], shown):
        for key in ["dense"] * _own_dense(exp, dense[name]) + presets_of(exp):
            runs = dense[name] if key == "dense" else study_arm(exp, key)
            curves = np.array([r["steps"]["reward_mean"] for r in runs], float)
            mean = curves.mean(axis=0)
            smooth = [mean[max(0, i - window + 1):i + 1].mean() for i in range(len(mean))]
            behaviour = (key in CORRECTION_PRESETS.names()
                         and CorrectionConfig(kind=key).anchor == "behaviour")
            handles[key], = ax.plot(np.arange(1, len(mean) + 1), smooth, label=key,
                                    color=colors[key], ls="--" if behaviour else "-",
                                    lw=2.4 if key in ("dense", "sparse_rl") else 1.3)
        ax.set_title(WHERE[name].split(":")[0], fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel("training reward (seed mean)")
    axes[0][0].legend(handles=list(handles.values()), fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
