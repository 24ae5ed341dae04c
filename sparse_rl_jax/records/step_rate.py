"""Seconds per step and the time left, from a window of recent steps: what every progress
line's ``s/step`` and ``eta`` report (the trainer's, the warm start's, the experiments').

A step that compiled is reported apart ("compiled in 28 s") and left out of the window: its
time is mostly XLA's, not the step's. Spikes (a checkpoint save, a moment of a busy machine)
stay out through the window's median. Until a step without compiling is known, the compiling
step's time less its compile seconds stands in (``compile_watch.CompileWatch`` measures
them), so the first line already has an estimate. :class:`LoopClock` puts it on the lines
of a loop that logs every few steps (the warm start, the experiments' training loops).
"""

from __future__ import annotations

import collections
import time
from typing import Callable

import numpy as np

from sparse_rl_jax.records.compile_watch import CompileWatch

WINDOW = 10
"""Recent steps the median is taken over."""
FLOOR = 0.02
"""The least share of a compiling interval that stands in for its steps' time."""


def format_duration(seconds: float) -> str:
    """``H:MM:SS`` of ``seconds`` (rounded to the second)."""
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class StepRate:
    """Seconds per step from the median of the last ``window`` steps that did not compile.

    Feed it one interval at a time with :meth:`add`; an interval may hold several steps (the
    warm start logs every few dozen), which count as that many steps of their mean time.
    """

    def __init__(self, window: int = WINDOW):
        if not isinstance(window, int) or window < 1:
            raise ValueError(f"StepRate.window must be an int >= 1, got {window!r}")
        self._recent: collections.deque[float] = collections.deque(maxlen=window)
        self._stand_in: float | None = None
        self.compile_seconds = 0.0
        """XLA seconds of every compiling interval so far."""

    def add(self, seconds: float, steps: int = 1, compile_seconds: float = 0.0) -> None:
        """Records ``steps`` steps that took ``seconds`` in all, ``compile_seconds`` of them
        compiling (> 0: the interval stays out of the window; its time less the compile
        seconds stands in for the rate until the window has a step)."""
        if steps < 1 or seconds < 0 or compile_seconds < 0:
            raise ValueError(f"StepRate.add: need steps >= 1 and seconds >= 0, got "
                             f"steps={steps}, seconds={seconds}, "
                             f"compile_seconds={compile_seconds}")
        if compile_seconds > 0:
            self.compile_seconds += compile_seconds
            if self._stand_in is None:  # never under 2% of the interval: a compile measured
                # longer than its interval (threads overlapping) still leaves a rate
                self._stand_in = max(seconds - compile_seconds, FLOOR * seconds) / steps
            return
        self._recent.append(seconds / steps)

    def per_step(self) -> float | None:
        """Seconds per step: the window's median, else the stand-in, else None."""
        if self._recent:
            return float(np.median(self._recent))
        return self._stand_in

    def eta(self, remaining_steps: int) -> float | None:
        """Seconds for ``remaining_steps`` more steps at :meth:`per_step` (None when unknown)."""
        rate = self.per_step()
        return None if rate is None else rate * max(remaining_steps, 0)

    def describe(self, remaining_steps: int) -> str:
        """``"3.10 s/step | eta 0:04:32"``, or ``""`` while the rate is unknown."""
        rate, eta = self.per_step(), self.eta(remaining_steps)
        if rate is None:
            return ""
        return f"{rate:.2f} s/step | eta {format_duration(eta)}"


class LoopClock:
    """The timing on a loop's progress lines: time so far, the first interval's compile
    apart, ``s/step`` and the ETA over recent intervals (:class:`StepRate`).

    Enter :attr:`compiles` around the loop and call :meth:`lap` at each progress line.

    Args:
      steps: the loop's last step.
      stops_early: the loop may stop before ``steps`` (the warm start's held-out target):
        its ETA reads "at most".
      clock: seconds counter.
    """

    def __init__(self, steps: int, stops_early: bool = False,
                 clock: Callable[[], float] = time.monotonic):
        self.steps, self.stops_early, self._clock = steps, stops_early, clock
        self.rate, self.compiles = StepRate(), CompileWatch()
        self._start = self._last = clock()
        self._last_step = 0

    def lap(self, step: int) -> str:
        """``"(35s) | compiled in 9 s | 0.52 s/step | eta 0:12:30"`` at ``step`` (the compile
        only when the interval since the last lap compiled, the rate while steps are left)."""
        now, compiled = self._clock(), self.compiles.lap()
        seconds = compiled.seconds if compiled.count else 0.0
        self.rate.add(now - self._last, max(step - self._last_step, 1), seconds)
        self._last, self._last_step = now, step
        parts = [f"({now - self._start:.0f}s)"]
        if seconds:
            parts.append(f"compiled in {seconds:.0f} s")
        if step < self.steps:
            parts.append(self.rate.describe(self.steps - step) + " at most" * self.stops_early)
        return " | ".join(p for p in parts if p)
