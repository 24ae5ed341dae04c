"""Verifiable rewards: the interface, the shipped task's exact match, math-verify, and the
final number.

A reward function maps a batch of completions and their gold answers to one float32 score
each::

    RewardFn = Callable[[Sequence[str], Sequence[str]], np.ndarray]   # -> [N] float32

Register your own with ``register_reward_fn(name, factory)`` (``unregister_reward_fn(name)``
removes it again) and select it by name with ``get_reward_fn(name, **kwargs)``;
``compute_rewards`` checks any reward function's output.

``math_verify`` scores 1.0 when the content of the completion's last ``\\boxed{...}`` is
equivalent to the gold answer under ``math_verify.parse`` + ``math_verify.verify`` (numbers,
fractions vs decimals, symbolic expressions, sets, intervals; units and ``\\text{}`` are
handled by math-verify's own normalisation), else 0.0. No box, an unparsable answer, an
exception or a timeout scores 0.0; it never raises on model output.

``final_number`` is the lenient reward for small models that rarely box their answer (the
usual GSM8K-style check): the completion's answer is the last number inside its last
``\\boxed{...}``, or, without a box, the last number of the text (``1,200`` and ``-3.50``
read as 1200 and -3.5); it scores 1.0 when that number equals a numeric gold answer.

math-verify times out slow parses/comparisons with ``signal.alarm``, which only works in the
main thread. Called from another thread, ``MathVerifyReward`` scores in a worker subprocess
(started once, whose main thread can use the alarm) and kills and restarts it if a batch
exceeds its wall-clock limit (that batch scores 0).
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import math
import os
import re
import select
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from models.registry import Registry
from sparse_rl_jax.core.config_checks import check_int, check_number
from sparse_rl_jax.tasks.task import exact_match

log = logging.getLogger(__name__)

Answer = str | tuple[str, ...]
"""A gold answer: a string, or a tuple of strings any of which is correct (a list answer)."""

RewardFn = Callable[[Sequence[str], Sequence[Answer]], np.ndarray]
"""``(completions [N], answers [N]) -> rewards [N] float32``."""

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def _check_batch(completions: Sequence[str], answers: Sequence[str]) -> None:
    if len(completions) != len(answers):
        raise ValueError(
            f"completions ({len(completions)}) and answers ({len(answers)}) differ in length"
        )


def compute_rewards(fn: RewardFn, completions: Sequence[str], answers: Sequence[str]) -> np.ndarray:
    """Calls ``fn`` and checks its output: ``[N]`` finite values, returned as float32.

    Raises:
      ValueError: mismatched inputs, or an output of the wrong shape or with NaN/inf (the
        message names the reward function).
    """
    _check_batch(completions, answers)
    out = np.asarray(fn(completions, answers), dtype=np.float32)
    name = getattr(fn, "__name__", type(fn).__name__)
    if out.shape != (len(completions),):
        raise ValueError(
            f"reward fn {name} returned shape {out.shape}, expected ({len(completions)},)"
        )
    if not np.all(np.isfinite(out)):
        raise ValueError(f"reward fn {name} returned non-finite rewards {out}")
    return out


def gold_options(answer: Answer) -> tuple[str, ...]:
    """The acceptable gold strings of ``answer``: its elements (tuple/list) or ``(str(answer),)``."""
    if isinstance(answer, (tuple, list)):
        return tuple(str(a) for a in answer)
    return (str(answer),)


def repeat_answers(answers: Sequence[Answer], num_samples: int) -> list[Answer]:
    """Each answer ``num_samples`` times in a row (sample ``i`` answers prompt ``i // num_samples``).

    A list, not a NumPy array: tuple answers of equal length would become a 2-D array.
    """
    return [a for a in answers for _ in range(num_samples)]


def task_exact_reward(completions: Sequence[str], answers: Sequence[Answer]) -> np.ndarray:
    """Shipped task: 1.0 where ``task.answer_of(completion)`` is a gold answer: ``[N]`` float32."""
    _check_batch(completions, answers)
    return np.asarray(
        [max(exact_match(c, g) for g in gold_options(a)) for c, a in zip(completions, answers)],
        np.float32,
    )


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces balanced.

    ``"\\boxed{\\frac{1}{2}}"`` gives ``"\\frac{1}{2}"``; an unclosed last box gives None
    rather than an earlier box (the completion's final answer is unreadable).
    """
    start = max(text.rfind(cmd + "{") for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    open_at = text.index("{", start)
    depth = 0
    for i in range(open_at, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[open_at + 1 : i]
    return None


_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def last_number(text: str) -> float | None:
    """The last number written in ``text`` (thousands commas allowed), or None.

    ``"2 + 3 = 5 apples."`` gives 5.0, ``"costs $1,250.50"`` gives 1250.5, ``"no digits"``
    gives None.
    """
    found = _NUMBER.findall(text)
    return float(found[-1].replace(",", "")) if found else None


def final_number_score(completion: str, answer: Answer) -> float:
    """1.0 if the completion's final number equals a gold option, else 0.0.

    The final number is the last number of the completion's last ``\\boxed{...}`` when it
    has one, else the last number of the whole text. Never raises on model output.

    Raises:
      ValueError: no option of ``answer`` is a plain number (the reward cannot score it).
    """
    golds = [last_number(option) for option in gold_options(answer)
             if _NUMBER.fullmatch(option.strip())]
    if not golds:
        raise ValueError(f"final_number reward: the gold answer {answer!r} is not a number")
    boxed = last_boxed(completion)
    pred = last_number(completion if boxed is None else boxed)
    return float(pred is not None and any(math.isclose(pred, g, rel_tol=0, abs_tol=1e-9)
                                          for g in golds))


def final_number_reward(completions: Sequence[str], answers: Sequence[Answer]) -> np.ndarray:
    """``final_number_score`` for each (completion, answer): ``[N]`` float32."""
    _check_batch(completions, answers)
    return np.asarray([final_number_score(str(c), a) for c, a in zip(completions, answers)],
                      np.float32)


def math_verify_score(completion: str, answer: Answer, timeout_s: int = 5) -> float:
    """1.0 if the last box of ``completion`` verifies against ``answer`` with math-verify, else 0.0.

    The gold is parsed as ``\\boxed{answer}`` (so ``$...$``-wrapped and plain golds both
    parse); a tuple ``answer`` scores 1.0 if any of its elements verifies. ``timeout_s``
    bounds each math-verify parse and comparison (signal-based: call this in the main
    thread or use ``MathVerifyReward``). Never raises on bad input.
    """
    import math_verify  # here, not at import: it brings sympy (0.6 s) that task rewards skip

    boxed = last_boxed(completion)
    if boxed is None or not boxed.strip():
        return 0.0
    try:
        pred = math_verify.parse(f"\\boxed{{{boxed}}}", parsing_timeout=timeout_s)
        if not pred:
            return 0.0
        for option in gold_options(answer):
            gold = math_verify.parse(f"\\boxed{{{option}}}", parsing_timeout=timeout_s)
            if gold and math_verify.verify(gold, pred, timeout_seconds=timeout_s):
                return 1.0
        return 0.0
    except BaseException as e:  # math-verify's TimeoutException derives from BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        log.debug("math_verify failed on %r vs %r: %r", boxed, answer, e)
        return 0.0


def _score_batch(pairs: Sequence[tuple[str, Answer]], timeout_s: int) -> list[float]:
    return [math_verify_score(c, a, timeout_s) for c, a in pairs]


def serve_worker() -> None:
    """Worker loop (run in a subprocess): JSON requests on stdin, JSON score lists on stdout.

    Each request line is ``{"pairs": [[completion, answer], ...], "timeout_s": int}``; the
    reply is one line ``[score, ...]``. Scoring runs in this process's main thread, so
    math-verify's signal-based timeouts work.
    """
    protocol = sys.stdout
    sys.stdout = sys.stderr  # stray prints must not corrupt the protocol
    for line in sys.stdin:
        request = json.loads(line)
        protocol.write(json.dumps(_score_batch(request["pairs"], request["timeout_s"])) + "\n")
        protocol.flush()


class _SubprocessScorer:
    """A long-lived ``serve_worker`` subprocess for scoring off the main thread.

    A subprocess (not ``multiprocessing``) so that nothing re-imports the caller's
    ``__main__``; it is killed and restarted when a batch overruns its wall-clock limit.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None

    def _start(self) -> subprocess.Popen:
        package_root = str(Path(__file__).resolve().parents[1])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        return subprocess.Popen(
            [
                sys.executable,
                "-c",
                "from sparse_rl_jax.tasks.rewards import serve_worker; serve_worker()",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def score(self, pairs: list[tuple[str, Answer]], timeout_s: int, wall_s: float) -> list[float]:
        with self._lock:
            try:
                if self._proc is None or self._proc.poll() is not None:
                    self._proc = self._start()
                self._proc.stdin.write(json.dumps({"pairs": pairs, "timeout_s": timeout_s}) + "\n")
                self._proc.stdin.flush()
                ready, _, _ = select.select([self._proc.stdout], [], [], wall_s)
                reply = self._proc.stdout.readline() if ready else ""
                scores = json.loads(reply) if reply else None
            except (OSError, ValueError) as e:
                log.warning("math_verify worker failed (%r); scoring 0", e)
                scores = None
            if scores is None or len(scores) != len(pairs):
                log.warning("math_verify worker gave no answer within %.0fs; scoring 0", wall_s)
                self._kill()
                return [0.0] * len(pairs)
            return [float(x) for x in scores]


_WORKER = _SubprocessScorer()
atexit.register(_WORKER._kill)


@dataclasses.dataclass(frozen=True)
class MathVerifyReward:
    """Reward fn: ``math_verify_score`` for each (completion, answer): ``[N]`` float32.

    Attributes:
      timeout_s: limit (whole seconds, >= 1) on each math-verify parse and comparison.
      worker_startup_s, worker_s_per_item: off the main thread, a batch of N items may take
        ``worker_startup_s + N * worker_s_per_item`` seconds in the worker subprocess before
        the worker is killed and the batch scores 0.
    """

    timeout_s: int = 5
    worker_startup_s: float = 60.0
    worker_s_per_item: float = 15.0

    def __post_init__(self):
        check_int(self, "timeout_s", 1)
        check_number(self, "worker_startup_s", gt=0)
        check_number(self, "worker_s_per_item", gt=0)

    def __call__(self, completions: Sequence[str], answers: Sequence[Answer]) -> np.ndarray:
        _check_batch(completions, answers)
        pairs = [(str(c), gold_options(a)) for c, a in zip(completions, answers)]
        if threading.current_thread() is threading.main_thread():
            scores = _score_batch(pairs, self.timeout_s)
        else:
            wall_s = self.worker_startup_s + self.worker_s_per_item * len(pairs)
            scores = _WORKER.score(pairs, self.timeout_s, wall_s)
        return np.asarray(scores, np.float32)


REWARD_FNS: Registry[Callable[..., RewardFn]] = Registry("reward fn")
REWARD_FNS.register("task_exact", lambda: task_exact_reward)  # takes no arguments
REWARD_FNS.register("math_verify", MathVerifyReward)
REWARD_FNS.register("final_number", lambda: final_number_reward)  # takes no arguments


def register_reward_fn(name: str, factory: Callable[..., RewardFn]) -> None:
    """Makes ``get_reward_fn(name, **kwargs)`` return ``factory(**kwargs)``.

    Raises:
      ValueError: ``name`` is already registered.
    """
    REWARD_FNS.register(name, factory)


def unregister_reward_fn(name: str) -> None:
    """Removes the reward fn registered as ``name`` (e.g. a test's own, when it is done).

    Raises:
      ValueError: ``name`` is not registered (the message lists the registered ones).
    """
    REWARD_FNS.unregister(name)


def available_reward_fns() -> tuple[str, ...]:
    """Registered reward names, sorted."""
    return tuple(sorted(REWARD_FNS.names()))


def get_reward_fn(name: str, **kwargs: Any) -> RewardFn:
    """The reward fn registered as ``name`` ("task_exact", "math_verify", "final_number", or
    your own).

    Raises:
      ValueError: unknown name (the message lists the registered ones).
    """
    factory = REWARD_FNS.get(name)
    try:
        return factory(**kwargs)
    except TypeError as e:
        raise ValueError(f"reward fn {name!r} does not take arguments {sorted(kwargs)}: {e}") from e
