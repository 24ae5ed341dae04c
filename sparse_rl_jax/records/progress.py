"""Live progress for a training loop: a rich progress bar on a terminal, plain lines otherwise.

On a TTY the bar shows ``step/total``, elapsed time, ETA and the latest values of a few
metrics. When the stream is not a terminal (CI, a subprocess, a log file) every update prints
one self-contained line instead, e.g.::

    step 1/100 | reward 0.395 | rejected 0 | kv saved 0.13 | compiled in 28 s | 1.60 s/step | eta 0:02:38
    step 12/100 | reward 0.412 | rejected 0.07 | kv saved 0.75 | 1.52 s/step | eta 0:02:14

``s/step`` and the ETA come from the median of the last steps that did not compile
(``step_rate.StepRate``); the first step's compile is reported apart, and anything compiled
after it is named on a line of its own (a new shape mid-run: the run's data should never
bring one, see ``trainer``).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TextIO

import numpy as np
from rich.console import Console
from rich.table import Column
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)

from sparse_rl_jax.records.compile_watch import NO_COMPILES, Compiles, merged
from sparse_rl_jax.records.step_rate import StepRate, format_duration

# (metric name, short label) pairs shown by default.
DEFAULT_PROGRESS_FIELDS: tuple[tuple[str, str], ...] = (
    ("reward_mean", "reward"),
    ("rejection_rate", "rejected"),
    ("kv_token_savings", "kv saved"),
)


COMPILING = "compiling the first step..."
"""Shown until the first step ends: that step includes XLA compilation."""


def format_fields(metrics: Mapping[str, Any], fields: Sequence[tuple[str, str]]) -> str:
    """``"label value | ..."`` for the fields present in ``metrics`` (4 significant digits)."""
    parts = [
        f"{label} {float(np.asarray(metrics[name])):.4g}"
        for name, label in fields
        if name in metrics
    ]
    return " | ".join(parts)


class TrainProgress:
    """Progress display for steps ``start_step+1 .. total_steps``.

    Args:
      total_steps: the step number at which training ends (>= 1).
      start_step: steps already done (a resumed run starts its bar there).
      fields: (metric name, label) pairs to show; names missing from an update are skipped.
      stream: where to write (default sys.stdout).
      live: True forces the rich bar, False plain lines; None picks the bar only when the
        stream is a terminal.
      clock: seconds counter timing the steps (for ``s/step`` and the ETA).
      compiles: returns what XLA compiled since its previous call
        (``compile_watch.CompileWatch.lap``); None: nothing is known to compile.
      eval_every: an evaluation follows every this many steps (``eval.every_steps``; 0:
        none): the ETA counts those still to come at the recent evaluations' median.

    Use as a context manager (or call :meth:`close`) so the bar is finalised.
    """

    def __init__(
        self,
        total_steps: int,
        *,
        start_step: int = 0,
        fields: Sequence[tuple[str, str]] = DEFAULT_PROGRESS_FIELDS,
        stream: TextIO | None = None,
        live: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
        compiles: Callable[[], Compiles] | None = None,
        eval_every: int = 0,
    ) -> None:
        if not isinstance(total_steps, int) or total_steps < 1:
            raise ValueError(f"TrainProgress.total_steps must be an int >= 1, got {total_steps!r}")
        if not isinstance(start_step, int) or not 0 <= start_step <= total_steps:
            raise ValueError(
                f"TrainProgress.start_step must be an int in [0, {total_steps}], got {start_step!r}"
            )
        self.total_steps = total_steps
        self.start_step = start_step
        self.fields = tuple(fields)
        self.rate, self.eval_rate, self.eval_every = StepRate(), StepRate(), eval_every
        self._clock = clock
        self._compiles = compiles or (lambda: NO_COMPILES)
        self._last_time, self._last_step = clock(), start_step
        self._pending, self._eval = NO_COMPILES, None
        stream = sys.stdout if stream is None else stream
        self._console = Console(file=stream, force_terminal=live, highlight=False)
        self.live = self._console.is_terminal if live is None else live
        self._stream = stream
        self._progress: Progress | None = None
        if self.live:
            self._progress = Progress(
                TextColumn("[bold]step"),
                BarColumn(bar_width=12),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("eta {task.fields[eta]}"),
                # folds onto further lines instead of being cut at the terminal width
                TextColumn("{task.fields[stats]}", table_column=Column(overflow="fold")),
                console=self._console,
            )
            self._task = self._progress.add_task(
                "train", total=total_steps, completed=start_step, stats=COMPILING, eta="-:--:--"
            )
            self._progress.start()
        else:
            self._stream.write(f"step {start_step}/{total_steps} | {COMPILING}\n")
            self._stream.flush()

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[None]:
        """Times an evaluation inside the coming step: left out of the step's time, shown on
        its line ("eval 12 s", with its compile the first time), and the rate of the
        evaluations still to come (``eval_every``)."""
        self._pending = merged(self._pending, self._compiles())  # the step's own so far
        start = self._clock()
        yield
        seconds, compiled = self._clock() - start, self._compiles()
        self.eval_rate.add(seconds, 1, compiled.seconds if compiled.count else 0.0)
        self._eval = (seconds, compiled)

    def eta(self, step: int) -> float | None:
        """Seconds left after ``step``: the steps at :attr:`rate`, the evaluations to come at
        :attr:`eval_rate` (None while the step rate is unknown)."""
        steps, per_eval = self.rate.eta(self.total_steps - step), self.eval_rate.per_step()
        evals = (self.total_steps // self.eval_every - step // self.eval_every
                 if self.eval_every else 0)
        if steps is None or not evals or per_eval is None:
            return steps
        return steps + evals * per_eval

    def update(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Show that ``step`` finished with these metrics (scalars: floats or 0-d arrays).

        What compiled since the previous update (``compiles``) is reported as "compiled in
        N s" the first time, and named on a line of its own later; either step stays out of
        the rate.
        """
        now, compiles = self._clock(), merged(self._pending, self._compiles())
        aside, eval_compiles = self._eval or (0.0, NO_COMPILES)
        seconds, steps = now - self._last_time - aside, max(step - self._last_step, 1)
        first = self._last_step == self.start_step
        self._last_time, self._last_step = now, step
        self._pending, self._eval = NO_COMPILES, None
        self.rate.add(max(seconds, 0.0), steps, compiles.seconds if compiles.count else 0.0)
        parts = [format_fields(metrics, self.fields)]
        if compiles.count and first:
            parts.append(f"compiled in {compiles.seconds:.0f} s")
        elif compiles.count:
            self.message(f"step {step}: compiled {compiles.summary()} after the first step")
        if aside:
            parts.append(f"eval {aside:.0f} s" + (f" (compiled in {eval_compiles.seconds:.0f} s)"
                                                   if eval_compiles.count else ""))
        rate, eta = self.rate.per_step(), self.eta(step)
        if self._progress is not None:
            self._progress.update(self._task, completed=step,
                                  stats=" | ".join(p for p in parts if p),
                                  eta="-:--:--" if eta is None else format_duration(eta))
            return
        if rate is not None:
            parts.append(f"{rate:.2f} s/step | eta {format_duration(eta)}")
        self._stream.write(" | ".join([f"step {step}/{self.total_steps}",
                                       *(p for p in parts if p)]) + "\n")
        self._stream.flush()

    def message(self, text: str) -> None:
        """Print a line (e.g. "saved checkpoint 10") without disturbing the bar."""
        if self._progress is not None:
            self._progress.console.print(text, markup=False)
        else:
            self._stream.write(text + "\n")
            self._stream.flush()

    def close(self) -> None:
        """Stop the live bar (leaving its last state on screen)."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def __enter__(self) -> TrainProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
