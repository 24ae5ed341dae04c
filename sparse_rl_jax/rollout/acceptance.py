"""Sparrow's tail statistic: per-token acceptance of the sparse policy by the dense one.

``alpha_t = sum_x min(p_sparse(x | ctx_t), p_dense(x | ctx_t))`` (1 - total variation; the
probability that speculative acceptance keeps the sparse sample), at the rollout temperature.
The exact form sums over the whole vocabulary in chunks; the ``top_k`` form is the official
code's lower bound (the sum over ids in both top-k sets, no renormalisation). Sparrow holds the
5th percentile of alpha (clipped to [0, 1]) per 2000-token bin of 1-based response position
(``cumsum`` of the response mask: bin 0 is tokens 1..1999) at a threshold (0.86).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.shapes import check_shape
from sparse_rl_jax.rollout.scoring import ReplayRecord, _map_chunks, _response_hidden

BIN_TOKENS = 2000  # Sparrow's bins of response position


def acceptance_from_logits(
    logits_sparse: jax.Array, logits_dense: jax.Array, *, top_k: int | None = None,
    temperature: float = 1.0, vocab_chunk: int = 8192,
) -> jax.Array:
    """``alpha [...]`` float32 from two logit arrays ``[..., V]``.

    Args:
      logits_sparse, logits_dense: ``[..., V]`` logits of the two policies.
      top_k: None for the exact sum over the vocabulary; else the sum over ids in both
        distributions' top-``top_k`` sets (a lower bound; 20 in Sparrow's code).
      temperature: the sampling temperature (> 0) both distributions are taken at.
      vocab_chunk: vocabulary columns per step of the exact sum.
    """
    if logits_sparse.shape != logits_dense.shape:
        raise ValueError(f"logits_sparse {logits_sparse.shape} != logits_dense "
                         f"{logits_dense.shape}")
    if not temperature > 0:
        raise ValueError(f"acceptance: temperature={temperature} must be > 0")
    ls = jax.nn.log_softmax(logits_sparse.astype(jnp.float32) / temperature, axis=-1)
    ld = jax.nn.log_softmax(logits_dense.astype(jnp.float32) / temperature, axis=-1)
    if top_k is not None:
        k = min(top_k, ls.shape[-1])
        _, ids_s = jax.lax.top_k(ls, k)
        _, ids_d = jax.lax.top_k(ld, k)
        shared = jnp.any(ids_s[..., :, None] == ids_d[..., None, :], axis=-1)
        both = jnp.minimum(jnp.take_along_axis(ls, ids_s, -1), jnp.take_along_axis(ld, ids_s, -1))
        return jnp.sum(jnp.where(shared, jnp.exp(both), 0.0), axis=-1)
    v = ls.shape[-1]
    chunk = min(vocab_chunk, v)
    pad = -v % chunk
    lead = ls.shape[:-1]

    def split(x):  # [..., V] -> [chunks, ..., chunk], padding at -inf (probability 0)
        x = jnp.pad(x, [(0, 0)] * len(lead) + [(0, pad)], constant_values=-jnp.inf)
        return jnp.moveaxis(x.reshape(lead + (-1, chunk)), -2, 0)

    def add(total, parts):
        a, b = parts
        return total + jnp.sum(jnp.exp(jnp.minimum(a, b)), axis=-1), None

    total, _ = jax.lax.scan(add, jnp.zeros(lead, jnp.float32), (split(ls), split(ld)))
    return total


def response_acceptance(
    model: nnx.Module, prompt: jax.Array, prompt_mask: jax.Array, response: jax.Array,
    record: ReplayRecord | None, *, top_k: int | None = None, temperature: float = 1.0,
    chunk_size: int = 128,
) -> jax.Array:
    """``alpha [N, M]`` of each response token: the replayed sparse policy (from the rollout's
    replay ``record``, ``Rollout.record``) against the dense policy of the same params.

    Args as ``scoring.response_logprobs``; ``top_k`` / ``temperature`` as
    :func:`acceptance_from_logits`. Teacher-forced; at most two ``[N, chunk, V]`` logit
    arrays at a time.
    """
    if record is None:
        raise ValueError("response_acceptance: needs the rollout's replay record (sample with "
                         "SamplingConfig(record_evictions=True))")
    h_sparse = _response_hidden(model, prompt, prompt_mask, response, record)
    h_dense = _response_hidden(model, prompt, prompt_mask, response, None)

    def chunk(hs, hd):
        return (acceptance_from_logits(model.unembed(hs), model.unembed(hd), top_k=top_k,
                                       temperature=temperature),)

    return _map_chunks(chunk, chunk_size, h_sparse, h_dense)[0]


@functools.partial(jax.jit, static_argnames=("graphdef", "top_k", "temperature", "chunk_size"))
def score_acceptance(graphdef, params, prompt, prompt_mask, response, record, *, top_k=None,
                     temperature=1.0, chunk_size=128) -> jax.Array:
    """Jitted :func:`response_acceptance` over an ``nnx.split`` model."""
    return response_acceptance(nnx.merge(graphdef, params), prompt, prompt_mask, response,
                               record, top_k=top_k, temperature=temperature,
                               chunk_size=chunk_size)


def response_positions(mask) -> np.ndarray:
    """``[N, M]`` int64 1-based position of each token among its row's valid response tokens:
    ``cumsum(mask)`` along the response (Sparrow's rule), so a left-padded or masked token
    does not advance it (the value on such a token is meaningless: callers drop it by ``mask``).

    Args:
      mask: ``[N, M]`` 1 on valid response tokens.
    """
    mask = np.asarray(mask).astype(bool)
    check_shape("mask", mask, N=None, M=None)
    return np.cumsum(mask, axis=1)


def percentile_per_bin_id(
    alpha: np.ndarray, mask: np.ndarray, bin_ids: np.ndarray, num_bins: int, *, q: float = 5.0,
) -> np.ndarray:
    """The ``q``-th percentile (``np.percentile``, linear) of ``alpha`` clipped to ``[0, 1]``
    (as Sparrow's code does) over the valid tokens of each bin: ``[num_bins]`` float64, NaN
    for a bin with no valid token. The one per-bin statistic behind
    :func:`acceptance_percentile_per_bin` and ``budget_control.bin_p5``.

    Args:
      alpha: ``[N, M]`` per-token acceptance.
      mask: ``[N, M]`` 1 on the tokens to pool (masked tokens are left out).
      bin_ids: ``[N, M]`` int bin of each token, read only where ``mask`` is set.
      num_bins: how many bins (ids outside ``[0, num_bins)`` are left out).
    """
    alpha = np.asarray(alpha, np.float64)
    check_shape("alpha", alpha, N=None, M=None)
    alpha = np.clip(alpha, 0.0, 1.0)
    mask = np.asarray(mask).astype(bool)
    check_shape("mask", mask, N=alpha.shape[0], M=alpha.shape[1])
    check_shape("bin_ids", bin_ids, N=alpha.shape[0], M=alpha.shape[1])
    bin_ids = np.asarray(bin_ids)
    out = np.full(num_bins, np.nan)
    for i in range(num_bins):
        values = alpha[mask & (bin_ids == i)]
        if values.size:
            out[i] = np.percentile(values, q)
    return out


def acceptance_percentile_per_bin(
    alpha: np.ndarray, mask: np.ndarray, *, q: float = 5.0, bin_tokens: int = BIN_TOKENS,
) -> np.ndarray:
    """The ``q``-th percentile of ``alpha`` (clipped to ``[0, 1]``) per bin of response
    position, pooling every valid token of the batch (:func:`percentile_per_bin_id`):
    ``[M // bin_tokens + 1]`` float64, NaN for a bin with no valid token.

    As in Sparrow's code, the position is 1-based and counts valid tokens only
    (:func:`response_positions`, ``cumsum(mask)``) and bin ``i`` holds positions
    ``[i * bin_tokens, (i + 1) * bin_tokens)``: bin 0 the first ``bin_tokens - 1`` tokens,
    bin 1 from the ``bin_tokens``-th on.

    Args:
      alpha: ``[N, M]`` per-token acceptance; mask: ``[N, M]`` 1 on response tokens.
    """
    alpha = np.asarray(alpha, np.float64)
    check_shape("alpha", alpha, N=None, M=None)
    bins = response_positions(mask) // bin_tokens
    return percentile_per_bin_id(alpha, mask, bins, alpha.shape[1] // bin_tokens + 1, q=q)
