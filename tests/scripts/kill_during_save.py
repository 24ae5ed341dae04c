"""``run.py`` whose process SIGKILLs itself while committing checkpoint step ``$KILL_AT_STEP``:
every file of that step is written to orbax's temporary directory, the commit rename is not
done (the worst moment for a kill during a save).

Run by tests/test_trainer.py in a subprocess: ``python kill_during_save.py train ...``.
"""

import os
import signal
import sys
from pathlib import Path

# Import this checkout's packages even where another copy is installed.
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from orbax.checkpoint._src.path import atomicity  # noqa: E402

KILL_AT_STEP = os.environ["KILL_AT_STEP"]
_finalize = atomicity.AtomicRenameTemporaryPath.finalize


async def finalize_or_die(self, *args, **kwargs):
    """Orbax's commit, except for step ``KILL_AT_STEP``: the process is killed first."""
    if self.get_final().name == KILL_AT_STEP:
        os.kill(os.getpid(), signal.SIGKILL)
    return await _finalize(self, *args, **kwargs)


atomicity.AtomicRenameTemporaryPath.finalize = finalize_or_die

import run  # noqa: E402

sys.exit(run.main(sys.argv[1:]))
