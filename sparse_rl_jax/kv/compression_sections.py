"""The sections of :class:`~sparse_rl_jax.kv.compression_config.CompressionConfig`, one per
part of the rollout cache a method reads (``python run.py config`` shows only those):

* ``compression.eviction`` (:class:`EvictionConfig`): the evicting policies (``snapkv``,
  ``rkv``, ``streaming``): the budget cache's size and the score that picks what it keeps.
* ``compression.sparrow`` (:class:`SparrowConfig`): ``sparrow``'s page budget per cached
  length and its dense layers.
* ``compression.alpha`` (:class:`AlphaConfig`): the acceptance alpha that training logs for a
  rollout that keeps its replay record, and the threshold it is held to.
* ``compression.adapt`` (:class:`AdaptConfig`): ``sparrow``'s closed loop on its page budget.

Each section checks its own fields; rules that span sections (a schedule's starts against
``page_size``, the closed loop against the method and the schedule) are
``CompressionConfig``'s.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from sparse_rl_jax.core.config_checks import (check, check_bool, check_choice, check_distinct,
                                              check_int, check_number, is_int)

HeadMode = Literal["per_head", "shared"]
GqaPool = Literal["max", "mean"]
Pool = Literal["max", "avg"]
Importance = Literal["sparse_rl", "kvpress_snapkv"]
AlphaMetric = Literal["exact", "top20", "off"]

HEAD_MODES: tuple[str, ...] = ("per_head", "shared")
GQA_POOLS: tuple[str, ...] = ("max", "mean")
POOLS: tuple[str, ...] = ("max", "avg")
IMPORTANCES: tuple[str, ...] = ("sparse_rl", "kvpress_snapkv")
ALPHA_METRICS: tuple[str, ...] = ("exact", "top20", "off")

# Per importance variant: (gqa_pool, pool, pool_kernel) used when the field is left as None.
#   sparse_rl:      official Sparse-RL / R-KV code: max over the group's logits, max-pool 7.
#   kvpress_snapkv: kvpress SnapKVPress / SnapKV paper: mean over the group's scores, avg-pool 5.
_VARIANT_DEFAULTS: dict[str, tuple[str, str, int]] = {
    "sparse_rl": ("max", "max", 7),
    "kvpress_snapkv": ("mean", "avg", 5),
}

# Sparrow's official budget presets: all 20 offline-calibrated schedules of the Sparrow repository
# (github.com/Infini-AI-Lab/Sparrow, vortex_torch/vortex_torch/indexer/utils_sglang.py, commit
# b8cb9870c524b7ab0288d9aa3c620e5990d69655), named as there: Qwen3 model size + the alpha p5
# threshold calibrated for. k (middle pages: the sink page and the 2 newest come on top) per
# 2000-token bin of the cached length, 20 bins (the last one open-ended), page size 16.
SPARROW_BIN_TOKENS = 2000
SPARROW_PRESETS: dict[str, tuple[int, ...]] = {
    "qwen3-1.7b-0.75": (29, 29, 45, 45, 61, 61, 77, 77, 93, 93, 93, 93, 93, 93, 93, 93, 93, 93, 93,
                        93),
    "qwen3-1.7b-0.80": (29, 45, 61, 77, 93, 93, 125, 125, 125, 157, 157, 157, 157, 157, 157, 157,
                        157, 157, 157, 157),
    "qwen3-1.7b-0.83": (29, 61, 77, 93, 125, 125, 157, 157, 189, 189, 189, 189, 189, 189, 189, 189,
                        189, 189, 189, 189),
    "qwen3-1.7b-0.86": (29, 61, 93, 93, 125, 157, 189, 221, 221) + (253,) * 11,
    "qwen3-1.7b-0.88": (45, 77, 125, 157, 157, 189, 221, 253, 253, 317, 317, 317, 317, 317, 317,
                        317, 317, 317, 317, 317),
    "qwen3-1.7b-0.90": (45, 93, 157, 189, 221, 253, 317, 317, 381, 381, 381, 381, 381, 381, 381,
                        381, 381, 381, 381, 381),
    "qwen3-1.7b-0.92": (61, 125, 189, 221, 253, 317, 381, 381, 445, 509, 509, 509, 509, 509, 509,
                        509, 509, 509, 509, 509),
    "qwen3-1.7b-0.94": (77, 157, 221, 317, 381, 445, 509, 509, 637, 765, 765, 765, 765, 765, 765,
                        765, 765, 765, 765, 765),
    "qwen3-4b-0.75": (29, 29, 29, 29, 45, 61, 77, 93, 125, 125, 125, 125, 157, 157, 157, 157, 157,
                      157, 189, 189),
    "qwen3-4b-0.80": (29, 29, 45, 61, 77, 93, 125, 157, 157, 157, 189, 221, 221, 221, 221, 221,
                      221, 221, 221, 221),
    "qwen3-4b-0.86": (29, 45, 61, 77, 93, 125, 157, 221, 253, 253, 317, 317, 317, 317, 381,
                      381, 381, 381, 509, 509),
    "qwen3-4b-0.88": (29, 61, 93, 125, 157, 189, 253, 317, 381, 445, 445, 509, 509, 509, 637, 637,
                      637, 637, 637, 637),
    "qwen3-4b-0.90": (45, 77, 125, 157, 189, 253, 317, 445, 637, 765, 765, 765, 765, 765, 765, 893,
                      893, 893, 893, 893),
    "qwen3-4b-0.92": (45, 93, 157, 189, 253, 381, 445, 765, 893, 1021, 1021, 1149, 1149, 1149,
                      1149, 1149, 1149, 1149, 1149, 1149),
    "qwen3-8b-0.75": (29, 29, 29, 45, 45, 77, 77, 77, 93, 93, 93, 93, 125, 125, 125, 125, 125, 125,
                      157, 157),
    "qwen3-8b-0.80": (29, 29, 45, 61, 77, 93, 125, 125, 157, 157, 189, 189, 189, 221, 221, 221,
                      221, 253, 253, 253),
    # 385 is upstream's number; every other k is 16m - 3 (381 here would be one).
    "qwen3-8b-0.86": (29, 45, 61, 77, 125, 157, 189, 253, 253, 253, 253, 317, 317, 317, 317, 317,
                      317, 385, 445, 445),
    "qwen3-8b-0.87": (29, 61, 77, 93, 157, 189, 221, 317, 317, 317, 317, 381, 381, 381, 381, 381,
                      445, 445, 509, 509),
    "qwen3-8b-0.92": (45, 93, 125, 189, 253, 445, 509, 637, 765, 765, 765, 893, 893, 893, 893, 893,
                      1021, 1021, 1021, 1021),
    "qwen3-14b-0.86": (29, 45, 77, 125, 253, 381, 381, 381, 381, 381, 381, 381, 381, 381, 381, 509,
                       637, 637, 893, 893),
}


def preset_schedule(name: str) -> tuple[tuple[int, int], ...]:
    """A named Sparrow preset (a key of :data:`SPARROW_PRESETS`) as ``((start_tokens, k),
    ...)`` with 2000-token bins."""
    return tuple((i * SPARROW_BIN_TOKENS, k) for i, k in enumerate(SPARROW_PRESETS[name]))


@dataclasses.dataclass(frozen=True)
class EvictionConfig:
    """The evicting policies' cache (``compression.eviction``): ``budget + buffer`` slots,
    compressed back to ``budget`` when full; the ``window`` newest stay, the rest are ranked
    by a score.

    Attributes:
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
        check_choice(self, "head_mode", HEAD_MODES)
        check_choice(self, "importance", IMPORTANCES)
        for field, default in zip(("gqa_pool", "pool", "pool_kernel"),
                                  _VARIANT_DEFAULTS[self.importance]):
            if getattr(self, field) is None:
                object.__setattr__(self, field, default)
        check_choice(self, "gqa_pool", GQA_POOLS)
        check_choice(self, "pool", POOLS)
        check_int(self, "window", 1)
        check_int(self, "budget", self.window + 1, f"must be an int > window ({self.window})")
        check_int(self, "buffer", 1)
        check(is_int(self.pool_kernel) and self.pool_kernel >= 1 and self.pool_kernel % 2 == 1,
              self, "pool_kernel", "must be an odd int >= 1")
        check_int(self, "num_sinks", 0)
        check_number(self, "rkv_lambda", ge=0, le=1)
        check_number(self, "redundancy_threshold", ge=-1, le=1,
                     rule="must be in [-1, 1] (a cosine similarity)")


@dataclasses.dataclass(frozen=True)
class SparrowConfig:
    """``sparrow``'s page budget (``compression.sparrow``): how many middle pages each decode
    step attends to, per cached length, and which layers stay dense.

    Attributes:
      budget_schedule: ``((start_0=0, k_0), (start_1, k_1), ...)``: a row whose cached length
        ``L`` (prompt + response, current token included) has
        ``ceil(L / page_size) * page_size >= start_i`` (largest such i) attends to ``k_i``
        middle pages + the sink page + the 2 newest. Starts strictly increasing multiples of
        ``compression.page_size``; or a preset name (a key of :data:`SPARROW_PRESETS`, e.g.
        ``qwen3-1.7b-0.86``, ``qwen3-4b-0.92``), resolved to the tuple at construction.
      dense_layers: layers that always attend densely (``(0, 1)`` in Sparrow).
    """

    budget_schedule: tuple[tuple[int, int], ...] | str = "qwen3-1.7b-0.86"
    dense_layers: tuple[int, ...] = (0, 1)

    def __post_init__(self) -> None:
        schedule = self.budget_schedule
        if isinstance(schedule, str):
            check(schedule in SPARROW_PRESETS, self, "budget_schedule",
                  f"is not a preset; known: {sorted(SPARROW_PRESETS)}")
            schedule = preset_schedule(schedule)
        elif isinstance(schedule, (list, tuple)):
            schedule = tuple(tuple(entry) if isinstance(entry, (list, tuple)) else entry
                             for entry in schedule)
        object.__setattr__(self, "budget_schedule", schedule)
        check(isinstance(schedule, tuple) and bool(schedule), self, "budget_schedule",
              "must be a non-empty list of [start, k]")
        for i, entry in enumerate(schedule):
            self._check_bin(i, entry)
        check_distinct(self, "dense_layers", lambda x: is_int(x) and x >= 0,
                       "must be distinct ints >= 0")

    def _check_bin(self, i: int, entry) -> None:
        """Entry ``i`` of the resolved ``budget_schedule``: a pair of ints ``(start, k)`` with
        ``k >= 0``, the first starting at 0 and the starts strictly increasing (their fit to
        ``page_size`` is ``CompressionConfig``'s check)."""
        field = f"budget_schedule[{i}]"
        check(isinstance(entry, tuple) and len(entry) == 2 and all(map(is_int, entry)),
              self, field, "must be a pair of ints [start, k]", entry)
        start, k = entry
        check(k >= 0, self, field, "must have k >= 0", entry)
        if i == 0:
            check(start == 0, self, field, "must start at 0 (the first bin)", entry)
        else:
            check(start > self.budget_schedule[i - 1][0], self, field,
                  f"must start after budget_schedule[{i - 1}] (starts strictly increasing)",
                  entry)

    @property
    def ks(self) -> tuple[int, ...]:
        """k of each bin of ``budget_schedule``."""
        return tuple(k for _, k in self.budget_schedule)


@dataclasses.dataclass(frozen=True)
class AlphaConfig:
    """The acceptance ``alpha = sum_x min(p_sparse, p_dense)`` of each sampled token
    (``compression.alpha``), which training logs for a rollout that keeps its replay record
    (``sampling.record_evictions``; ``sparrow`` keeps it by default). Costs a sparse (replay)
    and a dense forward per sequence.

    Attributes:
      threshold: target of the 5th percentile of alpha per 2000-token response bin, in
        (0, 1]: logged as the bins below it, held by the closed loop (``compression.adapt``)
        and by calibration (``experiments/calibrate_sparrow.py``).
      metric: ``exact`` (full vocabulary), ``top20`` (Sparrow's lower bound) or ``off``.
    """

    threshold: float = 0.86
    metric: AlphaMetric = "exact"

    def __post_init__(self) -> None:
        check_number(self, "threshold", gt=0, le=1)
        check_choice(self, "metric", ALPHA_METRICS)


@dataclasses.dataclass(frozen=True)
class AdaptConfig:
    """``sparrow``'s closed loop on its page budget (``compression.adapt``), off by default:
    after each RL step, k of each ``compression.sparrow.budget_schedule`` bin moves by
    ``step`` pages from that bin's live alpha p5 (``training.budget_control``): up where
    p5 < ``compression.alpha.threshold``, down where p5 >= threshold + ``margin``, within
    ``[min_k, max_k]`` and the bin's middle pages.

    Attributes:
      enabled: run the closed loop; needs method ``sparrow`` and an alpha metric
        (``compression.alpha.metric`` not ``off``).
      step: pages k moves per step of the closed loop, >= 1.
      margin: slack above the alpha threshold before k is lowered, in [0, 1).
      min_k: smallest k the closed loop sets, >= 0.
      max_k: largest k the closed loop sets: the compiled size of the page selection
        (``max_pages_k``), so adapting never recompiles; None = the schedule's largest k.
    """

    enabled: bool = False
    step: int = 8
    margin: float = 0.02
    min_k: int = 0
    max_k: int | None = None

    def __post_init__(self) -> None:
        check_bool(self, "enabled")
        check_int(self, "step", 1)
        check_number(self, "margin", ge=0, lt=1)
        check_int(self, "min_k", 0)
        check_int(self, "max_k", self.min_k, f"must be None or an int >= min_k ({self.min_k})",
                  optional=True)
