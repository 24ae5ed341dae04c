"""The decoupled objective: one correction for the two ways a sampler differs from the learner.

Three policies score the same sampled tokens (``[N, M]`` log-probs):
  behaviour: the sampler's own (compressed KV cache, and in async mode an older version);
  proximal: dense, under the learner's params at the start of the update;
  current: the params being trained (the loss's ``logp_new``).
The PPO ratio is ``current / proximal`` (clipped around the proximal policy; with
``correction.anchor: behaviour``, ``current / behaviour``: verl's bypass) and the correction
(``corrections.compute_corrections``: its IS weights, rejection, veto, OPSM) acts on
``proximal / behaviour``. When the rollout was drawn by the learner's own version
(sync mode, or async with ``trainer.max_lag: 0``) the proximal scores are the rollout's dense
scores, and this is exactly the synchronous loss.

:func:`mismatch_split` splits the mismatch the correction sees into compression (sampler vs
dense at the rollout's version) and lag (dense at the rollout's version vs the proximal).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sparse_rl_jax.core.masked_math import as_mask, masked_mean, safe_log_ratio
from sparse_rl_jax.rl.corrections import Corrections, compute_corrections
from sparse_rl_jax.rl.grpo_loss import LossBatch
from sparse_rl_jax.rl.loss_config import LOG_RATIO_CLAMP, CorrectionConfig

jitted_corrections = jax.jit(compute_corrections, static_argnames="cfg")


def decoupled_loss_batch(behaviour_NxM: jax.Array | None, proximal_NxM: jax.Array,
                         advantages_N: jax.Array, loss_mask_NxM: jax.Array,
                         cfg: CorrectionConfig, logp_ref_NxM: jax.Array | None = None,
                         replayed: bool = False) -> tuple[LossBatch, Corrections]:
    """The loss batch of the decoupled objective and the corrections it holds.

    Args:
      behaviour_NxM: the sampler's log-probs of the sampled tokens, or None for rows that
        carry none (then the correction sees ``r = 1`` and only ``anchor: proximal`` works).
      proximal_NxM: dense log-probs under the learner's params at the start of the update.
      advantages_N: per-sequence advantages (OPSM reads them).
      loss_mask_NxM: response tokens entering the loss.
      cfg: the correction applied to ``proximal / behaviour``; its ``anchor`` picks the PPO
        ratio's denominator (``proximal``, or ``behaviour``: the sampler's log-probs).
      logp_ref_NxM: the KL term's reference log-probs, or None.
      replayed: the learner scores these rows under their eviction record (shadow-mask
        training), so the ratio is to the sampler's log-probs whatever the anchor.

    Returns:
      ``(LossBatch, Corrections)``; ``grpo_loss(current, batch, ...)`` is the objective.

    Raises:
      ValueError: ``anchor: behaviour`` (or ``replayed``) without ``behaviour_NxM``.
    """
    to_behaviour = replayed or cfg.anchor == "behaviour"
    if behaviour_NxM is None:
        if to_behaviour:
            raise ValueError(f"correction.anchor={cfg.anchor!r}"
                             f"{' (a replayed record)' if replayed else ''} needs the "
                             "sampler's log-probs (behaviour_NxM), and these rows carry none; "
                             "use correction.anchor=proximal")
        behaviour_NxM = proximal_NxM
    corrections = jitted_corrections(proximal_NxM, behaviour_NxM, loss_mask_NxM, cfg=cfg,
                                     advantages=advantages_N)
    anchor = behaviour_NxM if to_behaviour else proximal_NxM
    batch = LossBatch.from_corrections(anchor, advantages_N, loss_mask_NxM, corrections,
                                       logp_ref_NxM)
    return batch, corrections


def k3_mean(log_r: jax.Array, valid: jax.Array) -> jax.Array:
    """Mean over ``valid`` of ``r - log r - 1`` (the ``mismatch_k3`` estimator)."""
    return masked_mean(jnp.exp(log_r) - log_r - 1.0, valid)


@jax.jit
def mismatch_split(behaviour_NxM: jax.Array, rollout_dense_NxM: jax.Array,
                   proximal_NxM: jax.Array, loss_mask_NxM: jax.Array) -> dict[str, jax.Array]:
    """``async/compression_mismatch_k3`` (dense at the rollout's version vs the sampler) and
    ``async/lag_mismatch_k3`` (the proximal vs dense at the rollout's version): the k3
    estimate of each part of the mismatch, averaged over the loss-mask tokens."""
    valid = as_mask(loss_mask_NxM)
    compression = safe_log_ratio(rollout_dense_NxM, behaviour_NxM, valid, LOG_RATIO_CLAMP)
    lag = safe_log_ratio(proximal_NxM, rollout_dense_NxM, valid, LOG_RATIO_CLAMP)
    return {"async/compression_mismatch_k3": k3_mean(compression, valid),
            "async/lag_mismatch_k3": k3_mean(lag, valid)}
