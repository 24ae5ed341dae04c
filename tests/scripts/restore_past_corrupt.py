"""Resumes past a corrupt newest checkpoint ``$RESTORES`` times (default 4), each in a fresh
directory under ``argv[1]``: steps 1 and 2 of a 60-array state are saved, step 2's array
metadata is overwritten with garbage, and ``restore_newest_good`` falls back to step 1. The
failure meets orbax with the step's array reads in flight; those left unawaited are collected
before exit. ``sys.unraisablehook`` is the one ``run.py`` installs, so stderr is what a
resuming ``run.py train`` would print about it.

Run by the fault tests in a subprocess: ``python restore_past_corrupt.py DIR``; prints the
step each restore returned.
"""

import gc
import os
import sys
import time
from pathlib import Path

# Import this checkout's packages even where another copy is installed.
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import jax.numpy as jnp  # noqa: E402

from sparse_rl_jax.cli import _drop_closed_loop_noise  # noqa: E402
from sparse_rl_jax.records.checkpoint import Checkpointer  # noqa: E402

sys.unraisablehook = _drop_closed_loop_noise  # as the cli's main does without --debug


def state(value: float) -> dict:
    """60 float32 arrays of 256 KiB: enough reads that some are in flight at the failure."""
    return {f"w{i}": jnp.full((256, 256), value, jnp.float32) for i in range(60)}


for attempt in range(int(os.environ.get("RESTORES", 4))):
    directory = Path(sys.argv[1]) / str(attempt)
    with Checkpointer(directory) as ckpt:
        for step in (1, 2):
            ckpt.save(step, state(float(step)), {"step": step})
    for file in (directory / "2" / "state" / "array_metadatas").iterdir():
        file.write_bytes(b"garbage")
    with Checkpointer(directory) as ckpt:
        print(ckpt.restore_newest_good(state(0.0), log=lambda _: None)[1]["step"])
time.sleep(1)  # the abandoned reads finish in tensorstore's threads
gc.collect()
