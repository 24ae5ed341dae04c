"""A second synthetic task in the Sparse-RL paper's regime: long, redundant traces.

A digit ``x`` walks ``x <- (x + k) mod 10``; the solution prints every step, counts the
visits to a target digit ``h`` and halts after the ``c``-th visit, answering with the number
of steps taken. ``k``, ``h``, ``c`` and the start ``x`` are labelled facts in the prompt, in
random order among ``d`` distractor facts::

    prompt:   "h=7 q=2 x=5 c=2 k=3 B=9 ?"
    solution: "0180 0210 0340 0471 0501 0631 0761 0891 0921 1051 1181 1211 1341 1472 #14"

Step ``s`` is written ``SSxn``: the two-digit step number, the new ``x`` and the visit count
``n`` after the step. With ``echo_every = R > 0`` the group ``hHcC`` (the target and the count
to reach, restated) follows every ``R``-th step before the halt, a knob that makes the rarely
needed facts recent again.

Why this regime: only the current ``x``, ``n``, step number and the facts ``k`` and ``h`` (read
at every step) matter for the next token, so most of the trace's KV is stale and repetitive
and a compressed cache can drop it; ``c`` is read only at visits, so an eviction policy
ranking by attention may drop it, and then the count is wrong or the halt never comes and the
response runs to the length cap. ``k`` is drawn coprime to 10 so every digit is visited once
every 10 steps: the walk takes ``S = t0 + 10 (c - 1)`` steps, ``t0`` in ``1..10`` the first
visit.

Lengths, one token per character (``task_tokenizer``; the alphabet is the shipped task's):
``prompt_length(4 + d) = 4 (4 + d) + 1`` prompt tokens (``task.prompt_length``) and
``walk_solution_length(S, R) = 5 (S + E) + 1 + len(str(S))`` response tokens (+1 for EOS),
``E = (S - 1) // R`` echoes (0 when ``R = 0``). The answer is read like the shipped task's
(``task.answer_of``: the digits after the last ``#``), so ``data.reward: task_exact`` scores it.

Problem ``i`` depends only on ``(seed, i)``.
"""

from __future__ import annotations

import dataclasses
from typing import Literal
import numpy as np

from sparse_rl_jax.core.config_checks import check, check_choice, check_int
from sparse_rl_jax.tasks.task import LABELS, Problem, TaskConfig, TaskDataset, prompt_length

FACTS = ("k", "h", "c", "x")
"""The labels of the needed facts: step, target digit, visits to count, start digit."""
DISTRACTOR_LABELS = "".join(lab for lab in LABELS if lab not in FACTS)
STEPS_COPRIME = (1, 3, 7, 9)
"""The values of ``k``: coprime to 10, so the walk visits every digit once per 10 steps."""
FACT_ORDERS = ("random", "fixed")
MAX_COUNT = 9  # keeps n one digit and the step number S <= 90 two digits


@dataclasses.dataclass(frozen=True)
class WalkTaskConfig:
    """The walk task's distribution (``data.source: walk``).

    Attributes:
      c_min, c_max: range of the visit count ``c`` (1 <= c_min <= c_max <= 9); the walk takes
        ``10 c - 9 .. 10 c`` steps, ~5 response tokens each.
      distractors_min, distractors_max: range of the number of distractor facts in the prompt
        (0 <= min <= max <= 48).
      echo_every: restate ``h`` and ``c`` after every ``echo_every``-th step (0 = never).
      fact_order: "random" shuffles the facts among the distractors; "fixed" writes
        ``k h c x`` first, then the distractors (each fact at a fixed place: easier to learn).
      seed: data seed; problem ``i`` depends only on ``(seed, i)``.
    """

    c_min: int = 1
    c_max: int = 5
    distractors_min: int = 2
    distractors_max: int = 6
    echo_every: int = 0
    fact_order: Literal["random", "fixed"] = "random"
    seed: int = 0

    def __post_init__(self):
        check_int(self, "c_max", 1)
        check(self.c_max <= MAX_COUNT, self, "c_max", f"must be <= {MAX_COUNT}")
        check_int(self, "c_min", 1)
        check(self.c_min <= self.c_max, self, "c_min", f"must be in [1, c_max={self.c_max}]")
        check_int(self, "distractors_max", 0)
        check(self.distractors_max <= len(DISTRACTOR_LABELS), self, "distractors_max",
              f"must be <= {len(DISTRACTOR_LABELS)}")
        check_int(self, "distractors_min", 0)
        check(self.distractors_min <= self.distractors_max, self, "distractors_min",
              f"must be in [0, distractors_max={self.distractors_max}]")
        check_int(self, "echo_every", 0, "must be an int >= 0 (0 = no echo)")
        check_choice(self, "fact_order", FACT_ORDERS)
        check_int(self, "seed", 0)

    @property
    def max_prompt_tokens(self) -> int:
        """Longest prompt in task tokens: ``prompt_length(4 + distractors_max)``."""
        return prompt_length(len(FACTS) + self.distractors_max)

    @property
    def max_response_tokens(self) -> int:
        """Longest correct response in task tokens, EOS included (a floor for max_new_tokens)."""
        return walk_solution_length(10 * self.c_max, self.echo_every) + 1

    def curriculum(self, progress: float) -> WalkTaskConfig:
        """A warm start's curriculum at ``progress``: the walk has none (this config)."""
        return self

    def shuffled(self) -> None:
        """No label order to shuffle (the facts are placed by ``fact_order``)."""
        return None

    @staticmethod
    def lookup_columns(problem: Problem) -> list[int]:
        """No solution character is a plain copy of one prompt fact."""
        return []

    @staticmethod
    def label_columns(problem: Problem) -> list[int]:
        """No solution character names a label."""
        return []


def walk_solution_length(steps: int, echo_every: int) -> int:
    """Characters (= task tokens, EOS excluded) of a solution taking ``steps`` steps:
    ``5 (steps + E) + 1 + len(str(steps))`` with ``E = (steps - 1) // echo_every`` (0 if 0)."""
    echoes = (steps - 1) // echo_every if echo_every else 0
    return 5 * (steps + echoes) + 1 + len(str(steps))


def render_walk(k: int, h: int, c: int, x: int, distractors: list[tuple[str, int]],
                order: list[int], echo_every: int = 0) -> Problem:
    """The problem for the given facts; ``order`` permutes ``[k, h, c, x, *distractors]``.

    Raises:
      ValueError: ``k`` not coprime to 10, ``h``/``x`` not a digit, ``c`` outside 1..9,
        distractor labels not distinct non-fact labels, or ``order`` not a permutation.
    """
    if k not in STEPS_COPRIME or not 0 <= h <= 9 or not 0 <= x <= 9 or not 1 <= c <= MAX_COUNT:
        raise ValueError(f"need k in {STEPS_COPRIME}, h and x digits, c in 1..{MAX_COUNT}; "
                         f"got k={k} h={h} c={c} x={x}")
    labels = [lab for lab, _ in distractors]
    if len(set(labels)) != len(labels) or any(lab not in DISTRACTOR_LABELS for lab in labels):
        raise ValueError(f"distractor labels {labels!r} must be distinct characters of "
                         f"{DISTRACTOR_LABELS!r}")
    facts = [*zip(FACTS, (k, h, c, x)), *distractors]
    if sorted(order) != list(range(len(facts))):
        raise ValueError(f"order {order!r} must be a permutation of 0..{len(facts) - 1}")
    prompt = " ".join(f"{facts[i][0]}={int(facts[i][1])}" for i in order) + " ?"
    groups, count, step = [], 0, 0
    while count < c:
        step += 1
        x = (x + k) % 10
        count += x == h
        groups.append(f"{step:02d}{x}{count}")
        if echo_every and step % echo_every == 0 and count < c:
            groups.append(f"h{h}c{c}")
    answer = str(step)
    return Problem(prompt=prompt, solution=" ".join(groups) + f" #{answer}", answer=answer)


def sample_walk(rng: np.random.Generator, cfg: WalkTaskConfig) -> Problem:
    """Draws one problem from ``cfg``'s distribution with ``rng``."""
    k = int(rng.choice(STEPS_COPRIME))
    h, x = (int(v) for v in rng.integers(0, 10, size=2))
    c = int(rng.integers(cfg.c_min, cfg.c_max + 1))
    d = int(rng.integers(cfg.distractors_min, cfg.distractors_max + 1))
    labels = [DISTRACTOR_LABELS[i] for i in rng.permutation(len(DISTRACTOR_LABELS))[:d]]
    values = rng.integers(0, 10, size=d).tolist()
    order = rng.permutation(len(FACTS) + d).tolist()
    if cfg.fact_order == "fixed":
        order = list(range(len(FACTS) + d))
    return render_walk(k, h, c, x, list(zip(labels, values)), order, cfg.echo_every)


def walk_at(cfg: WalkTaskConfig, index: int) -> Problem:
    """Problem number ``index`` (>= 0) of the stream defined by ``cfg``; pure in (cfg, index)."""
    if index < 0:
        raise ValueError(f"problem index {index} must be >= 0")
    return sample_walk(np.random.default_rng([cfg.seed, index]), cfg)


class WalkDataset(TaskDataset):
    """The first ``size`` problems of ``cfg``'s stream as a lazy, indexable sequence:
    ``dataset[i] == walk_at(cfg, i)`` (see ``task.TaskDataset``)."""

    problem_fn = staticmethod(walk_at)


def synthetic_dataset(cfg: TaskConfig | WalkTaskConfig, size: int) -> TaskDataset:
    """The first ``size`` problems of either shipped task, picked by the config's type."""
    return (WalkDataset if isinstance(cfg, WalkTaskConfig) else TaskDataset)(cfg, size)
