"""JSONL loading of the real formats, templates, malformed records and the resumable order."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from sparse_rl_jax.tasks.datasets import (DatasetConfig, EpochShuffle, Example, RecordError,
                                          extract_answer, gather, load_jsonl)
from sparse_rl_jax.tasks.prompts import BOXED_INSTRUCTION, render_prompt
from sparse_rl_jax.tasks.task_tokenizer import build_task_tokenizer

FIXTURES = Path(__file__).parent / "fixtures"
PAPER_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

# ChatML as Qwen2.5 writes it, spelled out here as the oracle for template="chat".
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def records(name: str) -> list[dict]:
    """The fixture's records, decoded independently of the loader."""
    return [json.loads(line) for line in (FIXTURES / name).read_text("utf-8").splitlines()]


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    tok = AutoTokenizer.from_pretrained(build_task_tokenizer(tmp_path_factory.mktemp("tok")))
    tok.chat_template = CHATML
    return tok


@pytest.mark.parametrize(
    "name, question_field, gold",
    [
        ("math500.jsonl", "problem", lambda r: r["answer"]),
        ("aime24.jsonl", "problem", lambda r: r["answer"]),
        ("amc23.jsonl", "question", lambda r: repr(r["answer"])),  # 27.0 -> "27.0"
        ("gaokao2023en.jsonl", "question", lambda r: r["answer"]),
        ("gsm8k.jsonl", "question", lambda r: r["answer"].splitlines()[-1].removeprefix("#### ")),
    ],
)
def test_eval_sets_round_trip_with_boxed_template(name, question_field, gold):
    fmt = "gsm8k_hash" if name.startswith("gsm8k") else "plain"
    cfg = DatasetConfig(
        path=str(FIXTURES / name), prompt_field=question_field, answer_format=fmt, template="boxed"
    )
    loaded = load_jsonl(cfg)
    raw = records(name)
    assert len(loaded) == len(raw) and loaded.num_skipped == 0
    for i, (ex, rec) in enumerate(zip(loaded, raw)):
        assert ex.prompt == rec[question_field] + "\n" + PAPER_INSTRUCTION
        assert ex.answer == gold(rec)
        assert ex.meta == {"path": cfg.path, "line": i + 1}


def test_gsm8k_answers_include_thousands_separators():
    cfg = DatasetConfig(
        path=str(FIXTURES / "gsm8k.jsonl"), prompt_field="question", answer_format="gsm8k_hash"
    )
    assert [ex.answer for ex in load_jsonl(cfg)] == ["18", "3", "70000", "2,125"]


def test_simplerl_qwen_string_prompts_are_used_raw():
    cfg = DatasetConfig(path=str(FIXTURES / "simplelr_qwen.jsonl"), answer_field="label")
    loaded = load_jsonl(cfg)
    assert [(e.prompt, e.answer) for e in loaded] == [
        (r["prompt"], r["label"]) for r in records("simplelr_qwen.jsonl")
    ]


def test_simplerl_messages_through_chat_template_equal_the_qwen_strings(chat_tokenizer):
    msgs = DatasetConfig(
        path=str(FIXTURES / "simplelr_messages.jsonl"), answer_field="label", template="chat"
    )
    loaded = load_jsonl(msgs, chat_tokenizer)
    qwen = records("simplelr_qwen.jsonl")
    assert [e.prompt for e in loaded] == [r["prompt"] for r in qwen]
    assert [e.answer for e in loaded] == [r["label"] for r in qwen]


def test_chat_template_on_a_string_question(chat_tokenizer):
    cfg = DatasetConfig(
        path=str(FIXTURES / "amc23.jsonl"),
        prompt_field="question",
        template="chat",
        system_prompt="You are a helpful assistant.",
        max_records=1,
    )
    (ex,) = load_jsonl(cfg, chat_tokenizer)
    q = records("amc23.jsonl")[0]["question"]
    assert ex.prompt == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        f"<|im_start|>user\n{q}\n{PAPER_INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n"
    )
    no_instruction = render_prompt(q, "chat", tokenizer=chat_tokenizer, instruction="")
    assert no_instruction == f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"


def test_chat_template_needs_a_tokenizer_with_one(tmp_path):
    cfg = DatasetConfig(
        path=str(FIXTURES / "amc23.jsonl"), prompt_field="question", template="chat"
    )
    with pytest.raises(ValueError, match="needs a tokenizer"):
        load_jsonl(cfg)
    plain = AutoTokenizer.from_pretrained(build_task_tokenizer(tmp_path))
    with pytest.raises(ValueError, match="no chat_template"):
        load_jsonl(cfg, plain)


def test_boxed_instruction_is_the_papers():
    assert BOXED_INSTRUCTION == PAPER_INSTRUCTION
    assert render_prompt("Q?", "boxed", instruction="Answer:") == "Q?\nAnswer:"
    assert render_prompt("Q?", "raw") == "Q?"


def test_meta_fields_and_max_records():
    cfg = DatasetConfig(
        path=str(FIXTURES / "math500.jsonl"),
        prompt_field="problem",
        meta_fields=("subject", "level"),
        max_records=2,
    )
    loaded = load_jsonl(cfg)
    raw = records("math500.jsonl")[:2]
    assert len(loaded) == 2
    assert [(e.meta["subject"], e.meta["level"]) for e in loaded] == [
        (r["subject"], r["level"]) for r in raw
    ]


def write_lines(path: Path, lines: list[str]) -> str:
    path.write_text("".join(line + "\n" for line in lines), "utf-8")
    return str(path)


def gsm_lines() -> list[str]:
    return (FIXTURES / "gsm8k.jsonl").read_text("utf-8").splitlines()


BAD_LINES = {
    "bad JSON": ('{"question": "x", "answer": "#### 1"', "invalid JSON"),
    "missing field": ('{"question": "x"}', "missing field(s) ['answer']"),
    "no hashes": ('{"question": "x", "answer": "1"}', "no '####'"),
    "not an object": ('["question", "answer"]', "JSON object"),
    "empty question": ('{"question": "  ", "answer": "#### 1"}', "prompt is empty"),
    "nested list answer": ('{"question": "x", "answer": [["#### 1"]]}', "string, a number or a list"),
    "empty list answer": ('{"question": "x", "answer": []}', "empty list"),
}


@pytest.mark.parametrize("kind", sorted(BAD_LINES))
def test_malformed_record_error_names_file_and_line(tmp_path, kind):
    bad, reason = BAD_LINES[kind]
    lines = gsm_lines()
    path = write_lines(tmp_path / "data.jsonl", [lines[0], "", lines[1], bad, lines[2]])
    cfg = DatasetConfig(path=path, prompt_field="question", answer_format="gsm8k_hash")
    with pytest.raises(RecordError) as err:
        load_jsonl(cfg)
    assert str(err.value).startswith(f"{path}:4: ")
    assert reason in str(err.value)
    assert (err.value.path, err.value.line) == (path, 4)


def test_skip_counts_malformed_records_and_logs(tmp_path, caplog):
    lines = gsm_lines()
    bad = [v[0] for v in BAD_LINES.values()]
    path = write_lines(
        tmp_path / "data.jsonl", [lines[0], bad[0], lines[1], "", bad[1], bad[2], lines[3]]
    )
    cfg = DatasetConfig(
        path=path, prompt_field="question", answer_format="gsm8k_hash", on_error="skip"
    )
    with caplog.at_level(logging.WARNING, logger="sparse_rl_jax.tasks.datasets"):
        loaded = load_jsonl(cfg)
    assert [e.answer for e in loaded] == ["18", "3", "2,125"]
    assert [e.meta["line"] for e in loaded] == [1, 3, 7]
    assert loaded.num_skipped == 3 and [s.line for s in loaded.skipped] == [2, 5, 6]
    assert "skipped 3 malformed record(s)" in caplog.text and path in caplog.text


def test_invalid_utf8_names_the_line(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_bytes(
        gsm_lines()[0].encode() + b"\n" + b'{"question": "\xff", "answer": "#### 1"}\n'
    )
    with pytest.raises(RecordError, match=":2: invalid JSON"):
        load_jsonl(
            DatasetConfig(path=str(path), prompt_field="question", answer_format="gsm8k_hash")
        )


def test_raw_template_rejects_messages():
    cfg = DatasetConfig(path=str(FIXTURES / "simplelr_messages.jsonl"), answer_field="label")
    with pytest.raises(RecordError, match=r":1: field 'prompt': .*template='chat'"):
        load_jsonl(cfg)


def test_missing_file():
    with pytest.raises(FileNotFoundError, match="DatasetConfig.path"):
        load_jsonl(DatasetConfig(path="/nonexistent/x.jsonl"))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"path": ""}, "path"),
        ({"prompt_field": ""}, "prompt_field"),
        ({"answer_format": "boxed"}, "answer_format"),
        ({"template": "qwen"}, "template"),
        ({"on_error": "ignore"}, "on_error"),
        ({"max_records": 0}, "max_records"),
        ({"meta_fields": ["level"]}, "meta_fields"),
    ],
)
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"DatasetConfig.{field}"):
        DatasetConfig(**{"path": "x.jsonl", **kwargs})


@pytest.mark.parametrize(
    "value, fmt, expected",
    [
        (27.0, "plain", "27.0"),
        (5, "plain", "5"),
        (" 7 ", "plain", "7"),
        ("a\n#### 1,000 ", "gsm8k_hash", "1,000"),
        (["$x$", 2], "plain", ("$x$", "2")),
        ("so \\boxed{\\frac{1}{\\sqrt{2}}}.", "boxed_in_solution", "\\frac{1}{\\sqrt{2}}"),
        (["a #### 3", "b #### 4"], "gsm8k_hash", ("3", "4")),
    ],
)
def test_extract_answer(value, fmt, expected):
    assert extract_answer(value, fmt) == expected


@pytest.mark.parametrize(
    "value, fmt",
    [(True, "plain"), (None, "plain"), ("", "plain"), ("a ####", "gsm8k_hash"), (3, "gsm8k_hash"),
     ([], "plain"), (["1", None], "plain"), ([["1"]], "plain"), ("no box", "boxed_in_solution"),
     (7, "boxed_in_solution")],
)
def test_extract_answer_rejects(value, fmt):
    with pytest.raises(ValueError):
        extract_answer(value, fmt)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 50),
    bs=st.integers(1, 50),
    seed=st.integers(0, 2**31),
    epochs=st.integers(1, 3),
)
def test_epoch_shuffle_covers_each_epoch_once(n, bs, seed, epochs):
    if bs > n:
        with pytest.raises(ValueError, match="num_examples"):
            EpochShuffle(n, bs, seed)
        return
    order = EpochShuffle(n, bs, seed)
    bpe = n // bs
    for e in range(epochs):
        seen = np.concatenate([order.batch_indices(e * bpe + k) for k in range(bpe)])
        assert seen.shape == (bpe * bs,) and len(set(seen.tolist())) == bpe * bs
        assert seen.min() >= 0 and seen.max() < n


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31), start=st.integers(0, 40))
def test_epoch_shuffle_resumes_identically(seed, start):
    uninterrupted = EpochShuffle(23, 4, seed).batches()
    reference = [next(uninterrupted) for _ in range(start + 10)][start:]
    resumed = EpochShuffle(23, 4, seed).batches(start=start)  # a fresh object, as after a restart
    for (p_ref, idx_ref), (p, idx) in zip(reference, (next(resumed) for _ in range(10))):
        assert p == p_ref and np.array_equal(idx, idx_ref)


def test_epoch_shuffle_seeds_epochs_and_unshuffled_order():
    a = EpochShuffle(100, 10, seed=1)
    assert not np.array_equal(a.batch_indices(0), EpochShuffle(100, 10, seed=2).batch_indices(0))
    assert not np.array_equal(a.batch_indices(0), a.batch_indices(10))  # epoch 1 reshuffles
    plain = EpochShuffle(10, 3, shuffle=False)
    assert [plain.batch_indices(k).tolist() for k in range(4)] == [
        [0, 1, 2],
        [3, 4, 5],
        [6, 7, 8],
        [0, 1, 2],
    ]
    with pytest.raises(ValueError, match="position"):
        a.batch_indices(-1)


def test_gather_from_a_loaded_dataset():
    loaded = load_jsonl(DatasetConfig(path=str(FIXTURES / "amc23.jsonl"), prompt_field="question"))
    batch = gather(loaded, np.array([2, 0]))
    assert all(isinstance(e, Example) for e in batch)
    assert [e.answer for e in batch] == ["45.0", "27.0"]


@pytest.mark.parametrize("name", ["math500.jsonl", "math500_nested.jsonl"])
def test_boxed_in_solution_reads_the_answer_from_the_solution(tmp_path, name):
    """MATH's form has no answer field: the loader must find it in the solution's last box."""
    raw = records(name)
    no_answer = tmp_path / name
    no_answer.write_text(
        "".join(json.dumps({k: v for k, v in r.items() if k != "answer"}) + "\n" for r in raw)
    )
    cfg = DatasetConfig(
        path=str(no_answer),
        prompt_field="problem",
        answer_field="solution",
        answer_format="boxed_in_solution",
        template="boxed",
    )
    loaded = load_jsonl(cfg)
    assert [ex.answer for ex in loaded] == [r["answer"] for r in raw]  # MATH500's own field


def test_boxed_in_solution_without_a_box_names_the_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(
        json.dumps({"problem": "p", "solution": "so \\boxed{1}"}) + "\n"
        + json.dumps({"problem": "q", "solution": "no box \\boxed{2"}) + "\n"
    )
    cfg = DatasetConfig(
        path=str(path), prompt_field="problem", answer_field="solution",
        answer_format="boxed_in_solution",
    )
    with pytest.raises(RecordError, match=r"m.jsonl:2: field 'solution': .*boxed"):
        load_jsonl(cfg)


def test_list_answers_load_as_tuples_and_any_element_scores():
    from sparse_rl_jax.tasks.rewards import get_reward_fn

    cfg = DatasetConfig(
        path=str(FIXTURES / "list_answers.jsonl"), prompt_field="question",
        answer_field="final_answer", template="boxed",
    )
    loaded = load_jsonl(cfg)
    raw = records("list_answers.jsonl")
    assert loaded.num_skipped == 0
    assert [ex.answer for ex in loaded] == [tuple(r["final_answer"]) for r in raw]
    reward = get_reward_fn("math_verify")
    completions = ["so \\boxed{-1-\\sqrt{3}}", "\\boxed{27}", "\\boxed{[-2,1)}"]
    golds = [ex.answer for ex in loaded]
    assert reward(completions, golds).tolist() == [1.0, 1.0, 1.0]
    assert reward(["\\boxed{1-\\sqrt{3}}", "\\boxed{28}", "\\boxed{(-2,1)}"], golds).tolist() == [
        0.0, 0.0, 0.0,
    ]
    # the second spelling is what makes the third row score: its first alone does not
    assert reward(["\\boxed{[-2,1)}"], [golds[2][:1]]).tolist() == [0.0]
