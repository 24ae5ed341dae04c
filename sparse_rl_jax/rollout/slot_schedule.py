"""The continuous engine's host-side schedule: which queued row goes into which free slot, and,
for rows sharing a KV page pool (``models.page_pool.PagePoolCache``), which pool pages each
slot's page table maps.

Between chunks the host reads the slots' ``[S]`` live flags and steps and calls
:meth:`SlotSchedule.plan`, which

1. retires the rows that stopped (their pages go back to the free list);
2. reserves, for every live row in admission order, the pages it may fill in the next chunk
   (so the pool never runs dry inside a chunk); when the free list is short it preempts the
   newest live row (its pages freed, the row queued first again: its re-run is the same rows,
   since its sampling keys are ``(key, row id, token index)``);
3. admits queued rows, in order, into free slots while each one's prompt pages and one
   chunk's fit.

It holds only numbers the host owns (the queue, the ``[S, R]`` page tables, the free list),
never KV. Without a pool every row fits: the schedule is plain refill.
"""

from __future__ import annotations

import dataclasses
from collections import deque

import numpy as np

from sparse_rl_jax.kv.compression_config import CompressionConfig
from sparse_rl_jax.rollout import engine_state
from sparse_rl_jax.rollout.sampling_config import SamplingConfig


class SlotSchedule:
    """The host's view of ``S`` decode slots and ``N`` queued rows.

    Args:
      slots: ``S``.
      prompt_lengths: ``[N]`` real prompt tokens of each row.
      caps: ``[N]`` response cap of each row.
      chunk: decode steps per chunk ``c``.
      page_size: positions per page.
      row_pages: ``R``, logical pages of a max-length row (a page table's width).
      pool_pages: pages of the shared pool, or 0 (no pool: rows hold their own KV).

    Attributes:
      table: ``[S, R]`` int32 pool page of each slot's logical page (``pool_pages`` = none).
      peak_live: most rows in flight at once (after an admission).
      peak_pages: most pool pages held at once.
      preemptions: rows preempted (and run again).
    """

    def __init__(self, slots: int, prompt_lengths: np.ndarray, caps: np.ndarray, *, chunk: int,
                 page_size: int, row_pages: int, pool_pages: int = 0):
        self.lengths, self.caps = np.asarray(prompt_lengths), np.asarray(caps)
        self.chunk, self.page_size, self.pool_pages = chunk, page_size, pool_pages
        self.queue = deque(range(len(self.caps)))
        self.row = np.full((slots,), -1, np.int64)
        self.order: list[int] = []  # live slots, oldest admission first
        self.free = list(range(pool_pages))[::-1]  # a stack: low page ids first
        self.table = np.full((slots, row_pages), pool_pages, np.int32)
        self.held = np.zeros((slots,), np.int64)
        self.peak_live = self.peak_pages = self.preemptions = 0

    @property
    def done(self) -> bool:
        """No row queued and none in flight."""
        return not self.queue and not self.order

    def pages_for(self, row: int, step: int) -> int:
        """Pages row ``row`` holds after a chunk started at ``step`` (tokens sampled so far):
        its positions ``[0, length + min(step + c, cap) - 1)`` (0 without a pool)."""
        if not self.pool_pages:
            return 0
        end = self.lengths[row] + min(step + self.chunk, self.caps[row]) - 1
        return -(-int(end) // self.page_size)

    def _grow(self, slot: int, pages: int) -> bool:
        """Map the slot's logical pages up to ``pages`` from the free list; False (nothing
        taken) when the free list is short."""
        more = pages - self.held[slot]
        if more > len(self.free):
            return False
        for p in range(self.held[slot], pages):
            self.table[slot, p] = self.free.pop()
        self.held[slot] = max(pages, self.held[slot])
        self.peak_pages = max(self.peak_pages, self.pool_pages - len(self.free))
        return True

    def _release(self, slot: int) -> None:
        """Return the slot's pages to the free list and unmap its table."""
        self.free.extend(self.table[slot, :self.held[slot]][::-1].tolist())
        self.table[slot] = self.pool_pages
        self.held[slot] = 0
        self.order.remove(slot)

    def plan(self, live: np.ndarray, step: np.ndarray) -> tuple[list[int], list[tuple[int, int]]]:
        """Retire, reserve and admit before a chunk (see the module docstring).

        Args:
          live: ``[S]`` bool the slots still decoding (as the device has them).
          step: ``[S]`` int tokens sampled so far by each slot's row.

        Returns:
          ``(preempted, admitted)``: slots whose row was preempted (the device must mark
          them not live), and ``(row, slot)`` pairs to insert.
        """
        for slot in [s for s in self.order if not live[s]]:
            self._release(slot)
        preempted, i = [], 0
        while i < len(self.order):
            slot = self.order[i]
            if self._grow(slot, self.pages_for(self.row[slot], int(step[slot]))):
                i += 1
                continue
            victim = self.order[-1]  # the newest row gives its pages back
            self.queue.appendleft(int(self.row[victim]))
            self._release(victim)
            preempted.append(victim)
            self.preemptions += 1
        admitted = []
        free_slots = [s for s in range(len(self.row)) if s not in self.order]
        while self.queue and free_slots:
            row, slot = self.queue[0], free_slots[0]
            if not self._grow(slot, self.pages_for(row, 1)):
                break
            self.queue.popleft()
            free_slots.pop(0)
            self.order.append(slot)
            self.row[slot] = row
            admitted.append((row, slot))
        self.peak_live = max(self.peak_live, len(self.order))
        return preempted, admitted


def insert_prompts(sampling: SamplingConfig, slots: int) -> int:
    """Prompts prefilled per :func:`insert` call (``J``, each fanned out to its
    ``num_samples`` rows): ``sampling.insert_prompts``, or when 0 enough prompts for a
    quarter of the slots (at least 1)."""
    return sampling.insert_prompts or -(-slots // (4 * sampling.num_samples))


def insert_calls(admitted: list[tuple[int, int]], j: int, g: int, s: int):
    """The :func:`insert` arguments ``(groups [J], targets [J * G])`` that put the admitted
    ``(row, slot)`` pairs in place, at most ``j`` prompts a call (each prefilled once for
    every admitted sample of it; a target ``s`` leaves that sample out of the call)."""
    prompts = list(dict.fromkeys(row // g for row, _ in admitted))
    for start in range(0, len(prompts), j):
        chosen = {p: i for i, p in enumerate(prompts[start:start + j])}
        groups = np.full((j,), -1, np.int32)
        groups[:len(chosen)] = list(chosen)
        targets = np.full((j * g,), s, np.int32)
        for row, slot in admitted:
            if row // g in chosen:
                targets[chosen[row // g] * g + row % g] = slot
        yield groups, targets


def checked_caps(row_caps, rows: int, max_new_tokens: int) -> np.ndarray:
    """``row_caps`` as ``[rows]`` ints in ``[1, max_new_tokens]`` (None: ``max_new_tokens``
    for every row). ValueError naming ``row_caps`` and the bad shape, dtype or values."""
    m = max_new_tokens
    if row_caps is None:
        return np.full((rows,), m, np.int32)
    caps = np.asarray(row_caps)
    expected = f"row_caps: expected {rows} ints in [1, max_new_tokens={m}], got"
    if caps.shape != (rows,) or caps.dtype.kind not in "iu":
        raise ValueError(f"{expected} shape {caps.shape} dtype {caps.dtype}: "
                         f"{np.array2string(caps, threshold=16)}")
    bad = np.flatnonzero((caps < 1) | (caps > m))
    if bad.size:
        shown = ", ".join(f"row_caps[{i}]={caps[i]}" for i in bad[:4])
        more = f" and {bad.size - 4} more" if bad.size > 4 else ""
        raise ValueError(f"{expected} {shown}{more}")
    return caps


def resolve_pool(sampling: SamplingConfig, compression: CompressionConfig, slots: int,
                 max_len: int) -> tuple[SamplingConfig, int]:
    """``(sampling, R)``: ``sampling.pool_pages`` resolved for this call (0 where rows share
    no pool, ``engine_state.pooled``; 0 given = ``slots * R``) and ``R``, the pages of one
    max-length row. ValueError naming the field when the pool cannot hold one such row."""
    row_pages = -(-max_len // compression.page_size)
    if not engine_state.pooled(compression):
        return dataclasses.replace(sampling, pool_pages=0), row_pages
    if 0 < sampling.pool_pages < row_pages:
        raise ValueError(
            f"sampling.pool_pages={sampling.pool_pages} cannot hold one max-length row of "
            f"{max_len} positions (prompt width {max_len - sampling.max_new_tokens} + "
            f"max_new_tokens {sampling.max_new_tokens}) in pages of {compression.page_size}: "
            f"the smallest pool that works is {row_pages} pages")
    pool_pages = sampling.pool_pages or slots * row_pages
    return dataclasses.replace(sampling, pool_pages=pool_pages), row_pages
