"""The walk experiments' sections of the results pages, from their stored runs: the per-arm
table, the regime's verdicts at seed resolution, each experiment's block, its per-seed curves,
the claim table and the commands that measured it."""

from __future__ import annotations

import numpy as np

from experiments.kit.reproduce_tables import reward_curve_table
from experiments.kit.results_data import (DEGRADED_BY, EARLY_STEPS, Experiment, cell, count,
                                          degraded, early_mean, pass1, provenance)
from experiments.kit.results_verdicts import NAIVE, SPARSE, collapse_definition, verdict_rows


def arm_table(exp: Experiment) -> str:
    """Per arm, seeds averaged (mean ± SE, per-seed values in brackets): training reward, the
    mismatch statistics, collapse and degradation counts, held-out accuracy."""
    head = ("| arm | reward first → last quarter | rejection | seq r<1e-4 | grad share r<1e-4, "
            f"first {EARLY_STEPS} steps | mismatch k3 | truncated | KV saved | collapsed | "
            f"degraded (> {DEGRADED_BY} below dense) | pass@1 dense | pass@1 own compression |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    dense = exp.arm("dense")
    for label in exp.arms():
        runs = exp.arm(label)
        mean = lambda key: np.mean([r[key] for r in runs])  # noqa: E731
        share = [early_mean(r, "low_r_grad_share") for r in runs]
        own = runs[0]["own_eval"]
        lines.append(
            f"| {label} | {mean('reward_first'):.2f} → {cell(r['reward_last'] for r in runs)} | "
            f"{mean('rejection_rate'):.3f} | {mean('low_r_sequence_fraction'):.3f} | "
            f"{'–' if np.isnan(share).any() else cell(share)} | {mean('mismatch_k3'):.3f} | "
            f"{mean('truncated_fraction'):.3f} | {mean('kv_token_savings'):.2f} | "
            f"{count(r['collapsed'] for r in runs)} | "
            f"{'–' if label == 'dense' or not dense else count(degraded(runs, dense))} | "
            f"{cell(pass1(r, 'dense') for r in runs)} | "
            f"{'–' if own == 'dense' else cell(pass1(r, own) for r in runs)} |")
    return "\n".join(lines)


def seed_verdicts(exp: Experiment) -> str:
    """The regime's verdicts at seed resolution (issue 41's targets)."""
    naive, sparse, dense = exp.arm(NAIVE), exp.arm(SPARSE), exp.arm("dense")
    lines = [f"- naive R-KV 32 collapses in {count(r['collapsed'] for r in naive)} seeds; "
             f"Sparse-RL R-KV 32 in {count(r['collapsed'] for r in sparse)}.",
             f"- Sparse-RL's held-out dense pass@1: {cell(pass1(r, 'dense') for r in sparse)}; "
             f"dense training's {cell(pass1(r, 'dense') for r in dense)}."]
    lines.append(f"- Seeds that degrade (held-out dense pass@1 more than {DEGRADED_BY} below the "
                 "dense-trained policy of the same seed):")
    for label in exp.arms():
        if label == "dense":
            continue
        runs = exp.arm(label)
        flags = degraded(runs, dense)
        which = [str(r["seed"]) for r, bad in zip(runs, flags) if bad]
        lines.append(f"  - {label}: {count(flags)}" + (f" (seed {', '.join(which)})" if which
                                                        else ""))
    return "\n".join(lines)


def experiment_block(exp: Experiment) -> str:
    """An experiment's block: its provenance, the arm table (with the verdicts at seed
    resolution for the regime) and the reward over spans of the steps."""
    text = [provenance(exp), "", arm_table(exp)]
    if exp.name == "regime":
        text += ["", "Verdicts at seed resolution:", "", seed_verdicts(exp)]
    text += ["", reward_curve_table(curves(exp))]
    return "\n".join(text)


def curves(exp: Experiment) -> dict[str, list[list[dict]]]:
    """Per arm, each seed's per-step records (reproduce.py's curve format)."""
    return {label: [[{"step": i + 1, **{k: v[i] for k, v in r["steps"].items()
                                         if v[i] is not None}}
                     for i in range(len(r["steps"]["reward_mean"]))] for r in exp.arm(label)]
            for label in exp.arms()}


def verdict_table(regime: Experiment, others: dict[str, Experiment | None], page_dir: str
                  ) -> str:
    """The claim table; links are written relative to the page's folder (``page_dir``)."""
    lines = ["| paper claim | verdict here | evidence, or why not testable |", "|---|---|---|"]
    for claim, verdict, evidence in verdict_rows(regime, others):
        evidence = evidence.replace("](docs/", f"]({page_dir}")
        lines.append(f"| {claim} | {verdict} | {evidence} |")
    n = len(regime.seeds())
    return "\n".join([f"Means ± standard error over {n} seeds, per-seed values in brackets "
                      f"(commit `{regime.parts[0]['commit']}`, {regime.parts[0]['date']}). "
                      f"Collapse, defined before any run: {collapse_definition()}.", "",
                      *lines])


def commands(exp: Experiment) -> str:
    """The commands that measured ``exp``, one per part, as a bash block."""
    return "```bash\n" + "\n".join(p["command"] for p in exp.parts) + "\n```"

