"""Shape and dtype checks at public boundaries: chex assertions whose error names the tensor.

Shapes and dtypes are static, so a check runs once at trace time and costs nothing under
``jit``. A failed check is a ``ValueError`` that names the argument and its axes, e.g.
``logp_old: expected [B, T] = [4, 16], got [4, 15]``; chex's own message is its cause.
"""

from __future__ import annotations

import chex
import numpy as np


def _show(size) -> str:
    """One expected axis as the message writes it: ``4``, ``*`` (any) or ``1|2`` (either)."""
    if size is None:
        return "*"
    if isinstance(size, (set, frozenset)):
        return "|".join(str(s) for s in sorted(size))
    return str(size)


def check_shape(name: str, x, /, *, dtype: type | None = None, **axes) -> None:
    """Raise ValueError naming ``name`` unless ``x`` has the shape ``axes`` spells out.

    Args:
      name: the argument as the caller's docs name it (``"batch.loss_mask"``).
      x: an array (or anything ``np.asarray`` takes), or None for an optional argument left
        out (not checked).
      dtype: optional ``int``, ``float`` or ``bool``: the dtype kind ``x`` must have
        (``chex.assert_type``).
      axes: one keyword per axis, in order, name -> size: an int, None (any size) or a set
        of allowed sizes, e.g. ``check_shape("logp", logp, B=4, T=None)``.
    """
    if x is None:
        return
    x = x if hasattr(x, "shape") else np.asarray(x)
    expected = tuple(axes.values())
    try:
        chex.assert_shape(x, expected)
    except AssertionError as err:
        wanted = ", ".join(_show(size) for size in expected)
        raise ValueError(f"{name}: expected [{', '.join(axes)}] = [{wanted}], "
                         f"got {list(x.shape)}") from err
    if dtype is not None:
        try:
            chex.assert_type(x, dtype)
        except AssertionError as err:
            raise ValueError(f"{name}: expected dtype {dtype.__name__}, got {x.dtype}") from err
