"""plot_metrics / plot_comparison write readable PNGs; moving_average matches a NumPy loop."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from matplotlib import colors
from matplotlib.image import imread

from sparse_rl_jax.records.plots import (DEFAULT_PLOT_KEYS, moving_average, plot_comparison,
                                         plot_metrics)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _records(n: int, seed: int, keys=DEFAULT_PLOT_KEYS) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [
        {"step": s, **{k: float(rng.normal()) + 0.01 * s for k in keys}} for s in range(1, n + 1)
    ]


def _check_png(path) -> np.ndarray:
    assert path.read_bytes()[:8] == PNG_MAGIC
    assert path.stat().st_size > 10_000, path
    image = imread(path)
    assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 300
    assert image[..., :3].std() > 0.05  # not a blank canvas
    return image


def _color_pixels(image: np.ndarray, color: str) -> int:
    """Pixels within a small distance of a matplotlib colour (e.g. 'C0')."""
    rgb = np.asarray(colors.to_rgb(color))
    return int((np.abs(image[..., :3] - rgb).max(axis=-1) < 0.06).sum())


def test_plot_metrics_writes_each_panel_and_summary(tmp_path):
    paths = plot_metrics(_records(40, 0), tmp_path)
    assert [p.name for p in paths] == [f"{k.replace('/', '_')}.png" for k in DEFAULT_PLOT_KEYS
                                       ] + ["summary.png"]
    for path in paths:
        _check_png(path)
    summary = imread(tmp_path / "summary.png")
    single = imread(tmp_path / "reward_mean.png")
    assert summary.shape[1] > single.shape[1]  # a grid, wider than one panel


def test_eval_metrics_logged_every_few_steps_get_their_summary_panels(tmp_path):
    records = _records(30, 1, keys=("reward_mean",))
    for record in records[::10]:  # eval.every_steps = 10
        record["eval/dense_pass_at_1"], record["eval/sparse_pass_at_1"] = 0.5, 0.25
    paths = plot_metrics(records, tmp_path, smooth=3)
    assert [p.name for p in paths] == ["reward_mean.png", "eval_dense_pass_at_1.png",
                                       "eval_sparse_pass_at_1.png", "summary.png"]
    summary = _check_png(tmp_path / "summary.png")
    assert summary.shape[1] > imread(tmp_path / "reward_mean.png").shape[1] * 2  # 3 panels


def test_plot_metrics_tolerates_missing_and_non_finite_values(tmp_path):
    records = [
        {"step": 1, "reward_mean": 0.1},
        {"step": 2, "reward_mean": float("nan"), "clip_fraction": 0.01},
        {"step": 3, "reward_mean": float("inf"), "clip_fraction": 0.02},
        {"step": 4, "reward_mean": 0.4},
        {"step": 5, "unrelated": 3.0},
    ]
    paths = plot_metrics(records, tmp_path, smooth=2)
    assert sorted(p.name for p in paths) == ["clip_fraction.png", "reward_mean.png", "summary.png"]
    for path in paths:
        _check_png(path)
    assert plot_metrics([{"step": 1, "unrelated": 1.0}], tmp_path / "none") == []
    assert not (tmp_path / "none").exists()
    with pytest.raises(ValueError, match="smooth"):
        plot_metrics(records, tmp_path, smooth=0)


def test_plot_comparison_overlays_runs(tmp_path):
    dense = _records(60, 1, keys=("reward_mean", "response_length_mean", "clip_fraction"))
    naive = _records(60, 2)
    sparse = _records(60, 3)
    paths = plot_comparison(
        [("dense", dense), ("naive sparse", naive), ("Sparse-RL", sparse)], tmp_path, smooth=5
    )
    names = [p.name for p in paths]
    assert names == [f"compare_{k.replace('/', '_')}.png" for k in DEFAULT_PLOT_KEYS] + [
        "compare_summary.png"]
    for path in paths:
        _check_png(path)
    # Each run is drawn in its own colour: all three in the reward panel; the dense run has no
    # rejection metric, so its colour is absent from that panel (legend included).
    reward = imread(tmp_path / "compare_reward_mean.png")
    rejection = imread(tmp_path / "compare_rejection_rate.png")
    for color in ("C0", "C1", "C2"):
        assert _color_pixels(reward, color) > 200, color
    assert _color_pixels(rejection, "C0") == 0
    assert _color_pixels(rejection, "C1") > 200 and _color_pixels(rejection, "C2") > 200
    with pytest.raises(ValueError, match="unique"):
        plot_comparison([("a", dense), ("a", naive)], tmp_path)
    with pytest.raises(ValueError, match="at least one"):
        plot_comparison([], tmp_path)


def _reference_moving_average(values: list[float], window: int) -> list[float]:
    out = []
    for i in range(len(values)):
        chunk = [v for v in values[max(0, i - window + 1) : i + 1] if math.isfinite(v)]
        out.append(sum(chunk) / len(chunk) if chunk else math.nan)
    return out


@settings(max_examples=40, deadline=None)
@given(
    values=st.lists(
        st.one_of(st.floats(-1e3, 1e3), st.just(math.nan), st.just(math.inf)), max_size=30
    ),
    window=st.integers(1, 8),
)
def test_moving_average_matches_loop(values, window):
    got = moving_average(np.asarray(values, dtype=float), window)
    want = np.asarray(_reference_moving_average(values, window), dtype=float)
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9, equal_nan=True)


def test_single_run_plots_label_axes_units_raw_vs_smoothed_and_the_run(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    from sparse_rl_jax.records.plots import YLABELS

    saved = []
    original = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, path, **kw: (saved.append((path, fig)),
                                                                     original(fig, path, **kw)))
    plot_metrics(_records(30, 0), tmp_path, smooth=5, title="runs/default")
    figures = {p.name: fig for p, fig in saved}
    panel = figures["kv_token_savings.png"].axes[0]
    assert panel.get_ylabel() == YLABELS["kv_token_savings"] == "fraction of dense KV tokens saved"
    assert [t.get_text() for t in panel.get_legend().get_texts()] == ["raw", "mean of last 5 steps"]
    summary = figures["summary.png"]
    assert summary._suptitle.get_text() == "runs/default"
    assert all(ax.get_ylabel() for ax in summary.axes if ax.get_visible())
    assert [t.get_text() for t in summary.legends[0].get_texts()] == ["raw", "mean of last 5 steps"]
