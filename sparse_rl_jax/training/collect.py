"""The collect half over explicit prompts: encode -> generate -> decode -> reward -> dense
score -> corrections (the rollout through ``sampling.engine``, ``engine.generate_rollout``).

:func:`collect_prompts` is the one path from plain-text prompts to scored rollouts that the
trainer (``collect_rounds``: rounds at the data cursor), evaluation and the experiments call;
:class:`RolloutPolicy` holds what stays fixed between its calls.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparse_rl_jax.kv.compression_config import CompressionConfig
from sparse_rl_jax.rl.corrections import Corrections
from sparse_rl_jax.rl.decoupled import jitted_corrections
from sparse_rl_jax.rl.loss_config import CorrectionConfig
from sparse_rl_jax.rollout.acceptance import score_acceptance
from sparse_rl_jax.rollout.engine import generate_rollout
from sparse_rl_jax.rollout.sampler import Rollout
from sparse_rl_jax.rollout.sampling_config import SamplingConfig
from sparse_rl_jax.rollout.scoring import ReplayRecord, score
from sparse_rl_jax.tasks.rewards import compute_rewards, repeat_answers
from sparse_rl_jax.training import memory_plan
from sparse_rl_jax.training.run_config import RunConfig

@dataclasses.dataclass(frozen=True)
class RolloutPolicy:
    """What :func:`collect_prompts` needs besides the params, fixed between calls.

    Attributes:
      graphdef: the policy's ``nnx.GraphDef``.
      tokenizer: ``models.Tokenizer``.
      sampling: sampling settings with the tokenizer's EOS / pad ids filled in
        (``policy.resolve_sampling``).
      reward_fn: ``(completions, answers) -> [N]`` rewards.
      compression: the rollout's KV compression (default: a dense cache).
      correction: the sampler/learner correction computed on scored rollouts.
      add_special_tokens: whether prompts get the tokenizer's special tokens (BOS), as
        ``data.add_special_tokens``.
      mask_truncated: drop responses that hit ``max_new_tokens`` without EOS from the loss
        mask (``overlong.mask_truncated``).
      logp_chunk: response columns per LM-head chunk when scoring.
      score_batch: sequences per scoring call; 0 = all rows in one call.
      fit_score_batch: lower ``score_batch`` to the largest divisor of the rows that the
        memory plan fits, when the device reports a memory limit.
      budget_ks: ``sparrow``'s k per ``budget_schedule`` bin in place of the schedule's own
        (the closed loop's, ``budget_control``), or None; used with ``compression`` only.
    """

    graphdef: nnx.GraphDef
    tokenizer: Any
    sampling: SamplingConfig
    reward_fn: Callable
    compression: CompressionConfig = CompressionConfig(method="none")
    correction: CorrectionConfig = CorrectionConfig()
    add_special_tokens: bool = False
    mask_truncated: bool = False
    logp_chunk: int = 128
    score_batch: int = 0
    fit_score_batch: bool = False
    budget_ks: tuple[int, ...] | None = None

    @classmethod
    def from_run(cls, cfg: RunConfig, graphdef: nnx.GraphDef, tokenizer, reward_fn: Callable,
                 sampling: SamplingConfig) -> "RolloutPolicy":
        """The policy a run trains: its compression, correction, data and trainer settings
        (``trainer.score_batch``, else the minibatch size lowered to what memory fits)."""
        return cls(graphdef, tokenizer, sampling, reward_fn, cfg.compression, cfg.correction,
                   add_special_tokens=cfg.data.add_special_tokens,
                   mask_truncated=cfg.overlong.mask_truncated, logp_chunk=cfg.trainer.logp_chunk,
                   score_batch=cfg.trainer.score_batch or cfg.trainer.minibatch_size,
                   fit_score_batch=not cfg.trainer.score_batch)


class Collected(NamedTuple):
    """Scored rollouts of ``B`` prompts, ``G = num_samples`` each (``N = B * G`` rows,
    prompt-major: row ``i`` answers prompt ``i // G``; ``M`` = max_new_tokens).

    Attributes:
      rollout: the sampler's ``Rollout``.
      rewards: ``[N]`` float32 task rewards of the decoded responses.
      loss_mask: ``[N, M]`` the response mask (with ``mask_truncated``: 0 on truncated rows).
      logp_old: ``[N, M]`` dense teacher-forced log-probs of the responses; None unscored.
      corrections: the sampler/learner ``Corrections`` of ``logp_old`` vs the sampler's
        log-probs on ``loss_mask``; None unscored.
      alpha: ``[N, M]`` sparse-vs-dense acceptance, or None (unscored, ``compression.alpha.metric: off``
        or no record kept).
      seconds: time spent in ``rollout``, ``reward`` and ``score``.
    """

    rollout: Rollout
    rewards: np.ndarray
    loss_mask: jax.Array
    logp_old: jax.Array | None
    corrections: Corrections | None
    alpha: jax.Array | None
    seconds: dict[str, float]


def timed(fn, *args, **kwargs):
    """``(fn(*args, **kwargs), seconds)``, waiting for the result's device arrays."""
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args, **kwargs))
    return out, time.perf_counter() - start


def _plan(policy: RolloutPolicy, sampling: SamplingConfig, params, prompt_width: int) -> dict:
    """:func:`memory_plan.estimate` arguments shared by a collect's calls."""
    bucket = sampling.prompt_bucket
    return dict(prompt_len=-(-prompt_width // bucket) * bucket,
                new_tokens=sampling.max_new_tokens,
                dtype=jax.tree.leaves(params)[0].dtype, logp_chunk=policy.logp_chunk)


def _sized_engine(sampling: SamplingConfig, compression: CompressionConfig, model_cfg,
                  plan: dict, rows: int) -> SamplingConfig:
    """``sampling`` with the continuous engine's unset ``slots`` / ``pool_pages`` (0) sized
    by ``memory_plan.engine_sizes`` where the device reports a memory limit (else as given:
    the engine's own defaults)."""
    limit = memory_plan.device_memory_limit()
    if sampling.engine != "continuous" or limit is None or (
            sampling.slots and sampling.pool_pages):
        return sampling
    slots, pool = memory_plan.engine_sizes(
        model_cfg, limit, rows=rows, compression=compression,
        num_samples=sampling.num_samples, record_evictions=sampling.record_evictions, **plan)
    return dataclasses.replace(sampling, slots=sampling.slots or slots,
                               pool_pages=sampling.pool_pages or pool)


def _score_batch(policy: RolloutPolicy, params, plan: dict, rows: int) -> int:
    """``policy.score_batch`` (0: ``rows``), lowered with ``fit_score_batch`` to the largest
    divisor of ``rows`` that the memory plan fits when the device reports a memory limit."""
    size = policy.score_batch or rows
    limit = memory_plan.device_memory_limit()
    if not policy.fit_score_batch or limit is None:
        return size
    model_cfg = nnx.merge(policy.graphdef, params).config
    fits = memory_plan.largest_batch("score", model_cfg, limit, **plan)
    if fits == 0:
        memory_plan.check_fits("score", model_cfg, batch=1, limit=limit, **plan)
    size = min(size, fits)
    return max(d for d in range(1, size + 1) if rows % d == 0)


def score_all(policy: RolloutPolicy, params, prompt, prompt_mask, response,
              record: ReplayRecord | None = None, size=None, temperature=None) -> jax.Array:
    """Teacher-forced log-probs ``[N, M]``, ``size`` sequences a call (None:
    ``policy.score_batch``): dense, or with the rows' ``record`` (``Rollout.record``) under
    the recorded sparse context; at ``temperature`` (None: ``policy.sampling.temperature``,
    the policy the rollouts were drawn from)."""
    temperature = policy.sampling.temperature if temperature is None else temperature
    size = size or policy.score_batch or response.shape[0]
    parts = []
    for start in range(0, response.shape[0], size):
        rows = slice(start, start + size)
        parts.append(score(policy.graphdef, params, prompt[rows], prompt_mask[rows],
                           response[rows], jax.tree.map(lambda x: x[rows], record),
                           chunk_size=policy.logp_chunk,
                           temperature=temperature).logp)
    return jnp.concatenate(parts, axis=0)


def acceptance_all(policy: RolloutPolicy, params, rollout: Rollout, size: int,
                   comp: CompressionConfig, temperature: float) -> jax.Array | None:
    """alpha ``[N, M]`` of a rollout (sampled under ``comp`` at ``temperature``) from its
    ``record``, ``size`` sequences a call; None when ``comp.alpha.metric`` is off or the
    rollout kept no record."""
    record = rollout.record
    if comp.alpha.metric == "off" or record is None:
        return None
    top_k = 20 if comp.alpha.metric == "top20" else None
    parts = []
    for start in range(0, rollout.response.shape[0], size):
        rows = slice(start, start + size)
        parts.append(score_acceptance(
            policy.graphdef, params, rollout.prompt[rows], rollout.prompt_mask[rows],
            rollout.response[rows], jax.tree.map(lambda x: x[rows], record), top_k=top_k,
            temperature=temperature, chunk_size=policy.logp_chunk))
    return jnp.concatenate(parts, axis=0)


def collect_prompts(policy: RolloutPolicy, params, prompts: Sequence[str],
                    answers: Sequence[Any], key: jax.Array, *,
                    compression: CompressionConfig | None = None,
                    sampling: SamplingConfig | None = None, score: bool = True,
                    edit: Callable[[Rollout], Rollout] | None = None) -> Collected:
    """The collect half over explicit prompts: encode -> generate -> decode -> reward, then
    (``score``) dense old-policy scores, acceptance and the sampler/learner corrections.

    Args:
      policy: what stays fixed between calls (:class:`RolloutPolicy`).
      params: the policy's params (sampling and dense scoring).
      prompts: ``B`` plain-text prompts; answers: their ``B`` gold answers.
      key: the sampling PRNG key.
      compression, sampling: override ``policy.compression`` / ``policy.sampling``.
      score: False for rewards only (``logp_old``, ``corrections``, ``alpha`` are None).
      edit: applied to the rollout before it is rewarded and scored (the trainer's positive
        control rewrites some rows there, ``anomaly_control``); None = as sampled.

    Returns:
      :class:`Collected` with ``N = B * sampling.num_samples`` rows. The rollout's estimated
      memory is checked against the device limit before compiling
      (``memory_plan.MemoryPlanError``).
    """
    comp = policy.compression if compression is None else compression
    sampling = policy.sampling if sampling is None else sampling
    seconds = {"rollout": 0.0, "reward": 0.0, "score": 0.0}
    prompt, prompt_mask = policy.tokenizer.encode(
        list(prompts), add_special_tokens=policy.add_special_tokens)
    plan = _plan(policy, sampling, params, prompt.shape[1])
    samples = sampling.num_samples
    model_cfg = nnx.merge(policy.graphdef, params).config
    sampling = _sized_engine(sampling, comp, model_cfg, plan, len(prompt) * samples)
    continuous = sampling.engine == "continuous"
    memory_plan.check_fits(  # before compiling: a clear error instead of an XLA OOM trace
        "rollout", model_cfg, batch=(continuous and sampling.slots) or len(prompt) * samples,
        compression=comp, num_samples=samples, step=1 if continuous else samples,
        record_evictions=sampling.record_evictions,
        pool_pages=sampling.pool_pages if continuous else 0, **plan)
    rollout, seconds["rollout"] = timed(generate_rollout, policy.graphdef, params, prompt,
                                        prompt_mask, key, sampling, comp,
                                        policy.budget_ks if compression is None else None)
    if edit is not None:
        rollout = edit(rollout)
    start = time.perf_counter()
    completions = policy.tokenizer.decode(rollout.response, rollout.response_mask)
    rewards = np.asarray(compute_rewards(policy.reward_fn, completions,
                                         repeat_answers(answers, samples)), np.float32)
    seconds["reward"] = time.perf_counter() - start
    loss_mask = rollout.response_mask
    if policy.mask_truncated:
        loss_mask = loss_mask * rollout.finished[:, None].astype(loss_mask.dtype)
    if not score:
        return Collected(rollout, rewards, loss_mask, None, None, None, seconds)
    size = _score_batch(policy, params, plan, rollout.response.shape[0])
    logp_old, t_score = timed(score_all, policy, params, rollout.prompt, rollout.prompt_mask,
                              rollout.response, size=size, temperature=sampling.temperature)
    alpha, t_alpha = timed(acceptance_all, policy, params, rollout, size, comp,
                           sampling.temperature)
    seconds["score"] = t_score + t_alpha
    # which rows are in the loss, before the group's advantages exist: OPSM (which reads them)
    # acts in the learner's batch (``rl_step.learner_batch``)
    correction = policy.correction
    if correction.opsm:
        correction = dataclasses.replace(correction, opsm=False)
    corr = jitted_corrections(logp_old, rollout.logp, loss_mask, cfg=correction)
    return Collected(rollout, rewards, loss_mask, logp_old, corr, alpha, seconds)
