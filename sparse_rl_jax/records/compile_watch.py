"""XLA compilations in this process, as they happen: how many, of which functions, and the
seconds spent tracing, lowering and compiling them.

Built on ``jax.monitoring``'s event-duration listener (public; jax 0.10-0.12 record these
events for every jit cache miss, eager ops included, and for loads from the persistent
compilation cache): no reading of jit's private caches. The trainer reports a step's compile
seconds apart from its time (``step_rate.StepRate``) and names what compiled after step 1;
``benchmarks/kit/compile_count.py`` counts compiles with it in the tests and benchmarks.
"""

from __future__ import annotations

import collections
import threading
from typing import NamedTuple

import jax

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
"""One event per XLA compilation (or persistent-cache load), named by the function."""
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                  "/jax/core/compile/jaxpr_to_mlir_module_duration", BACKEND_COMPILE)
"""The events whose seconds count as compiling: tracing, lowering, XLA."""


class Compiles(NamedTuple):
    """The compilations of one interval (:meth:`CompileWatch.lap`).

    Attributes:
      count: XLA compilations.
      seconds: seconds traced, lowered and compiled.
      names: ``"jit(<function>)"`` of each compilation, in order.
    """

    count: int
    seconds: float
    names: tuple[str, ...]

    def summary(self, most: int = 6) -> str:
        """``"12 programs (jit(prefill), jit(score), ... 6 more) in 3.1 s"``."""
        shown = ", ".join(self.names[:most])
        more = f", ... {self.count - most} more" if self.count > most else ""
        return (f"{self.count} program{'s' * (self.count != 1)} ({shown}{more}) in "
                f"{self.seconds:.1f} s")


NO_COMPILES = Compiles(0, 0.0, ())


def merged(first: Compiles, second: Compiles) -> Compiles:
    """The compilations of two intervals as one."""
    return Compiles(first.count + second.count, first.seconds + second.seconds,
                    first.names + second.names)


class CompileWatch:
    """Listens to compile events from ``__enter__`` to ``__exit__`` (any thread).

    ``counts`` holds the compilations per function since ``__enter__`` (a live
    ``Counter``); :meth:`lap` returns those since the previous lap.
    """

    def __init__(self) -> None:
        self.counts: collections.Counter = collections.Counter()
        self._lock = threading.Lock()
        self._names: list[str] = []
        self._seconds = 0.0

    def _listen(self, event: str, duration_secs: float, **kwargs) -> None:
        if event not in COMPILE_EVENTS:
            return
        with self._lock:
            self._seconds += duration_secs
            if event == BACKEND_COMPILE:
                name = str(kwargs.get("fun_name", "?"))
                self.counts[name] += 1
                self._names.append(name)

    def lap(self) -> Compiles:
        """The compilations since the previous lap (or ``__enter__``)."""
        with self._lock:
            out = Compiles(len(self._names), self._seconds, tuple(self._names))
            self._names, self._seconds = [], 0.0
        return out

    def __enter__(self) -> "CompileWatch":
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_duration_listener(self._listen)
