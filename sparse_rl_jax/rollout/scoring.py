"""Teacher-forced log-probs of response tokens: dense, or with a rollout's record replayed.

A replay record (:class:`ReplayRecord`, a rollout's ``Rollout.record``:
``kv_state.EvictionRecord`` of the evicting methods, ``page_sparsity.PageRecord`` of
``sparrow``) turns into the ``models.kv_view`` view of a full forward over prompt + response,
which makes every query see what it saw in the rollout; scoring knows no record format.

Dense scoring runs cuDNN flash attention where it exists (the fused backend on a GPU in half
precision, rows rotated to right padding), else the blockwise backend, which takes the
left-padded rows as they are; the replay runs the blockwise backend with each key's expiry
(eviction record) or each query's pages (page-selection record).
Neither materialises ``[T, S]`` scores at training lengths.

The LM head is applied in chunks along the response axis under ``jax.checkpoint``, so neither
the forward nor the backward pass holds ``[B, T, V]`` float32 logits at once.

Array names carry their shape where it is not obvious (``logp_NxCxV``): N rows, C response
columns of a chunk, V vocabulary, S = P + M prompt and response columns.
"""

from __future__ import annotations

import functools
from typing import ClassVar, NamedTuple, Protocol, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from models.attention import fused_is_flash
from models.kv_view import KVView
from models.shapes import check_shape
from sparse_rl_jax.core.config_checks import is_number


class ReplayRecord(Protocol):
    """What a rollout recorded of each query's context (``Rollout.record``), replayable by a
    teacher-forced forward. A pytree whose arrays all hold the rows first (``[N, ...]``), so
    that it is sliced, split into (micro-)batches, sharded and concatenated with the other
    per-row arrays; ``fill`` is the array value that records nothing (padding a record with
    it changes no replay)."""

    fill: ClassVar[int]

    def replay_view(self, positions: jax.Array, prompt_lengths: jax.Array,
                    response_len: int) -> KVView:
        """The ``models.kv_view`` view of a full forward over ``positions [N, S]`` (prompt +
        response columns, ``-1`` padding; ``prompt_lengths [N]`` real prompt tokens,
        ``response_len`` M response columns); ValueError naming the record when it does not
        fit or holds nothing."""


def concatenate_records(records: Sequence[ReplayRecord]) -> ReplayRecord:
    """The rows of several records of one kind (rollouts of possibly different prompt widths
    ``P_i``) as one record, which replays every row with its prompt left-padded to the widest
    ``P``: positions do not move with left padding, so each array is only padded with the
    record's ``fill`` after its row axis to the widest shape (an eviction record to ``P + M``
    key positions, a page record to the most page slots), then the rows are concatenated."""
    fill = type(records[0]).fill

    def cat(*arrays):
        widest = [max(a.shape[i] for a in arrays) for i in range(1, arrays[0].ndim)]
        return jnp.concatenate([
            jnp.pad(a, [(0, 0)] + [(0, w - d) for w, d in zip(widest, a.shape[1:])],
                    constant_values=fill) for a in arrays], axis=0)

    return jax.tree.map(cat, *records)


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


def _check_temperature(where: str, temperature) -> None:
    """Raise ValueError unless ``temperature`` is a finite number > 0 (a JAX array, possibly
    traced, passes unchecked)."""
    if isinstance(temperature, jax.Array):
        return
    if not (is_number(temperature) and temperature > 0):
        raise ValueError(f"{where}: temperature={temperature!r} must be a finite number > 0 "
                         f"(the rollout's sampling.temperature)")


def _log_softmax(model, hidden, temperature):
    """Float32 log-probabilities ``[N, c, V]`` of one chunk of hidden states ``[N, c, H]``
    under the ``temperature``-scaled softmax."""
    return jax.nn.log_softmax(model.unembed(hidden).astype(jnp.float32) / temperature, axis=-1)


def _pick_stats(logp_NxCxV, targets, with_entropy):
    """log p(target) ``[N, c]`` (and the entropy) from log-probabilities ``[N, c, V]``."""
    logp = jnp.take_along_axis(logp_NxCxV, targets[..., None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logp_NxCxV) * logp_NxCxV, axis=-1) if with_entropy else None
    return logp, entropy


def _chunk_stats(model, hidden, targets, with_entropy, temperature):
    """log p(target) (and entropy) for one chunk: hidden ``[N, c, H]``, targets ``[N, c]``."""
    return _pick_stats(_log_softmax(model, hidden, temperature), targets, with_entropy)


def _response_hidden(model, prompt, prompt_mask, response, record: ReplayRecord | None):
    """Final hidden state ``[N, M, H]`` that predicts each response token (teacher forcing)."""
    check_shape("prompt", prompt, dtype=int, N=None, P=None)
    n, p = prompt.shape
    check_shape("prompt_mask", prompt_mask, N=n, P=p)
    check_shape("response", response, dtype=int, N=n, M=None)
    m = response.shape[1]
    tokens = jnp.concatenate([prompt, response], axis=1).astype(jnp.int32)
    positions = sequence_positions(prompt_mask, m)
    if record is not None and not hasattr(record, "replay_view"):
        raise TypeError(
            f"record: expected a replay record (Rollout.record: kv_state.EvictionRecord or "
            f"page_sparsity.PageRecord), got {type(record).__name__}")
    if record is not None:
        view = record.replay_view(positions, prompt_mask.astype(jnp.int32).sum(axis=1), m)
        hidden = model(tokens, positions, kv=view, return_logits=False).hidden
    elif not fused_is_flash(model.dtype):
        hidden = model(tokens, positions, return_logits=False).hidden
    else:
        # The fused backend wants right-padded rows: rotate each row's left padding to its end.
        padding_Nx1 = p - prompt_mask.astype(jnp.int32).sum(axis=1, keepdims=True)
        cols_1xS = jnp.arange(p + m, dtype=jnp.int32)[None, :]
        to_right_NxS = (cols_1xS + padding_Nx1) % (p + m)
        hidden = model(jnp.take_along_axis(tokens, to_right_NxS, axis=1),
                       jnp.take_along_axis(positions, to_right_NxS, axis=1),
                       return_logits=False, attention_backend="fused").hidden
        to_left_NxS = (cols_1xS - padding_Nx1) % (p + m)
        hidden = jnp.take_along_axis(hidden, to_left_NxS[..., None], axis=1)
    # Column P-1+j predicts response token j.
    return hidden[:, p - 1 : p - 1 + m]


def _map_chunks(fn, chunk_size: int, *arrays):
    """``fn`` over chunks of ``chunk_size`` response columns (axis 1) under ``jax.checkpoint``;
    each output of ``fn`` is ``[N, c]`` (or None) and comes back as ``[N, M]``."""
    n, m = arrays[0].shape[:2]
    chunk = min(chunk_size, m)
    pad = -m % chunk
    num_chunks = (m + pad) // chunk

    def split(x):
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return x.reshape(n, num_chunks, chunk, *x.shape[2:]).swapaxes(0, 1)

    outs = jax.lax.map(lambda xs: jax.checkpoint(fn)(*xs), tuple(split(x) for x in arrays))
    return tuple(None if x is None else x.swapaxes(0, 1).reshape(n, -1)[:, :m] for x in outs)


def response_logprobs(
    model: nnx.Module,
    prompt: jax.Array,
    prompt_mask: jax.Array,
    response: jax.Array,
    *,
    record: ReplayRecord | None = None,
    chunk_size: int = 128,
    with_entropy: bool = False,
    temperature: float = 1.0,
) -> ScoreOutput:
    """Log-probs of each response token given the prompt and the response before it.

    Args:
      model: the decoder (``models.Decoder``), already merged.
      prompt: ``[N, P]`` int32 left-padded prompt tokens.
      prompt_mask: ``[N, P]`` 1 for real prompt tokens.
      response: ``[N, M]`` int32 sampled tokens (anything after the end is ignored by the
        caller's mask; it never influences earlier tokens).
      record: optional :class:`ReplayRecord` of the rollout (``Rollout.record``).
        When given, each query sees exactly the keys the sparse sampler attended to (the
        evicting cache's kept keys, or Sparrow's selected pages), which reproduces the
        sampler's log-probs.
      chunk_size: response columns per LM-head chunk.
      with_entropy: also return the per-token entropy of the full distribution.
      temperature: the policy is ``softmax(logits / temperature)``. Pass the rollout's
        ``sampling.temperature``: the sampler records its log-probs under that distribution,
        so only then are learner and sampler the same policy (and the PPO ratio, the
        Sparse-RL corrections and the KL term compare like with like).

    Returns:
      ``ScoreOutput(logp [N, M], entropy [N, M] | None)``.
    """
    _check_temperature("response_logprobs", temperature)
    hidden = _response_hidden(model, prompt, prompt_mask, response, record)
    stats = functools.partial(_chunk_stats, model, with_entropy=with_entropy,
                              temperature=temperature)
    logp, entropy = _map_chunks(stats, chunk_size, hidden, response.astype(jnp.int32))
    return ScoreOutput(logp, entropy)


class ShadowScores(NamedTuple):
    """Sparse (replayed) and dense scores of the same tokens under the same params.

    logp_sparse: ``[N, M]`` log-probs under the sampler's sparse context (differentiable).
    logp_dense: ``[N, M]`` log-probs under the full context (stop-gradient: the teacher).
    kl_full: ``[N, M]`` per-token forward KL over the vocabulary,
      ``sum_x p_dense(x) (log p_dense(x) - log p_sparse(x))`` (gradient through the sparse
      side only), or None when not asked for.
    entropy: ``[N, M]`` entropy of the sparse policy (differentiable), or None.
    """

    logp_sparse: jax.Array
    logp_dense: jax.Array
    kl_full: jax.Array | None
    entropy: jax.Array | None = None


def _shadow_chunk(student, teacher, h_sparse, h_dense, targets, with_kl, with_entropy,
                  temperature):
    """Sparse/dense log p(target) (and the vocabulary KL, the sparse entropy) for one chunk."""
    sparse_NxCxV = _log_softmax(student, h_sparse, temperature)
    dense_NxCxV = _log_softmax(teacher, h_dense, temperature)
    logp_sparse, entropy = _pick_stats(sparse_NxCxV, targets, with_entropy)
    logp_dense, _ = _pick_stats(dense_NxCxV, targets, False)
    kl = (jnp.sum(jnp.exp(dense_NxCxV) * (dense_NxCxV - sparse_NxCxV), axis=-1) if with_kl
          else None)
    return logp_sparse, logp_dense, kl, entropy


def shadow_logprobs(
    model: nnx.Module,
    prompt: jax.Array,
    prompt_mask: jax.Array,
    response: jax.Array,
    record: ReplayRecord,
    *,
    chunk_size: int = 128,
    with_kl: bool = False,
    with_entropy: bool = False,
    temperature: float = 1.0,
) -> ShadowScores:
    """Scores for shadow-mask training: the response under the recorded sparse context
    (the learner's policy) and under the full context (the distillation teacher).

    The teacher is the same model with its params behind ``stop_gradient``, so it costs one
    extra forward and no backward. Both LM heads are applied chunk by chunk under
    ``jax.checkpoint``: with ``with_kl`` at most two ``[N, chunk, V]`` float32 log-softmax
    arrays exist at a time, never ``[N, M, V]``.

    Args:
      model, prompt, prompt_mask, response, chunk_size, temperature: as in
        :func:`response_logprobs` (both policies are taken at ``temperature``).
      record: the rollout's :class:`ReplayRecord` (the sparse context).
      with_kl: also compute the full-vocabulary forward KL per token.
      with_entropy: also return the sparse policy's per-token entropy.
    """
    _check_temperature("shadow_logprobs", temperature)
    graphdef, state = nnx.split(model)
    teacher = nnx.merge(graphdef, jax.lax.stop_gradient(state))
    h_sparse = _response_hidden(model, prompt, prompt_mask, response, record)
    h_dense = _response_hidden(teacher, prompt, prompt_mask, response, None)
    fn = functools.partial(_shadow_chunk, model, teacher, with_kl=with_kl,
                           with_entropy=with_entropy, temperature=temperature)
    logp_sparse, logp_dense, kl, entropy = _map_chunks(fn, chunk_size, h_sparse, h_dense,
                                                       response.astype(jnp.int32))
    return ShadowScores(logp_sparse, jax.lax.stop_gradient(logp_dense), kl, entropy)


@functools.partial(jax.jit, static_argnames=("graphdef", "chunk_size", "with_entropy",
                                             "temperature"))
def score(
    graphdef: nnx.GraphDef,
    params,
    prompt: jax.Array,
    prompt_mask: jax.Array,
    response: jax.Array,
    record: ReplayRecord | None = None,
    *,
    chunk_size: int = 128,
    with_entropy: bool = False,
    temperature: float = 1.0,
) -> ScoreOutput:
    """Jitted :func:`response_logprobs` over an ``nnx.split`` model (``graphdef, params``).

    Pass the reference model's params for reference log-probs; pass the rollout's replay
    record (``Rollout.record``) to replay the sparse policy
    exactly; pass the rollout's ``sampling.temperature`` (static: one compile per value) to
    score the policy it sampled from.
    """
    model = nnx.merge(graphdef, params)
    return response_logprobs(
        model,
        prompt,
        prompt_mask,
        response,
        record=record,
        chunk_size=chunk_size,
        with_entropy=with_entropy,
        temperature=temperature,
    )
