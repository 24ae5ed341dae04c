"""``benchmarks/gpu_suite.py``: the default GPU plan fits 8 minutes of a 15-minute lease, in
priority order; a cell's rows reach the results file as it measures them, so a cell killed
at its budget keeps them; and a ``--cpu-scaled`` run writes a markdown and a JSON table with
every cell it was asked for, each with a status, numbers for every cell that runs on a CPU,
and (``--dump-hlo``) HLO files that ``hlo_cost.py --hlo`` walks. The scaled cells run in two
groups (three runs), so each test stays short."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_suite  # noqa: E402
import hlo_cost  # noqa: E402
from benchmarks.kit import hlo_walk  # noqa: E402

PRIORITY = ["decode_static", "decode_continuous", "decode_pallas", "score", "update",
            "sparrow_8k", "rl_pair"]
SKIPPED_ON_CPU = {
    "decode_transformers": ("cpu-scaled run",),
    # by name from models.attention_backends: not there, or there but timed on a GPU only
    "decode_pallas": ("not registered", "cpu-scaled run"),
}
CELLS = [c.name for c in gpu_suite.CELLS]
RL = ["rl_pair", "rl_async"]
DUMPED = ["decode_static", "decode_pallas", "score", "update"]  # --dump-hlo's two cells here
# three runs, each under a minute: the RL runs compile training steps, so they go alone
GROUPS = [DUMPED, [c for c in CELLS if c not in RL + DUMPED], RL]


def test_default_gpu_plan_fits_eight_minutes_in_priority_order():
    plan = gpu_suite.default_plan()
    assert [c.name for c in plan] == PRIORITY
    assert sum(c.budget_gpu for c in plan) <= gpu_suite.DEFAULT_GPU_SECONDS == 480
    assert gpu_suite.select_cells(None) == plan
    # --cells keeps the priority order whatever order they are named in
    assert [c.name for c in gpu_suite.select_cells(["score", "decode_static"])] == [
        "decode_static", "score"]


def test_a_cell_killed_at_its_budget_keeps_the_rows_it_wrote(tmp_path, monkeypatch):
    def slow_cell(ctx):
        yield {"step": 1.0}
        time.sleep(30)  # the budget's alarm stops it here
        yield {"step": 2.0}

    cell = gpu_suite.Cell("slow", "a cell that overruns", slow_cell, 1, 1)
    monkeypatch.setattr(gpu_suite, "CELLS", [cell])
    log = gpu_suite.RowLog(tmp_path / "rows.jsonl")
    args = argparse.Namespace(cells=["slow"], total_budget=10.0, budget_scale=1.0,
                              isolate=False)
    report = gpu_suite.run_suite(args, gpu_suite.Context(gpu=False, tmp=tmp_path), log)
    (result,) = report["cells"]
    assert result["status"] == "timeout" and result["rows"] == [{"step": 1.0}]
    lines = [json.loads(x) for x in log.path.read_text().splitlines()]
    assert lines[0] == {"cell": "slow", "row": {"step": 1.0}}  # on disk before the timeout
    assert lines[1]["result"]["status"] == "timeout"


@pytest.mark.slow
@pytest.mark.parametrize("group", GROUPS, ids=["decode_update", "benchmarks", "rl_pair"])
def test_cpu_scaled_suite_writes_every_cell(tmp_path, group):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    hlo = tmp_path / "hlo"
    # budgets x4: the test asserts what the suite writes, not its speed on a shared machine
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_suite.py"),
                           "--cpu-scaled", "--out", str(tmp_path), "--budget-scale", "4",
                           "--dump-hlo", str(hlo), "--cells", *group],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [report_file] = tmp_path.glob("gpu_suite_*_cpu.json")
    assert report_file.with_suffix(".md").is_file()
    report = json.loads(report_file.read_text())
    assert report["mode"] == "cpu-scaled"
    cells = {c["name"]: c for c in report["cells"]}
    assert list(cells) == group
    streamed = [json.loads(x) for x in report_file.with_suffix(".jsonl").read_text().splitlines()]
    markdown = report_file.with_suffix(".md").read_text()
    for name, cell in cells.items():
        assert f"| {name} |" in markdown
        assert [x["row"] for x in streamed if x["cell"] == name and "row" in x] == cell["rows"]
        if name in SKIPPED_ON_CPU:
            assert cell["status"] == "skipped"
            assert cell["error"].startswith(SKIPPED_ON_CPU[name]), cell["error"]
        elif name == "decode_continuous" and cell["status"] == "skipped":
            assert cell["error"].startswith("not available in this build")
        else:
            assert cell["status"] == "ok", (name, cell.get("error"))
            assert cell["rows"], name
            numbers = [v for row in cell["rows"] for v in row.values()
                       if isinstance(v, (int, float)) and not isinstance(v, bool)]
            assert numbers and all(math.isfinite(v) for v in numbers), name
            assert f"## {name}" in markdown
    if "rl_async" in cells:
        assert [r["mode"] for r in cells["rl_async"]["rows"]] == ["sync", "async"]
        assert all(r["steps_per_s"] > 0 for r in cells["rl_async"]["rows"])
    if "update" in cells:
        # --dump-hlo: the decode step's and the update's HLO, which hlo_cost.py --hlo walks
        for name in ("decode_static_none", "update"):
            text = (hlo / f"{name}.hlo").read_text()
            hlo_cost.main(["--hlo", str(hlo / f"{name}.hlo"), "--json", str(tmp_path / "w")])
            (walked,) = json.loads((tmp_path / "w").read_text())
            assert walked["bytes"] == hlo_walk.walk(text).bytes > 0
            assert walked["flops"] > 0
        dumped = [r for r in cells["decode_static"]["rows"] if r["method"].startswith("hlo")]
        assert len(dumped) == 1 and dumped[0]["walked_x_floor"] > 1
        update = cells["update"]["rows"][0]
        assert update["plan_gib"] > 0 and update["hlo"] == str(hlo / "update.hlo")
    if "rl_pair" not in cells:
        return
    rl = cells["rl_pair"]["rows"]
    assert {r["arm"] for r in rl} == {"dense", "rkv"}
    assert all(0 <= r["kv_saved"] <= 1 and 0 <= r["reward"] <= 1 for r in rl)
    assert all(r["kv_saved"] == 0 for r in rl if r["arm"] == "dense")  # a dense cache saves none
