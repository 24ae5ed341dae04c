"""The walk experiment on quantized KV (issue 40): naive and Sparse-RL training on rollouts
whose cache is quantized (``compression.quant``), alone (a dense cache of that level) and
stacked on the regime's R-KV 32, from the stored ``docs/results/quant/`` runs
(``experiments/reproduce.py --quants``). Plain functions over the loaded runs; no JAX.

Each arm is paired, seed by seed, with the same arm without quantization from the regime
experiment (same config and warm start): ``<kind> rkv 32 <level>`` with ``<kind> rkv 32``,
and ``<kind> none <level>`` with dense training (a full-precision dense cache).
"""

from __future__ import annotations

import numpy as np

from experiments.kit.results_data import (DEGRADED_BY, Experiment, cell, count, degraded,
                                          paired_gap, pass1, verdict)

WITHIN = 0.03
"""The target: Sparse-RL on R-KV 32 + int8 within this held-out pass@1 of Sparse-RL on R-KV
32 without quantization (read as "no worse by more than this")."""
TARGET = "sparse-rl rkv 32 int8"


def reference_label(label: str) -> str:
    """The regime arm an arm is paired with: its label without the level, or ``dense`` for
    quantization alone."""
    words = label.split(" ")
    return "dense" if words[1] == "none" else " ".join(words[:-1])


def _mean(runs: list[dict], key: str) -> str:
    values = [r[key] for r in runs if key in r and r[key] == r[key]]  # NaN: not logged
    return f"{np.mean(values):.4f}" if values else "–"


def quant_table(exp: Experiment, regime: Experiment) -> str:
    """Per arm: collapse and degradation counts, held-out dense pass@1, the mismatch the
    rollouts carried (the whole, and each source alone where split), the rejection rate, and
    the paired gap to the same arm without quantization, with the target's verdict."""
    dense = regime.arm("dense")
    head = ("| arm | collapsed / degraded | pass@1 dense | mismatch k3 | k3 from quantization | "
            "k3 from eviction | rejection | minus the same arm unquantized, paired | "
            f"verdict (no worse by > {WITHIN}) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for label in exp.arms():
        runs = exp.arm(label)
        seeds = {r["seed"] for r in runs}
        reference = [r for r in regime.arm(reference_label(label)) if r["seed"] in seeds]
        gap = paired_gap(runs, reference) if len(reference) == len(runs) else []
        bad = count(degraded(runs, [r for r in dense if r["seed"] in seeds]))
        lines.append(
            f"| {label} | {count(r['collapsed'] for r in runs)} / {bad} | "
            f"{cell(pass1(r, 'dense') for r in runs)} | {_mean(runs, 'mismatch_k3')} | "
            f"{_mean(runs, 'mismatch_k3_from_quant')} | "
            f"{_mean(runs, 'mismatch_k3_from_eviction')} | "
            f"{_mean(runs, 'rejection_rate')} | {cell(gap, 3) if gap else '–'} | "
            f"{verdict(gap, WITHIN, 'quantized') if gap and label == TARGET else '–'} |")
    note = (f"Degraded: held-out dense pass@1 more than {DEGRADED_BY} below dense training of "
            "the same seed (the regime experiment's dense arm). The split by source (the "
            "sampler against its replay with one source removed, on each step's first 4 rows: "
            "`training/mismatch_sources.py`) needs the eviction record, so quantization alone "
            "has only the whole; a dash where the runs did not log it.")
    return "\n".join(lines + ["", note])
