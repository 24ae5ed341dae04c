"""Fault matrix, data (issues 17 and 21): a malformed, empty or too-long training or eval
record is one ``error:`` line naming file and line, exit 2, before the run directory exists
(``on_error: skip`` counts and skips malformed records instead)."""

from __future__ import annotations

import json

import pytest

from fault_helpers import RECORDS, refused, run_args

pytest_plugins = ("fault_helpers",)  # the tiny model + data fixture

DATA_FAULTS = {
    "malformed_line": (b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": \n', ".jsonl:2: "
                       "invalid JSON"),
    "missing_field": (b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2="}\n',
                      ".jsonl:2: missing field(s) ['answer']"),
    "empty_file": (b"", "holds 0 usable records"),
    "non_utf8": (b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "\xff\xfe", "answer": "1"}\n',
                 ".jsonl:2: invalid JSON"),
    "prompt_longer_than_cache": (
        b'{"prompt": "1+1=", "answer": "2"}\n' + json.dumps(
            {"prompt": "1+" * 20 + "1=", "answer": "21"}).encode() + b"\n",
        ".jsonl:2: the prompt has 42 tokens, more than the KV cache (compression.eviction.budget "
        "+ buffer = 20) holds (20)"),
    "empty_prompt": (b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "", "answer": "0"}\n',
                     ".jsonl:2: "),
}


@pytest.mark.parametrize("fault", sorted(DATA_FAULTS))
def test_bad_data_names_file_and_line_before_any_state(tiny, tmp_path, capsys, fault):
    _, model, _ = tiny
    content, expected = DATA_FAULTS[fault]
    data = tmp_path / "data.jsonl"
    data.write_bytes(content)
    refused(capsys, run_args(model, data, tmp_path / "run"),
            expected if fault == "empty_file" else f"data{expected}")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("fault", sorted(DATA_FAULTS))
def test_bad_eval_data_names_file_and_line_before_any_state(tiny, tmp_path, capsys, fault):
    """The eval set of an in-training evaluation is read and checked in the preflight too,
    not when the first evaluation runs (after the run directory was written)."""
    _, model, data = tiny
    content, expected = DATA_FAULTS[fault]
    evals = tmp_path / "eval.jsonl"
    evals.write_bytes(content)
    refused(capsys, run_args(model, data, tmp_path / "run") + [
        f"eval.jsonl.path={evals}", "eval.every_steps=1"],
        "the eval set" if fault == "empty_file" else f"eval{expected}")
    assert not (tmp_path / "run").exists()


def test_prompt_longer_than_a_continuous_engine_slot(tiny, tmp_path, capsys):
    """A slot of the continuous engine holds what the static cache holds (budget + buffer
    for an evicting method), so the same preflight refuses the prompt, naming file and line."""
    _, model, _ = tiny
    content, expected = DATA_FAULTS["prompt_longer_than_cache"]
    data = tmp_path / "data.jsonl"
    data.write_bytes(content)
    refused(capsys, run_args(model, data, tmp_path / "run") + [
        "sampling.engine=continuous", "sampling.slots=2"], f"data{expected}")
    assert not (tmp_path / "run").exists()


def test_prompt_longer_than_model_context(tiny, tmp_path, capsys):
    _, model, _ = tiny
    data = tmp_path / "data.jsonl"
    long = {"prompt": "1+" * 150 + "1=", "answer": "151"}
    data.write_text(json.dumps(RECORDS[0]) + "\n" + json.dumps(long) + "\n")
    refused(capsys, run_args(model, data, tmp_path / "run") + ["compression.method=none"],
            "data.jsonl:2: the prompt has 302 tokens, more than the model context "
            "(max_position_embeddings) holds (256)")
    assert not (tmp_path / "run").exists()


def test_data_skip_mode_counts_and_goes_on(tiny, tmp_path):
    from sparse_rl_jax.tasks.datasets import DatasetConfig, load_jsonl

    data = tmp_path / "data.jsonl"
    data.write_bytes(DATA_FAULTS["non_utf8"][0] + DATA_FAULTS["malformed_line"][0])
    loaded = load_jsonl(DatasetConfig(path=str(data), on_error="skip"))
    assert len(loaded) == 2 and [s.line for s in loaded.skipped] == [2, 4]


def test_bad_eval_tfds_source_names_file_and_line_before_any_state(tiny, tmp_path, capsys):
    """``eval.tfds`` written from a malformed ``eval.jsonl``: the same file:line error."""
    _, model, data = tiny
    evals = tmp_path / "eval.jsonl"
    evals.write_bytes(DATA_FAULTS["malformed_line"][0])
    refused(capsys, run_args(model, data, tmp_path / "run") + [
        "eval.before_train=true", "eval.tfds.name=bad_eval", f"eval.tfds.data_dir={tmp_path}",
        f"eval.jsonl.path={evals}"], f"eval{DATA_FAULTS['malformed_line'][1]}")
    assert not (tmp_path / "run").exists()
