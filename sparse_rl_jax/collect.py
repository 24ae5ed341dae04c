"""Rollouts, rewards and dense scoring: the data part of an RL step's collect half.

:func:`collect_prompts` is the one path from plain-text prompts to scored rollouts (encode ->
generate -> decode -> reward -> dense score -> corrections) that the trainer, evaluation and
the experiments call; :func:`collect_rollouts` builds the trainer's update batch from rounds
of it.

Without dynamic sampling this is one round: ``trainer.prompts_per_step`` prompts at the data
cursor, ``sampling.num_samples`` samples each. With ``data.dynamic_sampling`` (DAPO) a round's
groups that carry no signal are dropped (all task rewards equal, or fewer than 2 sequences
left in the loss after correction rejection / ``overlong.mask_truncated``) and further rounds
of the same fixed size are rolled out until ``prompts_per_step`` kept groups fill the update
batch or ``data.max_collect_rounds`` is reached; kept groups beyond the batch are discarded
(they were sampled by this step's policy and would be stale next step), and a batch still short
is padded with dropped groups whose loss mask is zeroed. Every shape stays static: rounds
have the rollout's shape and the update batch ``prompts_per_step x num_samples`` rows.

Round ``r`` of a step reads prompt batch ``position + r`` and samples with key
``fold_in(key(seed), position + r)``, so the cursor ``position`` (checkpointed by the
trainer) is all a resumed run needs to continue identically.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparse_rl_jax import memory_plan
from sparse_rl_jax.acceptance import score_acceptance
from sparse_rl_jax.compression_config import CompressionConfig
from sparse_rl_jax.corrections import Corrections, compute_corrections
from sparse_rl_jax.kv_state import NEVER
from sparse_rl_jax.loss_config import CorrectionConfig
from sparse_rl_jax.overlong import overlong_penalty
from sparse_rl_jax.rewards import compute_rewards, repeat_answers
from sparse_rl_jax.rollout_metrics import (acceptance_metrics, kv_token_savings,
                                           rollout_metrics)
from sparse_rl_jax.run_config import RunConfig
from sparse_rl_jax.sampler import Rollout, generate
from sparse_rl_jax.sampling_config import SamplingConfig
from sparse_rl_jax.scoring import score

jitted_corrections = jax.jit(compute_corrections, static_argnames="cfg")
_rollout_metrics = jax.jit(rollout_metrics)


class UpdateBatch(NamedTuple):
    """The rows one RL step trains on (``N = prompts_per_step x num_samples``).

    Attributes:
      prompt, prompt_mask: ``[N, P]`` left-padded prompts (``P`` the widest round's).
      response: ``[N, M]`` sampled tokens.
      loss_mask: ``[N, M]`` response tokens entering the loss (0 on padding rows and, with
        ``overlong.mask_truncated``, on truncated responses).
      logp_sparse: ``[N, M]`` sampler log-probs; logp_old: ``[N, M]`` dense scorer log-probs.
      rewards: ``[N]`` float32 task reward plus the overlong penalty.
      valid: ``[N]`` bool, False on padding rows (whole groups).
      record: None, or (``correction.kind: shadow_mask``) the sampler's eviction record with
        the sequence axis first, ``[N, L, Hkv, P + M]`` int32, re-based to the common prompt
        width ``P``, so that it splits into minibatches like every other leaf.
    """

    prompt: jax.Array
    prompt_mask: jax.Array
    response: jax.Array
    loss_mask: jax.Array
    logp_sparse: jax.Array
    logp_old: jax.Array
    rewards: np.ndarray
    valid: np.ndarray
    record: jax.Array | None = None


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
      alpha: ``[N, M]`` sparse-vs-dense acceptance, or None (unscored, ``alpha_metric: off``
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


def score_all(policy: RolloutPolicy, params, prompt, prompt_mask, response, record=None,
              size=None) -> jax.Array:
    """Teacher-forced log-probs ``[N, M]``, ``size`` sequences a call (None:
    ``policy.score_batch``): dense, or with ``record`` (``[N, L, Hkv, P + M]``, sequence axis
    first) under the recorded sparse context."""
    size = size or policy.score_batch or response.shape[0]
    parts = []
    for start in range(0, response.shape[0], size):
        rows = slice(start, start + size)
        replay = None if record is None else jnp.moveaxis(record[rows], 0, 1)
        parts.append(score(policy.graphdef, params, prompt[rows], prompt_mask[rows],
                           response[rows], replay, chunk_size=policy.logp_chunk).logp)
    return jnp.concatenate(parts, axis=0)


def acceptance_all(policy: RolloutPolicy, params, rollout: Rollout, size: int,
                   comp: CompressionConfig, temperature: float) -> jax.Array | None:
    """alpha ``[N, M]`` of a rollout (sampled under ``comp`` at ``temperature``) from its
    record, ``size`` sequences a call; None when ``comp.alpha_metric`` is off or the rollout
    kept no record."""
    page = rollout.page_record if comp.page_sparse else None
    evict = rollout.eviction_record if comp.compresses else None
    if comp.alpha_metric == "off" or not ((page is not None and page.shape[3])
                                          or (evict is not None and evict.shape[-1])):
        return None
    top_k = 20 if comp.alpha_metric == "top20" else None
    parts = []
    for start in range(0, rollout.response.shape[0], size):
        rows = slice(start, start + size)
        parts.append(score_acceptance(
            policy.graphdef, params, rollout.prompt[rows], rollout.prompt_mask[rows],
            rollout.response[rows], None if evict is None else evict[:, rows],
            None if page is None else page[:, rows], page_size=comp.page_size, top_k=top_k,
            temperature=temperature, chunk_size=policy.logp_chunk))
    return jnp.concatenate(parts, axis=0)


def group_filter(rewards: np.ndarray, in_loss: np.ndarray, group_size: int) -> np.ndarray:
    """Which groups carry a training signal: ``[N]`` rewards, ``[N]`` bool -> ``[N / G]`` bool.

    A group is dropped when all its rewards are equal (every group-baselined advantage is 0)
    or fewer than 2 of its sequences have a token left in the loss.
    """
    groups = np.asarray(rewards).reshape(-1, group_size)
    informative = np.any(groups != groups[:, :1], axis=1)
    return informative & (np.asarray(in_loss).reshape(-1, group_size).sum(axis=1) >= 2)


def collect_prompts(policy: RolloutPolicy, params, prompts: Sequence[str],
                    answers: Sequence[Any], key: jax.Array, *,
                    compression: CompressionConfig | None = None,
                    sampling: SamplingConfig | None = None, score: bool = True) -> Collected:
    """The collect half over explicit prompts: encode -> generate -> decode -> reward, then
    (``score``) dense old-policy scores, acceptance and the sampler/learner corrections.

    Args:
      policy: what stays fixed between calls (:class:`RolloutPolicy`).
      params: the policy's params (sampling and dense scoring).
      prompts: ``B`` plain-text prompts; answers: their ``B`` gold answers.
      key: the sampling PRNG key.
      compression, sampling: override ``policy.compression`` / ``policy.sampling``.
      score: False for rewards only (``logp_old``, ``corrections``, ``alpha`` are None).

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
    memory_plan.check_fits(  # before compiling: a clear error instead of an XLA OOM trace
        "rollout", nnx.merge(policy.graphdef, params).config, batch=len(prompt) * samples,
        compression=comp, num_samples=samples, step=samples,
        record_evictions=sampling.record_evictions, **plan)
    rollout, seconds["rollout"] = timed(generate, policy.graphdef, params, prompt, prompt_mask,
                                        key, sampling, comp)
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
                              rollout.response, size=size)
    alpha, t_alpha = timed(acceptance_all, policy, params, rollout, size, comp,
                           sampling.temperature)
    seconds["score"] = t_score + t_alpha
    corr = jitted_corrections(logp_old, rollout.logp, loss_mask, cfg=policy.correction)
    return Collected(rollout, rewards, loss_mask, logp_old, corr, alpha, seconds)


def _round(ctx, params, position: int) -> tuple[Collected, np.ndarray]:
    """Collects prompt batch ``position`` with key ``fold_in(key(seed), position)``; returns
    it and which of its groups carry a training signal (``[B]`` bool, :func:`group_filter`)."""
    batch = ctx.source.batch(position)
    key = jax.random.fold_in(jax.random.key(ctx.cfg.trainer.seed), position)
    out = collect_prompts(ctx.policy, params, batch.prompts, batch.answers, key)
    corr = out.corrections
    in_loss = np.asarray(corr.seq_mask & jnp.any(corr.token_mask, axis=1))
    return out, group_filter(out.rewards, in_loss, ctx.sampling.num_samples)


def _left_pad(x: jax.Array, width: int, value: int) -> jax.Array:
    return jnp.pad(x, ((0, 0), (width - x.shape[1], 0)), constant_values=value)


def _rebased_record(rollout: Rollout, width: int) -> jax.Array:
    """The rollout's eviction record ``[L, N, Hkv, P' + M]`` for its prompt left-padded to
    ``width``, sequence axis first: ``[N, L, Hkv, width + M]``. Both the record's index (key
    position) and its values (query positions) move by the added padding; the padding keys
    are never evicted (the prompt mask hides them anyway)."""
    shift = width - rollout.prompt.shape[1]
    record = rollout.eviction_record
    record = jnp.where(record == NEVER, NEVER, record + shift)
    record = jnp.pad(record, ((0, 0), (0, 0), (0, 0), (shift, 0)), constant_values=NEVER)
    return jnp.moveaxis(record, 1, 0)


def _assemble(ctx, rounds: list[Collected], groups: list[tuple[int, int]], valid: np.ndarray
              ) -> UpdateBatch:
    """The update batch of the listed ``(round, group)`` pairs, in order."""
    g = ctx.sampling.num_samples
    per_round = rounds[0].rewards.shape[0]
    rows = np.concatenate([np.arange(r * per_round + k * g, r * per_round + (k + 1) * g)
                           for r, k in groups])
    width = max(out.rollout.prompt.shape[1] for out in rounds)

    def cat(get, pad=None):
        parts = [get(out) for out in rounds]
        if pad is not None:
            parts = [_left_pad(p, width, pad) for p in parts]
        return jnp.concatenate(parts, axis=0)[rows]

    valid_rows = np.repeat(valid, g)
    lengths = np.concatenate([np.asarray(out.rollout.response_mask).sum(1) for out in rounds])
    rewards = np.concatenate([out.rewards for out in rounds]) + overlong_penalty(
        lengths, ctx.sampling.max_new_tokens, ctx.cfg.overlong)
    loss_mask = cat(lambda o: o.loss_mask)
    record = None
    if ctx.cfg.correction.kind == "shadow_mask":
        record = cat(lambda o: _rebased_record(o.rollout, width))
    return UpdateBatch(
        prompt=cat(lambda o: o.rollout.prompt, ctx.sampling.pad_id),
        prompt_mask=cat(lambda o: o.rollout.prompt_mask, 0),
        response=cat(lambda o: o.rollout.response),
        loss_mask=loss_mask * jnp.asarray(valid_rows, loss_mask.dtype)[:, None],
        logp_sparse=cat(lambda o: o.rollout.logp),
        logp_old=cat(lambda o: o.logp_old),
        rewards=rewards[rows].astype(np.float32),
        valid=valid_rows,
        record=record,
    )


def _metrics(rounds: list[Collected], ctx) -> dict[str, jax.Array]:
    """Rollout statistics over every sequence rolled out this step (all rounds)."""
    def cat(get):
        return jnp.concatenate([get(out.rollout) for out in rounds], axis=0)

    rewards = np.concatenate([out.rewards for out in rounds])
    mask = cat(lambda r: r.response_mask)
    metrics = _rollout_metrics(jnp.asarray(rewards), cat(lambda r: r.response), mask,
                               ~cat(lambda r: r.finished), cat(lambda r: r.kv_mean),
                               cat(lambda r: r.dense_kv_mean))
    kv_peak, dense_peak = cat(lambda r: r.kv_peak), cat(lambda r: r.dense_kv_peak)
    metrics["kv_peak_tokens"] = jnp.max(kv_peak)
    metrics["dense_kv_peak_tokens"] = jnp.max(dense_peak)
    metrics["kv_peak_savings"] = kv_token_savings(kv_peak, dense_peak)
    metrics["compressions"] = sum(out.rollout.num_compressions for out in rounds)
    if ctx.cfg.overlong.buffer_len:
        metrics["overlong_penalty_mean"] = jnp.mean(overlong_penalty(
            np.asarray(mask).sum(1), ctx.sampling.max_new_tokens, ctx.cfg.overlong))
    if all(out.alpha is not None for out in rounds):
        metrics.update(acceptance_metrics(jnp.concatenate([out.alpha for out in rounds]), mask,
                                          ctx.cfg.compression.alpha_threshold))
    return metrics


def collect_rollouts(ctx, params, position: int
                     ) -> tuple[UpdateBatch, dict[str, Any], dict[str, float]]:
    """Rollouts, rewards and dense old-policy scores of one RL step, starting at prompt batch
    ``position``: rounds of :func:`collect_prompts` (``rl_step.collect`` adds the reference
    scores, the corrections of the assembled batch and the advantages).

    Args:
      ctx: the ``rl_step.StepContext``.
      params: the policy (sampling and old-policy scoring).
      position: the data cursor, in prompt batches.

    Returns:
      ``(batch, metrics, seconds)``: the :class:`UpdateBatch`; rollout metrics over all rounds
      plus ``collect_rounds`` (rounds used, the cursor's advance), ``prompts_consumed`` and
      ``groups_kept`` (update-batch groups that pass :func:`group_filter`, also reported
      without dynamic sampling); seconds spent in ``rollout``, ``reward`` and ``score``.
    """
    cfg = ctx.cfg
    target = cfg.trainer.prompts_per_step
    dynamic = cfg.data.dynamic_sampling
    rounds: list[Collected] = []
    keeps: list[np.ndarray] = []  # [B] per round: the group passes group_filter
    kept: list[tuple[int, int]] = []
    while True:
        out, keep = _round(ctx, params, position + len(rounds))
        rounds.append(out)
        keeps.append(keep)
        kept += [(len(rounds) - 1, k) for k in np.flatnonzero(keep if dynamic else
                                                              np.ones_like(keep))]
        if not dynamic or len(kept) >= target or len(rounds) >= cfg.data.max_collect_rounds:
            break
    kept = kept[:target]
    taken = set(kept)
    dropped = [(r, k) for r, keep in enumerate(keeps) for k in range(len(keep))
               if (r, k) not in taken]
    groups = kept + dropped[: target - len(kept)]
    valid = np.arange(target) < len(kept)
    batch = _assemble(ctx, rounds, groups, valid)

    metrics = _metrics(rounds, ctx)
    passes = np.concatenate(keeps)
    per_round = len(keeps[0])
    metrics["groups_kept"] = float(sum(passes[r * per_round + k] for r, k in kept))
    metrics["collect_rounds"] = float(len(rounds))
    metrics["prompts_consumed"] = float(len(rounds) * target)
    clock = {phase: sum(out.seconds[phase] for out in rounds)
             for phase in ("rollout", "reward", "score")}
    return batch, metrics, clock
