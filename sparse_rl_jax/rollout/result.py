"""The :class:`Rollout` a sampler returns (static ``sampler.generate`` or the continuous
``engine.generate_continuous``) and :func:`finish_rollout`, which both build it with."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sparse_rl_jax.kv import state as kv_state
from sparse_rl_jax.kv.compression_config import CompressionConfig
from sparse_rl_jax.kv.page_sparsity import PageRecord
from sparse_rl_jax.rollout.scoring import ReplayRecord


class Rollout(NamedTuple):
    """What one rollout produced (static ``sampler.generate`` or the continuous engine);
    ``N = B * num_samples`` rows.

    Row ``i`` holds sample ``i % num_samples`` of prompt ``i // num_samples``.

    Attributes:
      prompt: ``[N, P]`` int32 left-padded prompt tokens (``P`` is the bucketed length).
      prompt_mask: ``[N, P]`` int32, 1 on real prompt tokens.
      response: ``[N, M]`` int32 sampled tokens, ``pad_id`` after the end.
      response_mask: ``[N, M]`` int32, 1 on response tokens (EOS included).
      logp: ``[N, M]`` float32 log-prob of each token under the sampling policy (0 off-mask).
      finished: ``[N]`` bool, the row emitted an EOS token (else it was truncated).
      kv_peak / kv_mean: ``[N]`` float32 resident KV tokens per layer and head: maximum and
        mean over the row's forward passes (prefill included).
      dense_kv_peak / dense_kv_mean: ``[N]`` the same for a dense cache (every past token).
      num_compressions: ``[]`` int32 compressions performed during decode (prefill's included).
      record: the replay record (``scoring.ReplayRecord``, rows first; with
        ``sampling.record_evictions``): ``kv_state.EvictionRecord`` (``[N, L, Hkv, P + M]``)
        of the evicting methods, ``page_sparsity.PageRecord`` (``[N, L, Hkv, M, K]``) of
        ``sparrow``; ``kv_state.QuantRecord`` for ``none`` with ``compression.quant``; None
        for ``none`` and unrecorded. ``score(..., record)`` gives ``logp``.
    """

    prompt: jax.Array
    prompt_mask: jax.Array
    response: jax.Array
    response_mask: jax.Array
    logp: jax.Array
    finished: jax.Array
    kv_peak: jax.Array
    kv_mean: jax.Array
    dense_kv_peak: jax.Array
    dense_kv_mean: jax.Array
    num_compressions: jax.Array
    record: ReplayRecord | None


def replay_record_of(evicted_at: jax.Array, page_record: jax.Array,
                     compression: CompressionConfig) -> ReplayRecord | None:
    """``Rollout.record`` from a decode loop's raw arrays (the state's ``evicted_at [L, N, Hkv,
    P + M]``, ``page_record [L, N, Hkv, M, K]``; last axis 0 unrecorded), rows moved first."""
    if page_record.shape[-1]:
        return PageRecord(jnp.moveaxis(page_record, 1, 0), compression.page_size,
                          compression.quant)
    if evicted_at.shape[-1]:
        return kv_state.EvictionRecord(jnp.moveaxis(evicted_at, 1, 0), quant=compression.quant)
    if compression.quant != "none":
        return kv_state.QuantRecord(compression.quant)
    return None


def finish_rollout(prompt: np.ndarray, prompt_mask: np.ndarray, num_samples: int,
                   compression: CompressionConfig, *, response, logp, finished, response_len,
                   kv_sum, kv_peak, forwards, num_compressions, evicted_at,
                   page_record) -> Rollout:
    """The :class:`Rollout` of ``N = B * num_samples`` decoded rows (prompt-major).

    Args:
      prompt, prompt_mask: ``[B, P]`` the bucketed prompts (host arrays).
      response, logp: ``[N, M]`` sampled tokens (``pad_id`` after the end) and their
        log-probs (any value off the response); finished: ``[N]`` bool;
        response_len: ``[N]`` int tokens of each response.
      kv_sum, kv_peak, forwards: ``[N]`` resident-token sum / peak and forwards per row.
      num_compressions: ``[]``; evicted_at, page_record: the loop's raw record arrays
        (:func:`replay_record_of`), the record of ``compression``'s method.
    """
    steps = jnp.arange(response.shape[1])
    response_mask = (steps[None, :] < response_len[:, None]).astype(jnp.int32)
    plen = jnp.asarray(np.repeat(prompt_mask.sum(axis=1), num_samples), jnp.float32)
    forwards = forwards.astype(jnp.float32)
    # A dense cache holds every past token: plen at prefill, then plen + i at forward i.
    return Rollout(
        prompt=jnp.repeat(jnp.asarray(prompt), num_samples, axis=0),
        prompt_mask=jnp.repeat(jnp.asarray(prompt_mask), num_samples, axis=0),
        response=response,
        response_mask=response_mask,
        logp=logp * response_mask,
        finished=finished,
        kv_peak=kv_peak.astype(jnp.float32),
        kv_mean=kv_sum / forwards,
        dense_kv_peak=plen + forwards - 1,
        dense_kv_mean=plen + (forwards - 1) / 2,
        num_compressions=num_compressions,
        record=replay_record_of(evicted_at, page_record, compression),
    )
