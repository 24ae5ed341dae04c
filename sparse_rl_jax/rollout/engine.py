"""Continuous-batching rollouts: ``S`` decode slots that stay full, finished rows refilled.

:func:`generate_continuous` returns the same :class:`rollout.Rollout` as the static
``sampler.generate`` (rows prompt-major, same fields and shapes), row for row the same for
the same key: every row is prefilled at the bucketed prompt width ``P`` static uses for the
call, its sampling stream is ``(key, row id, token index)`` (``token_sampling.sample_rows``),
and its cache is compressed when *its* cache is full (``engine_state``), so neither its
slot nor its neighbours nor the refill timing change its tokens or its record.

The host loop: :func:`insert` prefills the next queued rows' prompts, up to ``J``
(``sampling.insert_prompts``, default a quarter of the slots' worth), each prompt once,
fanned out to its rows' free slots; :func:`decode_chunk` decodes every live slot for up to
``c`` (``sampling.chunk``) steps in one jitted loop, retiring rows at EOS or their cap, and
ends early once ``J * num_samples`` slots are free while rows are queued; the host reads the
``[S]`` live flags and refills. (Measured with ``benchmarks/bench_engine.py``'s model,
lognormal caps, 128 rows in 16 slots: the early end keeps the computed slot-steps at ~4660
whatever the chunk, against 5360 / 6640 without it at chunk 16 / 32; half the slots per
insert computes 5150.) Between chunks the host touches only the queue and those flags, never
the KV. Shapes are fixed by ``(S, J, c, N, P)``, so each function compiles once per run.
Rows of the paged layout (``none``, ``sparrow``) share one KV page pool
(``models.page_pool``, ``sampling.pool_pages``): the host's ``slot_schedule.SlotSchedule``
maps the pages each row may fill in the next chunk into its slot's page table before the
chunk, admits a queued row only when its pages fit, and takes a retired row's pages back;
the tables are the only thing besides the flags it uploads.

Outputs are indexed by row (``[N, ...]``, written as the rows decode); the slot state is
indexed by slot (``[S, ...]``). A slot whose row is done keeps the row's id (and does not
advance) until it is refilled.
"""

from __future__ import annotations

import functools
import time
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparse_rl_jax.kv import state as kv_state
from sparse_rl_jax.kv.compression_config import CompressionConfig
from sparse_rl_jax.kv.page_sparsity import schedule_budget
from sparse_rl_jax.rollout import engine_state
from sparse_rl_jax.rollout.result import Rollout, finish_rollout
from sparse_rl_jax.rollout.sampler import (_is_eos, bucket_prompts, checked_budget_ks, generate,
                                           prefill_rows)
from sparse_rl_jax.rollout.sampling_config import SamplingConfig
from sparse_rl_jax.rollout.slot_schedule import (SlotSchedule, checked_caps, insert_calls,
                                                 insert_prompts, resolve_pool)
from sparse_rl_jax.rollout.token_sampling import row_keys, sample_rows


class Slots(NamedTuple):
    """The decode slots (``S`` of them).

    Attributes:
      kv: the slots' KV state (``engine_state.slot_state``: per-row write index ``[S]``).
      row: ``[S]`` int32 global row id in the slot, ``-1`` never filled.
      step: ``[S]`` int32 tokens sampled so far (the index of the next one).
      last: ``[S]`` int32 the newest sampled token (fed next).
      live: ``[S]`` bool the row is still decoding.
      lengths: ``[S]`` int32 real prompt tokens of the row.
      cap: ``[S]`` int32 the row's response cap (``<= max_new_tokens``).
    """

    kv: kv_state.SparseKVState
    row: jax.Array
    step: jax.Array
    last: jax.Array
    live: jax.Array
    lengths: jax.Array
    cap: jax.Array


class Outputs(NamedTuple):
    """What the rows produced, indexed by row id (``N`` rows, ``M`` response slots).

    Attributes:
      response, logp: ``[N, M]`` tokens (``pad_id`` after the end) and their log-probs.
      finished: ``[N]`` bool emitted EOS; length: ``[N]`` int32 tokens sampled.
      kv_sum, kv_peak, forwards: ``[N]`` resident KV tokens summed / peak over the row's
        forwards, and its forwards.
      compressions: ``[N]`` int32 compressions of the row (its prefill's included).
      evicted_at: ``[L, N, Hkv, T]`` the eviction record (``T = 0`` when none is kept).
      page_record: ``[L, N, Hkv, M, K]`` (``sparrow`` with a record) or ``[L, N, Hkv, 0, 0]``.
    """

    response: jax.Array
    logp: jax.Array
    finished: jax.Array
    length: jax.Array
    kv_sum: jax.Array
    kv_peak: jax.Array
    forwards: jax.Array
    compressions: jax.Array
    evicted_at: jax.Array
    page_record: jax.Array


def _slot_state_fn(model, compression: CompressionConfig, sampling: SamplingConfig,
                   max_len: int):
    """``batch -> empty slot state`` for this model and call (also gives the batch axes);
    paged rows (``engine_state.pooled``) share a pool of ``sampling.pool_pages`` pages
    (resolved by :func:`run_continuous`)."""
    record = bool(sampling.record_evictions) and not compression.page_sparse
    return lambda b: engine_state.slot_state(compression, model.config, slots=b,
                                             max_len=max_len, dtype=model.dtype, record=record,
                                             pool_pages=sampling.pool_pages)


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling", "compression", "max_len",
                                             "slots", "rows"))
def init_engine(graphdef, params, *, sampling: SamplingConfig, compression: CompressionConfig,
                max_len: int, slots: int, rows: int) -> tuple[Slots, Outputs]:
    """Empty slots (``S = slots``) and outputs for ``N = rows`` rows of ``max_len``
    positions (prompt width + ``max_new_tokens``)."""
    model = nnx.merge(graphdef, params)
    kv = _slot_state_fn(model, compression, sampling, max_len)(slots)
    cfg, m = model.config, sampling.max_new_tokens
    keep_pages = compression.page_sparse and sampling.record_evictions
    k = kv.cache.num_selected if keep_pages else 0
    zeros = lambda dtype: jnp.zeros((slots,), dtype)  # noqa: E731
    per_row = lambda dtype: jnp.zeros((rows,), dtype)  # noqa: E731
    return (
        Slots(kv=kv, row=jnp.full((slots,), -1, jnp.int32), step=zeros(jnp.int32),
              last=zeros(jnp.int32), live=zeros(bool), lengths=zeros(jnp.int32),
              cap=zeros(jnp.int32)),
        Outputs(response=jnp.full((rows, m), sampling.pad_id, jnp.int32),
                logp=jnp.zeros((rows, m), jnp.float32), finished=per_row(bool),
                length=per_row(jnp.int32), kv_sum=per_row(jnp.float32),
                kv_peak=per_row(jnp.int32), forwards=per_row(jnp.int32),
                compressions=per_row(jnp.int32),
                evicted_at=jnp.full((cfg.num_layers, rows) + kv.evicted_at.shape[2:],
                                    kv_state.NEVER, jnp.int32),
                page_record=jnp.full((cfg.num_layers, rows, cfg.num_kv_heads)
                                     + ((m, k) if keep_pages else (0, 0)), -1, jnp.int32)))


def _flush_records(slots: Slots, out: Outputs) -> Outputs:
    """Copy every filled slot's eviction record to its row's (a no-op without a record)."""
    if not out.evicted_at.shape[-1]:
        return out
    rows = jnp.where(slots.row >= 0, slots.row, out.evicted_at.shape[1])
    return out._replace(evicted_at=out.evicted_at.at[:, rows].set(slots.kv.evicted_at,
                                                                   mode="drop"))


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling", "compression", "max_len"),
                   donate_argnums=(2, 3))
def insert(graphdef, params, slots: Slots, out: Outputs, prompt, prompt_mask, row_caps, key,
           groups, targets, *, sampling: SamplingConfig, compression: CompressionConfig,
           max_len: int) -> tuple[Slots, Outputs]:
    """Prefill prompts ``groups [J]`` once each, fan each out to its ``G = num_samples`` rows
    (as the static ``sampler.prefill``), draw their token 0 and put row ``groups[j] * G + g``
    into slot ``targets[j * G + g]``.

    Args:
      slots, out: the engine (donated).
      prompt, prompt_mask: ``[B, P]`` every prompt of the call (bucketed); row ``r`` answers
        prompt ``r // G``.
      row_caps: ``[N]`` int32 response cap of each row.
      key: the rollout key; groups: ``[J]`` int32 prompt ids (``-1`` unused); targets:
        ``[J * G]`` int32 free slots (``S``: that row is not inserted by this call).
      max_len: ``P + max_new_tokens`` (static), as ``sampler.prefill``.

    Returns:
      ``(slots, out)``. A row whose token 0 ends it (EOS or cap 1) is done at once. An
      inserted row's outputs restart: token 0 then ``pad_id`` (log-prob 0, page record -1),
      so a preempted row's re-insert keeps nothing of its first run.
    """
    model = nnx.merge(graphdef, params)
    n, s, g = out.response.shape[0], slots.row.shape[0], sampling.num_samples
    src = jnp.maximum(groups, 0)
    rows = (src[:, None] * g + jnp.arange(g)).reshape(-1)
    pre = prefill_rows(model, prompt[src], prompt_mask[src], key, rows, sampling=sampling,
                       compression=compression, max_len=max_len, fan_out=g)
    axes = engine_state.batch_axes(_slot_state_fn(model, compression, sampling, max_len))
    at, r = targets, jnp.where(targets < s, rows, n)
    eos = _is_eos(pre.first, sampling.eos_ids)
    cap = row_caps[rows]
    slots = Slots(
        kv=engine_state.set_rows(slots.kv, engine_state.per_row_index(pre.state, rows.shape[0]),
                                 at, axes),
        row=slots.row.at[at].set(rows, mode="drop"),
        step=slots.step.at[at].set(1, mode="drop"),
        last=slots.last.at[at].set(pre.first, mode="drop"),
        live=slots.live.at[at].set(~eos & (cap > 1), mode="drop"),
        lengths=slots.lengths.at[at].set(pre.lengths, mode="drop"),
        cap=slots.cap.at[at].set(cap, mode="drop"))
    m = out.response.shape[1]
    response = jnp.full((rows.shape[0], m), sampling.pad_id, jnp.int32).at[:, 0].set(pre.first)
    logp = jnp.zeros((rows.shape[0], m), jnp.float32).at[:, 0].set(pre.first_logp)
    out = out._replace(
        response=out.response.at[r].set(response, mode="drop"),
        logp=out.logp.at[r].set(logp, mode="drop"),
        page_record=out.page_record.at[:, r].set(-1, mode="drop"),
        finished=out.finished.at[r].set(eos, mode="drop"),
        length=out.length.at[r].set(1, mode="drop"),
        kv_sum=out.kv_sum.at[r].set(pre.resident.astype(jnp.float32), mode="drop"),
        kv_peak=out.kv_peak.at[r].set(pre.resident, mode="drop"),
        forwards=out.forwards.at[r].set(1, mode="drop"),
        compressions=out.compressions.at[r].set(pre.compressions, mode="drop"))
    return slots, _flush_records(slots, out)


def _step(model, slots: Slots, out: Outputs, key, *, sampling: SamplingConfig,
          compression: CompressionConfig, budget_ks) -> tuple[Slots, Outputs]:
    """One decode forward of every slot: live slots feed their newest token and sample the
    next (``fold_in(fold_in(key, row), step)``); done slots feed padding and do not advance."""
    active = slots.live
    positions = jnp.where(active, slots.lengths + slots.step - 1, -1)
    kv = slots.kv.cache
    if compression.page_sparse:
        kv = kv.replace(budget=schedule_budget(compression, positions + 1, budget_ks))
    res = model(slots.last[:, None], positions[:, None], kv=kv, return_logits=False)
    before = engine_state.row_index(slots.kv)
    state = slots.kv.replace(cache=res.kv)
    state = engine_state.with_row_index(
        state, jnp.where(active, engine_state.row_index(state), before))
    resident = state.cache.row_tokens()
    t = slots.step
    token, logp = sample_rows(row_keys(key, jnp.maximum(slots.row, 0)), t,
                              model.unembed(res.hidden[:, 0]), sampling)
    eos = _is_eos(token, sampling.eos_ids)
    r = jnp.where(active, slots.row, out.response.shape[0])  # inactive slots write nothing
    page_record = out.page_record
    if page_record.shape[-1]:  # advanced (r, t - 1) around a slice: values [S, L, Hkv, K]
        page_record = page_record.at[:, r, :, t - 1].set(
            res.kv.selected.transpose(1, 0, 2, 3), mode="drop")
    out = out._replace(
        response=out.response.at[r, t].set(token, mode="drop"),
        logp=out.logp.at[r, t].set(logp, mode="drop"),
        finished=out.finished.at[r].set(eos, mode="drop"),
        length=out.length.at[r].set(t + 1, mode="drop"),
        kv_sum=out.kv_sum.at[r].add(resident.astype(jnp.float32), mode="drop"),
        kv_peak=out.kv_peak.at[r].max(resident, mode="drop"),
        forwards=out.forwards.at[r].add(1, mode="drop"),
        page_record=page_record)
    slots = slots._replace(kv=state, step=t + active, last=token,
                           live=active & ~eos & (t + 1 < slots.cap))
    return slots, out


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling", "compression", "max_len"),
                   donate_argnums=(2, 3))
def decode_chunk(graphdef, params, slots: Slots, out: Outputs, key, refill_at,
                 budget_ks=None, *, sampling: SamplingConfig, compression: CompressionConfig,
                 max_len: int) -> tuple[Slots, Outputs, jax.Array]:
    """Decode every live slot for up to ``sampling.chunk`` steps, fewer once none is live or
    ``refill_at`` (``[]`` int32, traced) slots are free (the host then refills them);
    returns ``(slots, out, steps [])``, ``steps`` the decode forwards it ran.

    As the static decode loop: steps run until some row's cache is full, then the full rows
    are compressed (``engine_state.compress_full_rows``; one compression call per fill, not
    per step). ``budget_ks``: ``sparrow``'s traced k per schedule bin, as
    ``sampler.generate``; ``max_len``: as :func:`insert`. ``slots`` and ``out`` are donated.
    """
    model = nnx.merge(graphdef, params)
    axes = engine_state.batch_axes(_slot_state_fn(model, compression, sampling, max_len))
    step = functools.partial(_step, model, key=key, sampling=sampling, compression=compression,
                             budget_ks=budget_ks)
    capacity = slots.kv.cache.capacity
    n = out.response.shape[0]

    def running(c):
        live = c[0].live
        return (c[2] < sampling.chunk) & jnp.any(live) & (jnp.sum(~live) < refill_at)

    def no_full_row(c):
        return ~jnp.any(engine_state.row_index(c[0].kv) >= capacity)

    def fill_then_compress(c):
        c = jax.lax.while_loop(lambda c: running(c) & no_full_row(c),
                               lambda c: step(c[0], c[1]) + (c[2] + 1,), c)
        slots, out, i = c
        kv, compressed = engine_state.compress_full_rows(slots.kv, compression, axes)
        rows = jnp.where(compressed & (slots.row >= 0), slots.row, n)
        out = out._replace(compressions=out.compressions.at[rows].add(1, mode="drop"))
        return slots._replace(kv=kv), out, i

    slots, out, steps = jax.lax.while_loop(running, fill_then_compress,
                                           (slots, out, jnp.zeros((), jnp.int32)))
    return slots, _flush_records(slots, out), steps


def _placed_like(tree, params):
    """``tree`` replicated on the mesh of ``params`` (so the engine's state has the placement
    its jitted functions return, and their second call does not recompile)."""
    sharding = jax.tree.leaves(params)[0].sharding
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return tree
    return jax.device_put(tree, jax.sharding.NamedSharding(sharding.mesh,
                                                           jax.sharding.PartitionSpec()))


def generate_continuous(graphdef: nnx.GraphDef, params, prompt: np.ndarray,
                        prompt_mask: np.ndarray, key: jax.Array, sampling: SamplingConfig,
                        compression: CompressionConfig,
                        budget_ks: Sequence[int] | None = None, *,
                        row_caps: np.ndarray | None = None) -> Rollout:
    """``sampler.generate`` through ``S = sampling.slots`` decode slots refilled as rows end.

    Args:
      graphdef, params, prompt ``[B, P]``, prompt_mask, key, sampling, compression,
        budget_ks: as ``sampler.generate`` (same key: row for row the same rollout).
      row_caps: optional ``[N]`` ints in ``[1, max_new_tokens]``, a response cap per row (a
        row stops there, unfinished); None = ``max_new_tokens`` for every row.

    Returns:
      A :class:`rollout.Rollout` with ``N = B * num_samples`` rows, prompt-major.
    """
    return run_continuous(graphdef, params, prompt, prompt_mask, key, sampling, compression,
                          budget_ks, row_caps=row_caps)[0]


def run_continuous(graphdef: nnx.GraphDef, params, prompt: np.ndarray,
                   prompt_mask: np.ndarray, key: jax.Array, sampling: SamplingConfig,
                   compression: CompressionConfig, budget_ks: Sequence[int] | None = None, *,
                   row_caps: np.ndarray | None = None, profile: dict | None = None
                   ) -> tuple[Rollout, int, int, SlotSchedule]:
    """:func:`generate_continuous` and its schedule: ``(rollout, slots, decode_steps,
    schedule)``, the decode steps summed over chunks (``slots * decode_steps`` slot-steps
    were computed) and the host's ``slot_schedule.SlotSchedule`` (its peak rows in flight,
    peak pool pages held, preemptions).

    ``profile``: a dict that, when given, gets the seconds spent in :func:`insert` calls
    (``"insert"``) and :func:`decode_chunk` calls (``"decode"``) added, and their counts
    (``"inserts"``, ``"chunks"``); each call is then waited for (a profile, not a fast run).
    """

    def timed(name, call):
        if profile is None:
            return call()
        start = time.perf_counter()
        result = jax.block_until_ready(call())
        profile[name] = profile.get(name, 0.0) + time.perf_counter() - start
        count = {"insert": "inserts", "decode": "chunks"}[name]
        profile[count] = profile.get(count, 0) + 1
        return result

    ks = checked_budget_ks(budget_ks, compression)
    prompt, prompt_mask = bucket_prompts(prompt, prompt_mask, sampling.prompt_bucket, compression)
    n, m = prompt.shape[0] * sampling.num_samples, sampling.max_new_tokens
    caps = checked_caps(row_caps, n, m)
    s, g = sampling.slots or n, sampling.num_samples
    j, max_len = insert_prompts(sampling, s), prompt.shape[1] + m
    sampling, row_pages = resolve_pool(sampling, compression, s, max_len)
    static = dict(sampling=sampling, compression=compression, max_len=max_len)
    slots, out = _placed_like(init_engine(graphdef, params, slots=s, rows=n, **static), params)
    device_prompt, device_mask = jnp.asarray(prompt), jnp.asarray(prompt_mask)
    device_caps = jnp.asarray(caps, jnp.int32)
    schedule = SlotSchedule(s, np.repeat(prompt_mask.sum(1), sampling.num_samples), caps,
                            chunk=sampling.chunk, page_size=compression.page_size,
                            row_pages=row_pages, pool_pages=sampling.pool_pages)
    live, step, decode_steps = np.zeros((s,), bool), np.zeros((s,), np.int32), 0
    while True:
        preempted, admitted = schedule.plan(live, step)
        if preempted:  # the host's [S] flags: those rows run again from their prompt
            live[preempted] = False
            slots = slots._replace(live=_placed_like(jnp.asarray(live), params))
        if sampling.pool_pages:
            slots = slots._replace(kv=engine_state.with_page_table(
                slots.kv, _placed_like(jnp.asarray(schedule.table), params)))
        for groups, targets in insert_calls(admitted, j, g, s):
            slots, out = timed("insert", lambda: insert(
                graphdef, params, slots, out, device_prompt, device_mask, device_caps, key,
                groups, targets, **static))
        if schedule.done:
            break
        # stop the chunk early once an insert's worth more slots is free for queued rows
        # (counted from the slots free now: rows waiting for pool pages leave some free)
        queued, free = len(schedule.queue), s - len(schedule.order)
        refill_at = np.int32(free + min(j * g, queued) if queued else s + 1)
        slots, out, steps = timed("decode", lambda: decode_chunk(
            graphdef, params, slots, out, key, refill_at, ks, **static))
        live, step = np.array(slots.live), np.asarray(slots.step)
        if not int(steps) and not admitted:  # a schedule bug, not an input: never spin
            raise RuntimeError(f"continuous engine: no progress with {queued} rows queued and "
                               f"{len(schedule.order)} live (pool {sampling.pool_pages} pages)")
        decode_steps += int(steps)
    rollout = finish_rollout(
        prompt, prompt_mask, sampling.num_samples, compression, response=out.response,
        logp=out.logp, finished=out.finished, response_len=out.length, kv_sum=out.kv_sum,
        kv_peak=out.kv_peak, forwards=out.forwards,
        num_compressions=jnp.max(out.compressions), evicted_at=out.evicted_at,
        page_record=out.page_record)
    return rollout, s, decode_steps, schedule


def generate_rollout(graphdef: nnx.GraphDef, params, prompt: np.ndarray,
                     prompt_mask: np.ndarray, key: jax.Array, sampling: SamplingConfig,
                     compression: CompressionConfig,
                     budget_ks: Sequence[int] | None = None) -> Rollout:
    """The rollout of ``sampling.engine``: ``static`` (``sampler.generate``) or
    ``continuous`` (:func:`generate_continuous`); same arguments, same :class:`Rollout`."""
    sample = generate_continuous if sampling.engine == "continuous" else generate
    return sample(graphdef, params, prompt, prompt_mask, key, sampling, compression, budget_ks)
