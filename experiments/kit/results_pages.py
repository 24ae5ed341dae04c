#!/usr/bin/env python
"""Writes the walk experiments' tables into docs/results.md and the README's Results section
from their stored outputs, so no result number is copied by hand.

Each experiment's outputs are ``docs/results/<name>/*.json``: verbatim copies of the
``results.json`` that ``experiments/reproduce.py`` wrote, one per call (an experiment may run
as several calls, e.g. one per group of seeds). Every table says the commit, date, machine
and command that produced it. The pages hold the generated text between
``<!-- results_page:BLOCK -->`` and ``<!-- /results_page:BLOCK -->`` markers; what lies
outside them is prose, and carries no measured number.

  python experiments/results_page.py           # rewrite the generated blocks (and curves)
  python experiments/results_page.py --check   # exit 1 when a page is stale
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from experiments.kit.budget_plots import plot_by_budget  # noqa: E402
from experiments.kit.reproduce_tables import (inference_table, reward_curve_table,  # noqa: E402
                                              training_table)
from experiments.kit.run_summary import mean_records  # noqa: E402
from experiments.kit import results_correction_stats  # noqa: E402
from experiments.kit.results_async import lag_table, regime_check  # noqa: E402
from experiments.kit.results_corrections import (STUDY_SETTINGS, dense_reference,  # noqa: E402
                                                 load_study, plot_rewards, recommendation,
                                                 setting_table, study_block)
from experiments.kit.results_quant import quant_table  # noqa: E402
from experiments.kit.results_data import (DEGRADED_BY, EARLY_STEPS, Experiment, cell,  # noqa: E402
                                          count, degraded, early_mean, load, pass1, provenance)
from experiments.kit.results_verdicts import (NAIVE, SPARSE, collapse_definition,  # noqa: E402
                                              verdict_rows)

COMMAND = "python experiments/results_page.py"
README, RESULTS_PAGE = ROOT / "README.md", ROOT / "docs" / "results.md"
EXPERIMENTS = ("regime", "local40", "control", "async", "quant")
"""The stored experiments (``docs/results/<name>/``): R-KV 32 on walk_local2 with its
positive control; R-KV 40 on walk_local; the positive control on walk_ft; the regime under
lag (async mode); the regime on quantized KV."""
FIGURES = {"regime": {"budget32": "regime_walk.png", "control": "regime_walk_control.png"},
           "local40": {"budget40": "local_walk.png"}, "control": {"control": "control_walk.png"},
           "async": {"budget32": "async_walk.png"}, "quant": {"budget32": "quant_walk.png"}}
FULL_PAGES = {"regime": "regime_walk_results.md", "local40": "local_walk_results.md",
              "control": "control_walk_results.md", "async": "async_walk_results.md",
              "quant": "quant_walk_results.md"}
MARK = re.compile(r"(<!-- results_page:(?P<name>[\w-]+) -->\n)(?P<body>.*?)"
                  r"(<!-- /results_page:(?P=name) -->)", re.DOTALL)


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
    return "```bash\n" + "\n".join(p["command"] for p in exp.parts) + "\n```"


def blocks() -> dict[str, str]:
    """Every generated block's text by name (experiments without stored runs are left out)."""
    stored = {name: load(name) for name in EXPERIMENTS}
    out = {name: experiment_block(exp) for name, exp in stored.items()
           if exp is not None and name not in ("async", "quant")}
    regime = stored["regime"]
    if stored["async"] is not None:
        exp = stored["async"]
        dense = [r for r in regime.arm("dense") if r["seed"] in exp.seeds()] if regime else []
        out["async"] = "\n".join([provenance(exp), "", lag_table(exp, dense), "",
                                   regime_check(exp, regime), "",
                                   reward_curve_table(curves(exp))])
    if stored["quant"] is not None and regime is not None:
        exp = stored["quant"]
        out["quant"] = "\n".join([provenance(exp), "", quant_table(exp, regime), "",
                                   reward_curve_table(curves(exp))])
    study = load_study()
    if study[STUDY_SETTINGS[0]] is not None:
        out["corrections"] = study_block(study)
        out["corrections-readme"] = "\n".join([
            setting_table(study[STUDY_SETTINGS[0]], dense_reference(study)[STUDY_SETTINGS[0]]),
            "", recommendation(study)])
    corrections = results_correction_stats.load()
    if corrections:
        out["correction-stats"] = results_correction_stats.block(corrections)
    if regime is not None:
        out["verdicts-readme"] = verdict_table(regime, stored, "docs/")
        out["verdicts"] = verdict_table(regime, stored, "")
        out["regime-commands"] = commands(regime)
    return out


def full_page(exp: Experiment) -> str:
    """An experiment's full output page: reproduce.py's own tables over the stored runs."""
    runs = list(exp.runs)
    return "\n\n".join([f"# Full output: the `{exp.name}` walk experiment",
                        f"Generated by `{COMMAND}` from `docs/results/{exp.name}/`.",
                        provenance(exp), training_table(runs), inference_table(runs),
                        reward_curve_table(curves(exp)), training_table(runs, per_seed=True)]
                       ) + "\n"


def fill(text: str, generated: dict[str, str], page: Path) -> str:
    """``text`` with each marked block replaced; a marker naming no block is an error."""
    def body(match):
        name = match["name"]
        if name not in generated:
            raise KeyError(f"{page.relative_to(ROOT)}: block '{name}' has no stored results "
                           f"(docs/results/ lacks them, or the name is wrong)")
        return match[1] + generated[name] + "\n" + match[4]
    return MARK.sub(body, text)


def pages() -> dict[Path, str]:
    """Every generated page's new text by path."""
    generated = blocks()
    out = {page: fill(page.read_text(), generated, page) for page in (README, RESULTS_PAGE)}
    for name, file in FULL_PAGES.items():
        exp = load(name)
        if exp is not None:
            out[ROOT / "docs" / file] = full_page(exp)
    return out


def write_plots() -> None:
    """Each stored experiment's seed-mean summary figure (reproduce.py's), as ``FIGURES``
    names it: the compressed arms of its budget with dense, and the control arms with dense."""
    for name, figures in FIGURES.items():
        exp = load(name)
        if exp is None:
            continue
        with tempfile.TemporaryDirectory() as work:
            # "<kind> <method> <budget>[ lag <k> | <quant>]" (and "<kind> none <quant>")
            budgets = sorted({int(a.split()[2]) for a in exp.arms() if "control" not in a
                              and a != "dense" and a.split()[2].isdigit()})
            plot_by_budget([(label, mean_records(runs)) for label, runs in curves(exp).items()],
                           budgets, Path(work))
            for folder, file in figures.items():
                summary = Path(work) / folder / "compare_summary.png"
                if summary.is_file():
                    shutil.copyfile(summary, ROOT / "docs" / file)


def write_study_plot() -> None:
    """The corrections study's reward curves (``docs/corrections_study.png``)."""
    plot_rewards(load_study(), ROOT / "docs" / "corrections_study.png")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 when a page differs from docs/results/")
    parser.add_argument("--no-plots", action="store_true", help="skip the curve figures")
    args = parser.parse_args(argv)
    new = pages()
    if args.check:
        stale = [page for page, text in new.items()
                 if not page.is_file() or page.read_text() != text]
        for page in stale:
            print(f"{page.relative_to(ROOT)} is stale: run `{COMMAND}`", file=sys.stderr)
        return 1 if stale else 0
    for page, text in new.items():
        page.write_text(text)
    if not args.no_plots:
        write_plots()
        write_study_plot()
    return 0


if __name__ == "__main__":
    sys.exit(main())
