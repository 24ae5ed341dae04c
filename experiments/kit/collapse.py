"""Collapse, defined before any run (issue 14), read from one run's per-step metrics: a run
collapses when, for at least a quarter of its steps in a row, its training reward (smoothed over
a tenth of the run) sits at least ``COLLAPSE_DROP`` below its peak while its truncated fraction
(smoothed alike) is at least ``COLLAPSE_TRUNCATION`` x its baseline (its first tenth) and at
least ``COLLAPSE_TRUNCATION_FLOOR``. An arm collapses when at least 2 of 3 seeds (2/3 of its
seeds) do."""

from __future__ import annotations

import numpy as np

COLLAPSE_DROP = 0.2
COLLAPSE_TRUNCATION = 3.0
COLLAPSE_TRUNCATION_FLOOR = 0.05


def collapse_steps(records: list[dict]) -> int:
    """The longest run of consecutive collapsed steps (see COLLAPSE_DROP) in one run."""
    steps = len(records)
    if not steps:
        return 0
    window = max(1, steps // 10)

    def smooth(key):
        values = np.array([r.get(key, np.nan) for r in records], float)
        return np.array([np.nanmean(values[max(0, i - window + 1):i + 1]) for i in range(steps)])

    reward, truncated = smooth("reward_mean"), smooth("truncated_fraction")
    baseline = truncated[window - 1]
    bad = ((reward <= np.nanmax(reward) - COLLAPSE_DROP)
           & (truncated >= max(COLLAPSE_TRUNCATION * baseline, COLLAPSE_TRUNCATION_FLOOR)))
    longest = current = 0
    for flag in bad:
        current = current + 1 if flag else 0
        longest = max(longest, current)
    return longest


def collapsed(records: list[dict]) -> bool:
    """Whether one run collapsed: ``collapse_steps`` spans at least a quarter of its steps."""
    return bool(records) and collapse_steps(records) >= max(1, len(records) // 4)
