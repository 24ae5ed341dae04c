"""One RL step: rollout -> reward -> dense scoring -> corrections -> K optimizer updates.

The array work is jitted (sampler, scorer, update); the host does what needs Python anyway:
tokenising prompts, decoding responses and calling the reward function. Every random choice
derives from ``(trainer.seed, step)``, so a step is reproducible on its own (what resuming
from a checkpoint relies on).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from sparse_rl_jax import memory_plan
from sparse_rl_jax.advantages import group_advantages
from sparse_rl_jax.corrections import compute_corrections
from sparse_rl_jax.grpo_loss import LossBatch
from sparse_rl_jax.prompt_source import PromptSource
from sparse_rl_jax.rewards import compute_rewards
from sparse_rl_jax.rollout_metrics import rollout_metrics
from sparse_rl_jax.run_config import RunConfig
from sparse_rl_jax.sampler import Rollout, generate
from sparse_rl_jax.sampling_config import SamplingConfig
from sparse_rl_jax.scoring import score
from sparse_rl_jax.train_step import Minibatch

BATCH_AXES = ("data", "fsdp")
_corrections = jax.jit(compute_corrections, static_argnames="cfg")
_rollout_metrics = jax.jit(rollout_metrics)


def batch_sharding(mesh) -> NamedSharding:
    """Splits an array's leading (sequence) axis over the mesh's data and fsdp axes."""
    return NamedSharding(mesh, PartitionSpec(BATCH_AXES))


@dataclasses.dataclass(frozen=True)
class StepContext:
    """Everything an RL step needs besides the params and optimizer state.

    Attributes:
      cfg: the run config.
      sampling: ``cfg.sampling`` with the tokenizer's EOS / pad ids filled in.
      graphdef: the policy's ``nnx.GraphDef``.
      tokenizer: ``models.Tokenizer``.
      source: the prompt source.
      reward_fn: ``(completions, answers) -> [N]`` rewards.
      update: the jitted ``update(params, opt_state, minibatch)``.
      mesh: the device mesh.
      ref_params: frozen reference params for the KL term, or None.
    """

    cfg: RunConfig
    sampling: SamplingConfig
    graphdef: nnx.GraphDef
    tokenizer: Any
    source: PromptSource
    reward_fn: Callable
    update: Callable
    mesh: Any
    ref_params: Any = None


def _score_all(ctx: StepContext, params, rollout: Rollout, size: int) -> jax.Array:
    """Dense teacher-forced log-probs ``[N, M]`` of the rollout, ``size`` sequences a call."""
    parts = []
    for start in range(0, rollout.response.shape[0], size):
        rows = slice(start, start + size)
        parts.append(score(ctx.graphdef, params, rollout.prompt[rows], rollout.prompt_mask[rows],
                           rollout.response[rows], chunk_size=ctx.cfg.trainer.logp_chunk).logp)
    return jnp.concatenate(parts, axis=0)


def _plan(ctx: StepContext, params, prompt_width: int) -> dict:
    """:func:`memory_plan.estimate` arguments shared by this step's calls."""
    bucket = ctx.sampling.prompt_bucket
    return dict(prompt_len=-(-prompt_width // bucket) * bucket,
                new_tokens=ctx.sampling.max_new_tokens,
                dtype=jax.tree.leaves(params)[0].dtype, logp_chunk=ctx.cfg.trainer.logp_chunk)


def _score_batch(ctx: StepContext, params, plan: dict, rows: int) -> int:
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


def _timed(fn, *args, **kwargs):
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args, **kwargs))
    return out, time.perf_counter() - start


def rl_step(ctx: StepContext, params, opt_state, step: int):
    """Runs RL step ``step`` (0-based); returns ``(params, opt_state, metrics)``.

    ``params`` and ``opt_state`` are donated to the optimizer updates: use the returned ones.
    Metrics are Python floats: rollout statistics, correction statistics (rejection rate,
    token mask fraction, mismatch KL), update statistics averaged over the minibatches, and
    the seconds spent in each phase.
    """
    cfg = ctx.cfg
    key = jax.random.fold_in(jax.random.key(cfg.trainer.seed), step)
    batch = ctx.source.batch(step)
    prompt, prompt_mask = ctx.tokenizer.encode(
        batch.prompts, add_special_tokens=cfg.data.add_special_tokens)

    plan = _plan(ctx, params, prompt.shape[1])
    samples = ctx.sampling.num_samples
    memory_plan.check_fits(  # before compiling: a clear error instead of an XLA OOM trace
        "rollout", nnx.merge(ctx.graphdef, params).config, batch=len(prompt) * samples,
        compression=cfg.compression, num_samples=samples, step=samples,
        record_evictions=ctx.sampling.record_evictions, **plan)
    rollout, t_rollout = _timed(generate, ctx.graphdef, params, prompt, prompt_mask, key,
                                ctx.sampling, cfg.compression)
    start = time.perf_counter()
    completions = ctx.tokenizer.decode(rollout.response, rollout.response_mask)
    answers = np.repeat(np.asarray(batch.answers, dtype=object), ctx.sampling.num_samples)
    rewards = compute_rewards(ctx.reward_fn, completions, list(answers))
    t_reward = time.perf_counter() - start

    size = _score_batch(ctx, params, plan, rollout.response.shape[0])
    logp_old, t_score = _timed(_score_all, ctx, params, rollout, size)
    logp_ref = None
    if ctx.ref_params is not None:
        logp_ref, t_ref = _timed(_score_all, ctx, ctx.ref_params, rollout, size)
        t_score += t_ref

    mask = rollout.response_mask
    corrections = _corrections(logp_old, rollout.logp, mask, cfg=cfg.correction)
    advantages = group_advantages(jnp.asarray(rewards), cfg.loss.group_size, cfg.loss.adv_eps)
    loss_batch = LossBatch.from_corrections(logp_old, advantages, mask, corrections, logp_ref)
    full = Minibatch(rollout.prompt, rollout.prompt_mask, rollout.response, loss_batch)

    start = time.perf_counter()
    order = np.random.default_rng([cfg.trainer.seed, step]).permutation(rollout.response.shape[0])
    sharding = batch_sharding(ctx.mesh)
    update_metrics = []
    for rows in np.split(order, len(order) // cfg.trainer.minibatch_size):
        minibatch = jax.device_put(jax.tree.map(lambda x: x[rows], full), sharding)
        params, opt_state, m = ctx.update(params, opt_state, minibatch)
        update_metrics.append(m)
    update_metrics = jax.device_get(update_metrics)
    t_update = time.perf_counter() - start

    metrics = _rollout_metrics(
        jnp.asarray(rewards), rollout.response, mask, ~rollout.finished,
        rollout.kv_mean, rollout.dense_kv_mean)
    metrics["kv_peak_tokens"] = jnp.max(rollout.kv_peak)
    metrics["dense_kv_peak_tokens"] = jnp.max(rollout.dense_kv_peak)
    metrics["kv_peak_savings"] = 1.0 - jnp.sum(rollout.kv_peak) / jnp.sum(rollout.dense_kv_peak)
    metrics["compressions"] = rollout.num_compressions
    metrics.update(corrections.metrics)
    metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
    for name in update_metrics[0]:
        metrics[name] = float(np.mean([m[name] for m in update_metrics]))
    metrics["skipped_updates"] = float(sum(m["all_rejected"] for m in update_metrics))
    total = t_rollout + t_reward + t_score + t_update
    metrics.update(
        time_rollout=t_rollout, time_reward=t_reward, time_score=t_score, time_update=t_update,
        time_step=total, rollout_share=t_rollout / total, score_share=t_score / total,
        update_share=t_update / total,
        tokens_per_second=float(np.sum(np.asarray(mask))) / total,
    )
    return params, opt_state, metrics
