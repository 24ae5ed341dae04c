"""Count XLA compilations, per jitted function, inside a ``with`` block.

Used to check that a call does not recompile (same shapes, same static args) without reading
jit's private cache. Built on ``jax.monitoring``: every backend compile records an event with
the name of the function being compiled.
"""

from __future__ import annotations

import collections
import contextlib
from typing import Iterator

import jax

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def count_compiles() -> Iterator[collections.Counter]:
    """Yields a ``Counter``: ``"jit(<function name>)"`` (e.g. ``"jit(decode_loop)"``) -> XLA
    compilations (or loads from the persistent compilation cache) that
    happened inside the block (eager ops count too, as ``jit(<primitive>)``).

    Example::

        with count_compiles() as compiles:
            generate(...)
        assert compiles["jit(decode_loop)"] == 0  # reused the compiled decode loop
    """
    counts: collections.Counter = collections.Counter()

    def listener(event: str, duration_secs: float, **kwargs) -> None:
        del duration_secs
        if event == _BACKEND_COMPILE:
            counts[str(kwargs.get("fun_name", "?"))] += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield counts
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
