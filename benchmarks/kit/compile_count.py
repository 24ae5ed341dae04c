"""Count XLA compilations, per jitted function, inside a ``with`` block.

Used to check that a call does not recompile (same shapes, same static args) without reading
jit's private cache: ``sparse_rl_jax.records.compile_watch.CompileWatch`` listens to the
``jax.monitoring`` event that every backend compile records with the function's name.
"""

from __future__ import annotations

import collections
import contextlib
from typing import Iterator

from sparse_rl_jax.records.compile_watch import CompileWatch


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
    with CompileWatch() as watch:
        yield watch.counts
