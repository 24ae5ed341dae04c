"""Which cache slots survive a compression: the window plus the top-scored rest, in slot order.

Invariants (tested as properties): the ``window`` newest slots ``[index - window, index)``
always survive; an empty slot (``pos == -1``) never survives while a valid token is evicted;
the kept slots come out in temporal (slot) order with the window last, so after a gather the
window sits at ``[budget - window, budget)``, aligned with the query ring.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

_LOWEST = float(np.finfo(np.float32).min)
_HIGHEST = float(np.finfo(np.float32).max)


def _rank_key(z: jax.Array, valid: jax.Array, in_window: jax.Array) -> jax.Array:
    """Ranking key: window ``+inf`` > any valid slot (Z clipped to finite) > empty ``-inf``."""
    finite = jnp.clip(jnp.nan_to_num(z, nan=_LOWEST), _LOWEST, _HIGHEST)
    return jnp.where(in_window, jnp.inf, jnp.where(valid, finite, -jnp.inf))


def select_slots(
    z: jax.Array,
    pos: jax.Array,
    index: jax.Array,
    *,
    budget: int,
    window: int,
    head_mode: str = "per_head",
) -> jax.Array:
    """Kept slot indices ``[B, Hkv, budget]`` int32, ascending in slot (temporal) order.

    Args:
      z: ``[B, Hkv, C]`` float scores (higher = keep); only valid non-window slots are read.
      pos: ``[B, Hkv, C]`` int32 slot positions, ``-1`` = empty.
      index: ``[]`` int32 next write slot; the window is ``[index - window, index)``,
        ``window <= index``; slots ``>= index`` count as empty.
      budget: slots kept, ``window < budget <= C``.
      window: newest slots always kept.
      head_mode: ``per_head`` (each KV head ranks its own Z) or ``shared`` (rank the sum of Z
        over KV heads; one set per row, broadcast over heads).
    """
    c = z.shape[-1]
    if not window < budget <= c:
        raise ValueError(f"need window < budget <= capacity, got {window}, {budget}, {c}")
    if head_mode not in ("per_head", "shared"):
        raise ValueError(f"head_mode={head_mode!r} is not one of ('per_head', 'shared')")
    slot = jnp.arange(c)
    live = slot < index
    valid = (pos >= 0) & live
    in_window = (slot >= index - window) & live
    if head_mode == "shared":
        z = jnp.sum(jnp.where(valid, z, 0.0), axis=1, keepdims=True)
        valid = jnp.any(valid, axis=1, keepdims=True)
    _, top = lax.top_k(_rank_key(z, valid, in_window), budget)  # [B, H|1, budget]
    # Temporal order with the window last: slots >= index (empty fillers) go first.
    order_key = jnp.where(top >= index, top - c, top)
    kept = jnp.take_along_axis(top, jnp.argsort(order_key, axis=-1), axis=-1)
    return jnp.broadcast_to(kept, pos.shape[:-1] + (budget,)).astype(jnp.int32)
