"""TFDS round trips: JSONL sets and the shipped task, written then read with tfds.data_source."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tensorflow_datasets as tfds

from sparse_rl_jax.tasks.datasets import DatasetConfig, load_jsonl
from sparse_rl_jax.tasks.task import TaskConfig, TaskDataset
from sparse_rl_jax.tasks.tfds_builder import (build_jsonl_tfds, build_task_tfds, dataset_dir,
                                              load_examples, prepare_examples)

FIXTURES = Path(__file__).parent / "fixtures"
REPO = Path(__file__).parents[1]


def gsm8k_cfg(path=FIXTURES / "gsm8k.jsonl") -> DatasetConfig:
    return DatasetConfig(
        path=str(path), prompt_field="question", answer_format="gsm8k_hash", template="boxed"
    )


def math500_cfg() -> DatasetConfig:
    return DatasetConfig(
        path=str(FIXTURES / "math500.jsonl"), prompt_field="problem", meta_fields=("level",)
    )


def test_jsonl_round_trip(tmp_path):
    splits = {"train": gsm8k_cfg(), "test": math500_cfg()}
    path = build_jsonl_tfds("math_mix", splits, tmp_path)
    assert path == dataset_dir("math_mix", tmp_path) and path.is_dir()
    for split, cfg in splits.items():
        expected = list(load_jsonl(cfg))
        got = load_examples("math_mix", tmp_path, split)
        assert len(got) == len(expected) and list(got) == expected
        assert got[1:] == expected[1:] and got[-1] == expected[-1]
        with pytest.raises(IndexError, match="out of range"):
            got[len(expected)]
        # The raw records through tfds.data_source directly, in source order.
        source = tfds.data_source(
            "sparse_rl_examples/math_mix", split=split, data_dir=str(tmp_path)
        )
        for i, ex in enumerate(expected):
            rec = source[i]
            assert rec["prompt"].decode() == ex.prompt and rec["answer"].decode() == ex.answer
            assert json.loads(rec["meta"].decode()) == ex.meta


def test_task_round_trip(tmp_path):
    train_cfg, test_cfg = TaskConfig(n_min=2, n_max=9, seed=0), TaskConfig(
        n_min=10, n_max=12, seed=1
    )
    build_task_tfds("task", {"train": (train_cfg, 40), "test": (test_cfg, 8)}, tmp_path)
    for split, (cfg, size) in {"train": (train_cfg, 40), "test": (test_cfg, 8)}.items():
        got = load_examples("task", tmp_path, split)
        problems = TaskDataset(cfg, size)
        assert len(got) == size
        for i in range(size):
            assert (got[i].prompt, got[i].answer, got[i].meta) == (
                problems[i].prompt,
                problems[i].answer,
                {"solution": problems[i].solution, "index": i},
            )


def test_reads_back_without_tensorflow_in_a_fresh_process(tmp_path):
    build_task_tfds("task", {"train": (TaskConfig(seed=3), 5)}, tmp_path)
    code = (
        "import sys, json, tensorflow_datasets as tfds\n"
        "src = tfds.data_source('sparse_rl_examples/task', split='train',"
        f" data_dir={str(tmp_path)!r})\n"
        "print(json.dumps([src[i]['answer'].decode() for i in range(len(src))]))\n"
        "assert 'tensorflow' not in sys.modules, 'tensorflow was imported'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [
        p.answer for p in TaskDataset(TaskConfig(seed=3), 5)
    ]


def test_building_does_not_import_tensorflow(tmp_path):
    code = (
        "import sys\n"
        "from sparse_rl_jax.tasks.task import TaskConfig\n"
        "from sparse_rl_jax.tasks.tfds_builder import build_task_tfds, load_examples\n"
        f"build_task_tfds('t', {{'train': (TaskConfig(), 3)}}, {str(tmp_path)!r})\n"
        f"assert len(load_examples('t', {str(tmp_path)!r})) == 3\n"
        "assert 'tensorflow' not in sys.modules, 'tensorflow was imported'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]


def test_matching_source_is_reused_and_a_changed_one_refused(tmp_path):
    data = tmp_path / "gsm.jsonl"
    shutil.copy(FIXTURES / "gsm8k.jsonl", data)
    out = tmp_path / "tfds"
    path = build_jsonl_tfds("gsm", {"test": gsm8k_cfg(data)}, out)
    records = sorted(path.glob("*.array_record*"))
    stamp = [f.stat().st_mtime_ns for f in records]
    assert build_jsonl_tfds("gsm", {"test": gsm8k_cfg(data)}, out) == path
    assert [f.stat().st_mtime_ns for f in records] == stamp  # reused, not rewritten

    lines = data.read_text("utf-8").splitlines()
    data.write_text("\n".join(lines[:2]) + "\n", "utf-8")  # the file changed
    with pytest.raises(ValueError, match="different source.*overwrite=True"):
        build_jsonl_tfds("gsm", {"test": gsm8k_cfg(data)}, out)
    build_jsonl_tfds("gsm", {"test": gsm8k_cfg(data)}, out, overwrite=True)
    assert [e.answer for e in load_examples("gsm", out, "test")] == ["18", "3"]


def test_malformed_jsonl_fails_before_writing(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text((FIXTURES / "gsm8k.jsonl").read_text("utf-8") + "{oops\n", "utf-8")
    with pytest.raises(ValueError, match=f"{bad}:5: invalid JSON"):
        build_jsonl_tfds("bad", {"test": gsm8k_cfg(bad)}, tmp_path / "tfds")
    assert not (tmp_path / "tfds").exists()


def test_missing_dataset_or_split(tmp_path):
    with pytest.raises(FileNotFoundError, match="no prepared dataset 'nope'"):
        load_examples("nope", tmp_path)
    build_task_tfds("task", {"train": (TaskConfig(), 2)}, tmp_path)
    with pytest.raises(ValueError, match="validation"):
        load_examples("task", tmp_path, "validation")


@pytest.mark.parametrize(
    "name, splits",
    [("Bad-Name", {"train": lambda: iter(())}), ("ok", {}), ("ok", {"Train!": lambda: iter(())})],
)
def test_bad_names_are_rejected(tmp_path, name, splits):
    with pytest.raises(ValueError, match="must"):
        prepare_examples(name, splits, tmp_path, fingerprint="x")
    assert not any(tmp_path.iterdir())


def test_data_source_tfds_reads_the_jsonl_batches_through_tfds(tmp_path):
    """``data.source: tfds`` (written from ``data.jsonl`` once, then read through
    ``tfds.data_source``) gives the very batches ``data.source: jsonl`` gives; ``eval.tfds``
    the very eval set of ``eval.jsonl``."""
    from sparse_rl_jax.core.config_io import ConfigError, load_config
    from sparse_rl_jax.training.evaluation import eval_set
    from sparse_rl_jax.tasks.prompt_source import PromptSource
    from sparse_rl_jax.training.run_config import RunConfig

    jsonl = [f"data.jsonl.path={FIXTURES / 'gsm8k.jsonl'}", "data.jsonl.prompt_field=question",
             "data.jsonl.answer_format=gsm8k_hash", "data.jsonl.template=boxed"]
    tfds_keys = ["data.source=tfds", "data.tfds.name=gsm8k_fixture",
                 f"data.tfds.data_dir={tmp_path}"]
    plain = load_config(RunConfig, None, ["data.source=jsonl", *jsonl])
    via_tfds = load_config(RunConfig, None, [*tfds_keys, *jsonl])
    for position in (0, 1, 7):  # 7 wraps into a later epoch
        assert PromptSource(via_tfds.data, 2).batch(position) == PromptSource(
            plain.data, 2).batch(position)
    assert (tmp_path / "sparse_rl_examples" / "gsm8k_fixture").is_dir()
    # Once written, the dataset reads without its source file.
    stored = load_config(RunConfig, None, tfds_keys)
    assert PromptSource(stored.data, 2).batch(3) == PromptSource(plain.data, 2).batch(3)

    evals = [k.replace("data.", "eval.", 1) for k in [*tfds_keys[1:], *jsonl]]
    assert eval_set(load_config(RunConfig, None, ["eval.num_prompts=3", *evals])) == eval_set(
        load_config(RunConfig, None, ["eval.num_prompts=3", *evals[2:]]))
    with pytest.raises(ConfigError, match=r"data\.tfds"):
        load_config(RunConfig, None, ["data.source=tfds"])
    with pytest.raises(ConfigError, match=r"data\.tfds.*name"):
        load_config(RunConfig, None, [*tfds_keys, "data.tfds.name=GSM8K"])
