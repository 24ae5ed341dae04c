"""How long async mode's learner waits on the other side before it stops the run.

A side that stops answering without raising (a wedged device, a deadlock) must not hang the
run. Every wait of the learner (the trainer's thread) on the other side has a deadline: its
wait for a step's rows (the rollout producer's side), its own score and update of the step
and the weight sync that publishes the next version (both on a worker thread it waits for:
the learner's and the weight sync's side), and its join of the producer when the steps end.
The producer's one wait, for the version a step needs, is ended by the learner: by that
publish (under the deadline) or by the close every exit of the learner makes.

The deadline is ``max(trainer.async_timeout_s, STEP_MULTIPLE x the slowest step so far)``,
where the first step a process runs is left out of "so far":

* the floor, ``trainer.async_timeout_s`` (default 1800 s), holds what the pace of steps does
  not: a first step that compiles generation, scoring and the update and rolls out a
  paper-scale batch (``configs/paper``: 1024 sequences of up to 4096 tokens), and a compile
  for a new shape (a new prompt bucket) mid-run, on a run whose steps take a second;
* ``STEP_MULTIPLE`` (10) x the slowest step covers steps that grow: responses lengthen as RL
  proceeds, and one long row holds a whole rollout. The first step, mostly compiling, would
  only inflate it.

A wait past the deadline raises :class:`AsyncRolloutError` naming the step, the side and the
seconds waited; the run stops there and its last checkpoint resumes it. The threads left
waiting are daemon threads: they keep no process alive. ``trainer.async_timeout_s: null``
waits forever.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

STEP_MULTIPLE = 10
"""The deadline is at least this many times the slowest step so far."""


class AsyncRolloutError(RuntimeError):
    """The rollout producer failed, or a side of async mode (the producer, the learner, the
    weight sync) went quiet past the deadline, before a step was done."""


class Deadline:
    """The deadline of async mode's waits: ``max(floor_s, STEP_MULTIPLE x the slowest step
    so far)``, the first step observed left out; None when ``floor_s`` is None (no deadline).

    Attributes:
      floor_s: ``trainer.async_timeout_s`` (seconds; None: wait forever).
      slowest: the slowest step observed so far, in seconds (the first left out).
    """

    def __init__(self, floor_s: float | None):
        self.floor_s = floor_s
        self.slowest = 0.0
        self._first_seen = False

    def observe(self, seconds: float) -> None:
        """Records a finished step's wall seconds (the first one observed is left out)."""
        if self._first_seen:
            self.slowest = max(self.slowest, seconds)
        self._first_seen = True

    @property
    def seconds(self) -> float | None:
        """How long a wait may last now (None: forever)."""
        if self.floor_s is None:
            return None
        return max(self.floor_s, STEP_MULTIPLE * self.slowest)

    def quiet(self, step: int, side: str, waited: float) -> AsyncRolloutError:
        """The error of a wait on ``side`` for step ``step`` (0-based) that ended after
        ``waited`` seconds without an answer."""
        return AsyncRolloutError(
            f"step {step + 1}: the {side} went quiet: no answer in {waited:.1f} s (deadline "
            f"{self.seconds:.1f} s, the larger of trainer.async_timeout_s={self.floor_s:g} and "
            f"{STEP_MULTIPLE} x the slowest step so far, {self.slowest:.1f} s). The run stopped; "
            "the same command resumes it from its last checkpoint. If steps can be this slow, "
            "raise trainer.async_timeout_s (null: no deadline)")


def finish_within(seconds: float | None, fn: Callable[[], Any]) -> tuple[bool, Any]:
    """Runs ``fn()`` on a daemon thread and waits at most ``seconds`` (None: no limit).

    Returns ``(True, its result)``, or ``(False, None)`` when it has not finished by then
    (the thread is left to itself: a daemon, it keeps no process alive). An exception
    ``fn`` raised is raised here.
    """
    done, out = threading.Event(), {}

    def work() -> None:
        try:
            out["result"] = fn()
        except BaseException as e:  # noqa: BLE001 -- raised again on the waiting thread
            out["error"] = e
        finally:
            done.set()

    threading.Thread(target=work, name="async-learner", daemon=True).start()
    if not done.wait(seconds):
        return False, None
    if "error" in out:
        raise out["error"]
    return True, out["result"]
