"""The walk experiment's markdown tables (``experiments/reproduce.py``'s ``results.md``, and the
full output pages): training statistics per arm, pass@1 under every inference mode, and the
reward over spans of the steps."""

from __future__ import annotations

import numpy as np

from experiments.kit.results_data import cell, pass1
from experiments.kit.run_summary import exact_mean, mean_records


def _optional(value: float) -> str:
    """A metric only some arms log: the value, or a dash where it is NaN (not logged)."""
    return "–" if np.isnan(value) else f"{value:.3f}"


def _by_arm(results: list[dict], per_seed: bool) -> list[tuple[str, list[dict]]]:
    """Results grouped by arm in first-seen order (one group per arm and seed if per_seed)."""
    groups: dict[str, list[dict]] = {}
    for r in results:
        groups.setdefault(f"{r['arm']} | {r['seed']}" if per_seed else r["arm"], []).append(r)
    return list(groups.items())


def training_table(results: list[dict], per_seed: bool = False) -> str:
    """Markdown table of the training statistics (means over the run) and the final policy's
    greedy accuracy dense and under its own compression. Seeds are averaged (per-seed values
    in brackets for the reward and the accuracies) unless ``per_seed``."""
    digits = 3 if per_seed else 2
    head = ("| arm | " + ("seed | " if per_seed else "")
            + "reward first→last quarter | rejection | tok masked | clip frac | mismatch k3 | "
            "repetition | truncated | seq r<1e-4 | grad share r<1e-4 | collapsed | "
            "KV saved mean / peak | "
            "eval pass@1 dense | eval pass@1 own sparse |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, rows in _by_arm(results, per_seed):
        col = lambda key: exact_mean([r[key] for r in rows])  # noqa: E731
        own = [pass1(r, r["own_eval"]) for r in rows]
        lines.append(
            f"| {name} | {exact_mean([r['reward_first'] for r in rows]):.3f} → "
            f"{cell([r['reward_last'] for r in rows], digits)} | {col('rejection_rate'):.3f} | "
            f"{col('token_mask_fraction'):.3f} | {col('clip_fraction'):.4f} | "
            f"{col('mismatch_k3'):.3f} | {col('repetition_fraction'):.3f} | "
            f"{col('truncated_fraction'):.3f} | {col('low_r_sequence_fraction'):.3f} | "
            f"{_optional(col('low_r_grad_share'))} | "
            f"{sum(r.get('collapsed', False) for r in rows)}/{len(rows)} | "
            f"{col('kv_token_savings'):.3f} / {col('kv_peak_savings'):.3f} | "
            f"{cell([pass1(r, 'dense') for r in rows], digits)} | "
            f"{cell(own, digits) if rows[0]['own_eval'] != 'dense' else '–'} |")
    return "\n".join(lines)


def reward_curve_table(curves: dict[str, list[list[dict]]], blocks: int = 4) -> str:
    """Markdown table: mean reward over each of ``blocks`` equal spans of the steps per arm
    (seeds averaged), so a late drift or collapse shows in numbers, not only in the plots."""
    lines = [f"| arm | reward over {blocks} spans of the steps (seed mean) |", "|---|---|"]
    for label, runs in curves.items():
        steps = mean_records(runs)
        spans = [chunk for chunk in np.array_split(np.arange(len(steps)), blocks) if chunk.size]
        means = [exact_mean([steps[i]["reward_mean"] for i in chunk]) for chunk in spans]
        lines.append(f"| {label} | " + " → ".join(f"{m:.3f}" for m in means) + " |")
    return "\n".join(lines)


def inference_table(results: list[dict]) -> str:
    """Markdown table: greedy pass@1 (mean over seeds) of every final policy under dense
    inference and under every sparse setting; avg@k in brackets."""
    modes = [e["mode"] for e in results[0]["eval"]]
    lines = ["| policy \\ inference | " + " | ".join(modes) + " |",
             "|" + "---|" * (len(modes) + 1)]
    for name, rows in _by_arm(results, per_seed=False):
        cells = []
        for mode in modes:
            evals = [next(e for e in r["eval"] if e["mode"] == mode) for r in rows]
            cells.append(f"{exact_mean([e['pass_at_1'] for e in evals]):.3f} "
                         f"({exact_mean([e['avg_at_k'] for e in evals]):.3f})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)

