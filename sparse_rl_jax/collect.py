"""Rollout rounds, rewards and dense scoring: the data part of an RL step's collect half.

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

import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparse_rl_jax import memory_plan
from sparse_rl_jax.acceptance import score_acceptance
from sparse_rl_jax.anomaly_control import control_rows, inject_missed_increment
from sparse_rl_jax.corrections import compute_corrections
from sparse_rl_jax.kv_state import NEVER
from sparse_rl_jax.overlong import overlong_penalty
from sparse_rl_jax.rewards import compute_rewards, repeat_answers
from sparse_rl_jax.rollout_metrics import (acceptance_metrics, kv_token_savings,
                                           rollout_metrics)
from sparse_rl_jax.sampler import Rollout, generate
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


class _Round(NamedTuple):
    rollout: Rollout
    rewards: np.ndarray  # [N] task rewards
    logp_old: jax.Array  # [N, M]
    loss_mask: jax.Array  # [N, M]
    keep: np.ndarray  # [N / G] the group carries a training signal
    alpha: jax.Array | None = None  # [N, M] sparse-vs-dense acceptance (needs the record)


def timed(fn, *args, **kwargs):
    """``(fn(*args, **kwargs), seconds)``, waiting for the result's device arrays."""
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args, **kwargs))
    return out, time.perf_counter() - start


def _plan(ctx, params, prompt_width: int) -> dict:
    """:func:`memory_plan.estimate` arguments shared by a round's calls."""
    bucket = ctx.sampling.prompt_bucket
    return dict(prompt_len=-(-prompt_width // bucket) * bucket,
                new_tokens=ctx.sampling.max_new_tokens,
                dtype=jax.tree.leaves(params)[0].dtype, logp_chunk=ctx.cfg.trainer.logp_chunk)


def _score_batch(ctx, params, plan: dict, rows: int) -> int:
    """``trainer.score_batch`` if set; else the minibatch size, lowered to the largest divisor
    of ``rows`` that the memory plan fits when the device reports a memory limit."""
    cfg = ctx.cfg
    size = cfg.trainer.score_batch or cfg.trainer.minibatch_size
    limit = memory_plan.device_memory_limit()
    if cfg.trainer.score_batch or limit is None:
        return size
    model_cfg = nnx.merge(ctx.graphdef, params).config
    fits = memory_plan.largest_batch("score", model_cfg, limit, **plan)
    if fits == 0:
        memory_plan.check_fits("score", model_cfg, batch=1, limit=limit, **plan)
    size = min(size, fits)
    return max(d for d in range(1, size + 1) if rows % d == 0)


def score_all(ctx, params, prompt, prompt_mask, response, record=None, size=None) -> jax.Array:
    """Teacher-forced log-probs ``[N, M]``, ``size`` sequences a call (None:
    ``trainer.score_batch``, else the minibatch size): dense, or with ``record``
    (``[N, L, Hkv, P + M]``, sequence axis first) under the recorded sparse context."""
    size = size or ctx.cfg.trainer.score_batch or ctx.cfg.trainer.minibatch_size
    parts = []
    for start in range(0, response.shape[0], size):
        rows = slice(start, start + size)
        replay = None if record is None else jnp.moveaxis(record[rows], 0, 1)
        parts.append(score(ctx.graphdef, params, prompt[rows], prompt_mask[rows],
                           response[rows], replay, chunk_size=ctx.cfg.trainer.logp_chunk).logp)
    return jnp.concatenate(parts, axis=0)


def acceptance_all(ctx, params, rollout: Rollout, size: int) -> jax.Array | None:
    """alpha ``[N, M]`` of a rollout from its record, ``size`` sequences a call; None when
    ``compression.alpha_metric`` is off or the rollout kept no record."""
    comp = ctx.cfg.compression
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
            ctx.graphdef, params, rollout.prompt[rows], rollout.prompt_mask[rows],
            rollout.response[rows], None if evict is None else evict[:, rows],
            None if page is None else page[:, rows], page_size=comp.page_size, top_k=top_k,
            temperature=ctx.sampling.temperature, chunk_size=ctx.cfg.trainer.logp_chunk))
    return jnp.concatenate(parts, axis=0)


def group_filter(rewards: np.ndarray, in_loss: np.ndarray, group_size: int) -> np.ndarray:
    """Which groups carry a training signal: ``[N]`` rewards, ``[N]`` bool -> ``[N / G]`` bool.

    A group is dropped when all its rewards are equal (every group-baselined advantage is 0)
    or fewer than 2 of its sequences have a token left in the loss.
    """
    groups = np.asarray(rewards).reshape(-1, group_size)
    informative = np.any(groups != groups[:, :1], axis=1)
    return informative & (np.asarray(in_loss).reshape(-1, group_size).sum(axis=1) >= 2)


def _round(ctx, params, position: int, clock: dict) -> _Round:
    """Rolls out, rewards and scores prompt batch ``position``."""
    cfg = ctx.cfg
    batch = ctx.source.batch(position)
    prompt, prompt_mask = ctx.tokenizer.encode(
        batch.prompts, add_special_tokens=cfg.data.add_special_tokens)
    key = jax.random.fold_in(jax.random.key(cfg.trainer.seed), position)
    plan = _plan(ctx, params, prompt.shape[1])
    samples = ctx.sampling.num_samples
    memory_plan.check_fits(  # before compiling: a clear error instead of an XLA OOM trace
        "rollout", nnx.merge(ctx.graphdef, params).config, batch=len(prompt) * samples,
        compression=cfg.compression, num_samples=samples, step=samples,
        record_evictions=ctx.sampling.record_evictions, **plan)
    rollout, seconds = timed(generate, ctx.graphdef, params, prompt, prompt_mask, key,
                             ctx.sampling, cfg.compression)
    clock["rollout"] += seconds
    if cfg.data.control_missed_increment:  # positive control: see anomaly_control
        rows = control_rows(cfg.trainer.seed, position, len(rollout.response),
                            cfg.data.control_missed_increment)
        rollout = inject_missed_increment(
            rollout, rows, [p for p in batch.prompts for _ in range(samples)], ctx.tokenizer,
            ctx.sampling.eos_ids[0], ctx.sampling.pad_id, cfg.data.synthetic.echo_every)
    start = time.perf_counter()
    completions = ctx.tokenizer.decode(rollout.response, rollout.response_mask)
    answers = repeat_answers(batch.answers, ctx.sampling.num_samples)
    rewards = np.asarray(compute_rewards(ctx.reward_fn, completions, answers), np.float32)
    clock["reward"] += time.perf_counter() - start
    size = _score_batch(ctx, params, plan, rollout.response.shape[0])
    logp_old, seconds = timed(score_all, ctx, params, rollout.prompt, rollout.prompt_mask,
                              rollout.response, size=size)
    alpha, seconds_alpha = timed(acceptance_all, ctx, params, rollout, size)
    clock["score"] += seconds + seconds_alpha
    loss_mask = rollout.response_mask
    if cfg.overlong.mask_truncated:
        loss_mask = loss_mask * rollout.finished[:, None].astype(loss_mask.dtype)
    corr = jitted_corrections(logp_old, rollout.logp, loss_mask, cfg=cfg.correction)
    in_loss = np.asarray(corr.seq_mask & jnp.any(corr.token_mask, axis=1))
    keep = group_filter(rewards, in_loss, ctx.sampling.num_samples)
    return _Round(rollout, rewards, logp_old, loss_mask, keep, alpha)


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


def _assemble(ctx, rounds: list[_Round], groups: list[tuple[int, int]], valid: np.ndarray
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


def _metrics(rounds: list[_Round], ctx) -> dict[str, jax.Array]:
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
    ``position`` (``rl_step.collect`` adds the corrections and advantages).

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
    clock = {"rollout": 0.0, "reward": 0.0, "score": 0.0}
    rounds: list[_Round] = []
    kept: list[tuple[int, int]] = []
    while True:
        rounds.append(_round(ctx, params, position + len(rounds), clock))
        r = len(rounds) - 1
        keep = rounds[-1].keep if dynamic else np.ones_like(rounds[-1].keep)
        kept += [(r, k) for k in np.flatnonzero(keep)]
        if not dynamic or len(kept) >= target or len(rounds) >= cfg.data.max_collect_rounds:
            break
    kept = kept[:target]
    taken = set(kept)
    dropped = [(r, k) for r, out in enumerate(rounds) for k in range(len(out.keep))
               if (r, k) not in taken]
    groups = kept + dropped[: target - len(kept)]
    valid = np.arange(target) < len(kept)
    batch = _assemble(ctx, rounds, groups, valid)

    metrics = _metrics(rounds, ctx)
    passes = np.concatenate([out.keep for out in rounds])
    per_round = len(rounds[0].keep)
    metrics["groups_kept"] = float(sum(passes[r * per_round + k] for r, k in kept))
    metrics["collect_rounds"] = float(len(rounds))
    metrics["prompts_consumed"] = float(len(rounds) * target)
    return batch, metrics, clock
