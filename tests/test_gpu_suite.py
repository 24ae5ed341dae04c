"""``benchmarks/gpu_suite.py --cpu-scaled``: a run writes a markdown and a JSON table with
every cell it was asked for, each with a status, and numbers for every cell that runs on a
CPU. The cells run in two groups (two runs), so neither test takes a minute."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CELLS = ["decode_static", "decode_continuous", "decode_transformers", "score", "update",
         "sparrow_8k", "compile", "rl_pair", "rl_async"]
SKIPPED_ON_CPU = {
    "decode_transformers": "cpu-scaled run",
}


GROUPS = [CELLS[:-2], ["rl_pair", "rl_async"]]  # the RL runs compile training steps: alone


@pytest.mark.slow
@pytest.mark.parametrize("group", GROUPS, ids=["benchmarks", "rl_pair"])
def test_cpu_scaled_suite_writes_every_cell(tmp_path, group):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    # budgets x4: the test asserts what the suite writes, not its speed on a shared machine
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_suite.py"),
                           "--cpu-scaled", "--out", str(tmp_path), "--budget-scale", "4",
                           "--cells", *group],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [report_file] = tmp_path.glob("gpu_suite_*_cpu.json")
    assert report_file.with_suffix(".md").is_file()
    report = json.loads(report_file.read_text())
    assert report["mode"] == "cpu-scaled"
    cells = {c["name"]: c for c in report["cells"]}
    assert list(cells) == group
    markdown = report_file.with_suffix(".md").read_text()
    for name, cell in cells.items():
        assert f"| {name} |" in markdown
        if name in SKIPPED_ON_CPU:
            assert cell["status"] == "skipped" and SKIPPED_ON_CPU[name] in cell["error"]
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
    if "rl_pair" not in cells:
        return
    rl = cells["rl_pair"]["rows"]
    assert {r["arm"] for r in rl} == {"dense", "rkv"}
    assert all(0 <= r["kv_saved"] <= 1 and 0 <= r["reward"] <= 1 for r in rl)
    assert all(r["kv_saved"] == 0 for r in rl if r["arm"] == "dense")  # a dense cache saves none
