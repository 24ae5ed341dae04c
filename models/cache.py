"""The attention cache the decoder reads and writes: the narrow interface to the RL library.

The cache is owned by the caller (the sampler); the model only writes the new tokens' keys
and values at the shared write index and attends over every slot. Keys are stored *after*
RoPE, so a caller may reorder or drop slots (KV eviction) without re-rotating anything.
Each slot carries the original position of its token per KV head (``-1`` marks an empty or
padding slot), which is all the model needs to build its mask: slot ``s`` is visible to a
query at position ``t`` iff ``0 <= pos[s] <= t``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class KVCache:
    """Fixed-capacity key/value buffers for every layer.

    Attributes:
      k: ``[L, B, Hkv, C, D]`` keys after RoPE.
      v: ``[L, B, Hkv, C, D]`` values.
      pos: ``[L, B, Hkv, C]`` int32 original token position of each slot, ``-1`` = empty.
      index: ``[]`` int32, the next slot to write; shared by all rows (left padding makes
        rows of different prompt lengths line up, padding slots carry ``pos == -1``).
    """

    k: jax.Array
    v: jax.Array
    pos: jax.Array
    index: jax.Array

    @property
    def capacity(self) -> int:
        """Number of slots ``C`` per layer, row and head."""
        return self.k.shape[3]


def init_cache(
    num_layers: int,
    batch: int,
    num_kv_heads: int,
    capacity: int,
    head_dim: int,
    dtype=jnp.float32,
) -> KVCache:
    """An empty cache: zero keys/values, every slot empty (``pos == -1``), index 0."""
    shape = (num_layers, batch, num_kv_heads, capacity, head_dim)
    return KVCache(
        k=jnp.zeros(shape, dtype),
        v=jnp.zeros(shape, dtype),
        pos=jnp.full(shape[:-1], -1, jnp.int32),
        index=jnp.zeros((), jnp.int32),
    )
