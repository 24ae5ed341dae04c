"""Batched rollouts with a fixed-size, score-evicted KV cache.

``generate`` = :func:`bucket_prompts`, then :func:`prefill` (jitted, over left-padded prompts,
once per prompt however many samples are drawn from it), then :func:`decode` (a jitted
``lax.while_loop`` whose KV state is donated); the three are public for callers that time or
trace the halves apart.
Every decode step writes one token per row, and the cache is compressed back to ``budget``
slots whenever it fills (``kv_state.maybe_compress``). The sampler records the log-prob of each
sampled token under the policy that produced it, and the record (``Rollout.record``) that
makes that policy reproducible by a teacher-forced forward (``score(..., rollout.record)``).
With ``sparrow`` nothing is evicted: each decode step attends to selected pages of the paged
cache (``models.page_sparse``, whose cache keeps its own page-mean keys); the record of those
pages replays it the same way. With ``none`` nothing is evicted (no record); its own layout
is the paged cache (``models.paged_cache``, decode reads only the filled pages),
``compression.layout: dense`` the slot cache.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.shapes import check_shape
from sparse_rl_jax.kv import state as kv_state
from sparse_rl_jax.kv.compression_config import CompressionConfig
from sparse_rl_jax.kv.page_sparsity import schedule_budget
from sparse_rl_jax.rollout.result import Rollout, finish_rollout
from sparse_rl_jax.rollout.sampling_config import SamplingConfig
from sparse_rl_jax.rollout.token_sampling import row_keys, sample_rows


class Prefilled(NamedTuple):
    """What :func:`prefill` hands to :func:`decode` (``N = B * num_samples`` rows).

    Attributes:
      state: the KV state after the prompt, fanned out to ``N`` rows.
      first: ``[N]`` int32 token 0 of each response (drawn from the prompt's last logits).
      first_logp: ``[N]`` float32 its log-prob.
      resident: ``[N]`` int32 resident KV tokens per layer and head after prefill.
      lengths: ``[N]`` int32 real prompt tokens of each row.
      compressions: ``[]`` int32 1 when prefill compressed the cache, else 0.
    """

    state: kv_state.SparseKVState
    first: jax.Array
    first_logp: jax.Array
    resident: jax.Array
    lengths: jax.Array
    compressions: jax.Array


class DecodeLoop(NamedTuple):
    """Carry (and result) of :func:`decode`'s ``while_loop``: ``N`` rows, ``M`` response slots."""

    state: kv_state.SparseKVState
    step: jax.Array  # [] tokens sampled so far per row
    last: jax.Array  # [N] the newest sampled token (fed next)
    done: jax.Array  # [N] bool
    response: jax.Array  # [N, M]
    logp: jax.Array  # [N, M]
    kv_sum: jax.Array  # [N] float32 sum of resident tokens over active forwards
    kv_peak: jax.Array  # [N] int32
    forwards: jax.Array  # [N] int32 forwards while active
    compressions: jax.Array  # []
    keys: jax.Array  # [N] row keys (token_sampling.row_keys)
    page_record: jax.Array  # [L, N, Hkv, M, K] (sparrow + record) or [L, N, Hkv, 0, 0]


def bucket_prompts(
    prompt: np.ndarray, prompt_mask: np.ndarray, bucket: int,
    compression: CompressionConfig | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Left-pads (or trims all-padding columns from) prompts to a multiple of ``bucket``.

    Args:
      prompt: ``[B, P]`` int tokens, left-padded.
      prompt_mask: ``[B, P]`` 1 on real tokens; rows must be left-padded (mask non-decreasing).
      bucket: the length granularity.
      compression: when it compresses, the longest prompt must fit its cache capacity
        (``budget + buffer``; prompts are never truncated) and the padded width is capped there.

    Returns:
      ``(prompt, mask)`` of shape ``[B, P']`` with ``P' = ceil(longest / bucket) * bucket``
      capped at the cache capacity.
    """
    prompt = np.asarray(prompt)
    check_shape("prompt", prompt, dtype=int, B=None, P=None)
    mask = np.asarray(prompt_mask).astype(np.int32)
    check_shape("prompt_mask", mask, B=prompt.shape[0], P=prompt.shape[1])
    if np.any(np.diff(mask, axis=1) < 0):
        raise ValueError("prompt_mask: prompts must be left-padded (zeros before the tokens)")
    lengths = mask.sum(axis=1)
    if np.any(lengths == 0):
        raise ValueError(f"prompt rows {np.flatnonzero(lengths == 0).tolist()} are empty")
    longest = int(lengths.max())
    width = -(-longest // bucket) * bucket
    if compression is not None and compression.compresses:
        kv_state.check_prompt_fits(compression, longest)
        width = min(width, compression.capacity)
    out = np.zeros((prompt.shape[0], width), np.int32)
    out_mask = np.zeros((prompt.shape[0], width), np.int32)
    keep = min(width, prompt.shape[1])
    out[:, width - keep :] = prompt[:, prompt.shape[1] - keep :]
    out_mask[:, width - keep :] = mask[:, prompt.shape[1] - keep :]
    return out, out_mask


def _is_eos(tokens: jax.Array, eos_ids: tuple[int, ...]) -> jax.Array:
    if not eos_ids:
        return jnp.zeros(tokens.shape, bool)
    return jnp.isin(tokens, jnp.asarray(eos_ids, jnp.int32))


def _resident(state: kv_state.SparseKVState) -> jax.Array:
    """Resident valid tokens per row ``[N]`` (all layers/heads hold as many)."""
    return state.cache.row_tokens()


@functools.partial(
    jax.jit, static_argnames=("graphdef", "sampling", "compression", "max_len")
)
def prefill(graphdef, params, prompt, prompt_mask, key, *, sampling: SamplingConfig,
            compression: CompressionConfig, max_len: int) -> Prefilled:
    """Prefills ``B`` prompts once, fans out to ``N = B * num_samples`` rows, draws token 0.

    Args:
      graphdef, params: ``nnx.split(model)`` of a ``models.Decoder``.
      prompt: ``[B, P]`` int32 left-padded prompt tokens (already bucketed, see
        :func:`bucket_prompts`); prompt_mask: ``[B, P]`` int32, 1 on real tokens.
      key: the rollout's PRNG key; token 0 of row ``i`` is drawn with
        ``fold_in(fold_in(key, i), 0)`` (:func:`token_sampling.sample_rows`).
      sampling, compression: as :func:`generate` (static).
      max_len: ``P + sampling.max_new_tokens``, the positions the cache must hold (static).

    Returns:
      A :class:`Prefilled` for :func:`decode`. Jitted: one compile per prompt width.
    """
    rows = jnp.arange(prompt.shape[0] * sampling.num_samples)
    return prefill_rows(nnx.merge(graphdef, params), prompt, prompt_mask, key, rows,
                        sampling=sampling, compression=compression, max_len=max_len,
                        fan_out=sampling.num_samples)


def prefill_rows(model, prompt, prompt_mask, key, rows, *, sampling: SamplingConfig,
                 compression: CompressionConfig, max_len: int, fan_out: int) -> Prefilled:
    """:func:`prefill`'s body (not jitted): prefill ``B`` prompts, repeat each ``fan_out``
    times to ``N = B * fan_out`` rows whose global row ids are ``rows [N]`` (their sampling
    streams, :func:`token_sampling.row_keys`), draw token 0 of each."""
    check_shape("prompt", prompt, dtype=int, B=None, P=None)
    b, p = prompt.shape
    check_shape("prompt_mask", prompt_mask, B=b, P=p)
    check_shape("rows", rows, dtype=int, N=b * fan_out)
    cfg = model.config
    compression.check_fits(cfg)
    state = kv_state.init_state(
        compression, num_layers=cfg.num_layers, batch=b, num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, max_len=max_len, dtype=model.dtype,
        record=bool(sampling.record_evictions))
    positions = jnp.where(prompt_mask > 0, jnp.cumsum(prompt_mask, axis=1) - 1, -1)
    out = model(prompt, positions, kv=state.cache, return_logits=False)
    state = state.replace(cache=out.kv)
    resident = _resident(state)
    before = state.cache.index
    state = kv_state.maybe_compress(state, compression, after_prefill=True)
    compressed = (state.cache.index != before).astype(jnp.int32)
    logits = model.unembed(out.hidden[:, -1])  # [B, V]

    repeat = lambda x, axis: jnp.repeat(x, fan_out, axis=axis)  # noqa: E731
    state = kv_state.SparseKVState(
        cache=state.cache.repeat_rows(fan_out),
        evicted_at=repeat(state.evicted_at, 1),
    )
    tokens, logp = sample_rows(row_keys(key, rows), 0, repeat(logits, 0), sampling)
    return Prefilled(state=state, first=tokens, first_logp=logp, resident=repeat(resident, 0),
                     lengths=repeat(prompt_mask.sum(axis=1), 0), compressions=compressed)


def _step(model, c: DecodeLoop, *, lengths, sampling: SamplingConfig,
          compression: CompressionConfig, budget_ks=None) -> DecodeLoop:
    """One decode forward: feed ``c.last``, sample the next token of every active row."""
    positions = (lengths + c.step - 1)[:, None]
    kv = c.state.cache
    if compression.page_sparse:  # the cache refreshes its own page keys (end_forward)
        kv = kv.replace(budget=schedule_budget(compression, positions[:, 0] + 1, budget_ks))
    out = model(c.last[:, None], positions, kv=kv, return_logits=False)
    active = ~c.done
    page_record = c.page_record
    state = c.state.replace(cache=out.kv)
    if page_record.shape[-1]:
        chosen = jnp.where(active[None, :, None, None], out.kv.selected, -1)
        page_record = jax.lax.dynamic_update_slice(
            page_record, chosen[:, :, :, None], (0, 0, 0, c.step - 1, 0))
    resident = _resident(state)
    token, logp = sample_rows(c.keys, c.step, model.unembed(out.hidden[:, 0]), sampling)
    token = jnp.where(active, token, sampling.pad_id)
    logp = jnp.where(active, logp, 0.0)
    return c._replace(
        state=state,
        step=c.step + 1,
        last=token,
        done=c.done | _is_eos(token, sampling.eos_ids),
        response=jax.lax.dynamic_update_slice(c.response, token[:, None], (0, c.step)),
        logp=jax.lax.dynamic_update_slice(c.logp, logp[:, None], (0, c.step)),
        kv_sum=c.kv_sum + jnp.where(active, resident, 0),
        kv_peak=jnp.where(active, jnp.maximum(c.kv_peak, resident), c.kv_peak),
        forwards=c.forwards + active,
        page_record=page_record,
    )


def start_loop(prefilled: Prefilled, key, cfg, *, sampling: SamplingConfig,
               compression: CompressionConfig) -> DecodeLoop:
    """The :class:`DecodeLoop` :func:`decode_loop` starts from: token 0 of each of the
    ``N`` rows of ``prefilled`` written, ``cfg`` the ``models.ModelConfig``."""
    n = prefilled.first.shape[0]
    for name in ("first", "first_logp", "resident", "lengths"):
        check_shape(f"prefilled.{name}", getattr(prefilled, name), N=n)
    m = sampling.max_new_tokens
    keep_record = compression.page_sparse and sampling.record_evictions
    record_shape = (cfg.num_layers, n, cfg.num_kv_heads) + (
        (m, prefilled.state.cache.num_selected) if keep_record else (0, 0))
    return DecodeLoop(
        state=prefilled.state,
        step=jnp.ones((), jnp.int32),
        last=prefilled.first,
        done=_is_eos(prefilled.first, sampling.eos_ids),
        response=jnp.full((n, m), sampling.pad_id, jnp.int32).at[:, 0].set(prefilled.first),
        logp=jnp.zeros((n, m), jnp.float32).at[:, 0].set(prefilled.first_logp),
        kv_sum=prefilled.resident.astype(jnp.float32),
        kv_peak=prefilled.resident,
        forwards=jnp.ones((n,), jnp.int32),
        compressions=prefilled.compressions,
        keys=row_keys(key, jnp.arange(n)),
        page_record=jnp.full(record_shape, -1, jnp.int32),
    )


def decode_loop(graphdef, params, prefilled: Prefilled, key, *, sampling: SamplingConfig,
                compression: CompressionConfig, budget_ks: jax.Array | None = None
                ) -> DecodeLoop:
    """The decode loop, not jitted (:func:`decode` is its jit; call this to trace a fresh one).

    Feeds the newest token, samples the next, compresses the cache whenever it fills, until
    every row emitted an EOS id or ``sampling.max_new_tokens`` tokens exist.

    Args:
      graphdef, params: ``nnx.split(model)``.
      prefilled: :func:`prefill`'s result (``N`` rows).
      key: the rollout's PRNG key (the one :func:`prefill` got): token ``t`` of row ``i`` is
        drawn with ``fold_in(fold_in(key, i), t)``.
      sampling, compression: the same configs :func:`prefill` got.
      budget_ks: ``sparrow``: optional ``[len(budget_schedule)]`` int32 k per schedule bin
        (traced: changing it does not recompile; each at most ``compression.max_pages_k``),
        in place of the schedule's own ks; see :func:`generate`.

    Returns:
      The final :class:`DecodeLoop` (``response [N, M]``, ``logp [N, M]``, ``done [N]``, ...).
    """
    model = nnx.merge(graphdef, params)
    state, lengths, m = prefilled.state, prefilled.lengths, sampling.max_new_tokens
    loop = start_loop(prefilled, key, model.config, sampling=sampling, compression=compression)
    step = functools.partial(_step, model, lengths=lengths, sampling=sampling,
                             compression=compression, budget_ks=budget_ks)
    capacity = state.cache.capacity

    def running(c: DecodeLoop):
        return (c.step < m) & ~jnp.all(c.done)

    def fill_then_compress(c: DecodeLoop):
        # Decode until the cache is full, then compress once (why: kv_state.maybe_compress).
        c = jax.lax.while_loop(lambda c: running(c) & (c.state.cache.index < capacity), step, c)
        before = c.state.cache.index
        state = kv_state.maybe_compress(c.state, compression)
        return c._replace(state=state,
                          compressions=c.compressions + (state.cache.index != before))

    return jax.lax.while_loop(running, fill_then_compress, loop)


decode = jax.jit(decode_loop, static_argnames=("graphdef", "sampling", "compression"),
                 donate_argnums=(2,))
decode.__doc__ = """Jitted :func:`decode_loop`; the ``prefilled`` argument is donated."""


def checked_budget_ks(budget_ks, compression: CompressionConfig) -> jax.Array | None:
    """``budget_ks`` as an int32 array, or ValueError naming it when it does not fit the
    schedule (one k per bin, each in ``[0, max_pages_k]``) or the method is not sparrow."""
    if budget_ks is None:
        return None
    ks = np.asarray(budget_ks)
    bins, largest = len(compression.sparrow.budget_schedule), compression.max_pages_k
    if not compression.page_sparse or ks.shape != (bins,) or ks.dtype.kind not in "iu" or (
            ks.min() < 0 or ks.max() > largest):
        raise ValueError(f"budget_ks: expected {bins} ints in [0, max_pages_k={largest}] (one "
                         f"per budget_schedule bin) with compression.method sparrow, got "
                         f"{ks.tolist()} with method {compression.method!r}")
    return jnp.asarray(ks, jnp.int32)


def generate(
    graphdef: nnx.GraphDef,
    params,
    prompt: np.ndarray,
    prompt_mask: np.ndarray,
    key: jax.Array,
    sampling: SamplingConfig,
    compression: CompressionConfig,
    budget_ks: Sequence[int] | None = None,
) -> Rollout:
    """Samples ``sampling.num_samples`` responses per prompt with a compressed KV cache.

    Args:
      graphdef, params: ``nnx.split(model)`` of a ``models.Decoder``.
      prompt: ``[B, P]`` int left-padded prompt tokens (host or device array).
      prompt_mask: ``[B, P]`` 1 on real tokens.
      key: PRNG key (the only source of randomness: same key, same rollout). Token ``t`` of
        row ``i`` is drawn with ``fold_in(fold_in(key, i), t)``, so a row's tokens do not
        depend on the other rows of the call.
      sampling: decoding rule, lengths, group size, EOS ids.
      compression: KV budget and eviction method (``none`` = dense cache).
      budget_ks: ``sparrow`` only: k per ``budget_schedule`` bin in place of the schedule's
        own (the closed loop's, ``budget_control``), each in ``[0, max_pages_k]``; a value
        passed to the compiled decode loop, so new ks do not recompile it.

    Returns:
      A :class:`Rollout` with ``N = B * num_samples`` rows.
    """
    ks = checked_budget_ks(budget_ks, compression)
    prompt, prompt_mask = bucket_prompts(prompt, prompt_mask, sampling.prompt_bucket, compression)
    max_len = prompt.shape[1] + sampling.max_new_tokens
    prefilled = prefill(
        graphdef, params, jnp.asarray(prompt), jnp.asarray(prompt_mask), key,
        sampling=sampling, compression=compression, max_len=max_len,
    )
    loop = decode(graphdef, params, prefilled, key, sampling=sampling,
                  compression=compression, budget_ks=ks)
    response_len = jnp.where(
        loop.done,
        jnp.argmax(_is_eos(loop.response, sampling.eos_ids), axis=1) + 1,
        loop.step,
    )
    rows = dict(response=loop.response, logp=loop.logp, finished=loop.done,
                response_len=response_len, kv_sum=loop.kv_sum, kv_peak=loop.kv_peak,
                forwards=loop.forwards, num_compressions=loop.compressions,
                evicted_at=loop.state.evicted_at, page_record=loop.page_record)
    del loop  # frees the KV cache before the record's rows move first (a copy of it)
    return finish_rollout(prompt, prompt_mask, sampling.num_samples, compression, **rows)
