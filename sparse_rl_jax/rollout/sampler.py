"""Batched rollouts with a fixed-size, score-evicted KV cache.

``generate`` = :func:`bucket_prompts`, then :func:`prefill` (jitted, over left-padded prompts,
once per prompt however many samples are drawn from it), then :func:`decode` (a jitted
``lax.while_loop`` whose KV state is donated); the three are public for callers that time or
trace the halves apart.
Every decode step writes one token per row, and the cache is compressed back to ``budget``
slots whenever it fills (``kv_state.maybe_compress``). The sampler records the log-prob of each
sampled token under the policy that produced it, and the eviction record that makes that policy
reproducible by a teacher-forced forward (``scoring.score(..., replay_record(rollout,
compression))``). With ``sparrow`` nothing is evicted: each decode step attends to
selected pages of the paged cache (``models.page_sparse``, whose cache keeps its own page-mean
keys); the selection record replays it the same way. With ``none`` nothing is evicted; its own
layout is the paged cache (``models.paged_cache``, decode reads only the filled pages),
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
from sparse_rl_jax.kv.page_sparsity import PageRecord, schedule_budget
from sparse_rl_jax.rollout.sampling_config import SamplingConfig
from sparse_rl_jax.rollout.token_sampling import sample_tokens


class Rollout(NamedTuple):
    """What one call of :func:`generate` produced; ``N = B * num_samples`` rows.

    Row ``i`` holds sample ``i % num_samples`` of prompt ``i // num_samples``.

    Attributes:
      prompt: ``[N, P]`` int32 left-padded prompt tokens (``P`` is the bucketed length).
      prompt_mask: ``[N, P]`` int32, 1 on real prompt tokens.
      response: ``[N, M]`` int32 sampled tokens, ``pad_id`` after the end.
      response_mask: ``[N, M]`` int32, 1 on response tokens (EOS included).
      logp: ``[N, M]`` float32 log-prob of each token under the sampling policy (0 off-mask).
      finished: ``[N]`` bool, the row emitted an EOS token (else it was truncated).
      eviction_record: ``[L, N, Hkv, P + M]`` int32 (``kv_state.NEVER`` = kept), indexed by
        token position; all ``NEVER`` for ``none``; ``[L, N, Hkv, 0]`` when
        ``sampling.record_evictions`` is off and for ``sparrow`` (see ``page_record``).
      kv_peak / kv_mean: ``[N]`` float32 resident KV tokens per layer and head: maximum and
        mean over the row's forward passes (prefill included).
      dense_kv_peak / dense_kv_mean: ``[N]`` the same for a dense cache (every past token).
      num_compressions: ``[]`` int32 compressions performed during decode (prefill's included).
      page_record: ``[L, N, Hkv, M, K]`` int32 (``sparrow`` with ``sampling.record_evictions``):
        the pages the query at response index ``r`` attended to (``-1`` unused; all ``-1`` on
        dense layers and steps that never ran); ``[L, N, Hkv, 0, 0]`` otherwise.
    """

    prompt: jax.Array
    prompt_mask: jax.Array
    response: jax.Array
    response_mask: jax.Array
    logp: jax.Array
    finished: jax.Array
    eviction_record: jax.Array
    kv_peak: jax.Array
    kv_mean: jax.Array
    dense_kv_peak: jax.Array
    dense_kv_mean: jax.Array
    num_compressions: jax.Array
    page_record: jax.Array


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
    key: jax.Array
    page_record: jax.Array  # [L, N, Hkv, M, K] (sparrow + record) or [L, N, Hkv, 0, 0]


def replay_record(rollout: Rollout, compression: CompressionConfig
                  ) -> kv_state.EvictionRecord | PageRecord | None:
    """The replay record (``scoring.ReplayRecord``) of a rollout sampled under
    ``compression``: its eviction record (evicting methods) or page selections (``sparrow``);
    None for ``none`` (dense) and when the rollout kept no record
    (``sampling.record_evictions`` off)."""
    if compression.page_sparse and rollout.page_record.shape[3]:
        return PageRecord(rollout.page_record, compression.page_size)
    if compression.compresses and rollout.eviction_record.shape[-1]:
        return kv_state.EvictionRecord(rollout.eviction_record)
    return None


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
      key: PRNG key of token 0.
      sampling, compression: as :func:`generate` (static).
      max_len: ``P + sampling.max_new_tokens``, the positions the cache must hold (static).

    Returns:
      A :class:`Prefilled` for :func:`decode`. Jitted: one compile per prompt width.
    """
    check_shape("prompt", prompt, dtype=int, B=None, P=None)
    b, p = prompt.shape
    check_shape("prompt_mask", prompt_mask, B=b, P=p)
    model = nnx.merge(graphdef, params)
    cfg = model.config
    dense_layers = compression.sparrow.dense_layers
    if compression.page_sparse and any(i >= cfg.num_layers for i in dense_layers):
        raise ValueError(f"CompressionConfig.sparrow.dense_layers={dense_layers} names a layer "
                         f"the model ({cfg.num_layers} layers) does not have")
    state = kv_state.init_state(
        compression, num_layers=cfg.num_layers, batch=b, num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, max_len=max_len, dtype=model.dtype,
        record=bool(sampling.record_evictions) and not compression.page_sparse)
    positions = jnp.where(prompt_mask > 0, jnp.cumsum(prompt_mask, axis=1) - 1, -1)
    out = model(prompt, positions, kv=state.cache, return_logits=False)
    state = state.replace(cache=out.kv)
    resident = _resident(state)
    before = state.cache.index
    state = kv_state.maybe_compress(state, compression, after_prefill=True)
    compressed = (state.cache.index != before).astype(jnp.int32)
    logits = model.unembed(out.hidden[:, -1])  # [B, V]

    n = sampling.num_samples
    fan_out = lambda x, axis: jnp.repeat(x, n, axis=axis)  # noqa: E731
    state = kv_state.SparseKVState(
        cache=state.cache.repeat_rows(n),
        evicted_at=fan_out(state.evicted_at, 1),
    )
    tokens, logp = sample_tokens(key, fan_out(logits, 0), sampling)
    return Prefilled(state=state, first=tokens, first_logp=logp, resident=fan_out(resident, 0),
                     lengths=fan_out(prompt_mask.sum(axis=1), 0), compressions=compressed)


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
    key, sub = jax.random.split(c.key)
    token, logp = sample_tokens(sub, model.unembed(out.hidden[:, 0]), sampling)
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
        key=key,
        page_record=page_record,
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
      key: PRNG key of tokens ``1 .. M-1``.
      sampling, compression: the same configs :func:`prefill` got.
      budget_ks: ``sparrow``: optional ``[len(budget_schedule)]`` int32 k per schedule bin
        (traced: changing it does not recompile; each at most ``compression.max_pages_k``),
        in place of the schedule's own ks; see :func:`generate`.

    Returns:
      The final :class:`DecodeLoop` (``response [N, M]``, ``logp [N, M]``, ``done [N]``, ...).
    """
    n = prefilled.first.shape[0]
    for name in ("first", "first_logp", "resident", "lengths"):
        check_shape(f"prefilled.{name}", getattr(prefilled, name), N=n)
    model = nnx.merge(graphdef, params)
    state, lengths = prefilled.state, prefilled.lengths
    m, cfg = sampling.max_new_tokens, model.config
    keep_record = compression.page_sparse and sampling.record_evictions
    record_shape = (cfg.num_layers, n, cfg.num_kv_heads) + (
        (m, state.cache.num_selected) if keep_record else (0, 0))
    loop = DecodeLoop(
        state=state,
        step=jnp.ones((), jnp.int32),
        last=prefilled.first,
        done=_is_eos(prefilled.first, sampling.eos_ids),
        response=jnp.full((n, m), sampling.pad_id, jnp.int32).at[:, 0].set(prefilled.first),
        logp=jnp.zeros((n, m), jnp.float32).at[:, 0].set(prefilled.first_logp),
        kv_sum=prefilled.resident.astype(jnp.float32),
        kv_peak=prefilled.resident,
        forwards=jnp.ones((n,), jnp.int32),
        compressions=prefilled.compressions,
        key=key,
        page_record=jnp.full(record_shape, -1, jnp.int32),
    )
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


def _checked_budget_ks(budget_ks, compression: CompressionConfig) -> jax.Array | None:
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
      key: PRNG key (the only source of randomness: same key, same rollout).
      sampling: decoding rule, lengths, group size, EOS ids.
      compression: KV budget and eviction method (``none`` = dense cache).
      budget_ks: ``sparrow`` only: k per ``budget_schedule`` bin in place of the schedule's
        own (the closed loop's, ``budget_control``), each in ``[0, max_pages_k]``; a value
        passed to the compiled decode loop, so new ks do not recompile it.

    Returns:
      A :class:`Rollout` with ``N = B * num_samples`` rows.
    """
    ks = _checked_budget_ks(budget_ks, compression)
    prompt, prompt_mask = bucket_prompts(prompt, prompt_mask, sampling.prompt_bucket, compression)
    max_len = prompt.shape[1] + sampling.max_new_tokens
    k_prefill, k_decode = jax.random.split(key)
    prefilled = prefill(
        graphdef, params, jnp.asarray(prompt), jnp.asarray(prompt_mask), k_prefill,
        sampling=sampling, compression=compression, max_len=max_len,
    )
    loop = decode(graphdef, params, prefilled, k_decode, sampling=sampling,
                  compression=compression, budget_ks=ks)
    n = sampling.num_samples
    steps = jnp.arange(sampling.max_new_tokens)
    response_len = jnp.where(
        loop.done,
        jnp.argmax(_is_eos(loop.response, sampling.eos_ids), axis=1) + 1,
        loop.step,
    )
    response_mask = (steps[None, :] < response_len[:, None]).astype(jnp.int32)
    plen = jnp.asarray(np.repeat(prompt_mask.sum(axis=1), n), jnp.float32)  # prefilled is donated
    forwards = loop.forwards.astype(jnp.float32)
    # A dense cache holds every past token: plen at prefill, then plen + i at forward i.
    dense_peak = plen + forwards - 1
    dense_mean = plen + (forwards - 1) / 2
    return Rollout(
        prompt=jnp.repeat(jnp.asarray(prompt), n, axis=0),
        prompt_mask=jnp.repeat(jnp.asarray(prompt_mask), n, axis=0),
        response=loop.response,
        response_mask=response_mask,
        logp=loop.logp * response_mask,
        finished=loop.done,
        eviction_record=loop.state.evicted_at,
        kv_peak=loop.kv_peak.astype(jnp.float32),
        kv_mean=loop.kv_sum / forwards,
        dense_kv_peak=dense_peak,
        dense_kv_mean=dense_mean,
        num_compressions=loop.compressions,
        page_record=loop.page_record,
    )

