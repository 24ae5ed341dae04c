"""Sparrow bookkeeping around the model's page-sparse decode (``models.page_sparse``, whose
cache keeps its own page-mean keys).

- :func:`schedule_budget`: k of each row from ``budget_schedule`` and its cached length.
- :func:`replay_from_page_record`: the selection record as the per-query pages of a
  teacher-forced forward, which replays the sampler's page-sparse policy exactly;
  :class:`PageRecord` is the record as a ``scoring.ReplayRecord``.
"""

from __future__ import annotations

from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from models.page_sparse import NO_PAGE, PageReplay
from models.shapes import check_shape
from sparse_rl_jax.kv.compression_config import CompressionConfig


def schedule_bin(cfg: CompressionConfig, lengths: jax.Array) -> jax.Array:
    """Index ``[B]`` int32 of the ``budget_schedule`` entry of cached lengths ``lengths [B]``
    (current token included): the last entry with ``start_i <= ceil(L / page_size) *
    page_size`` (with 16-token pages and 2000-token starts this is Sparrow's
    ``bin = ceil(L / 16) // 125``, the last bin open-ended)."""
    starts = jnp.asarray([s for s, _ in cfg.sparrow.budget_schedule], jnp.int32)
    ps = cfg.page_size
    covered = (jnp.asarray(lengths).astype(jnp.int32) + ps - 1) // ps * ps
    idx = jnp.sum(covered[:, None] >= starts[None, :], axis=1) - 1
    return jnp.clip(idx, 0, len(cfg.sparrow.budget_schedule) - 1)


def schedule_budget(cfg: CompressionConfig, lengths: jax.Array,
                    ks: jax.Array | None = None) -> jax.Array:
    """k per row ``[B]`` int32 for cached lengths ``lengths [B]``: the k of each row's
    :func:`schedule_bin`, from ``ks [len(budget_schedule)]`` (a traced schedule, e.g. the
    closed loop's) or else the schedule's own."""
    if ks is None:
        ks = jnp.asarray(cfg.sparrow.ks, jnp.int32)
    return jnp.asarray(ks, jnp.int32)[schedule_bin(cfg, lengths)]


def num_pages(max_len: int, page_size: int) -> int:
    """Pages that hold ``max_len`` positions: ``ceil(max_len / page_size)``."""
    return -(-max_len // page_size)


def replay_from_page_record(
    record: jax.Array, positions: jax.Array, prompt_lengths: jax.Array, page_size: int,
    quant: str = "none",
) -> PageReplay:
    """The selection record as the per-query pages of a teacher-forced forward over
    prompt + response (``models.Decoder(..., kv=replay)``), which replays the
    sampler's page-sparse policy exactly.

    Args:
      record: ``[L, B, Hkv, M, K]`` int32: the pages the query at response index ``r`` (position
        ``prompt_len + r``) attended to; ``-1`` unused. A row of ``-1`` only (dense layers,
        steps that never ran) replays dense.
      positions: ``[B, S]`` positions of the columns (``-1`` padding), see
        ``scoring.sequence_positions``.
      prompt_lengths: ``[B]`` real prompt tokens per row.
      page_size: tokens per page of ``record``.
      quant: the ``models.kv_quant`` format the rollout's cache stored (the replay's keys and
        values are quantized and decoded the same way).

    Returns:
      :class:`PageReplay` with ``pages [L, B, Hkv, S, K]`` (``-1`` only on prompt and padding
      columns: prefill is dense). It is as compact as the record: the attention expands it
      into visibility one query block at a time, never ``[S, S]`` per layer and head.
    """
    n_layers, b, h, m, k = record.shape
    s = positions.shape[1]
    r = positions - prompt_lengths[:, None]  # response index of each query column
    in_resp = (r >= 0) & (r < m)
    index = jnp.broadcast_to(jnp.clip(r, 0, m - 1)[None, :, None, :, None], (n_layers, b, h, s, k))
    pages = jnp.take_along_axis(record.astype(jnp.int32), index, axis=3)
    pages = jnp.where(in_resp[None, :, None, :, None], pages, NO_PAGE)
    return PageReplay(pages=pages, page_size=page_size, quant=quant)


@struct.dataclass
class PageRecord:
    """A ``sparrow`` rollout's replay record (``Rollout.record``, a ``scoring.ReplayRecord``):
    the pages each decode query attended to.

    Attributes:
      pages: ``[N, L, Hkv, M, K]`` int32, row first: the pages the query at response index
        ``r`` attended to (``NO_PAGE`` = -1 unused; all -1 on dense layers and steps that
        never ran).
      page_size: tokens per page (static).
      quant: the ``models.kv_quant`` format of the rollout's cache (static): the replay
        quantizes its own keys and values the same way.
    """

    pages: jax.Array
    page_size: int = struct.field(pytree_node=False, default=16)
    quant: str = struct.field(pytree_node=False, default="none")
    fill: ClassVar[int] = NO_PAGE

    def replay_view(self, positions: jax.Array, prompt_lengths: jax.Array,
                    response_len: int) -> PageReplay:
        """The per-query pages of the ``[N, S]`` columns (:func:`replay_from_page_record`)."""
        if self.pages.ndim == 5 and self.pages.shape[3] == 0 and response_len > 0:
            raise ValueError("the page record is empty: sample with "
                             "SamplingConfig(record_evictions=True) to replay the sparse context")
        check_shape("record.pages", self.pages, N=positions.shape[0], L=None, Hkv=None,
                    M=response_len, K=None)
        return replay_from_page_record(jnp.moveaxis(self.pages, 0, 1), positions,
                                       prompt_lengths, self.page_size, self.quant)
