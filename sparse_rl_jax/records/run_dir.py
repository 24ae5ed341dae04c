"""The run directory as a record you can trust: path checks, an owner lock and a manifest.

``run_dir`` holds ``manifest.json`` (``config_hash``, ``code_version``, ``last_good_step``)
and, while a run owns it, ``run.lock`` (the owner's host and pid). :func:`open_run_dir` reads
both and refuses a directory that another live run holds or whose manifest records a
different config before anything in it is written; only then does it take the lock. The
config hash covers what determines the run (model, data, method, seeds), never where the
directory lives, so a moved or copied run directory resumes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

MANIFEST = "manifest.json"
LOCK = "run.lock"
# Entries that mark a directory as a run directory (a non-empty directory without any of
# them is someone else's and is refused).
RUN_ENTRIES = (MANIFEST, LOCK, "config.yaml", "checkpoints", "metrics.jsonl")


class RunDirError(RuntimeError):
    """The run directory cannot be used: not a directory, not writable, owned by another live
    run, or holding a run with a different config."""


def code_version() -> str:
    """The installed ``sparse-rl-jax`` version (recorded in the manifest, informational)."""
    try:
        return metadata.version("sparse-rl-jax")
    except metadata.PackageNotFoundError:
        return "unknown"


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def check_run_dir_path(run_dir: Path) -> None:
    """Refuses (RunDirError naming the path) a run_dir that is a file, lies under a file, or
    is an existing directory this process cannot write; writes nothing lasting (an existing
    directory gets a probe file that is removed at once)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"run_dir={str(run_dir)!r} is a file, not a directory")
    for parent in run_dir.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise RunDirError(f"run_dir={str(run_dir)!r}: its parent {parent} is a file")
            break
    if run_dir.is_dir():
        try:
            fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=run_dir)
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            raise RunDirError(f"run_dir={str(run_dir)!r} is not writable: {e.strerror}") from e


def read_manifest(run_dir: Path) -> dict[str, Any] | None:
    """The manifest of ``run_dir``, or None when it has none; a malformed one is an error."""
    path = run_dir / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RunDirError(f"{path} is not valid JSON ({e}); restore it or use a new run_dir") \
            from e
    if not isinstance(manifest, dict) or not isinstance(manifest.get("config_hash"), str):
        raise RunDirError(f"{path} has no 'config_hash'; restore it or use a new run_dir")
    return manifest


def _lock_owner(path: Path) -> dict[str, Any] | None:
    try:
        owner = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # vanished or half-written: treated as stale
    return owner if isinstance(owner, dict) else None


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by another user
    return True


def check_not_locked(run_dir: Path, take_over: bool = False) -> dict[str, Any] | None:
    """Raises RunDirError when a live run on this host holds the lock, or a run on another
    host does (whether that one is alive cannot be told from here) unless ``take_over``;
    returns the owner that may be taken over (a dead pid here, or any with ``take_over``),
    or None."""
    owner = _lock_owner(run_dir / LOCK) if (run_dir / LOCK).exists() else None
    if owner is None:
        return None
    host = socket.gethostname()
    here = owner.get("host") == host
    if here and owner.get("pid") == os.getpid():
        return None
    if here and _alive(owner.get("pid")):
        raise RunDirError(
            f"run_dir={str(run_dir)!r} is in use by another run (pid {owner.get('pid')} on "
            f"{host}, lock file {run_dir / LOCK}); wait for it or use a new run_dir")
    if not here and not take_over:
        raise RunDirError(
            f"run_dir={str(run_dir)!r} is locked by a run on another host (pid "
            f"{owner.get('pid')} on {owner.get('host')}, lock file {run_dir / LOCK}); this "
            f"host ({host}) cannot tell whether it is still running. If it is gone (it "
            "crashed, or the directory was copied or moved here), run the same command with "
            "--take-over; otherwise wait for it or use a new run_dir")
    return owner


@dataclasses.dataclass
class RunDir:
    """An opened run directory: this process holds its lock until :meth:`close`.

    Attributes:
      path: the directory.
      config_hash: the hash of the config this run trains.
      manifest: the manifest found on opening (None for a new directory).
    """

    path: Path
    config_hash: str
    manifest: dict[str, Any] | None

    def write_manifest(self, last_good_step: int | None) -> None:
        """Records the config hash, code version and newest committed checkpoint step."""
        _atomic_write(self.path / MANIFEST, json.dumps({
            "config_hash": self.config_hash, "code_version": code_version(),
            "last_good_step": last_good_step}, indent=1) + "\n")

    def close(self) -> None:
        """Releases the lock (only if this process still holds it)."""
        lock = self.path / LOCK
        owner = _lock_owner(lock) if lock.exists() else None
        if owner and owner.get("pid") == os.getpid() and owner.get("host") == socket.gethostname():
            lock.unlink(missing_ok=True)


def check_resumable(run_dir: Path, config_hash: str, checkpoint_hash: Callable[[], str | None],
                    take_over: bool = False) -> dict[str, Any] | None:
    """Reads ``run_dir`` (writing nothing) and refuses it when it cannot hold this run.

    Args:
      run_dir: the run directory (it may not exist yet).
      config_hash: this run's config hash.
      checkpoint_hash: returns the config hash stored with the newest checkpoint (None if
        there is none); asked only for a directory without a manifest (older runs).
      take_over: a lock left by a run on another host may be taken over (see
        :func:`check_not_locked`).

    Returns:
      The manifest, or None for a new or manifest-less directory.

    Raises:
      RunDirError: path problems, another live owner, a different config, or a non-empty
        directory that is not a run directory.
    """
    check_run_dir_path(run_dir)
    if not run_dir.is_dir():
        return None
    check_not_locked(run_dir, take_over)
    manifest = read_manifest(run_dir)
    stored = manifest["config_hash"] if manifest else checkpoint_hash()
    if stored is not None and stored != config_hash:
        raise RunDirError(
            f"run_dir={str(run_dir)!r} holds a run with a different config (hash {stored} != "
            f"{config_hash}); nothing was changed in it; resume it with its own config.yaml or "
            "use a new run_dir")
    entries = {p.name for p in run_dir.iterdir()}
    if entries and not entries & set(RUN_ENTRIES):
        raise RunDirError(
            f"run_dir={str(run_dir)!r} is a non-empty directory that is not a run directory "
            f"(holds {sorted(entries)[:5]}...); use a new or empty directory")
    return manifest


def open_run_dir(run_dir: Path, config_hash: str, manifest: dict[str, Any] | None,
                 take_over: bool = False) -> RunDir:
    """Creates ``run_dir`` if needed and takes its lock (``run.lock`` with host and pid); a
    lock left by a dead process (or, with ``take_over``, by a run on another host) is taken
    over. Call :func:`check_resumable` first."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunDirError(f"run_dir={str(run_dir)!r} cannot be created: {e.strerror}") from e
    lock = run_dir / LOCK
    mine = json.dumps({"pid": os.getpid(), "host": socket.gethostname()})
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        check_not_locked(run_dir, take_over)  # another run may have started since
        _atomic_write(lock, mine)  # a stale lock: take it over
    except OSError as e:
        raise RunDirError(f"run_dir={str(run_dir)!r} is not writable: {e.strerror}") from e
    else:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(mine)
    if _lock_owner(lock) != json.loads(mine):  # lost a take-over race
        check_not_locked(run_dir)
        raise RunDirError(f"run_dir={str(run_dir)!r}: lost the lock {lock} to another run")
    return RunDir(run_dir, config_hash, manifest)
