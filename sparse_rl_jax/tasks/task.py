"""The shipped synthetic reasoning task: a running digit sum over labelled digits.

The prompt lists ``n`` labelled digits; the solution walks through them in prompt order,
writing for each its label, its digit (looked up in the prompt) and the running sum mod 10,
and ends with ``#`` and the final sum (the verifiable answer)::

    prompt:   "A=3 B=7 C=1 D=5 ?"
    solution: "A33 B70 C11 D56 #6"

Every step copies a digit from the prompt by content (find the label, take the digit after
``=``: an induction-style lookup), then adds it to the previous sum (a local operation), so
one token needs one skill and a 2-layer model learns it in a short supervised warm start.
The digit for step ``i`` lies ``~4n`` tokens back, so a KV cache that evicted that prompt
item breaks the chain from there on while a dense cache does not. ``n`` (drawn from
``[n_min, n_max]``) is the difficulty knob: with one token per character (see
``task_tokenizer``) a problem takes ``prompt_length(n) = 4n + 1`` prompt tokens and
``solution_length(n) = 4n + 2`` response tokens (+1 for EOS); ``max_items_for_context``
inverts that for a given KV budget.

Every string is plain text; the pipeline tokenises it. Problem ``i`` of a dataset depends
only on ``(seed, i)``, so a resumed run sees the same problems in the same order.
"""

from __future__ import annotations

import dataclasses
import re
import string
from collections.abc import Iterator, Sequence
from typing import Literal, overload

import numpy as np

from sparse_rl_jax.core.config_checks import check, check_choice, check_int

LABELS = string.ascii_uppercase + string.ascii_lowercase
"""The 52 possible labels (one character each), in "alphabetical" order."""
DIGITS = "0123456789"
ALPHABET = LABELS + DIGITS + "= ?#"
"""Every character a prompt or solution of this task can contain."""
MAX_ITEMS = len(LABELS)
LABEL_ORDERS = ("alphabetical", "random")

_ANSWER_RE = re.compile(r"#(\d+)")


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    """The task's distribution.

    Attributes:
      n_min: fewest labelled digits in a prompt (>= 1).
      n_max: most labelled digits (n_min <= n_max <= 52); the response takes ``4n + 3``
        tokens with EOS, the whole context ``8n + 4``.
      seed: data seed; problem ``i`` depends only on ``(seed, i)``.
      label_order: "alphabetical" uses labels A, B, C, ... (the next label is predictable,
        only the digit must be looked up); "random" draws ``n`` distinct labels from the 52
        in random order (the next label must be looked up in the prompt too: harder).
    """

    n_min: int = 4
    n_max: int = 8
    seed: int = 0
    label_order: Literal["alphabetical", "random"] = "alphabetical"

    def __post_init__(self):
        check_int(self, "n_max", 1)
        check_int(self, "n_min", 1)
        check(self.n_min <= self.n_max, self, "n_min", f"must be in [1, n_max={self.n_max}]")
        check(self.n_max <= MAX_ITEMS, self, "n_max", f"must be <= {MAX_ITEMS}")
        check_int(self, "seed", 0)
        check_choice(self, "label_order", LABEL_ORDERS)

    @property
    def max_prompt_tokens(self) -> int:
        """Longest prompt in task tokens: ``prompt_length(n_max)``."""
        return prompt_length(self.n_max)

    @property
    def max_response_tokens(self) -> int:
        """Longest correct response in task tokens, EOS included (a floor for max_new_tokens)."""
        return solution_length(self.n_max) + 1

    def curriculum(self, progress: float) -> TaskConfig:
        """The easier distribution a warm start draws from at ``progress`` in [0, 1] of its
        curriculum: ``n`` in ``[1, m]``, ``m`` rising linearly from 1 to ``n_max``; this
        config itself from ``progress >= 1`` on."""
        if progress >= 1:
            return self
        top = 1 + round(max(0.0, progress) * (self.n_max - 1))
        return dataclasses.replace(self, n_min=1, n_max=top)

    def shuffled(self) -> TaskConfig:
        """This distribution with its labels in random order (where a label's place in the
        prompt no longer gives its digit)."""
        return dataclasses.replace(self, label_order="random")

    @staticmethod
    def lookup_columns(problem: Problem) -> list[int]:
        """Solution characters copied from the prompt by label: each step's digit."""
        return [4 * i + 1 for i in range(num_items(problem))]

    @staticmethod
    def label_columns(problem: Problem) -> list[int]:
        """Solution characters naming the next label (each step's first character)."""
        return [4 * i for i in range(num_items(problem))]


@dataclasses.dataclass(frozen=True)
class Problem:
    """One task instance: the prompt, a correct solution (ends with the answer), the answer."""

    prompt: str
    solution: str
    answer: str


def prompt_length(n: int) -> int:
    """Characters (= task tokens) in a prompt with ``n`` labelled digits: ``4n + 1``."""
    return 4 * n + 1


def solution_length(n: int) -> int:
    """Characters (= task tokens, EOS excluded) in the solution for ``n`` digits: ``4n + 2``."""
    return 4 * n + 2


def num_items(problem: Problem) -> int:
    """``n``, the number of labelled digits of a problem of this task."""
    return (len(problem.prompt) - 1) // 4


def max_items_for_context(num_tokens: int) -> int:
    """Largest ``n`` whose prompt + solution + EOS fit in ``num_tokens`` tokens (0 if none).

    Use it to set the difficulty relative to a KV budget: e.g. ``n_min`` at the budget and
    ``n_max`` at twice the budget makes eviction necessary on every long problem.
    """
    return max(0, min(MAX_ITEMS, (num_tokens - 4) // 8))


def render_problem(labels: Sequence[str], digits: Sequence[int]) -> Problem:
    """The problem for the given labels and digits (in prompt order).

    Raises:
      ValueError: labels not distinct single task labels, or digits outside 0..9, or the
        two sequences differ in length or are empty.
    """
    if len(labels) != len(digits) or not labels:
        raise ValueError(
            f"labels ({len(labels)}) and digits ({len(digits)}) must be non-empty and "
            "of equal length"
        )
    if len(set(labels)) != len(labels) or any(lab not in LABELS or len(lab) != 1 for lab in labels):
        raise ValueError(f"labels {list(labels)!r} must be distinct characters of {LABELS!r}")
    if any(not 0 <= int(d) <= 9 for d in digits):
        raise ValueError(f"digits {list(digits)!r} must lie in 0..9")
    running = np.cumsum(np.asarray(digits, np.int64)) % 10
    prompt = " ".join(f"{lab}={int(d)}" for lab, d in zip(labels, digits)) + " ?"
    steps = " ".join(f"{lab}{int(d)}{int(s)}" for lab, d, s in zip(labels, digits, running))
    answer = str(int(running[-1]))
    return Problem(prompt=prompt, solution=f"{steps} #{answer}", answer=answer)


def sample_problem(rng: np.random.Generator, cfg: TaskConfig) -> Problem:
    """Draws one problem from ``cfg``'s distribution with ``rng``."""
    n = int(rng.integers(cfg.n_min, cfg.n_max + 1))
    if cfg.label_order == "alphabetical":
        labels = list(LABELS[:n])
    else:
        labels = [LABELS[i] for i in rng.permutation(MAX_ITEMS)[:n]]
    digits = rng.integers(0, 10, size=n).tolist()
    return render_problem(labels, digits)


def problem_at(cfg: TaskConfig, index: int) -> Problem:
    """Problem number ``index`` (>= 0) of the stream defined by ``cfg``; pure in (cfg, index)."""
    if index < 0:
        raise ValueError(f"problem index {index} must be >= 0")
    return sample_problem(np.random.default_rng([cfg.seed, index]), cfg)


class TaskDataset(Sequence[Problem]):
    """The first ``size`` problems of ``cfg``'s stream as a lazy, indexable sequence.

    ``dataset[i] == problem_at(cfg, i)``; nothing is stored, so ``size`` may be huge.
    Subclasses for other tasks override ``problem_fn`` (``(cfg, index) -> Problem``).
    """

    problem_fn = staticmethod(problem_at)

    def __init__(self, cfg: TaskConfig, size: int):
        if size < 1:
            raise ValueError(f"{type(self).__name__} size={size} must be >= 1")
        self.cfg = cfg
        self.size = size

    def __len__(self) -> int:
        return self.size

    @overload
    def __getitem__(self, index: int) -> Problem: ...

    @overload
    def __getitem__(self, index: slice) -> list[Problem]: ...

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self.size))]
        index = int(index)
        if not -self.size <= index < self.size:
            raise IndexError(f"problem index {index} out of range for size {self.size}")
        return self.problem_fn(self.cfg, index % self.size)

    def __iter__(self) -> Iterator[Problem]:
        return (self.problem_fn(self.cfg, i) for i in range(self.size))


def answer_of(text: str) -> str | None:
    """The answer a completion states: the digits right after its last ``#``, else None."""
    last_hash = text.rfind("#")
    found = _ANSWER_RE.match(text, last_hash) if last_hash >= 0 else None
    return found.group(1) if found else None


def exact_match(completion: str, answer: str) -> float:
    """1.0 if ``answer_of(completion)`` equals ``answer`` exactly, else 0.0."""
    return float(answer_of(completion) == answer)
