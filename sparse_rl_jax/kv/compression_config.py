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
``sparrow.budget_schedule``, a step function of the cached length.

The settings of each part live in a section (``compression_sections``): ``eviction``,
``sparrow``, ``alpha``, ``adapt``; :attr:`CompressionConfig.used_sections` names those the
method reads. The flat keys of before the split (``budget``, ``alpha_threshold``, ``adapt_k``
...) are refused with their new place (``CompressionConfig.MOVED_KEYS``).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

from sparse_rl_jax.core.config_checks import check, check_choice, check_int, reject, reject_moved
from sparse_rl_jax.kv.compression_sections import (AdaptConfig, AlphaConfig, EvictionConfig,
                                                   SparrowConfig)
from models.kv_quant import KV_QUANTS, get_quant
from sparse_rl_jax.kv.scores import EVICTION_SCORES

Layout = Literal["dense", "budget", "paged"]

LAYOUTS: tuple[str, ...] = ("dense", "budget", "paged")


def methods() -> tuple[str, ...]:
    """The allowed ``method`` values: ``none``, every registered eviction score
    (``kv.scores.EVICTION_SCORES``: the evicting methods) and ``sparrow``."""
    return ("none", *EVICTION_SCORES.names(), "sparrow")

_SECTIONS = {"eviction": EvictionConfig, "sparrow": SparrowConfig, "alpha": AlphaConfig,
             "adapt": AdaptConfig}


@dataclasses.dataclass(frozen=True)
class CompressionConfig:
    """How the rollout KV cache is compressed (static under ``jit``; hashable).

    ``CompressionConfig(budget=64)`` (a flat key of before the sections) is a
    :class:`~sparse_rl_jax.core.config_checks.ConfigError` naming its new place
    (``eviction.budget``).

    Attributes:
      method: the eviction/selection policy: ``none`` (never evicts), a registered eviction
        score (``kv.scores.EVICTION_SCORES``: ``snapkv`` (Z = importance), ``rkv`` (Z =
        rkv_lambda * importance - (1 - rkv_lambda) * redundancy), ``streaming`` (``num_sinks``
        first tokens + the newest)): the evicting methods read ``eviction``; ``sparrow`` (attend selected pages, evict nothing) reads
        ``sparrow`` (and ``adapt``).
      layout: the cache layout: ``dense`` (one slot per token; ``none``), ``budget``
        (``budget + buffer`` slots; the evicting methods) or ``paged`` (one slot per token in
        ``page_size``-slot pages, decode reads only the filled ones; ``none``'s own and
        ``sparrow``'s); None = the method's own. Other pairs are rejected.
      page_size: (layout ``paged``) tokens per page, >= 1 (16 in Sparrow).
      quant: the rollout cache's KV format (``models.kv_quant.KV_QUANTS``): ``none`` (the
        cache dtype), ``int8``, ``fp8`` or ``int4`` (two values a byte; an even head_dim), a
        scale per token and KV head computed when the token is written; attention and
        eviction scores read the decoded values, and a replay of the rollout's record
        (``score(..., record)``) quantizes its own keys and values the same way. Runs in
        every cache (the slot cache of layouts ``dense`` and ``budget``; the paged cache and
        the continuous engine's page pool of ``paged``, ``sparrow`` taking its page means of
        the decoded keys); the XLA attention path reads every level, the GPU page kernel
        (``model.attention``) ``int8`` and ``fp8`` pages with their scale pages, the TPU
        kernel none.
      eviction: the evicting methods' budget cache and score (:class:`EvictionConfig`).
      sparrow: ``sparrow``'s page budget and dense layers (:class:`SparrowConfig`).
      alpha: the logged acceptance alpha of a recorded rollout (:class:`AlphaConfig`).
      adapt: ``sparrow``'s closed loop on its page budget (:class:`AdaptConfig`).
    """

    # The flat keys of before the sections (a frozen record: new fields never join it): old
    # key -> its place now; ``config_io`` names the new place of one in a file or override.
    MOVED_KEYS: ClassVar[dict[str, str]] = {
        **{key: f"eviction.{key}" for key in (
            "budget", "buffer", "window", "head_mode", "gqa_pool", "pool", "pool_kernel",
            "rkv_lambda", "redundancy_threshold", "num_sinks", "importance")},
        "budget_schedule": "sparrow.budget_schedule", "dense_layers": "sparrow.dense_layers",
        "alpha_threshold": "alpha.threshold", "alpha_metric": "alpha.metric",
        "adapt_k": "adapt.enabled", "adapt_step": "adapt.step", "adapt_margin": "adapt.margin",
        "adapt_min_k": "adapt.min_k", "adapt_max_k": "adapt.max_k",
    }

    method: str = "snapkv"
    layout: Layout | None = None
    page_size: int = 16
    quant: str = "none"
    eviction: EvictionConfig = EvictionConfig()
    sparrow: SparrowConfig = SparrowConfig()
    alpha: AlphaConfig = AlphaConfig()
    adapt: AdaptConfig = AdaptConfig()

    def __new__(cls, *args, **kwargs):
        reject_moved(cls.__name__, kwargs, cls.MOVED_KEYS)
        return super().__new__(cls)

    def __post_init__(self) -> None:
        check_choice(self, "method", methods())
        self._check_layout()
        check_int(self, "page_size", 1)
        check_choice(self, "quant", KV_QUANTS.names())
        for name, section in _SECTIONS.items():
            check(isinstance(getattr(self, name), section), self, name,
                  f"must be of type {section.__name__}")
        for i in range(1, len(self.sparrow.budget_schedule)):
            self._check_bin_fits_pages(i)
        self._check_adapt()

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

    def _check_bin_fits_pages(self, i: int) -> None:
        """Bin ``i`` (> 0) of ``sparrow.budget_schedule`` starts at a multiple of
        ``page_size``, and bin ``i - 1``'s k is no larger than the middle pages a length
        below that start can have."""
        schedule = self.sparrow.budget_schedule
        start, previous = schedule[i][0], schedule[i - 1]
        check(start % self.page_size == 0, self, f"sparrow.budget_schedule[{i}]",
              f"must start at a multiple of page_size={self.page_size}", schedule[i])
        # The longest length of bin i-1 has ceil(L / page_size) = start / page_size - 1
        # pages, of which all but the sink and the 2 newest are middle pages.
        pages = max(start // self.page_size - 1 - 3, 0)
        check(previous[1] <= pages, self, f"sparrow.budget_schedule[{i - 1}]",
              f"has k larger than the {pages} middle pages a length in "
              f"[{previous[0]}, {start}) can have (the bin would always be dense)", previous)

    def _check_adapt(self) -> None:
        """With ``adapt.enabled``: a sparrow method with the alpha metric, and a schedule
        whose every k lies in ``[adapt.min_k, adapt.max_k]``."""
        adapt, ks = self.adapt, self.sparrow.ks
        if not adapt.enabled:
            return
        check(self.method == "sparrow", self, "adapt.enabled",
              f"needs method sparrow (got {self.method!r}): it adapts the page budget",
              adapt.enabled)
        check(self.alpha.metric != "off", self, "adapt.enabled",
              "needs alpha.metric exact or top20 (the loop is driven by the alpha p5)",
              adapt.enabled)
        check(adapt.min_k <= min(ks), self, "adapt.min_k",
              f"must be <= every k of sparrow.budget_schedule (smallest {min(ks)}) with "
              "adapt.enabled", adapt.min_k)
        check(adapt.max_k is None or adapt.max_k >= max(ks), self, "adapt.max_k",
              f"must be >= every k of sparrow.budget_schedule (largest {max(ks)}) with "
              "adapt.enabled", adapt.max_k)

    @property
    def used_sections(self) -> tuple[str, ...]:
        """The sections ``method`` reads: ``eviction`` and ``alpha`` (a recorded rollout's)
        for the evicting methods; ``sparrow``, ``alpha`` and, when on, ``adapt`` for
        ``sparrow``; none for ``none`` (``python run.py config`` shows only these)."""
        if self.compresses:
            return ("eviction", "alpha")
        if self.page_sparse:
            return ("sparrow", "alpha") + (("adapt",) if self.adapt.enabled else ())
        return ()

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
        """The largest k of ``sparrow.budget_schedule`` (static size of the page selection),
        or with ``adapt.enabled`` the largest the closed loop may set (``adapt.max_k`` when
        given)."""
        if self.adapt.enabled and self.adapt.max_k is not None:
            return self.adapt.max_k
        return max(self.sparrow.ks)

    @property
    def capacity(self) -> int:
        """Cache slots of a compressing cache: ``eviction.budget + eviction.buffer``."""
        return self.eviction.budget + self.eviction.buffer

    def check_fits(self, model_config) -> None:
        """ValueError naming the field when a model of ``model_config`` (``models.ModelConfig``)
        cannot run this compression: a ``sparrow.dense_layers`` layer it does not have
        (``sparrow``), or a ``quant`` its head_dim cannot be packed into (int4: an even one)."""
        layers, dense = model_config.num_layers, self.sparrow.dense_layers
        if self.page_sparse and any(i >= layers for i in dense):
            raise ValueError(f"compression.sparrow.dense_layers={dense} names a layer the model "
                             f"({layers} layers) does not have")
        get_quant(self.quant).check_head_dim(model_config.head_dim, "compression.quant")

    def cache_capacity(self, max_total_len: int) -> int:
        """Slots to allocate for sequences of up to ``max_total_len`` tokens (prompt + response).

        The ``dense`` layout: the whole sequence; ``paged``: the whole sequence rounded up to
        whole pages; ``budget``: ``budget + buffer``.
        """
        if self.cache_layout == "paged":
            return -(-max_total_len // self.page_size) * self.page_size
        return self.capacity if self.cache_layout == "budget" else max_total_len
