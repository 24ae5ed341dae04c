"""The sampler/learner mismatch of a quantized, evicting rollout, split by source.

A rollout whose cache both evicts and quantizes differs from the dense learner in two ways.
Its replay record (``kv.state.EvictionRecord``, with the level in ``quant``) lets the learner
replay either alone on the same rows: eviction without quantization
(``record.replace(quant="none")``) and quantization without eviction
(``kv.state.QuantRecord``, every key kept). The k3 estimate of each against the dense scores
(``r - log r - 1`` with ``r = pi_dense / pi_replay``, as ``mismatch_k3``) says which source
the correction is paying for. Two more scoring passes over a few rows, so it runs on a sample
(:data:`SOURCE_ROWS`), and only where the rollout kept its record
(``sampling.record_evictions: true``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sparse_rl_jax.core.masked_math import as_mask, masked_mean, safe_log_ratio
from sparse_rl_jax.kv.state import EvictionRecord, QuantRecord
from sparse_rl_jax.rl.loss_config import LOG_RATIO_CLAMP
from sparse_rl_jax.rollout.sampler import Rollout
from sparse_rl_jax.training.collect import RolloutPolicy, score_all

SOURCE_ROWS = 4
"""Rows of a step's first round that each source is replayed on."""


def k3(logp_dense_NxM: jax.Array, logp_replay_NxM: jax.Array, mask_NxM: jax.Array
       ) -> jax.Array:
    """Mean over ``mask`` of ``r - log r - 1``, ``log r = logp_dense - logp_replay``."""
    valid = as_mask(mask_NxM)
    log_r = safe_log_ratio(logp_dense_NxM, logp_replay_NxM, valid, LOG_RATIO_CLAMP)
    return masked_mean(jnp.exp(log_r) - log_r - 1.0, valid)


def mismatch_by_source(policy: RolloutPolicy, params, rollout: Rollout,
                       logp_dense_NxM: jax.Array, loss_mask_NxM: jax.Array,
                       rows: int = SOURCE_ROWS) -> dict[str, jax.Array]:
    """``kv_quant_mismatch_k3`` (quantization alone) and ``kv_eviction_mismatch_k3``
    (eviction alone) over the first ``rows`` rows of ``rollout``; empty when its record is
    not a quantized eviction record (nothing to split, or no record kept).

    Args:
      policy, params: the rollout's policy and params (the replays score under them).
      rollout: the sampled rows, with ``record``.
      logp_dense_NxM: dense scores of the rollout's rows; loss_mask_NxM: the tokens counted.
    """
    record = rollout.record
    if not isinstance(record, EvictionRecord) or record.quant == "none":
        return {}
    take = slice(0, rows)
    sample = (rollout.prompt[take], rollout.prompt_mask[take], rollout.response[take])
    n = sample[2].shape[0]
    quant_only = score_all(policy, params, *sample, QuantRecord(quant=record.quant), size=n)
    evict_only = score_all(policy, params, *sample,
                           jax.tree.map(lambda x: x[take], record.replace(quant="none")),
                           size=n)
    dense, mask = logp_dense_NxM[take], loss_mask_NxM[take]
    return {"kv_quant_mismatch_k3": k3(dense, quant_only, mask),
            "kv_eviction_mismatch_k3": k3(dense, evict_only, mask)}
