"""``run.py`` whose disk "fills" when checkpoint step ``$DISK_FULL_AT_STEP`` is saved: from
that save on, every write past ``$DISK_FULL_BYTES`` (default 16 KiB) of one file fails with
EFBIG (``RLIMIT_FSIZE``, SIGXFSZ ignored), as writes fail on a full disk; the real orbax save
path meets the failure.

Run by the fault tests in a subprocess: ``python disk_full_at_save.py train ...``.
"""

import os
import resource
import signal
import sys
from pathlib import Path

# Import this checkout's packages even where another copy is installed.
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import orbax.checkpoint as ocp  # noqa: E402

FULL_AT_STEP = int(os.environ["DISK_FULL_AT_STEP"])
LIMIT = int(os.environ.get("DISK_FULL_BYTES", 16 * 1024))
_save = ocp.CheckpointManager.save


def save_on_a_full_disk(self, step, *args, **kwargs):
    """Orbax's save, with the file-size limit set first when ``step`` is the full one."""
    if step == FULL_AT_STEP:
        self.wait_until_finished()  # earlier saves are committed on a disk that had room
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, resource.RLIM_INFINITY))
    return _save(self, step, *args, **kwargs)


ocp.CheckpointManager.save = save_on_a_full_disk

import run  # noqa: E402

sys.exit(run.main(sys.argv[1:]))
