"""KV compression configuration: which tokens a fixed-size rollout cache keeps.

The cache holds ``capacity = budget + buffer`` slots. When it fills it is compressed back to
``budget`` slots: the newest ``window`` tokens always stay, the other ``budget - window`` are
chosen by a score (SnapKV importance, R-KV importance minus redundancy, StreamingLLM sinks +
recency). ``none`` is the dense baseline through the same code path: it never evicts.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

Method = Literal["none", "snapkv", "rkv", "streaming"]
HeadMode = Literal["per_head", "shared"]
GqaPool = Literal["max", "mean"]
Pool = Literal["max", "avg"]
Importance = Literal["sparse_rl", "kvpress_snapkv"]

METHODS: tuple[str, ...] = ("none", "snapkv", "rkv", "streaming")
HEAD_MODES: tuple[str, ...] = ("per_head", "shared")
GQA_POOLS: tuple[str, ...] = ("max", "mean")
POOLS: tuple[str, ...] = ("max", "avg")
IMPORTANCES: tuple[str, ...] = ("sparse_rl", "kvpress_snapkv")

# Per importance variant: (gqa_pool, pool, pool_kernel) used when the field is left as None.
#   sparse_rl:      official Sparse-RL / R-KV code: max over the group's logits, max-pool 7.
#   kvpress_snapkv: kvpress SnapKVPress / SnapKV paper: mean over the group's scores, avg-pool 5.
_VARIANT_DEFAULTS: dict[str, tuple[str, str, int]] = {
    "sparse_rl": ("max", "max", 7),
    "kvpress_snapkv": ("mean", "avg", 5),
}


def _check_choice(field: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"CompressionConfig.{field}={value!r} is not one of {allowed}")


def _check_int(field: str, value: object, minimum: int, rule: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"CompressionConfig.{field}={value!r} must be an int {rule}")


@dataclasses.dataclass(frozen=True)
class CompressionConfig:
    """How the rollout KV cache is compressed (static under ``jit``; hashable).

    Attributes:
      method: ``none`` (dense, never evicts), ``snapkv`` (Z = importance), ``rkv``
        (Z = rkv_lambda * importance - (1 - rkv_lambda) * redundancy), ``streaming``
        (``num_sinks`` first tokens + the newest).
      budget: slots kept after a compression (includes the ``window`` newest), > window.
      buffer: slots written between two compressions, >= 1; capacity = budget + buffer.
      window: newest tokens that always survive; their queries score the others.
      head_mode: ``per_head`` (each KV head keeps its own tokens, R-KV reference) or
        ``shared`` (rank the sum of Z over KV heads, one set per row, official Sparse-RL).
      gqa_pool: reduction over the query heads of one KV group (``max`` | ``mean``); on the
        logits for the ``sparse_rl`` importance, on the pooled scores for ``kvpress_snapkv``.
        None -> the variant's default (max | mean).
      pool: 1-D pooling of importance along slots (``max`` | ``avg``, zero padding counted);
        None -> the variant's default (max | avg).
      pool_kernel: odd pooling width; None -> the variant's default (7 | 5).
      rkv_lambda: R-KV mixing weight in [0, 1] (0.1 in Sparse-RL, 0.07 R-KV default).
      redundancy_threshold: cosine similarity above which a key counts as a duplicate.
      num_sinks: StreamingLLM attention sinks (the first valid tokens of a row), >= 0.
      importance: ``sparse_rl`` (pool logits over the group, softmax over non-window keys) or
        ``kvpress_snapkv`` (per-head softmax over all keys, causal inside the window, sliced;
        its usual window is 64).
    """

    method: Method = "snapkv"
    budget: int = 512
    buffer: int = 128
    window: int = 8
    head_mode: HeadMode = "per_head"
    gqa_pool: GqaPool | None = None
    pool: Pool | None = None
    pool_kernel: int | None = None
    rkv_lambda: float = 0.1
    redundancy_threshold: float = 0.5
    num_sinks: int = 4
    importance: Importance = "sparse_rl"

    def __post_init__(self) -> None:
        _check_choice("method", self.method, METHODS)
        _check_choice("head_mode", self.head_mode, HEAD_MODES)
        _check_choice("importance", self.importance, IMPORTANCES)
        gqa_pool, pool, kernel = _VARIANT_DEFAULTS[self.importance]
        if self.gqa_pool is None:
            object.__setattr__(self, "gqa_pool", gqa_pool)
        if self.pool is None:
            object.__setattr__(self, "pool", pool)
        if self.pool_kernel is None:
            object.__setattr__(self, "pool_kernel", kernel)
        _check_choice("gqa_pool", self.gqa_pool, GQA_POOLS)
        _check_choice("pool", self.pool, POOLS)
        _check_int("window", self.window, 1, ">= 1")
        _check_int("budget", self.budget, self.window + 1, f"> window ({self.window})")
        _check_int("buffer", self.buffer, 1, ">= 1")
        _check_int("pool_kernel", self.pool_kernel, 1, "odd and >= 1")
        if self.pool_kernel % 2 != 1:
            raise ValueError(
                f"CompressionConfig.pool_kernel={self.pool_kernel!r} must be an int odd and >= 1"
            )
        _check_int("num_sinks", self.num_sinks, 0, ">= 0")
        for field, value in (
            ("rkv_lambda", self.rkv_lambda),
            ("redundancy_threshold", self.redundancy_threshold),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"CompressionConfig.{field}={value!r} must be a float")
        if not 0.0 <= self.rkv_lambda <= 1.0:
            raise ValueError(f"CompressionConfig.rkv_lambda={self.rkv_lambda!r} must be in [0, 1]")
        if not -1.0 <= self.redundancy_threshold <= 1.0:
            raise ValueError(
                f"CompressionConfig.redundancy_threshold={self.redundancy_threshold!r} "
                "must be in [-1, 1] (a cosine similarity)"
            )

    @property
    def compresses(self) -> bool:
        """False for ``none``: the cache is never compressed."""
        return self.method != "none"

    @property
    def capacity(self) -> int:
        """Cache slots of a compressing cache: ``budget + buffer``."""
        return self.budget + self.buffer

    def cache_capacity(self, max_total_len: int) -> int:
        """Slots to allocate for sequences of up to ``max_total_len`` tokens (prompt + response).

        ``none`` is dense: the whole sequence. Otherwise ``budget + buffer``.
        """
        return max_total_len if self.method == "none" else self.capacity
