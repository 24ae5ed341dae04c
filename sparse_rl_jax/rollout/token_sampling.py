"""Drawing one token per row from logits: temperature, top-k, top-p, greedy."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sparse_rl_jax.rollout.sampling_config import SamplingConfig


def filter_logits(logits: jax.Array, cfg: SamplingConfig) -> jax.Array:
    """Temperature-scaled logits with tokens outside top-k / top-p set to -inf.

    Args:
      logits: ``[B, V]`` float32.
      cfg: sampling configuration (temperature, top_k, top_p are read).

    Returns:
      ``[B, V]`` float32 logits of the distribution actually sampled from.
    """
    scaled = logits.astype(jnp.float32) / cfg.temperature
    vocab = scaled.shape[-1]
    if 0 < cfg.top_k < vocab:
        kth = jax.lax.top_k(scaled, cfg.top_k)[0][:, -1:]
        scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
    if cfg.top_p < 1.0:
        sorted_logits = jnp.sort(scaled, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        # Mass strictly before each sorted token: a token is kept while that mass < top_p,
        # so the most likely token always survives.
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        kept = mass_before < cfg.top_p
        threshold = jnp.min(jnp.where(kept, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        scaled = jnp.where(scaled < threshold, -jnp.inf, scaled)
    return scaled


def sample_tokens(
    key: jax.Array, logits: jax.Array, cfg: SamplingConfig
) -> tuple[jax.Array, jax.Array]:
    """Samples one token per row and its log-prob under the sampling policy.

    The recorded log-prob is ``log_softmax(logits / temperature)`` at the chosen token: the
    policy the token came from before truncation. With temperature 1 and no top-k/top-p (the
    training setting) that is exactly the sampler's distribution.

    Args:
      key: PRNG key.
      logits: ``[B, V]`` next-token logits.
      cfg: sampling configuration.

    Returns:
      ``(tokens [B] int32, logp [B] float32)``.
    """
    scaled = logits.astype(jnp.float32) / cfg.temperature
    if cfg.greedy:
        tokens = jnp.argmax(scaled, axis=-1)
    else:
        tokens = jax.random.categorical(key, filter_logits(logits, cfg), axis=-1)
    tokens = tokens.astype(jnp.int32)
    logp = jnp.take_along_axis(jax.nn.log_softmax(scaled, axis=-1), tokens[:, None], axis=-1)
    return tokens, logp[:, 0]


def row_keys(key: jax.Array, rows: jax.Array) -> jax.Array:
    """``[N]`` per-row PRNG keys ``fold_in(key, rows[i])`` of a rollout key.

    ``rows`` are global row ids (prompt-major: ``prompt_index * num_samples + sample``), so a
    row's randomness does not depend on the batch or decode slot it runs in."""
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, rows.astype(jnp.int32))


def sample_rows(keys: jax.Array, t: jax.Array, logits: jax.Array, cfg: SamplingConfig
                ) -> tuple[jax.Array, jax.Array]:
    """:func:`sample_tokens` with one stream per row: response token ``t[i]`` of row ``i`` is
    drawn with ``fold_in(keys[i], t[i])``.

    Args:
      keys: ``[N]`` row keys (:func:`row_keys`).
      t: ``[N]`` or ``[]`` int token index within each row's response (0 = the token drawn
        from the prompt's last logits).
      logits: ``[N, V]`` next-token logits.
      cfg: sampling configuration.

    Returns:
      ``(tokens [N] int32, logp [N] float32)``.
    """
    steps = jnp.broadcast_to(jnp.asarray(t, jnp.int32), keys.shape)
    token_keys = jax.vmap(jax.random.fold_in)(keys, steps)
    tokens, logp = jax.vmap(lambda k, row: sample_tokens(k, row[None], cfg))(token_keys, logits)
    return tokens[:, 0], logp[:, 0]
