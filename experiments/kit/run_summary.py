"""One run's summary in ``results.json`` (``experiments/reproduce.py``) from its per-step
metrics: the compared metrics' means, collapse, and the per-step curves; and the step-by-step
mean of several seeds' runs."""

from __future__ import annotations

import math

from experiments.kit.collapse import collapsed

COMPARE_KEYS = ("reward_mean", "rejection_rate", "clip_fraction", "mismatch_k3",
                "repetition_fraction", "kv_token_savings", "kv_peak_savings",
                "response_length_mean", "token_mask_fraction", "truncated_fraction",
                "low_r_sequence_fraction", "low_r_grad_share", "entropy_estimate",
                "mismatch_k3_from_quant", "mismatch_k3_from_eviction", "is_ess",
                "kept_token_fraction")


def summarize(records: list[dict], tail: int) -> dict:
    """Means over the first and the last ``tail`` steps of a run's metrics (reward), and
    over the whole run (everything else)."""
    def mean(rows, key):
        return exact_mean([r[key] for r in rows if key in r])
    first, last = records[:tail], records[-tail:]
    return {
        "reward_first": mean(first, "reward_mean"), "reward_last": mean(last, "reward_mean"),
        "collapsed": collapsed(records),
        **{key: mean(records, key) for key in COMPARE_KEYS if key != "reward_mean"},
    }


def step_curves(records: list[dict]) -> dict[str, list[float | None]]:
    """Per-step values of every compared metric a run logged (None where a step lacks it),
    kept in results.json so tables of curves are generated from it, not from run dirs."""
    keys = [key for key in COMPARE_KEYS if any(key in r for r in records)]
    return {key: [None if r.get(key) is None else round(float(r[key]), 6) for r in records]
            for key in keys}


def mean_records(runs: list[list[dict]]) -> list[dict]:
    """Step-by-step means of several runs' metrics (the steps the runs share); exactly
    rounded sums (``math.fsum``: Python 3.12's ``sum`` compensates, 3.11's does not, and a
    mean on a rounding boundary then prints differently in the stored tables)."""
    return [{"step": steps[0]["step"],
             **{key: math.fsum(step[key] for step in steps) / len(steps) for key in COMPARE_KEYS
                if all(key in step for step in steps)}} for steps in zip(*runs)]


def exact_mean(values: list[float]) -> float:
    """The mean (an exactly rounded sum, as in ``mean_records``), NaN for no values."""
    return math.fsum(values) / len(values) if values else float("nan")
