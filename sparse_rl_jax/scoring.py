"""Teacher-forced log-probs of response tokens: dense, or with an eviction record replayed.

Dense scoring runs the fused attention backend (rows rotated to right padding); the replay
runs the blockwise backend with each key's expiry. Neither materialises ``[T, S]`` scores
at training lengths on an accelerator (XLA's CPU fused attention does).

The LM head is applied in chunks along the response axis under ``jax.checkpoint``, so neither
the forward nor the backward pass holds ``[B, T, V]`` float32 logits at once.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from sparse_rl_jax.kv_state import visibility_from_record


class ScoreOutput(NamedTuple):
    """Per-response-token statistics, all ``[N, M]`` float32 (entropy may be None)."""

    logp: jax.Array
    entropy: jax.Array | None


def sequence_positions(prompt_mask: jax.Array, response_len: int) -> jax.Array:
    """Positions of the prompt+response columns: ``[N, P + M]`` int32, -1 on left padding.

    Args:
      prompt_mask: ``[N, P]`` 1 for real prompt tokens, 0 for left padding.
      response_len: ``M``; response column ``j`` sits at position ``prompt_len + j``.
    """
    prompt_mask = prompt_mask.astype(jnp.int32)
    prompt_pos = jnp.where(prompt_mask > 0, jnp.cumsum(prompt_mask, axis=1) - 1, -1)
    lengths = prompt_mask.sum(axis=1, keepdims=True)
    response_pos = lengths + jnp.arange(response_len, dtype=jnp.int32)[None, :]
    return jnp.concatenate([prompt_pos, response_pos], axis=1).astype(jnp.int32)


def _chunk_stats(model, hidden, targets, with_entropy):
    """log p(target) (and entropy) for one chunk: hidden ``[N, c, H]``, targets ``[N, c]``."""
    logprobs = jax.nn.log_softmax(model.unembed(hidden).astype(jnp.float32), axis=-1)
    logp = jnp.take_along_axis(logprobs, targets[..., None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logprobs) * logprobs, axis=-1) if with_entropy else None
    return logp, entropy


def response_logprobs(
    model: nnx.Module,
    prompt: jax.Array,
    prompt_mask: jax.Array,
    response: jax.Array,
    *,
    eviction_record: jax.Array | None = None,
    chunk_size: int = 128,
    with_entropy: bool = False,
) -> ScoreOutput:
    """Log-probs of each response token given the prompt and the response before it.

    Args:
      model: the decoder (``models.Decoder``), already merged.
      prompt: ``[N, P]`` int32 left-padded prompt tokens.
      prompt_mask: ``[N, P]`` 1 for real prompt tokens.
      response: ``[N, M]`` int32 sampled tokens (anything after the end is ignored by the
        caller's mask; it never influences earlier tokens).
      eviction_record: optional ``[L, N, Hkv, T]`` int32 from the sampler (``evicted_at``
        indexed by position). When given, each query sees exactly the keys the sparse
        sampler's cache held (mask replay), which reproduces the sampler's log-probs.
      chunk_size: response columns per LM-head chunk.
      with_entropy: also return the per-token entropy of the full distribution.

    Returns:
      ``ScoreOutput(logp [N, M], entropy [N, M] | None)``.
    """
    n, p = prompt.shape
    m = response.shape[1]
    tokens = jnp.concatenate([prompt, response], axis=1).astype(jnp.int32)
    positions = sequence_positions(prompt_mask, m)
    if eviction_record is not None:
        key_expiry = visibility_from_record(eviction_record, positions)
        hidden = model(tokens, positions, key_expiry=key_expiry, return_logits=False).hidden
    else:
        # The fused backend wants right-padded rows: rotate each row's left padding to its end.
        shift = p - prompt_mask.astype(jnp.int32).sum(axis=1, keepdims=True)  # [N, 1]
        cols = jnp.arange(p + m, dtype=jnp.int32)[None, :]
        to_right = (cols + shift) % (p + m)
        hidden = model(jnp.take_along_axis(tokens, to_right, axis=1),
                       jnp.take_along_axis(positions, to_right, axis=1),
                       return_logits=False, attention_backend="fused").hidden
        hidden = jnp.take_along_axis(hidden, ((cols - shift) % (p + m))[..., None], axis=1)
    # Column P-1+j predicts response token j.
    hidden = hidden[:, p - 1 : p - 1 + m]
    chunk = min(chunk_size, m)
    pad = -m % chunk
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(response.astype(jnp.int32), ((0, 0), (0, pad)))
    num_chunks = (m + pad) // chunk
    hidden = hidden.reshape(n, num_chunks, chunk, -1).swapaxes(0, 1)
    targets = targets.reshape(n, num_chunks, chunk).swapaxes(0, 1)
    stats = jax.checkpoint(
        functools.partial(_chunk_stats, model, with_entropy=with_entropy)
    )
    logp, entropy = jax.lax.map(lambda xs: stats(*xs), (hidden, targets))

    def unchunk(x):
        return x.swapaxes(0, 1).reshape(n, -1)[:, :m]

    return ScoreOutput(unchunk(logp), unchunk(entropy) if with_entropy else None)


@functools.partial(jax.jit, static_argnames=("graphdef", "chunk_size", "with_entropy"))
def score(
    graphdef: nnx.GraphDef,
    params,
    prompt: jax.Array,
    prompt_mask: jax.Array,
    response: jax.Array,
    eviction_record: jax.Array | None = None,
    *,
    chunk_size: int = 128,
    with_entropy: bool = False,
) -> ScoreOutput:
    """Jitted :func:`response_logprobs` over an ``nnx.split`` model (``graphdef, params``).

    Pass the reference model's params for reference log-probs; pass the sampler's
    ``eviction_record`` to replay the sparse policy exactly.
    """
    model = nnx.merge(graphdef, params)
    return response_logprobs(
        model,
        prompt,
        prompt_mask,
        response,
        eviction_record=eviction_record,
        chunk_size=chunk_size,
        with_entropy=with_entropy,
    )
