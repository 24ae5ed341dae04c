"""Matching a stored checkpoint state to a restore target: leaf names, typed PRNG keys,
shapes and finiteness (pure functions; :class:`sparse_rl_jax.records.checkpoint.Checkpointer` uses
them to refuse a checkpoint that does not fit, naming the step and the leaf).

Typed PRNG keys are stored as their raw ``key_data`` (uint32) plus a ``{leaf: impl}`` record,
so the files are plain arrays; :func:`raw_target` turns a target holding typed keys into the
stored layout.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from sparse_rl_jax.records.checkpoint_errors import CheckpointError

PyTree = Any


def path_name(path: tuple[Any, ...]) -> str:
    """A pytree key path as ``a/0/b`` (the same for a namedtuple and orbax's dict)."""
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


def is_prng_key(x: Any) -> bool:
    """Whether ``x`` is an array (or abstract array) of typed PRNG keys."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def prng_impls(state: PyTree) -> dict[str, str]:
    """``{leaf name: PRNG impl name}`` of the typed-key leaves of ``state``."""
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    return {path_name(path): str(jax.random.key_impl(leaf)) for path, leaf in leaves
            if is_prng_key(leaf)}


def to_raw(state: PyTree) -> PyTree:
    """``state`` with typed keys replaced by their ``key_data`` (what is written)."""
    return jax.tree.map(lambda leaf: jax.random.key_data(leaf) if is_prng_key(leaf) else leaf,
                        state)


def from_raw(state: PyTree, impls: Mapping[str, str]) -> PyTree:
    """The restored ``state`` with the leaves named in ``impls`` wrapped back into typed keys."""
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: (jax.random.wrap_key_data(leaf, impl=impls[path_name(path)])
                            if path_name(path) in impls else leaf), state)


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


def flat_shapes(tree: PyTree) -> dict[str, tuple[int, ...]]:
    """``{leaf name: shape}`` of ``tree``."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {path_name(path): tuple(np.shape(leaf)) for path, leaf in leaves}


def nonfinite_leaves(tree: PyTree) -> list[str]:
    """Names of the floating-point leaves of ``tree`` that hold a NaN or an infinity."""
    flags = jax.tree.map(
        lambda x: bool(jax.numpy.all(jax.numpy.isfinite(x)))
        if jax.numpy.issubdtype(getattr(x, "dtype", np.int32), np.inexact) else True, tree)
    return [path_name(path) for path, ok in jax.tree_util.tree_flatten_with_path(flags)[0]
            if not ok]


def raw_target(abstract_state: PyTree, impls: Mapping[str, str], where: str) -> PyTree:
    """The restore target with typed keys replaced by their key_data layout; CheckpointError
    (``where``: which checkpoint) when a leaf's key-ness or PRNG impl differs from the saved."""

    def convert(path: tuple[Any, ...], leaf: Any) -> Any:
        name = path_name(path)
        if is_prng_key(leaf):
            if name not in impls:
                raise CheckpointError(
                    f"{where}: leaf '{name}' is a typed PRNG key in the target but was not "
                    "saved as one")
            if _key_dtype(impls[name]) != leaf.dtype:
                raise CheckpointError(
                    f"{where}: leaf '{name}' was saved with PRNG impl {impls[name]!r} but "
                    f"the target has dtype {leaf.dtype}")
            leaf = jax.ShapeDtypeStruct(leaf.shape + _key_data_shape(impls[name]),
                                        jax.numpy.uint32, sharding=getattr(leaf, "sharding", None))
        elif name in impls:
            raise CheckpointError(
                f"{where}: leaf '{name}' was saved as a typed PRNG key ({impls[name]}) but "
                f"the target has dtype {getattr(leaf, 'dtype', type(leaf).__name__)}")
        return _to_abstract(leaf)

    return jax.tree_util.tree_map_with_path(convert, abstract_state)


def check_layout(stored: Mapping[str, tuple[int, ...]], wanted: Mapping[str, tuple[int, ...]],
                 where: str) -> None:
    """CheckpointError listing the leaves missing on either side and every shape that
    differs between the stored state and the target (``flat_shapes`` of each)."""
    missing = sorted(set(wanted) - set(stored))
    extra = sorted(set(stored) - set(wanted))
    problems = []
    if missing:
        problems.append(f"leaves in the target but not in the checkpoint: {missing}")
    if extra:
        problems.append(f"leaves in the checkpoint but not in the target: {extra}")
    for name in sorted(set(stored) & set(wanted)):
        if stored[name] != wanted[name]:
            problems.append(f"leaf '{name}' has shape {stored[name]} in the checkpoint but "
                            f"{wanted[name]} in the target")
    if problems:
        raise CheckpointError(f"{where} does not match the target state: " + "; ".join(problems))
