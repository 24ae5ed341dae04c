"""The sampler/learner mismatch of a quantized, evicting rollout, split by source.

A rollout whose cache both evicts and quantizes differs from the dense learner in two ways.
Its replay record (``kv.state.EvictionRecord``, or ``sparrow``'s ``kv.page_sparsity.PageRecord``,
whose page selection plays the part of eviction; the level in ``quant``) lets the learner
replay the policy with one source removed, on the same rows: eviction without quantization
(``record.replace(quant="none")``) and quantization without eviction
(``kv.state.QuantRecord``, every key kept). How far the sampler is from each says what the
removed source contributes: the k3 estimate of KL(sampler || replay), ``r - log r - 1`` with
``r = pi_replay / pi_sampler``, which is unbiased because the tokens were drawn from the
sampler (the same estimator as ``mismatch_k3``, whose ``pi_dense`` removes both). Taking the
ratio to the dense scores instead would weigh each replay at tokens it did not draw, and blows
up where a replay rules out a token the sampler took. Two more scoring passes over a few rows,
so it runs on a sample (:data:`SOURCE_ROWS`), and only where the rollout kept its record
(``sampling.record_evictions: true``).
"""

from __future__ import annotations

import jax

from sparse_rl_jax.core.masked_math import as_mask, safe_log_ratio
from sparse_rl_jax.kv.page_sparsity import PageRecord
from sparse_rl_jax.kv.state import EvictionRecord, QuantRecord
from sparse_rl_jax.rl.decoupled import k3_mean
from sparse_rl_jax.rl.loss_config import LOG_RATIO_CLAMP
from sparse_rl_jax.rollout.sampler import Rollout
from sparse_rl_jax.training.collect import RolloutPolicy, score_all

SOURCE_ROWS = 4
"""Rows of a step's first round that each source is replayed on."""


def k3(logp_replay_NxM: jax.Array, logp_sampler_NxM: jax.Array, mask_NxM: jax.Array
       ) -> jax.Array:
    """Mean over ``mask`` of ``r - log r - 1``, ``log r = logp_replay - logp_sampler``."""
    valid = as_mask(mask_NxM)
    return k3_mean(safe_log_ratio(logp_replay_NxM, logp_sampler_NxM, valid, LOG_RATIO_CLAMP),
                   valid)


def mismatch_by_source(policy: RolloutPolicy, params, rollout: Rollout,
                       loss_mask_NxM: jax.Array, rows: int = SOURCE_ROWS
                       ) -> dict[str, jax.Array]:
    """``mismatch_k3_from_quant`` (the sampler against its eviction without quantization)
    and ``mismatch_k3_from_eviction`` (against its quantization without eviction) over the
    first ``rows`` rows of ``rollout``; empty when its record is not a quantized eviction or
    page-selection record (nothing to split, or no record kept).

    Args:
      policy, params: the rollout's policy and params (the replays score under them).
      rollout: the sampled rows, with ``record`` and the sampler's ``logp``.
      loss_mask_NxM: the tokens counted.
    """
    record = rollout.record
    if not isinstance(record, (EvictionRecord, PageRecord)) or record.quant == "none":
        return {}
    take = slice(0, rows)
    sample = (rollout.prompt[take], rollout.prompt_mask[take], rollout.response[take])
    n = sample[2].shape[0]
    quant_only = score_all(policy, params, *sample, QuantRecord(quant=record.quant), size=n)
    evict_only = score_all(policy, params, *sample,
                           jax.tree.map(lambda x: x[take], record.replace(quant="none")),
                           size=n)
    sampler, mask = rollout.logp[take], loss_mask_NxM[take]
    return {"mismatch_k3_from_quant": k3(evict_only, sampler, mask),
            "mismatch_k3_from_eviction": k3(quant_only, sampler, mask)}
