"""PNG plots of training metrics: one run, or several runs overlaid for comparison.

Records are the dicts of ``metrics.jsonl`` (``{"step": s, name: float, ...}``). Each metric
gets its own PNG plus a combined grid; metrics absent from every record are skipped, records
missing a metric (or holding a non-finite value) leave a gap. Rendering uses matplotlib's Agg
canvas directly (no pyplot, no display needed).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # matplotlib is imported where a plot is drawn: importing the trainer
    from matplotlib.axes import Axes  # does not pay for it (0.6 s)

# Metric names as emitted by rollout_metrics / corrections / grpo_loss, with panel titles.
DEFAULT_PLOT_KEYS: tuple[str, ...] = (
    "reward_mean",
    "response_length_mean",
    "rejection_rate",
    "clip_fraction",
    "mismatch_k3",
    "kv_token_savings",
    "alpha_p5",
    "eval/dense_pass_at_1",
    "eval/sparse_pass_at_1",
    "eval/dense_avg_at_k",
    "eval/sparse_avg_at_k",
)
TITLES: dict[str, str] = {
    "reward_mean": "Reward (mean)",
    "response_length_mean": "Response length (tokens)",
    "rejection_rate": "Rejection rate (sequences)",
    "clip_fraction": "PPO clip fraction",
    "mismatch_k3": "Mismatch KL (k3 of dense/sparse ratio)",
    "kv_token_savings": "KV token savings",
    "alpha_p5": "Acceptance alpha, 5th percentile (sparse vs dense)",
    "eval/dense_pass_at_1": "Eval pass@1, dense (greedy)",
    "eval/sparse_pass_at_1": "Eval pass@1, sparse (greedy)",
    "eval/dense_avg_at_k": "Eval avg@k, dense (sampled)",
    "eval/sparse_avg_at_k": "Eval avg@k, sparse (sampled)",
}
YLABELS: dict[str, str] = {
    "reward_mean": "mean reward per sequence",
    "response_length_mean": "tokens",
    "rejection_rate": "fraction of sequences",
    "clip_fraction": "fraction of tokens",
    "mismatch_k3": "nats per token",
    "kv_token_savings": "fraction of dense KV tokens saved",
    "alpha_p5": "sum_x min(p_sparse, p_dense)",
}

Records = Sequence[Mapping[str, Any]]


def _series(records: Records, key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of ``key``; non-finite values become NaN so the line breaks."""
    steps, values = [], []
    for index, record in enumerate(records):
        if key in record and record[key] is not None:
            value = float(record[key])
            steps.append(record.get("step", index))
            values.append(value if math.isfinite(value) else math.nan)
    return np.asarray(steps, dtype=float), np.asarray(values, dtype=float)


def moving_average(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over up to ``window`` finite values ending at each index (NaNs skipped)."""
    if window < 1:
        raise ValueError(f"smoothing window must be >= 1, got {window}")
    finite = np.isfinite(values)
    sums = np.cumsum(np.where(finite, values, 0.0))
    counts = np.cumsum(finite)
    lag_sums = np.concatenate([np.zeros(window), sums[:-window]])[: len(values)]
    lag_counts = np.concatenate([np.zeros(window), counts[:-window]])[: len(values)]
    n = counts - lag_counts
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 0, (sums - lag_sums) / np.maximum(n, 1), np.nan)


def _draw(ax: Axes, runs: Sequence[tuple[str, Records]], key: str, smooth: int) -> None:
    """Plot ``key`` of every run that has it on ``ax``."""
    for color_index, (label, records) in enumerate(runs):
        steps, values = _series(records, key)
        if steps.size == 0:
            continue
        color = f"C{color_index}"  # a run keeps its colour in every panel
        marker = "." if steps.size < 50 else None  # keep isolated points visible
        if smooth > 1:
            raw = "raw" if label is None else None
            ax.plot(steps, values, color=color, alpha=0.25, linewidth=1, label=raw)
            values = moving_average(values, smooth)
        width = 2 if smooth > 1 else 1.5
        if label is None:  # one run: the legend tells raw from smoothed
            label = f"mean of last {smooth} steps" if smooth > 1 else None
        ax.plot(steps, values, color=color, linewidth=width, marker=marker, label=label)
    ax.set_title(TITLES.get(key, key), fontsize=11)
    ax.set_xlabel("step")
    ax.set_ylabel(YLABELS.get(key, key), fontsize=9)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3)


def _file_name(prefix: str, key: str) -> str:
    return prefix + key.replace("/", "_").replace(" ", "_") + ".png"


def _plot_runs(
    runs: Sequence[tuple[str, Records]],
    out_dir: str | os.PathLike[str],
    keys: Sequence[str],
    smooth: int,
    prefix: str,
    legend: bool,
    title: str | None = None,
) -> list[Path]:
    if smooth < 1:
        raise ValueError(f"smooth must be an int >= 1, got {smooth!r}")
    from matplotlib.figure import Figure

    present = [k for k in keys if any(_series(records, k)[0].size for _, records in runs)]
    if not present:
        return []
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for key in present:
        fig = Figure(figsize=(6.4, 4.0), dpi=110, layout="constrained")
        ax = fig.add_subplot()
        _draw(ax, runs, key, smooth)
        if legend or ax.get_legend_handles_labels()[1]:
            ax.legend(fontsize=9)
        path = out / _file_name(prefix, key)
        fig.savefig(path)
        written.append(path)
    ncols = min(3, len(present))
    nrows = math.ceil(len(present) / ncols)
    fig = Figure(figsize=(5.0 * ncols, 3.4 * nrows), dpi=100, layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, key in zip(axes, present):
        _draw(ax, runs, key, smooth)
    for ax in axes[len(present):]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title, fontsize=13)
    if legend or axes[0].get_legend_handles_labels()[1]:
        by_label = {}  # a run may be missing from some panels: gather its handle anywhere
        for ax in axes[: len(present)]:
            for handle, label in zip(*ax.get_legend_handles_labels()):
                by_label.setdefault(label, handle)
        fig.legend(
            by_label.values(), by_label.keys(), loc="outside upper center", ncols=len(by_label)
        )
    path = out / f"{prefix}summary.png"
    fig.savefig(path)
    written.append(path)
    return written


def plot_metrics(
    records: Records,
    out_dir: str | os.PathLike[str],
    keys: Sequence[str] = DEFAULT_PLOT_KEYS,
    *,
    smooth: int = 1,
    title: str | None = None,
) -> list[Path]:
    """Write ``<key>.png`` per metric present in ``records`` and a combined ``summary.png``.

    ``smooth > 1`` draws a trailing moving average over the faint raw curve (a legend names
    both). ``title`` (e.g. the run directory) heads ``summary.png``. Returns the written
    paths (empty when none of ``keys`` occurs in ``records``).
    """
    return _plot_runs([(None, records)], out_dir, keys, smooth, prefix="", legend=False,
                      title=title)


def plot_comparison(
    runs: Sequence[tuple[str, Records]],
    out_dir: str | os.PathLike[str],
    keys: Sequence[str] = DEFAULT_PLOT_KEYS,
    *,
    smooth: int = 1,
    prefix: str = "compare_",
) -> list[Path]:
    """Overlay several runs, e.g. ``[("dense", r1), ("naive sparse", r2), ("Sparse-RL", r3)]``.

    Writes ``<prefix><key>.png`` per metric present in any run and ``<prefix>summary.png``
    with one shared legend; a run lacking a metric is simply absent from that panel. Returns
    the written paths.
    """
    if not runs:
        raise ValueError("plot_comparison needs at least one (label, records) run")
    labels = [label for label, _ in runs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"plot_comparison run labels must be unique, got {labels}")
    return _plot_runs(runs, out_dir, keys, smooth, prefix=prefix, legend=True)
