"""Live progress for a training loop: a rich progress bar on a terminal, plain lines otherwise.

On a TTY the bar shows ``step/total``, elapsed time, ETA and the latest values of a few
metrics. When the stream is not a terminal (CI, a subprocess, a log file) every update prints
one self-contained line instead, e.g.::

    step 12/100 | reward 0.412 | rejected 0.07 | kv saved 0.75 | 3.10 s/step | eta 0:04:32
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping, Sequence
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
    TimeRemainingColumn,
)

# (metric name, short label) pairs shown by default.
DEFAULT_PROGRESS_FIELDS: tuple[tuple[str, str], ...] = (
    ("reward_mean", "reward"),
    ("rejection_rate", "rejected"),
    ("kv_token_savings", "kv saved"),
)


COMPILING = "compiling the first step..."
"""Shown until the first step ends: that step includes XLA compilation."""


def _format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


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
      clock: seconds counter used for the plain-mode rate and ETA.

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
        self._clock = clock
        self._start_time = clock()
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
                TextColumn("eta"),
                TimeRemainingColumn(),
                # folds onto further lines instead of being cut at the terminal width
                TextColumn("{task.fields[stats]}", table_column=Column(overflow="fold")),
                console=self._console,
                speed_estimate_period=600.0,
            )
            self._task = self._progress.add_task(
                "train", total=total_steps, completed=start_step, stats=COMPILING
            )
            self._progress.start()
        else:
            self._stream.write(f"step {start_step}/{total_steps} | {COMPILING}\n")
            self._stream.flush()

    def update(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Show that ``step`` finished with these metrics (scalars: floats or 0-d arrays)."""
        stats = format_fields(metrics, self.fields)
        if self._progress is not None:
            self._progress.update(self._task, completed=step, stats=stats)
            return
        done = step - self.start_step
        line = f"step {step}/{self.total_steps}"
        if stats:
            line += f" | {stats}"
        if done > 0:
            per_step = (self._clock() - self._start_time) / done
            eta = per_step * max(self.total_steps - step, 0)
            line += f" | {per_step:.2f} s/step | eta {_format_duration(eta)}"
        self._stream.write(line + "\n")
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
