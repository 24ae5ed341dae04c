"""The shipped synthetic task and its tokenizer, checked against an independent re-derivation."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from sparse_rl_jax.tasks.task import (ALPHABET, LABELS, TaskConfig, TaskDataset, answer_of,
                                      exact_match, max_items_for_context, problem_at, prompt_length,
                                      render_problem, sample_problem, solution_length)
from sparse_rl_jax.tasks.task_tokenizer import build_task_tokenizer

CONFIGS = [
    TaskConfig(n_min=1, n_max=3, seed=0),
    TaskConfig(n_min=4, n_max=12, seed=7),
    TaskConfig(n_min=30, n_max=52, seed=3, label_order="random"),
]


def reference_solve(prompt: str) -> tuple[list[str], str]:
    """Independent solver: parse `L=d` items, walk them keeping the running sum mod 10."""
    assert prompt.endswith(" ?")
    items = [re.fullmatch(r"([A-Za-z])=(\d)", tok).groups() for tok in prompt[:-2].split(" ")]
    steps, total = [], 0
    for label, digit in items:
        total = (total + int(digit)) % 10
        steps.append(f"{label}{digit}{total}")
    return steps, str(total)


@settings(max_examples=60, deadline=None)
@given(cfg=st.sampled_from(CONFIGS), index=st.integers(0, 10**9))
def test_solution_is_the_running_sum_walk(cfg, index):
    p = problem_at(cfg, index)
    steps, answer = reference_solve(p.prompt)
    assert p.answer == answer
    assert p.solution.split(" ") == steps + [f"#{answer}"]
    n = len(steps)
    assert cfg.n_min <= n <= cfg.n_max
    assert len(p.prompt) == prompt_length(n) and len(p.solution) == solution_length(n)
    labels = [s[0] for s in steps]
    assert len(set(labels)) == n
    if cfg.label_order == "alphabetical":
        assert "".join(labels) == LABELS[:n]
    assert set(p.prompt + p.solution) <= set(ALPHABET)
    assert answer_of(p.solution) == p.answer and exact_match(p.solution, p.answer) == 1.0


def test_random_labels_draw_from_all_52_in_shuffled_order():
    cfg = TaskConfig(n_min=20, n_max=30, label_order="random")
    walks = [[s[0] for s in reference_solve(problem_at(cfg, i).prompt)[0]] for i in range(20)]
    assert set().union(*walks) == set(LABELS)
    assert sum(w != sorted(w) for w in walks) == 20


def test_generator_is_deterministic_and_indexable():
    cfg = TaskConfig(n_min=2, n_max=20, seed=11)
    a, b = TaskDataset(cfg, 1000), TaskDataset(cfg, 1000)
    assert [a[i] for i in (0, 5, 999)] == [b[i] for i in (0, 5, 999)]
    assert a[-1] == a[999] and a[3:6] == [a[3], a[4], a[5]] and list(a)[:3] == a[:3]
    # Independent of iteration history: reading 999 first changes nothing about 0.
    assert TaskDataset(cfg, 1000)[0] == problem_at(cfg, 0)
    other_seed = TaskDataset(TaskConfig(n_min=2, n_max=20, seed=12), 1000)
    assert sum(a[i] != other_seed[i] for i in range(20)) >= 18
    with pytest.raises(IndexError, match="out of range"):
        a[1000]


def test_generator_matches_across_processes():
    cfg = TaskConfig(n_min=3, n_max=30, seed=5, label_order="random")
    here = [problem_at(cfg, i).solution for i in range(10)]
    code = (
        "import json; from sparse_rl_jax.tasks.task import TaskConfig, problem_at;"
        "cfg = TaskConfig(n_min=3, n_max=30, seed=5, label_order='random');"
        "print(json.dumps([problem_at(cfg, i).solution for i in range(10)]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env=dict(os.environ, PYTHONHASHSEED="123"),
        cwd=Path(__file__).parents[1],
    )
    assert json.loads(out.stdout) == here


def test_sample_problem_uses_the_given_rng():
    cfg = TaskConfig(n_min=5, n_max=9)
    p1 = sample_problem(np.random.default_rng(3), cfg)
    p2 = sample_problem(np.random.default_rng(3), cfg)
    assert p1 == p2 and reference_solve(p1.prompt)[1] == p1.answer


def test_render_problem_example_and_errors():
    p = render_problem(["A", "B", "C", "D"], [3, 7, 1, 5])
    assert (p.prompt, p.solution, p.answer) == ("A=3 B=7 C=1 D=5 ?", "A33 B70 C11 D56 #6", "6")
    with pytest.raises(ValueError, match="distinct"):
        render_problem(["A", "A"], [1, 2])
    with pytest.raises(ValueError, match="0..9"):
        render_problem(["A"], [10])
    with pytest.raises(ValueError, match="equal length"):
        render_problem(["A", "B"], [1])


@pytest.mark.parametrize(
    "text, answer",
    [
        ("A33 B70 #6", "6"),
        ("A33 #6 #7", "7"),  # the last claim counts
        ("A33 #6 #", None),  # a trailing bare '#' is no answer
        ("A33 B70", None),
        ("", None),
        ("#12", "12"),
    ],
)
def test_answer_of(text, answer):
    assert answer_of(text) == answer
    assert exact_match(text, "6") == float(answer == "6")


def test_length_budget_helpers():
    for n in (1, 7, 52):
        total = prompt_length(n) + solution_length(n) + 1  # + EOS
        assert max_items_for_context(total) == n
        assert max_items_for_context(total - 1) == n - 1
    assert max_items_for_context(3) == 0 and max_items_for_context(10**6) == 52
    cfg = TaskConfig(n_min=2, n_max=9)
    longest = render_problem(LABELS[:9], [9] * 9)
    assert cfg.max_prompt_tokens == len(longest.prompt)
    assert cfg.max_response_tokens == len(longest.solution) + 1  # + EOS


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"n_min": 0}, "n_min"),
        ({"n_min": 5, "n_max": 4}, "n_min"),
        ({"n_max": 53}, "n_max"),
        ({"seed": -1}, "seed"),
        ({"label_order": "sorted"}, "label_order"),
        ({"n_max": 4.0}, "n_max"),
    ],
)
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"TaskConfig.{field}"):
        TaskConfig(**kwargs)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(build_task_tokenizer(tmp_path_factory.mktemp("tok")))


def test_tokenizer_special_tokens(tokenizer):
    assert tokenizer.eos_token == "<eos>" and tokenizer.pad_token == "<pad>"
    ids = {tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id}
    assert len(ids) == 3
    char_ids = tokenizer.convert_tokens_to_ids(list(ALPHABET))
    assert len(set(char_ids)) == len(ALPHABET) and not set(char_ids) & ids
    assert len(tokenizer) == len(ALPHABET) + 3
    assert tokenizer("A?")["input_ids"] == tokenizer.convert_tokens_to_ids(["A", "?"])
    assert tokenizer("A\n")["input_ids"][-1] == tokenizer.unk_token_id


@settings(max_examples=30, deadline=None)
@given(cfg=st.sampled_from(CONFIGS), index=st.integers(0, 10**6))
def test_tokenizer_round_trips_task_strings(tokenizer, cfg, index):
    p = problem_at(cfg, index)
    text = p.prompt + p.solution
    ids = tokenizer(text)["input_ids"]
    assert len(ids) == len(text)  # one token per character, no added specials
    assert tokenizer.convert_ids_to_tokens(ids) == list(text)
    assert tokenizer.decode(ids) == text
    with_eos = tokenizer(p.solution + tokenizer.eos_token)["input_ids"]
    assert with_eos[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(with_eos, skip_special_tokens=True) == p.solution


def test_task_tokenizer_round_trips_beside_a_qwen2_config(tmp_path):
    # The warm-started default is a Qwen2 checkpoint: its directory holds config.json with
    # model_type qwen2 next to the task tokenizer. Loading must keep the char-level
    # tokenizer (newer transformers' AutoTokenizer would swap in Qwen2's pre-tokenizer).
    import transformers

    import models

    build_task_tokenizer(tmp_path)
    transformers.Qwen2Config(vocab_size=69, hidden_size=8, intermediate_size=8,
                             num_hidden_layers=1, num_attention_heads=1,
                             num_key_value_heads=1).save_pretrained(tmp_path)
    tok = models.Tokenizer(tmp_path)
    problem = problem_at(TaskConfig(n_min=5, n_max=5), 3)
    for text in (problem.prompt, problem.solution):
        ids, mask = tok.encode([text], add_special_tokens=False)
        assert ids.shape[1] == len(text)  # one token per character, spaces included
        assert tok.decode(ids, mask) == [text]
