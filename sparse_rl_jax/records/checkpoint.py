"""Atomic, keep-last-N checkpoints of a training-state pytree plus JSON metadata (orbax).

A checkpoint at step ``s`` is one directory ``<directory>/<s>`` holding three orbax items:

- ``state``: the training-state pytree (params, optimizer state, step, RNG keys, ...), written
  with ``ocp.args.StandardSave``. Typed PRNG keys are stored as their raw ``key_data`` (uint32)
  and re-wrapped on restore, so the files are plain arrays.
- ``meta``: a JSON object supplied by the caller (data position, config hash, ...).
- ``prng_impls``: JSON ``{leaf path: PRNG impl name}`` for the typed-key leaves of ``state``.

Orbax writes each step into ``<s>.orbax-checkpoint-tmp-*`` and renames it to ``<s>`` only when
every item is complete, so a process killed during a save leaves the previous checkpoints
intact; unfinished temporary directories are ignored by :meth:`Checkpointer.latest_step` and
removed when the next :class:`Checkpointer` opens the directory. Saves are asynchronous: the
arrays are copied off the device before :meth:`Checkpointer.save` returns and written in the
background; :meth:`Checkpointer.wait` blocks until the last save is committed and
:meth:`Checkpointer.check` raises at once if it has already failed (one ``CheckpointError``
naming the step, ``checkpoint_errors``). Matching a stored state to a restore target (leaf
names, typed keys, shapes, finiteness) is ``checkpoint_layout``.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import orbax.checkpoint as ocp

from sparse_rl_jax.records.checkpoint_errors import (FAILURE_ECHOES, CheckpointError, OrbaxErrorLog,
                                                     save_error)
from sparse_rl_jax.records.checkpoint_layout import (check_layout, flat_shapes, from_raw,
                                                     nonfinite_leaves, prng_impls, raw_target,
                                                     to_raw)

__all__ = ["CheckpointError", "Checkpointer"]

PyTree = Any

_STATE = "state"
_META = "meta"
_PRNG = "prng_impls"


def _check_json(meta: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(meta, Mapping):
        raise TypeError(f"checkpoint meta must be a dict, got {type(meta).__name__}")
    for key, value in meta.items():
        if not isinstance(key, str):
            raise TypeError(f"checkpoint meta keys must be str, got {key!r}")
        try:
            json.dumps(value)
        except (TypeError, ValueError) as err:
            raise TypeError(f"checkpoint meta[{key!r}] is not JSON-serialisable: {err}") from err
    return dict(meta)


def _drop_read_only_notice(record: logging.LogRecord) -> bool:
    """Logging filter: False for orbax's "Given directory is read only" notice."""
    return not str(record.msg).startswith("Given directory is read only")


class Checkpointer:
    """Saves and restores ``(state pytree, meta dict)`` pairs under one directory.

    Args:
      directory: root directory; step ``s`` lives in ``directory/<s>``.
      keep: how many of the most recent checkpoints to keep (>= 1).
      save_every: :meth:`save` writes only steps divisible by this (>= 1) unless forced.
      read_only: open an existing directory for restoring only (evaluation); the directory
        must exist and :meth:`save` is refused.

    Use as a context manager or call :meth:`close` so background writes finish. While it is
    open, orbax's own error log of a failed save is held back and attached to the
    CheckpointError instead (``checkpoint_errors.OrbaxErrorLog``).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        keep: int = 3,
        save_every: int = 1,
        read_only: bool = False,
    ) -> None:
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"Checkpointer.keep must be an int >= 1, got {keep!r}")
        if not isinstance(save_every, int) or save_every < 1:
            raise ValueError(f"Checkpointer.save_every must be an int >= 1, got {save_every!r}")
        self.directory = os.path.abspath(os.fspath(directory))
        if read_only and not os.path.isdir(self.directory):
            raise CheckpointError(f"checkpoint directory {self.directory} does not exist")
        if os.path.exists(self.directory) and not os.path.isdir(self.directory):
            raise CheckpointError(f"checkpoint directory {self.directory} is not a directory")
        self.read_only = read_only
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        registry.add(_STATE, ocp.args.StandardSave)
        registry.add(_STATE, ocp.args.StandardRestore)
        for item in (_META, _PRNG):
            registry.add(item, ocp.args.JsonSave)
            registry.add(item, ocp.args.JsonRestore)
        options = ocp.CheckpointManagerOptions(
            save_decision_policy=ocp.checkpoint_managers.FixedIntervalPolicy(save_every),
            preservation_policy=ocp.checkpoint_managers.LatestN(keep),
            cleanup_tmp_directories=not read_only,
            read_only=read_only,
            save_interval_steps=0 if read_only else 1,  # orbax warns unless 0 when read_only
            create=not read_only,
        )
        absl_log = logging.getLogger("absl")
        absl_log.addFilter(_drop_read_only_notice)  # orbax warns on every read-only open
        try:
            self._manager = ocp.CheckpointManager(
                self.directory, options=options, handler_registry=registry
            )
        finally:
            absl_log.removeFilter(_drop_read_only_notice)
        self._saving: int | None = None  # the step of the last save started
        self._orbax_log = OrbaxErrorLog(self.directory)
        self._orbax_log.attach()

    # -- queries -------------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """Checkpoint steps, ascending.

        On opening, only committed steps are listed (a save killed before its commit never
        is); afterwards a save started by this object is listed at once, while its background
        write finishes (call :meth:`wait` to be sure it is on disk).
        """
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest step of :meth:`all_steps`, or None when there is none (resume from it)."""
        return self._manager.latest_step()

    def _resolve_step(self, step: int | None) -> int:
        self._manager.wait_until_finished()
        steps = self.all_steps()
        if not steps:
            raise CheckpointError(f"no checkpoint found in {self.directory}")
        if step is None:
            return steps[-1]
        if step not in steps:
            raise CheckpointError(
                f"checkpoint step {step} not found in {self.directory}; available steps: {steps}"
            )
        return step

    def read_meta(self, step: int | None = None) -> dict[str, Any]:
        """The JSON metadata of ``step`` (default: latest) without loading any arrays."""
        step = self._resolve_step(step)
        try:
            restored = self._manager.restore(
                step, args=ocp.args.Composite(**{_META: ocp.args.JsonRestore()})
            )
        except Exception as err:  # orbax/tensorstore raise many types; name the checkpoint
            raise self._read_error(
                step, f"checkpoint step {step} in {self.directory}: cannot read '{_META}'", err
            ) from err
        return dict(restored[_META])

    def stored_shapes(self, step: int | None = None) -> dict[str, tuple[int, ...]]:
        """``{leaf name: shape}`` of the state stored at ``step`` (default: latest), from its
        metadata without loading any arrays (typed keys appear as their raw key data)."""
        step = self._resolve_step(step)
        where = f"checkpoint step {step} in {self.directory}"
        try:
            stored = self._manager.metadata(step).item_metadata[_STATE]
        except Exception as err:  # orbax/tensorstore raise many types; name the checkpoint
            raise self._read_error(step, f"{where} is unreadable", err) from err
        if stored is None:
            raise CheckpointError(f"{where} has no '{_STATE}' item")
        return flat_shapes(stored.tree if hasattr(stored, "tree") else stored)

    # -- save ----------------------------------------------------------------------------

    def save(
        self, step: int, state: PyTree, meta: Mapping[str, Any], *, force: bool = False
    ) -> bool:
        """Start an atomic save of ``state`` and ``meta`` at ``step``; returns whether it saved.

        Saves only when ``step % save_every == 0`` unless ``force`` (use it for the final
        step). ``state`` is any pytree of arrays (typed PRNG keys allowed); ``meta`` must be
        JSON-serialisable. Steps must increase: a step at or below :meth:`latest_step`
        is an error (a directory from another run must be resumed, not overwritten). Older
        checkpoints beyond ``keep`` are deleted once the new one is committed.
        """
        if self.read_only:
            raise CheckpointError(f"checkpoint directory {self.directory} was opened read_only")
        if not isinstance(step, (int, np.integer)) or isinstance(step, bool) or step < 0:
            raise ValueError(f"checkpoint step must be an int >= 0, got {step!r}")
        step = int(step)
        meta = _check_json(meta)
        latest = self.latest_step()
        if latest is not None and step <= latest:
            raise CheckpointError(
                f"cannot save step {step}: {self.directory} already holds step {latest}; "
                "resume from it or use a new directory"
            )
        if not force and not self._manager.should_save(step):
            return False
        self.wait()  # the previous save is committed, or its failure is raised naming it
        self._saving = step
        try:
            return self._manager.save(
                step,
                args=ocp.args.Composite(
                    **{
                        _STATE: ocp.args.StandardSave(to_raw(state)),
                        _META: ocp.args.JsonSave(meta),
                        _PRNG: ocp.args.JsonSave(prng_impls(state)),
                    }
                ),
                force=True,
            )
        except Exception as err:  # this save could not start (disk, permissions)
            raise self._save_error(err) from err

    def _save_error(self, err: BaseException) -> CheckpointError:
        """A failed save (the last one started) as a CheckpointError naming its step; orbax
        keeps the unfinished write in a temporary directory, so committed checkpoints stay
        intact and restorable."""
        committed = [s for s in self._manager.all_steps() if s != self._saving]
        return save_error(self.directory, err, self._saving, sorted(committed), self._orbax_log)

    # -- restore -------------------------------------------------------------------------

    def restore(
        self, abstract_state: PyTree, *, step: int | None = None
    ) -> tuple[PyTree, dict[str, Any]]:
        """Load ``(state, meta)`` from ``step`` (default: the latest committed step).

        ``abstract_state`` fixes the tree structure, shapes and placement of the result: its
        leaves are ``jax.ShapeDtypeStruct`` (e.g. from ``jax.eval_shape``) or arrays, and each
        restored array takes the leaf's ``.sharding`` (a sharded target restores sharded;
        leaves without one go to the first local device). Dtypes are cast to the target's.
        Typed-key leaves come back as typed keys of the same PRNG impl.

        Raises CheckpointError, naming the step and leaf, when there is no checkpoint, the step
        is missing, the files are unreadable, or the tree structure or a shape differs.
        """
        step = self._resolve_step(step)
        where = f"checkpoint step {step} in {self.directory}"
        try:
            impls = self._manager.restore(
                step, args=ocp.args.Composite(**{_PRNG: ocp.args.JsonRestore()})
            )[_PRNG]
        except Exception as err:  # orbax/tensorstore raise many types; name the checkpoint
            raise self._read_error(step, f"{where} is unreadable", err) from err
        target = raw_target(abstract_state, impls, where)
        check_layout(self.stored_shapes(step), flat_shapes(target), where)
        try:
            restored = self._manager.restore(
                step,
                args=ocp.args.Composite(
                    **{
                        _STATE: ocp.args.StandardRestore(target),
                        _META: ocp.args.JsonRestore(),
                    }
                ),
            )
        except Exception as err:  # orbax/tensorstore raise many types; name the checkpoint
            raise self._read_error(step, f"{where} could not be restored", err) from err
        return from_raw(restored[_STATE], impls), dict(restored[_META])

    def _read_error(self, step: int, failure: str, err: Exception) -> CheckpointError:
        """``failure: err`` as the CheckpointError of a failed read of ``step``. orbax leaves
        that read's other array reads running; when they are collected, their errors (which
        name the step's files) are dropped as echoes of this one
        (``checkpoint_errors.FAILURE_ECHOES``), not printed as hundreds of lines of
        "Exception ignored in: <coroutine ...>" tracebacks."""
        FAILURE_ECHOES.add(os.path.join(self.directory, str(step), ""))
        return CheckpointError(f"{failure}: {err}")

    def restore_newest_good(
        self, abstract_state: PyTree, log: Callable[[str], None] = print
    ) -> tuple[PyTree, dict[str, Any]]:
        """:meth:`restore` of the newest step that restores, skipping corrupt newer ones.

        A step is corrupt when it cannot be read or matched to ``abstract_state``, or when a
        floating-point leaf holds NaN or inf (a flipped bit). Each skipped step is moved to
        ``<directory>.corrupt/<step>`` (kept for inspection, out of the step listing, so the
        run can save that step again) and logged with where it went and why.

        Raises:
          CheckpointError: no step restores (the message lists every step's reason; nothing
            is moved).
        """
        self._manager.wait_until_finished()
        reasons = {}
        for step in reversed(self.all_steps()):
            try:
                restored = self.restore(abstract_state, step=step)
                bad = nonfinite_leaves(restored[0])
                if bad:
                    raise CheckpointError(f"checkpoint step {step} in {self.directory}: "
                                          f"leaves {bad} hold NaN or inf")
            except CheckpointError as err:
                reasons[step] = str(err)
                continue
            for bad, reason in reasons.items():
                log(f"warning: skipping checkpoint step {bad} (moved to "
                    f"{self._set_aside(bad)}): {reason}")
            return restored
        raise CheckpointError(f"no checkpoint in {self.directory} restores: " +
                              "; ".join(reasons.values()))

    def _set_aside(self, step: int) -> str:
        """Moves step ``step`` to ``<directory>.corrupt/`` (never over an earlier one there);
        returns where it went."""
        aside = f"{self.directory}.corrupt"
        os.makedirs(aside, exist_ok=True)
        target = os.path.join(aside, str(step))
        suffix = 0
        while os.path.exists(target):
            suffix += 1
            target = os.path.join(aside, f"{step}.{suffix}")
        os.replace(os.path.join(self.directory, str(step)), target)
        self._manager.reload()
        return target

    # -- lifecycle -----------------------------------------------------------------------

    def check(self) -> None:
        """Raises CheckpointError if a background save has already failed (e.g. the disk
        filled); returns at once while the last save is still being written."""
        try:
            self._manager.check_for_errors()
        except Exception as err:
            raise self._save_error(err) from err

    def wait(self) -> None:
        """Block until the last save is committed (and old steps are deleted).

        Raises CheckpointError when that background write failed (e.g. the disk filled).
        """
        try:
            self._manager.wait_until_finished()
        except Exception as err:
            raise self._save_error(err) from err

    def close(self) -> None:
        """Wait for pending work and release orbax resources (CheckpointError as in wait)."""
        try:
            self._manager.close()
        except Exception as err:
            raise self._save_error(err) from err
        finally:
            self._orbax_log.detach()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """Closes. When the block raised, that error stays the one raised: a failure to close
        and orbax's error records still held back (a failed save's threads may log after its
        error was raised) are added to it as notes instead of being raised or logged."""
        if exc is None:
            self.close()
            return
        try:
            self._manager.close()
        except Exception as close_err:  # reported on the block's error, which stays raised
            exc.add_note(f"closing the checkpointer also failed: {close_err}")
        finally:
            late = self._orbax_log.take()
            self._orbax_log.detach()
            if late:
                exc.add_note(f"orbax's log of the failure:\n{late}")
