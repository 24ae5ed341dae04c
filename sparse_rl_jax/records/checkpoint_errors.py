"""What a failed checkpoint operation looks like to the caller: one :class:`CheckpointError`
naming the directory, the step and the reason, instead of orbax's own reports.

Orbax writes a checkpoint in background threads; when a write fails (a full disk) each of
them logs the failure with a full traceback (ERROR records on the ``absl`` logger, and
asyncio's "exception was never retrieved" for each orbax future: some hundreds of lines)
before and after the error reaches the caller. :class:`OrbaxErrorLog` holds those records
back while a :class:`~sparse_rl_jax.records.checkpoint.Checkpointer` is open and :func:`save_error`
attaches them to the CheckpointError as a note, so they are still there for whoever prints
the traceback (``run.py --debug``). asyncio's reports of the failed save's futures that come
later, when the futures are garbage-collected, restate the reported failure and are dropped,
as are Python's warnings about the aborted save's coroutines that were never awaited
(:data:`FAILURE_ECHOES`). A failed restore leaves the same kind of echoes: its array reads
still in flight are closed unfinished when collected, and each one's error (naming the step's
files) would print as an ``Exception ignored in: <coroutine ...>`` traceback.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings

# Substrings of orbax / tensorstore / OS errors that mean the disk (or a quota or a file-size
# limit) ran out of room.
DISK_FULL_MARKERS = ("RESOURCE_EXHAUSTED", "No space", "too large", "ENOSPC", "EFBIG",
                     "Disk quota")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, unreadable, or does not match the requested state."""


_ORBAX = f"{os.sep}orbax{os.sep}"
# The JSON spec tensorstore appends to its errors (hundreds of characters, no reason in it).
_TENSORSTORE_SPEC = re.compile(r"\s*\[tensorstore_spec='.*?'\]")
# Loggers orbax's failures reach: its own (absl) and asyncio's for its unawaited futures.
_LOGGERS = ("absl", "asyncio")
# The RuntimeWarning Python emits when an aborted save's write coroutine is collected unrun.
_UNAWAITED = r"coroutine '.*' was never awaited"


def _from_orbax(record: logging.LogRecord, directory: str) -> bool:
    """Whether ``record`` was logged inside orbax, carries an exception raised there, or
    reports an error about a file under ``directory`` (tensorstore's own futures)."""
    if _ORBAX in record.pathname or directory in record.getMessage():
        return True
    tb = record.exc_info[2] if record.exc_info else None
    while tb is not None:
        if _ORBAX in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False


class OrbaxErrorLog(logging.Filter):
    """Holds back orbax's ERROR records about the checkpoints in ``directory`` (use
    :meth:`attach` / :meth:`detach`); :meth:`take` returns them as text for a
    CheckpointError's note."""

    def __init__(self, directory: str) -> None:
        super().__init__()
        self.directory = directory
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        """False (held back) for an ERROR record from orbax, True otherwise."""
        if record.levelno >= logging.ERROR and _from_orbax(record, self.directory):
            self.records.append(record)
            return False
        return True

    def attach(self) -> None:
        """Starts holding back orbax's error records."""
        for name in _LOGGERS:
            logging.getLogger(name).addFilter(self)

    def detach(self) -> None:
        """Stops holding them back; records no error took are logged now (nothing is lost)."""
        for name in _LOGGERS:
            logging.getLogger(name).removeFilter(self)
        for record in self.take_records():
            logging.getLogger(record.name).handle(record)

    def take_records(self) -> list[logging.LogRecord]:
        """The held-back records (oldest first), forgetting them."""
        records, self.records = self.records, []
        return records

    def take(self) -> str:
        """The held-back records formatted with their tracebacks ('' when none)."""
        formatter = logging.Formatter("%(levelname)s:%(name)s:%(message)s")
        return "\n".join(formatter.format(record) for record in self.take_records())


def _names_any(err: BaseException | None, paths: set[str]) -> bool:
    """Whether the message of ``err``, or of an error it was raised from or during, names one
    of ``paths``."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if any(path in str(err) for path in paths):
            return True
        err = err.__cause__ or err.__context__
    return False


class _FailureEchoes(logging.Filter):
    """Drops the echoes of checkpoint operations that already failed with a CheckpointError:
    they restate that failure and arrive when orbax's abandoned futures and coroutines are
    garbage-collected, often after the checkpointer is closed and the error printed (at
    interpreter exit). Only reports naming a path whose failure was reported are dropped:
    asyncio's ERROR records ("Future exception was never retrieved") and the errors of
    coroutines closed unfinished (``sys.unraisablehook``, "Exception ignored in: <coroutine
    ...>"). Once a failure was reported, the "coroutine ... was never awaited"
    RuntimeWarnings of the aborted reads and writes (which name no path) are ignored."""

    def __init__(self) -> None:
        super().__init__()
        self.paths: set[str] = set()
        self._next_hook = sys.__unraisablehook__

    def filter(self, record: logging.LogRecord) -> bool:
        """False for an asyncio ERROR record naming a path of a reported failure."""
        return not (record.levelno >= logging.ERROR
                    and any(p in record.getMessage() for p in self.paths))

    def unraisablehook(self, unraisable) -> None:
        """``sys.unraisablehook`` while installed: drops an error naming a path of a reported
        failure and passes anything else to the hook it replaced."""
        if not _names_any(unraisable.exc_value, self.paths):
            self._next_hook(unraisable)

    def add(self, path: str) -> None:
        """Starts dropping the echoes of the failed operation on ``path`` (a checkpoint
        directory, or one step's directory): installs the filter on the asyncio logger and in
        front of ``sys.unraisablehook`` (once; again if the hook was replaced since), and the
        warnings filter once per process."""
        if not self.paths:
            warnings.filterwarnings("ignore", message=_UNAWAITED, category=RuntimeWarning)
        self.paths.add(path)
        asyncio_log = logging.getLogger("asyncio")
        if self not in asyncio_log.filters:
            asyncio_log.addFilter(self)
        if getattr(sys.unraisablehook, "__self__", None) is not self:
            self._next_hook, sys.unraisablehook = sys.unraisablehook, self.unraisablehook


FAILURE_ECHOES = _FailureEchoes()


def save_error(directory: str, err: BaseException, step: int | None,
               committed: list[int], orbax_log: OrbaxErrorLog) -> CheckpointError:
    """The CheckpointError for a failed save of ``step`` (None: unknown) in ``directory``:
    the first line of orbax's error, ``(disk full?)`` when it reads like one, the committed
    steps (intact: orbax keeps an unfinished write in a temporary directory that is never
    listed) and what to do; orbax's held-back log is attached as a note."""
    text = str(err).strip()
    reason = _TENSORSTORE_SPEC.sub("", text.splitlines()[0]) if text else type(err).__name__
    full = any(marker in text for marker in DISK_FULL_MARKERS)
    which = f"checkpoint step {step}" if step is not None else "a checkpoint"
    resume = (f"; free space and run the same command to resume from step {committed[-1]}"
              if full and committed else "")
    error = CheckpointError(
        f"saving {which} in {directory} failed{' (disk full?)' if full else ''}: {reason}; "
        f"committed checkpoints: {committed}{resume}")
    details = orbax_log.take()
    if details:
        error.add_note(f"orbax's log of the failure:\n{details}")
    FAILURE_ECHOES.add(directory)
    return error
