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
background; :meth:`Checkpointer.wait` blocks until the last save is committed.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

PyTree = Any

_STATE = "state"
_META = "meta"
_PRNG = "prng_impls"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, unreadable, or does not match the requested state."""


def _path_name(path: tuple[Any, ...]) -> str:
    """Render a pytree key path as ``a/0/b`` (the same for a namedtuple and orbax's dict)."""
    parts = []
    for key in path:
        if isinstance(key, jax.tree_util.DictKey):
            parts.append(str(key.key))
        elif isinstance(key, jax.tree_util.SequenceKey):
            parts.append(str(key.idx))
        elif isinstance(key, jax.tree_util.GetAttrKey):
            parts.append(key.name)
        elif isinstance(key, jax.tree_util.FlattenedIndexKey):
            parts.append(str(key.key))
        else:
            parts.append(str(key))
    return "/".join(parts)


def _is_prng_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _key_dtype(impl: str) -> Any:
    """The typed-key dtype that ``jax.random.key(..., impl=impl)`` produces."""
    return jax.eval_shape(lambda: jax.random.key(0, impl=impl)).dtype


def _key_data_shape(impl: str) -> tuple[int, ...]:
    """Trailing shape of ``jax.random.key_data`` for one key of this impl (e.g. (2,))."""
    return jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=impl))).shape


def _to_abstract(leaf: Any) -> Any:
    """A restore target for one leaf: arrays become ShapeDtypeStructs that keep their sharding.

    Leaves without a sharding restore onto the first local device.
    """
    if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)):
        sharding = getattr(leaf, "sharding", None)
        if sharding is None:
            sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
    return leaf


def _flat_shapes(tree: PyTree) -> dict[str, tuple[int, ...]]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {_path_name(path): tuple(np.shape(leaf)) for path, leaf in leaves}


def _nonfinite_leaves(tree: PyTree) -> list[str]:
    """Names of the floating-point leaves of ``tree`` that hold a NaN or an infinity."""
    flags = jax.tree.map(
        lambda x: bool(jax.numpy.all(jax.numpy.isfinite(x)))
        if jax.numpy.issubdtype(getattr(x, "dtype", np.int32), np.inexact) else True, tree)
    return [_path_name(path) for path, ok in jax.tree_util.tree_flatten_with_path(flags)[0]
            if not ok]


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

    Use as a context manager or call :meth:`close` so background writes finish.
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
            raise CheckpointError(
                f"checkpoint step {step} in {self.directory}: cannot read '{_META}': {err}"
            ) from err
        return dict(restored[_META])

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
        leaves = jax.tree_util.tree_flatten_with_path(state)[0]
        impls = {
            _path_name(path): str(jax.random.key_impl(leaf))
            for path, leaf in leaves
            if _is_prng_key(leaf)
        }
        raw_state = jax.tree.map(
            lambda leaf: jax.random.key_data(leaf) if _is_prng_key(leaf) else leaf, state
        )
        try:
            return self._manager.save(
                step,
                args=ocp.args.Composite(
                    **{
                        _STATE: ocp.args.StandardSave(raw_state),
                        _META: ocp.args.JsonSave(meta),
                        _PRNG: ocp.args.JsonSave(impls),
                    }
                ),
                force=True,
            )
        except Exception as err:  # an earlier async write or this one failed (disk, perms)
            raise self._save_error(err) from err

    def _save_error(self, err: BaseException) -> CheckpointError:
        """A save failure as a CheckpointError; orbax keeps the unfinished write in a
        temporary directory, so committed checkpoints stay intact and restorable."""
        steps = sorted(self._manager.all_steps())
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        full = any(s in str(err) for s in ("RESOURCE_EXHAUSTED", "No space", "too large",
                                           "ENOSPC", "EFBIG"))
        return CheckpointError(
            f"saving a checkpoint in {self.directory} failed{' (disk full?)' if full else ''}: "
            f"{reason}; committed checkpoints: {steps}")

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
            stored = self._manager.metadata(step).item_metadata[_STATE]
        except Exception as err:  # orbax/tensorstore raise many types; name the checkpoint
            raise CheckpointError(f"{where} is unreadable: {err}") from err
        if stored is None:
            raise CheckpointError(f"{where} has no '{_STATE}' item")
        stored_tree = stored.tree if hasattr(stored, "tree") else stored
        target = self._raw_target(abstract_state, impls, where)
        self._check_layout(_flat_shapes(stored_tree), _flat_shapes(target), where)
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
            raise CheckpointError(f"{where} could not be restored: {err}") from err
        state = jax.tree_util.tree_map_with_path(
            lambda path, leaf: (
                jax.random.wrap_key_data(leaf, impl=impls[_path_name(path)])
                if _path_name(path) in impls
                else leaf
            ),
            restored[_STATE],
        )
        return state, dict(restored[_META])

    def restore_newest_good(
        self, abstract_state: PyTree, log: Callable[[str], None] = print
    ) -> tuple[PyTree, dict[str, Any]]:
        """:meth:`restore` of the newest step that restores, skipping corrupt newer ones.

        A step is corrupt when it cannot be read or matched to ``abstract_state``, or when a
        floating-point leaf holds NaN or inf (a flipped bit). Each skipped step is logged with why and moved to ``<directory>.corrupt/<step>``
        (kept for inspection, out of the step listing, so the run can save that step again).

        Raises:
          CheckpointError: no step restores (the message lists every step's reason).
        """
        self._manager.wait_until_finished()
        reasons = []
        for step in reversed(self.all_steps()):
            try:
                restored = self.restore(abstract_state, step=step)
                bad = _nonfinite_leaves(restored[0])
                if bad:
                    raise CheckpointError(f"checkpoint step {step} in {self.directory}: "
                                          f"leaves {bad} hold NaN or inf")
            except CheckpointError as err:
                reasons.append(str(err))
                log(f"warning: skipping checkpoint step {step}: {err}")
                continue
            for bad in self.all_steps():
                if bad > step:
                    self._set_aside(bad)
            return restored
        raise CheckpointError(f"no checkpoint in {self.directory} restores: " +
                              "; ".join(reasons))

    def _set_aside(self, step: int) -> None:
        aside = f"{self.directory}.corrupt"
        os.makedirs(aside, exist_ok=True)
        target = os.path.join(aside, str(step))
        suffix = 0
        while os.path.exists(target):
            suffix += 1
            target = os.path.join(aside, f"{step}.{suffix}")
        os.replace(os.path.join(self.directory, str(step)), target)
        self._manager.reload()

    @staticmethod
    def _raw_target(abstract_state: PyTree, impls: Mapping[str, str], where: str) -> PyTree:
        """The restore target with typed keys replaced by their key_data layout."""

        def convert(path: tuple[Any, ...], leaf: Any) -> Any:
            name = _path_name(path)
            if _is_prng_key(leaf):
                if name not in impls:
                    raise CheckpointError(
                        f"{where}: leaf '{name}' is a typed PRNG key in the target but was not "
                        "saved as one"
                    )
                if _key_dtype(impls[name]) != leaf.dtype:
                    raise CheckpointError(
                        f"{where}: leaf '{name}' was saved with PRNG impl {impls[name]!r} but "
                        f"the target has dtype {leaf.dtype}"
                    )
                leaf = jax.ShapeDtypeStruct(
                    leaf.shape + _key_data_shape(impls[name]),
                    jax.numpy.uint32,
                    sharding=getattr(leaf, "sharding", None),
                )
            elif name in impls:
                raise CheckpointError(
                    f"{where}: leaf '{name}' was saved as a typed PRNG key ({impls[name]}) but "
                    f"the target has dtype {getattr(leaf, 'dtype', type(leaf).__name__)}"
                )
            return _to_abstract(leaf)

        return jax.tree_util.tree_map_with_path(convert, abstract_state)

    @staticmethod
    def _check_layout(
        stored: Mapping[str, tuple[int, ...]], wanted: Mapping[str, tuple[int, ...]], where: str
    ) -> None:
        missing = sorted(set(wanted) - set(stored))
        extra = sorted(set(stored) - set(wanted))
        problems = []
        if missing:
            problems.append(f"leaves in the target but not in the checkpoint: {missing}")
        if extra:
            problems.append(f"leaves in the checkpoint but not in the target: {extra}")
        for name in sorted(set(stored) & set(wanted)):
            if stored[name] != wanted[name]:
                problems.append(
                    f"leaf '{name}' has shape {stored[name]} in the checkpoint but "
                    f"{wanted[name]} in the target"
                )
        if problems:
            raise CheckpointError(
                f"{where} does not match the target state: " + "; ".join(problems)
            )

    # -- lifecycle -----------------------------------------------------------------------

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

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
