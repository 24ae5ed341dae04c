"""experiments/calibrate_sparrow.py: the per-bin pick, and one tiny end-to-end run."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np

from tiny_hf import make_tiny_hf

_SPEC = importlib.util.spec_from_file_location(
    "calibrate_sparrow", Path(__file__).resolve().parents[1] / "experiments/calibrate_sparrow.py")
calibrate = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(calibrate)


def test_pick_takes_the_smallest_passing_k_per_bin():
    p5 = {8: np.array([0.90, 0.80, np.nan, 0.70]), 16: np.array([0.95, 0.87, np.nan, 0.80])}
    schedule, met = calibrate.pick_schedule(p5, 0.86, 2000)
    assert schedule == ((0, 8), (2000, 16), (4000, 16), (6000, 16))
    assert met == [True, True, True, False]


def test_end_to_end_on_a_tiny_model(tmp_path):
    path = make_tiny_hf(tmp_path / "m", "qwen2", std=0.2, hidden_size=32, intermediate_size=64)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": t}) for t in ["a b c", "d e f g h"]))
    out = calibrate.main(["--model", path, "--prompts", str(prompts), "--ks", "2",
                          "--max-new-tokens", "40", "--bin-tokens", "32", "--page-size", "4",
                          "--dense-layers", "0", "--device", "cpu", "--dtype", "float32"])
    assert [s for s, _ in out["schedule"]] == [0, 32] and len(out["met"]) == 2
    assert all(k == 2 for _, k in out["schedule"]) and out["predicted_speedup"] >= 1.0
