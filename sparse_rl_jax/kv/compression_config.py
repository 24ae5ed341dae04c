"""KV compression configuration: which tokens a fixed-size rollout cache keeps.

The cache holds ``capacity = budget + buffer`` slots. When it fills it is compressed back to
``budget`` slots: the newest ``window`` tokens always stay, the other ``budget - window`` are
chosen by a score (SnapKV importance, R-KV importance minus redundancy, StreamingLLM sinks +
recency). ``none`` is the dense baseline through the same code path: it never evicts.

Two axes, one field each: ``method`` is the eviction/selection *policy* (``none`` | ``snapkv``
| ``rkv`` | ``streaming`` | ``sparrow``) and ``layout`` the cache *layout* the model attends
through (``dense``: a slot for every token of the sequence; ``budget``: ``budget + buffer``
slots compressed back when full; ``paged``: a slot for every token in ``page_size``-slot
pages, one position array for all layers, decode reads only the filled pages,
``models.paged_cache``). ``layout`` may be left out (None: the method's own,
:attr:`CompressionConfig.natural_layout`); the evicting policies run on ``budget``, ``sparrow``
on ``paged``, ``none`` on ``paged`` (its own: faster on CPU at every length measured,
benchmarks/README.md) or ``dense``; any other pair is a config error naming ``layout``. Every
layout a method takes runs the same policy (same tokens up to float summation order).

``sparrow`` (page-sparse decode, arXiv 2606.08446) evicts nothing either: the cache holds every
token in pages and each decode step attends, per layer and KV head, to the sink page, the
top-k middle pages by ``mean-query . page-mean-key`` and the 2 newest pages
(``models.page_sparse``: a selection over the paged layout's own pages); k comes from
``budget_schedule``, a step function of the cached length.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from sparse_rl_jax.core.config_checks import (check, check_choice, check_distinct, check_int,
                                         check_number, is_int, reject)
from sparse_rl_jax.kv.scores import EVICTION_SCORES

HeadMode = Literal["per_head", "shared"]
GqaPool = Literal["max", "mean"]
Pool = Literal["max", "avg"]
Importance = Literal["sparse_rl", "kvpress_snapkv"]
AlphaMetric = Literal["exact", "top20", "off"]

Layout = Literal["dense", "budget", "paged"]

LAYOUTS: tuple[str, ...] = ("dense", "budget", "paged")


def methods() -> tuple[str, ...]:
    """The allowed ``method`` values: ``none``, every registered eviction score
    (``kv.scores.EVICTION_SCORES``: the evicting methods) and ``sparrow``."""
    return ("none", *EVICTION_SCORES.names(), "sparrow")

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


@dataclasses.dataclass(frozen=True)
class CompressionConfig:
    """How the rollout KV cache is compressed (static under ``jit``; hashable).

    Attributes:
      method: the eviction/selection policy: ``none`` (never evicts), a registered eviction
        score (``kv.scores.EVICTION_SCORES``: ``snapkv`` (Z = importance), ``rkv`` (Z = rkv_lambda * importance - (1 - rkv_lambda) *
        redundancy), ``streaming`` (``num_sinks`` first tokens + the newest)), ``sparrow``
        (attend selected pages, evict nothing).
      layout: the cache layout: ``dense`` (one slot per token; ``none``), ``budget``
        (``budget + buffer`` slots; the evicting methods) or ``paged`` (one slot per token in
        ``page_size``-slot pages, decode reads only the filled ones; ``none``'s own and
        ``sparrow``'s); None = the method's own. Other pairs are rejected.
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
      page_size: (layout ``paged``: ``sparrow``'s pages) tokens per page, >= 1 (16 in
        Sparrow).
      budget_schedule: (``sparrow``) ``((start_0=0, k_0), (start_1, k_1), ...)``: a row whose
        cached length ``L`` (prompt + response, current token included) has
        ``ceil(L / page_size) * page_size >= start_i`` (largest such i) attends to ``k_i``
        middle pages + the sink page + the 2 newest. Starts strictly increasing multiples of
        ``page_size``; or a preset name (a key of :data:`SPARROW_PRESETS`, e.g.
        ``qwen3-1.7b-0.86``, ``qwen3-4b-0.92``), resolved to the tuple at construction.
      dense_layers: (``sparrow``) layers that always attend densely (``(0, 1)`` in Sparrow).
      alpha_threshold: target of the 5th percentile of the per-token acceptance
        ``alpha = sum_x min(p_sparse, p_dense)`` per 2000-token response bin, in (0, 1];
        used by calibration (``experiments/calibrate_sparrow.py``).
      alpha_metric: how training logs alpha when the rollout keeps its record
        (``sampling.record_evictions``): ``exact`` (full vocabulary), ``top20`` (Sparrow's
        lower bound) or ``off``. Costs a sparse (replay) and a dense forward per sequence.
      adapt_k: (``sparrow``) closed loop, off by default: after each RL step, k of each
        ``budget_schedule`` bin moves by ``adapt_step`` pages from that bin's live alpha p5
        (``budget_control``): up where p5 < ``alpha_threshold``, down where p5 >=
        ``alpha_threshold + adapt_margin``, within ``[adapt_min_k, adapt_max_k]`` and the
        bin's middle pages. Needs the alpha metric (``alpha_metric`` not ``off``).
      adapt_step: pages k moves per step of the closed loop, >= 1.
      adapt_margin: slack above ``alpha_threshold`` before k is lowered, in [0, 1).
      adapt_min_k: smallest k the closed loop sets, >= 0.
      adapt_max_k: largest k the closed loop sets: the compiled size of the page selection
        (``max_pages_k``), so adapting never recompiles; None = the schedule's largest k.
    """

    method: str = "snapkv"
    layout: Layout | None = None
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
    page_size: int = 16
    budget_schedule: tuple[tuple[int, int], ...] | str = "qwen3-1.7b-0.86"
    dense_layers: tuple[int, ...] = (0, 1)
    alpha_threshold: float = 0.86
    alpha_metric: AlphaMetric = "exact"
    adapt_k: bool = False
    adapt_step: int = 8
    adapt_margin: float = 0.02
    adapt_min_k: int = 0
    adapt_max_k: int | None = None

    def __post_init__(self) -> None:
        check_choice(self, "method", methods())
        self._check_layout()
        check_choice(self, "head_mode", HEAD_MODES)
        check_choice(self, "importance", IMPORTANCES)
        check_choice(self, "alpha_metric", ALPHA_METRICS)
        gqa_pool, pool, kernel = _VARIANT_DEFAULTS[self.importance]
        if self.gqa_pool is None:
            object.__setattr__(self, "gqa_pool", gqa_pool)
        if self.pool is None:
            object.__setattr__(self, "pool", pool)
        if self.pool_kernel is None:
            object.__setattr__(self, "pool_kernel", kernel)
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
        self._check_sparrow()

    def _check_layout(self) -> None:
        """``layout`` is None or the one layout ``method`` runs on (named in the error)."""
        if self.layout is None:
            return
        check_choice(self, "layout", LAYOUTS)
        if self.layout in self.valid_layouts:
            return
        if self.layout == "budget":
            reason = {
                "none": f"a budget cache needs an eviction policy "
                        f"({' | '.join(EVICTION_SCORES.names())}) to get back under budget; "
                        "method none keeps every token",
                "sparrow": "sparrow selects pages of the full cache, which a budget cache does "
                           "not hold",
            }[self.method]
        elif self.method == "sparrow":
            reason = "sparrow selects among the pages of the paged cache"
        else:
            reason = (f"method {self.method!r} evicts: it compresses a budget cache (method "
                      "none keeps every token)")
        needs = " or ".join(repr(x) for x in self.valid_layouts)
        reject(self, "layout", f"does not fit method {self.method!r} (needs {needs}): {reason}")

    def _check_sparrow(self) -> None:
        """Validate (and resolve a preset name of) the page-sparse fields."""
        check_int(self, "page_size", 1)
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
        check_number(self, "alpha_threshold", gt=0, le=1)
        self._check_adapt()

    def _check_adapt(self) -> None:
        """The closed-loop fields: types and bounds, and (when on) a sparrow method with the
        alpha metric and a schedule whose every k lies in ``[adapt_min_k, adapt_max_k]``."""
        check(isinstance(self.adapt_k, bool), self, "adapt_k", "must be true or false")
        check_int(self, "adapt_step", 1)
        check_number(self, "adapt_margin", ge=0, lt=1)
        check_int(self, "adapt_min_k", 0)
        check_int(self, "adapt_max_k", self.adapt_min_k,
                  f"must be None or an int >= adapt_min_k ({self.adapt_min_k})", optional=True)
        if not self.adapt_k:
            return
        check(self.method == "sparrow", self, "adapt_k",
              f"needs method sparrow (got {self.method!r}): it adapts the page budget")
        check(self.alpha_metric != "off", self, "adapt_k",
              "needs alpha_metric exact or top20 (the loop is driven by the alpha p5)")
        ks = [k for _, k in self.budget_schedule]
        check(self.adapt_min_k <= min(ks), self, "adapt_min_k",
              f"must be <= every k of budget_schedule (smallest {min(ks)}) with adapt_k")
        check(self.adapt_max_k is None or self.adapt_max_k >= max(ks), self, "adapt_max_k",
              f"must be >= every k of budget_schedule (largest {max(ks)}) with adapt_k")

    def _check_bin(self, i: int, entry) -> None:
        """Entry ``i`` of the resolved ``budget_schedule``: a pair of ints ``(start, k)``, the
        first starting at 0, starts increasing multiples of ``page_size``, and ``k`` no larger
        than the middle pages a length below the next start can have."""
        field = f"budget_schedule[{i}]"
        check(isinstance(entry, tuple) and len(entry) == 2 and all(map(is_int, entry)),
              self, field, "must be a pair of ints [start, k]", entry)
        start, k = entry
        check(k >= 0, self, field, "must have k >= 0", entry)
        check(start % self.page_size == 0, self, field,
              f"must start at a multiple of page_size={self.page_size}", entry)
        if i == 0:
            check(start == 0, self, field, "must start at 0 (the first bin)", entry)
            return
        previous_start, previous_k = self.budget_schedule[i - 1]
        check(start > previous_start, self, field,
              f"must start after budget_schedule[{i - 1}] (starts strictly increasing)", entry)
        # The longest length of bin i-1 has ceil(L / page_size) = start / page_size - 1
        # pages, of which all but the sink and the 2 newest are middle pages.
        pages = max(start // self.page_size - 1 - 3, 0)
        if previous_k > pages:
            reject(self, f"budget_schedule[{i - 1}]",
                   f"has k larger than the {pages} middle pages a length in "
                   f"[{previous_start}, {start}) can have (the bin would always be dense)",
                   self.budget_schedule[i - 1])

    @property
    def valid_layouts(self) -> tuple[str, ...]:
        """The layouts ``method`` runs on, its own (:attr:`natural_layout`) first."""
        if self.method in EVICTION_SCORES:
            return ("budget",)
        return ("paged", "dense") if self.method == "none" else ("paged",)

    @property
    def natural_layout(self) -> str:
        """The layout ``method`` runs on when ``layout`` is left out: ``budget`` if it
        evicts, ``paged`` for ``none`` and ``sparrow``."""
        return self.valid_layouts[0]

    @property
    def cache_layout(self) -> str:
        """The cache layout in effect: ``layout``, or the method's own when it is None."""
        return self.layout or self.natural_layout

    @property
    def compresses(self) -> bool:
        """False for ``none`` and ``sparrow``: the cache is never compressed."""
        return self.method in EVICTION_SCORES

    @property
    def page_sparse(self) -> bool:
        """True for ``sparrow``: decode attends to selected pages of a full paged cache."""
        return self.method == "sparrow"

    @property
    def max_pages_k(self) -> int:
        """The largest k of ``budget_schedule`` (static size of the page selection), or with
        ``adapt_k`` the largest the closed loop may set (``adapt_max_k`` when given)."""
        if self.adapt_k and self.adapt_max_k is not None:
            return self.adapt_max_k
        return max(k for _, k in self.budget_schedule)

    @property
    def capacity(self) -> int:
        """Cache slots of a compressing cache: ``budget + buffer``."""
        return self.budget + self.buffer

    def cache_capacity(self, max_total_len: int) -> int:
        """Slots to allocate for sequences of up to ``max_total_len`` tokens (prompt + response).

        The ``dense`` layout: the whole sequence; ``paged``: the whole sequence rounded up to
        whole pages; ``budget``: ``budget + buffer``.
        """
        if self.cache_layout == "paged":
            return -(-max_total_len // self.page_size) * self.page_size
        return self.capacity if self.cache_layout == "budget" else max_total_len
