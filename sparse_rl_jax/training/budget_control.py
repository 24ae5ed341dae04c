"""Sparrow's closed loop (beyond the paper): k per schedule bin adapted online from the live
acceptance p5 (``compression.adapt``).

After each RL step the acceptance ``alpha`` of every sampled token (sparse rollout vs the
dense policy, ``acceptance``) is pooled per ``budget_schedule`` bin of the cached length the
token was decoded at (the token at 1-based response position ``p = cumsum(response_mask)``,
``p >= 2``, of a row with a ``plen``-token prompt: ``L = plen + p - 1``, the length whose k
chose its pages; position 1 comes from the dense prefill and masked tokens are left out), and
each bin's 5th percentile ``p5_i`` of alpha clipped to ``[0, 1]`` (``np.percentile``, linear)
moves its k:

  ``p5_i < alpha.threshold``                   -> ``k_i + adapt.step`` (more pages)
  ``p5_i >= alpha.threshold + adapt.margin``   -> ``k_i - adapt.step`` (slack: fewer pages)
  otherwise, or no token in the bin            -> ``k_i``

clipped to ``[adapt.min_k, upper_i]``, ``upper_i`` the smaller of ``max_pages_k`` (the compiled
selection size) and the middle pages a length of bin ``i`` can have. The ks go to the sampler
as a traced value (``sampler.generate(budget_ks=...)``), so adapting never recompiles.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import jax.numpy as jnp
import numpy as np

from models.shapes import check_shape
from sparse_rl_jax.kv.compression_config import CompressionConfig
from sparse_rl_jax.kv.page_sparsity import schedule_bin
from sparse_rl_jax.rollout.acceptance import percentile_per_bin_id, response_positions

P5_METRIC = "alpha_p5_kbin{}"  # p5 of alpha per schedule bin (the loop's input)
K_METRIC = "sparrow_k_bin{}"  # k per schedule bin the step's rollouts used


def initial_ks(cfg: CompressionConfig) -> tuple[int, ...]:
    """The schedule's own k per bin: where the loop starts."""
    return cfg.sparrow.ks


def upper_ks(cfg: CompressionConfig) -> tuple[int, ...]:
    """The largest k of each bin: ``max_pages_k``, and for every bin but the last (which is
    open-ended) the middle pages of its longest length (``ceil(L / page_size) - 3`` with
    ``L`` one below the next start)."""
    starts = [start for start, _ in cfg.sparrow.budget_schedule]
    ends = [max(nxt // cfg.page_size - 4, 0) for nxt in starts[1:]] + [cfg.max_pages_k]
    return tuple(min(cfg.max_pages_k, end) for end in ends)


def bin_p5(cfg: CompressionConfig, alpha, response_mask, prompt_lengths) -> np.ndarray:
    """``[len(budget_schedule)]`` float64 p5 of alpha (clipped to ``[0, 1]``) per schedule bin
    of the cached length each token was decoded at (NaN: no token), see the module docstring.

    The response position is Sparrow's 1-based ``cumsum(response_mask)``
    (``acceptance.response_positions``), so masked or padded tokens neither count nor advance
    it: the token at position ``p >= 2`` was decoded at ``L = plen + p - 1``; position 1 (the
    dense prefill's sample) and masked tokens are left out.

    Args:
      alpha: ``[N, M]`` per-token acceptance.
      response_mask: ``[N, M]`` 1 on sampled tokens.
      prompt_lengths: ``[N]`` real prompt tokens per row.
    """
    alpha = np.asarray(alpha, np.float64)
    check_shape("alpha", alpha, N=None, M=None)
    n, m = alpha.shape
    check_shape("response_mask", response_mask, N=n, M=m)
    check_shape("prompt_lengths", prompt_lengths, N=n)
    positions = response_positions(response_mask)
    lengths = np.asarray(prompt_lengths)[:, None] + positions - 1
    bins = np.asarray(schedule_bin(cfg, jnp.asarray(lengths.reshape(-1)))).reshape(n, m)
    decoded = np.asarray(response_mask).astype(bool) & (positions >= 2)
    return percentile_per_bin_id(alpha, decoded, bins, len(cfg.sparrow.budget_schedule))


def next_ks(cfg: CompressionConfig, ks: tuple[int, ...], p5: np.ndarray) -> tuple[int, ...]:
    """The loop's update of ``ks`` from each bin's ``p5`` (NaN: hold), see the module
    docstring."""
    out, adapt, threshold = [], cfg.adapt, cfg.alpha.threshold
    for k, value, upper in zip(ks, p5, upper_ks(cfg)):
        if value < threshold:
            k += adapt.step
        elif value >= threshold + adapt.margin:
            k -= adapt.step
        out.append(int(min(max(k, adapt.min_k), upper)))
    return tuple(out)


def p5_metrics(p5: np.ndarray) -> dict[str, float]:
    """``alpha_p5_kbin{i}`` of each bin with tokens (the rollout metrics the loop reads)."""
    return {P5_METRIC.format(i): float(v) for i, v in enumerate(p5) if not np.isnan(v)}


def observed_p5(cfg: CompressionConfig, metrics: Mapping[str, float]) -> np.ndarray:
    """The per-bin p5 a step's metrics hold (:func:`p5_metrics`), NaN where absent."""
    return np.asarray([metrics.get(P5_METRIC.format(i), np.nan)
                       for i in range(len(cfg.sparrow.budget_schedule))], np.float64)


def restored_ks(cfg: CompressionConfig, saved) -> tuple[int, ...]:
    """The ks a checkpoint saved (its ``budget_ks``), checked against the schedule's bins and
    bounds; the schedule's own when the checkpoint has none (saved without the loop)."""
    if saved is None:
        return initial_ks(cfg)
    ks = tuple(saved)
    uppers = upper_ks(cfg)
    if len(ks) != len(uppers) or not all(
            isinstance(k, int) and cfg.adapt.min_k <= k <= u for k, u in zip(ks, uppers)):
        raise ValueError(f"checkpoint budget_ks={list(ks)} does not fit "
                         f"compression.sparrow.budget_schedule ({len(uppers)} bins, k in "
                         f"[adapt.min_k={cfg.adapt.min_k}, {list(uppers)}])")
    return ks


@dataclasses.dataclass
class BudgetLoop:
    """The trainer's closed-loop state: the ks of the next RL step (None when ``adapt.enabled`` is
    off, and then every method is a no-op).

    Attributes:
      cfg: the run's compression config.
      ks: k per ``budget_schedule`` bin for the next step's rollouts, or None.
    """

    cfg: CompressionConfig
    ks: tuple[int, ...] | None

    @classmethod
    def start(cls, cfg: CompressionConfig, meta: Mapping | None) -> "BudgetLoop":
        """The loop at the start of a run: the ks a resumed checkpoint's ``meta`` saved
        (:meth:`meta`), else the schedule's own."""
        if not cfg.adapt.enabled:
            return cls(cfg, None)
        return cls(cfg, restored_ks(cfg, None if meta is None else meta.get("budget_ks")))

    def context(self, ctx):
        """``rl_step.StepContext`` ``ctx`` with this step's ks (``ctx`` itself when off)."""
        return ctx if self.ks is None else dataclasses.replace(ctx, budget_ks=self.ks)

    def observe(self, metrics: dict) -> None:
        """Logs the ks the step used into ``metrics`` (``sparrow_k_bin{i}``) and moves them by
        the step's per-bin p5 (``alpha_p5_kbin{i}``)."""
        if self.ks is None:
            return
        metrics.update({K_METRIC.format(i): float(k) for i, k in enumerate(self.ks)})
        self.ks = next_ks(self.cfg, self.ks, observed_p5(self.cfg, metrics))

    def meta(self) -> dict:
        """What a checkpoint saves for :meth:`start` to resume with: ``{"budget_ks": [...]}``,
        or nothing when off."""
        return {} if self.ks is None else {"budget_ks": list(self.ks)}
