"""Rewards: math-verify on a table of tricky answers, robustness, threads, the registry, the
final-number reward."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import math_verify
import math_verify.grader
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from math_verify.errors import TimeoutException

from sparse_rl_jax.tasks import rewards
from sparse_rl_jax.tasks.datasets import DatasetConfig, load_jsonl
from sparse_rl_jax.tasks.rewards import (MathVerifyReward, available_reward_fns, compute_rewards,
                                         final_number_reward, get_reward_fn, last_boxed, last_number,
                                         math_verify_score, register_reward_fn, task_exact_reward,
                                         unregister_reward_fn)
from sparse_rl_jax.tasks.task import TaskConfig, problem_at

FIXTURES = Path(__file__).parent / "fixtures"

# (completion, gold answer, correct?) -- the verdicts are mathematical facts.
TABLE = [
    ("so the answer is $\\boxed{\\frac{1}{2}}$.", "0.5", True),  # nested braces, \frac vs decimal
    ("\\boxed{0.5}", "\\frac{1}{2}", True),
    ("\\boxed{\\dfrac{1}{2}}", "1/2", True),
    ("\\boxed{\\frac{1}{3}}", "0.5", False),
    ("\\boxed{0.33}", "\\frac{1}{3}", False),
    ("\\boxed{\\frac{14}{3}}", "\\frac{14}{3}", True),
    ("\\boxed{4\\frac{2}{3}}", "\\frac{14}{3}", True),  # mixed number
    ("They meet after \\boxed{27 \\text{ miles}}", "27", True),  # units in \text{}
    ("\\boxed{27 miles}", "27", True),
    ("\\boxed{\\text{Evelyn}}", "\\text{Evelyn}", True),
    ("\\boxed{90}", "90^\\circ", True),
    ("\\boxed{(3, \\frac{\\pi}{2})}", "\\left( 3, \\frac{\\pi}{2} \\right)", True),
    ("\\boxed{\\frac{\\pi}{3}}", "$\\frac{\\pi}{3}$", True),  # Gaokao $-wrapped gold
    ("\\boxed{p-q}", "p - q", True),  # symbolic
    ("\\boxed{q-p}", "p - q", False),
    ("First \\boxed{1}, on reflection \\boxed{2}.", "2", True),  # last box wins
    ("First \\boxed{1}, on reflection \\boxed{2}.", "1", False),
    ("\\boxed{2} and then \\boxed{3", "2", False),  # unclosed last box: no readable answer
    ("The answer is 2.", "2", False),  # no box, no answer
    ("", "2", False),
    ("\\boxed{}", "2", False),
    ("\\boxed{25}", "025", True),  # AIME-style gold
    ("\\boxed{-1-\\sqrt{3}}", "$-1-\\sqrt{3}$", True),
]


@pytest.mark.parametrize("completion, gold, correct", TABLE)
def test_math_verify_table(completion, gold, correct):
    assert math_verify_score(completion, gold) == float(correct)


def test_math_verify_reward_batch_matches_table():
    fn = get_reward_fn("math_verify")
    out = fn([c for c, _, _ in TABLE], [g for _, g, _ in TABLE])
    assert out.dtype == np.float32 and out.shape == (len(TABLE),)
    assert out.tolist() == [float(ok) for _, _, ok in TABLE]


def test_gsm8k_golds_from_the_loader():
    cfg = DatasetConfig(
        path=str(FIXTURES / "gsm8k.jsonl"), prompt_field="question", answer_format="gsm8k_hash"
    )
    golds = [e.answer for e in load_jsonl(cfg)]  # "18", "3", "70000", "2,125"
    fn = get_reward_fn("math_verify")
    right = ["\\boxed{18}", "\\boxed{3}", "\\boxed{70,000}", "\\boxed{2125}"]
    wrong = ["\\boxed{17}", "\\boxed{4}", "\\boxed{7000}", "\\boxed{2.125}"]
    assert fn(right, golds).tolist() == [1, 1, 1, 1]
    assert fn(wrong, golds).tolist() == [0, 0, 0, 0]


def test_amc_float_golds_from_the_loader():
    cfg = DatasetConfig(path=str(FIXTURES / "amc23.jsonl"), prompt_field="question")
    golds = [e.answer for e in load_jsonl(cfg)]
    assert golds == ["27.0", "36.0", "45.0"]
    fn = get_reward_fn("math_verify")
    assert fn(["\\boxed{27}", "\\boxed{36.0}", "\\boxed{45^\\circ}"], golds).tolist() == [1, 1, 1]
    assert fn(["\\boxed{28}", "\\boxed{6}", "\\boxed{4.5}"], golds).tolist() == [0, 0, 0]


def balanced(depth: int):
    """Strings with balanced braces (no backslash-brace escapes)."""
    leaf = st.text(alphabet="0123456789xy+-^_ \\abc", max_size=6)
    if depth == 0:
        return leaf
    inner = balanced(depth - 1)
    return st.lists(st.one_of(leaf, inner.map(lambda s: "{" + s + "}")), max_size=4).map("".join)


@settings(max_examples=60, deadline=None)
@given(content=balanced(3), before=balanced(2), after=st.text(alphabet="abc .,", max_size=10))
def test_last_boxed_extracts_balanced_content(content, before, after):
    text = f"{before} \\boxed{{wrong}} {before} \\boxed{{{content}}}{after}"
    assert last_boxed(text) == content


def test_last_boxed_edge_cases():
    assert last_boxed("no box") is None
    assert last_boxed("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"
    assert last_boxed("\\fbox{7} then \\boxed{8}") == "8"
    assert last_boxed("\\boxed{8} then \\fbox{7}") == "7"
    assert last_boxed("\\boxed{1} \\boxed{2") is None


def test_failures_inside_math_verify_score_zero(monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("parser bug")

    monkeypatch.setattr(math_verify, "parse", boom)
    assert math_verify_score("\\boxed{1}", "1") == 0.0


def test_math_verify_timeout_exception_scores_zero(monkeypatch):
    def times_out(*args, **kwargs):
        raise TimeoutException("too slow")

    monkeypatch.setattr(math_verify, "verify", times_out)
    assert math_verify_score("\\boxed{1}", "1") == 0.0


def test_signal_timeout_interrupts_a_slow_comparison(monkeypatch):
    def slow_but_true(*args, **kwargs):
        time.sleep(3)
        return True  # would score 1.0 if the 1 s alarm did not interrupt it

    monkeypatch.setattr(math_verify.grader, "sympy_expr_eq", slow_but_true)
    # Strings differ, so only the (patched) sympy comparison could say "equal".
    assert math_verify_score("\\boxed{4\\frac{2}{3}}", "\\frac{14}{3}", timeout_s=1) == 0.0


def test_off_main_thread_scores_in_a_worker_process():
    fn = MathVerifyReward()
    completions, golds = [c for c, _, _ in TABLE], [g for _, g, _ in TABLE]
    results = {}

    def run():
        results["first"] = fn(completions, golds)
        results["second"] = fn(completions[:3], golds[:3])  # reuses the worker

    worker_thread = threading.Thread(target=run)
    worker_thread.start()
    worker_thread.join()
    expected = [float(ok) for _, _, ok in TABLE]
    assert results["first"].tolist() == expected
    assert results["second"].tolist() == expected[:3]


def test_worker_overrunning_its_wall_limit_is_replaced():
    impatient = MathVerifyReward(worker_startup_s=0.001, worker_s_per_item=0.001)
    patient = MathVerifyReward()
    results = {}

    def run():
        rewards._WORKER._kill()  # force a cold start that cannot finish in 3 ms
        results["killed"] = impatient(["\\boxed{1}"], ["1"])
        results["after"] = patient(["\\boxed{1}", "\\boxed{2}"], ["1", "1"])

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert results["killed"].tolist() == [0.0]
    assert results["after"].tolist() == [1.0, 0.0]


def test_task_exact_reward_against_generated_solutions():
    problems = [problem_at(TaskConfig(), i) for i in range(8)]
    golds = [p.answer for p in problems]
    fn = get_reward_fn("task_exact")
    assert fn([p.solution for p in problems], golds).tolist() == [1.0] * 8
    shifted = [p.solution[:-1] + str((int(p.answer) + 1) % 10) for p in problems]
    assert fn(shifted, golds).tolist() == [0.0] * 8
    assert task_exact_reward(["no answer"], ["3"]).dtype == np.float32


def test_compute_rewards_checks_outputs():
    assert compute_rewards(task_exact_reward, ["#1"], ["1"]).tolist() == [1.0]
    with pytest.raises(ValueError, match="shape"):
        compute_rewards(lambda c, a: np.zeros((len(c), 2)), ["x"], ["y"])
    with pytest.raises(ValueError, match="non-finite"):
        compute_rewards(lambda c, a: np.full(len(c), np.nan), ["x"], ["y"])
    with pytest.raises(ValueError, match="differ in length"):
        compute_rewards(task_exact_reward, ["x", "y"], ["y"])


@pytest.fixture
def length_reward():
    """A reward fn registered as ``length`` for the test, removed afterwards."""

    def length_factory(scale: float = 1.0):
        return lambda completions, answers: np.asarray(
            [scale * len(c) for c in completions], np.float32
        )

    register_reward_fn("length", length_factory)
    yield length_factory
    unregister_reward_fn("length")


def test_registry(length_reward):
    assert {"task_exact", "math_verify", "length"} <= set(available_reward_fns())
    assert get_reward_fn("length", scale=2.0)(["ab", "c"], ["", ""]).tolist() == [4.0, 2.0]
    with pytest.raises(ValueError, match="already registered"):
        register_reward_fn("length", length_reward)
    with pytest.raises(ValueError, match="not registered; available"):
        get_reward_fn("nope")
    with pytest.raises(ValueError, match="does not take arguments"):
        get_reward_fn("task_exact", timeout_s=3)
    assert get_reward_fn("math_verify", timeout_s=2).timeout_s == 2
    with pytest.raises(ValueError, match="MathVerifyReward.timeout_s"):
        get_reward_fn("math_verify", timeout_s=0)


def test_tuple_answers_score_if_any_element_matches_on_and_off_the_main_thread():
    fn = MathVerifyReward()
    completions = ["\\boxed{\\frac{1}{2}}", "\\boxed{3}", "\\boxed{0.5}"]
    golds = [("7", "0.5"), ("1", "2"), ("\\frac12",)]
    expected = [1.0, 0.0, 1.0]
    assert fn(completions, golds).tolist() == expected
    results = {}
    t = threading.Thread(target=lambda: results.update(out=fn(completions, golds)))
    t.start()
    t.join()
    assert results["out"].tolist() == expected  # tuples survive the worker's JSON round trip
    assert task_exact_reward(["x #12", "x #12"], [("11", "12"), ("11",)]).tolist() == [1.0, 0.0]


def test_repeat_answers_keeps_tuples_whole():
    assert rewards.repeat_answers([("1", "2"), "3"], 2) == [("1", "2"), ("1", "2"), "3", "3"]


def test_math_verify_accepts_one_plus_an_equation_gold():
    """The upstream parse artifact docs/tasks.md warns about: with an equation gold ``x=3``,
    ``1+(x=3)`` verifies (math-verify compares the right-hand sides). If this starts failing,
    math-verify fixed it: update the note in docs/tasks.md."""
    assert math_verify_score("\\boxed{1+(x=3)}", "x=3") == 1.0
    assert math_verify_score("\\boxed{1+(3)}", "3") == 0.0


# SmolLM2-135M-Instruct's greedy answers to data/arithmetic/test.jsonl (abridged): it reasons
# step by step but never boxes, so only its final number can be read.
SMOL_RIGHT = ("1. Lee has 10 marbles.\n2. Lee loses 8 marbles.\n4. Lee now has 10 - 8 = 2 "
              "marbles.\n\nSo, Lee has 2 marbles.<|im_end|>")
SMOL_WRONG = "4. So, Omar has 10 - 5 = 5 coins left.\n\nSo, Omar has 20 coins now.<|im_end|>"


@pytest.mark.parametrize("text, number", [
    ("2 + 3 = 5 apples.", 5.0), ("costs $1,250.50 in all", 1250.5), ("it fell to -3.5", -3.5),
    ("1,2,3", 3.0), ("step 12.", 12.0), ("no digits", None), ("", None),
])
def test_last_number(text, number):
    assert last_number(text) == number


@pytest.mark.parametrize("completion, gold, score", [
    (SMOL_RIGHT, "2", 1.0),
    (SMOL_WRONG, "11", 0.0),
    (SMOL_WRONG, "20", 1.0),
    ("so 7 + 4 = 11, \\boxed{11} and then 3", "11", 1.0),    # the box wins over later text
    ("the answer is 11 \\boxed{12}", "11", 0.0),
    ("\\boxed{x = 1,200}", "1200", 1.0),
    ("\\boxed{}", "5", 0.0),
    ("I do not know", "5", 0.0),
    ("6.0 apples", "6", 1.0),
    ("6.01 apples", "6", 0.0),
    ("-4", ("4", "-4"), 1.0),
])
def test_final_number_reward(completion, gold, score):
    assert final_number_reward([completion], [gold]).tolist() == [score]
    assert get_reward_fn("final_number")([completion], [gold]).tolist() == [score]


def test_final_number_reward_rejects_a_non_numeric_gold():
    with pytest.raises(ValueError, match="gold answer '\\$5' is not a number"):
        final_number_reward(["5"], ["$5"])
    with pytest.raises(ValueError, match="differ in length"):
        final_number_reward(["5", "6"], ["5"])
