"""One RL step in two halves: ``collect`` (rollout -> reward -> dense scoring -> corrections
-> advantages) then ``update`` (K optimizer updates).

``collect`` reads prompts at the data cursor; ``collect.collect_prompts`` is the same collect
over explicit prompts (what evaluation and the experiments call), with the policy's fixed
settings in a ``collect.RolloutPolicy`` (:attr:`StepContext.policy`).

The array work is jitted (sampler, scorer, update); the host does what needs Python anyway:
tokenising prompts, decoding responses and calling the reward function. Every random choice
derives from ``(trainer.seed, step)`` and the data cursor (``collect``), so a step is
reproducible on its own (what resuming from a checkpoint relies on).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from models.shapes import check_shape
from sparse_rl_jax.rl.advantages import compute_advantages
from sparse_rl_jax.rl.decoupled import decoupled_loss_batch
from sparse_rl_jax.rl.grpo_loss import check_loss_batch
from sparse_rl_jax.rl.update_step import Minibatch, dropout_key
from sparse_rl_jax.rollout.sampling_config import SamplingConfig
from sparse_rl_jax.rollout.scoring import sequence_positions
from sparse_rl_jax.tasks.prompt_source import PromptSource
from sparse_rl_jax.training import memory_plan
from sparse_rl_jax.training.collect import RolloutPolicy, score_all, timed
from sparse_rl_jax.training.collect_rounds import UpdateBatch, collect_rollouts
from sparse_rl_jax.training.run_config import RunConfig

BATCH_AXES = ("data", "fsdp")


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
      update: the jitted ``update(params, opt_state, minibatch, micro_batch_size,
        dropout_key)`` (``train_step.jit_update_step``).
      mesh: the device mesh.
      reference: ``params -> the KL term's reference params``
        (``kl_reference.kl_reference``), or None (no KL term).
      budget_ks: ``sparrow``'s closed-loop k per schedule bin for this step's rollouts
        (``budget_control``), or None for the schedule's own.
    """

    cfg: RunConfig
    sampling: SamplingConfig
    graphdef: nnx.GraphDef
    tokenizer: Any
    source: PromptSource
    reward_fn: Callable
    update: Callable
    mesh: Any
    reference: Callable[[Any], Any] | None = None
    budget_ks: tuple[int, ...] | None = None

    @property
    def policy(self) -> RolloutPolicy:
        """The run's :class:`RolloutPolicy` (``collect.collect_prompts``'s fixed settings)."""
        policy = RolloutPolicy.from_run(self.cfg, self.graphdef, self.tokenizer,
                                        self.reward_fn, self.sampling)
        return dataclasses.replace(policy, budget_ks=self.budget_ks)


def planned_micro_batch(ctx: StepContext, params, full: Minibatch) -> int:
    """``trainer.micro_batch_size``, or when 0 the memory plan's choice for ``full``'s
    sequence widths (``memory_plan.micro_batch_size``: the whole minibatch where it fits)."""
    cfg = ctx.cfg
    if cfg.trainer.micro_batch_size:
        return cfg.trainer.micro_batch_size
    return memory_plan.micro_batch_size(
        nnx.merge(ctx.graphdef, params).config, cfg.trainer.minibatch_size,
        step=ctx.mesh.shape["data"] * ctx.mesh.shape["fsdp"], prompt_len=full.prompt.shape[1],
        new_tokens=full.response.shape[1], dtype=jax.tree.leaves(params)[0].dtype,
        logp_chunk=cfg.trainer.logp_chunk, remat=cfg.model.remat, lora=cfg.model.lora)


def collect(ctx: StepContext, params, position: int
            ) -> tuple[Minibatch, dict[str, Any], dict[str, float]]:
    """The first half of an RL step: everything the update consumes, from data cursor
    ``position`` (prompt batches).

    Rollouts, rewards and dense old-policy scores (``collect_rounds.collect_rollouts``:
    rounds of ``collect.collect_prompts`` over the prompt batches at the cursor), then
    :func:`learner_batch` with the rollout's own dense scores as the proximal policy.

    Returns:
      ``(batch, metrics, seconds)``: the step's :class:`Minibatch` over all ``N`` rows
      (``update`` splits it); rollout and correction metrics (device scalars) with
      ``collect_rounds`` (the cursor's advance); seconds in ``rollout``, ``reward``,
      ``score``.
    """
    batch, metrics, clock = collect_rollouts(ctx, params, position)
    full, more, t_score = learner_batch(ctx, params, batch, batch.logp_old)
    metrics.update(more)
    clock["score"] += t_score
    return full, metrics, clock


def learner_batch(ctx: StepContext, params, batch: UpdateBatch, proximal_NxM: jax.Array
                  ) -> tuple[Minibatch, dict[str, Any], float]:
    """The update's :class:`Minibatch` of the rollout rows ``batch`` under the decoupled
    objective (``decoupled.decoupled_loss_batch``): behaviour = the sampler's log-probs,
    proximal = ``proximal_NxM`` (dense under ``params``, the learner's at the start of the
    update), plus the reference scores under ``params`` (KL term) and the group advantages.

    Returns ``(minibatch, correction metrics, seconds spent scoring the reference)``.
    """
    cfg = ctx.cfg
    # Shadow-mask training (``batch.record`` is set): the learner's policy is the replayed
    # sparse one, so the PPO ratio is against the sampler's own log-probs (equal to the replay)
    # and the reference is scored under the same record; the dense scores still feed the
    # mismatch metrics. ``correction.anchor: behaviour`` takes the same ratio without a record.
    logp_ref, t_ref = None, 0.0
    if ctx.reference is not None:
        logp_ref, t_ref = timed(score_all, ctx.policy, ctx.reference(params), batch.prompt,
                                batch.prompt_mask, batch.response, batch.record)
    mask = batch.loss_mask
    advantages = compute_advantages(jnp.asarray(batch.rewards), cfg.sampling.num_samples,
                                    cfg.advantage, mask, batch.valid)
    loss_batch, corrections = decoupled_loss_batch(batch.logp_sparse, proximal_NxM, advantages,
                                                   mask, cfg.correction, logp_ref,
                                                   replayed=batch.record is not None)
    full = Minibatch(batch.prompt, batch.prompt_mask, batch.response, loss_batch, batch.record)
    return full, dict(corrections.metrics), t_ref


def check_minibatch(full: Minibatch) -> None:
    """Raise ValueError naming the leaf of ``full`` that is not ``[N, P]`` (prompt, prompt
    mask), ``[N, M]`` int (response), ``[N, M]`` / ``[N]`` (loss) or, for the record, what
    its ``replay_view`` over the ``[N, P + M]`` columns refuses (shapes only: nothing runs)."""
    check_shape("full.response", full.response, dtype=int, N=None, M=None)
    n, m = full.response.shape
    check_shape("full.prompt", full.prompt, dtype=int, N=n, P=None)
    p = full.prompt.shape[1]
    check_shape("full.prompt_mask", full.prompt_mask, N=n, P=p)
    check_loss_batch(full.loss, n, m, name="full.loss")
    if full.record is not None:
        jax.eval_shape(lambda record, mask: record.replay_view(
            sequence_positions(mask, m), mask.sum(axis=1), m), full.record, full.prompt_mask)


def update(ctx: StepContext, params, opt_state, full: Minibatch, step: int):
    """The second half of an RL step: ``full``'s rows in a ``(trainer.seed, step)`` order,
    one optimizer update per ``trainer.minibatch_size`` of them (``ctx.update``; with LoRA
    dropout, keyed by ``train_step.dropout_key``).

    ``params`` and ``opt_state`` are donated: use the returned ones. A leaf of ``full`` of
    the wrong shape raises ValueError naming it (:func:`check_minibatch`).

    Returns:
      ``(params, opt_state, metrics)``: update metrics averaged over the minibatches (Python
      floats) and ``skipped_updates`` (minibatches with every token rejected).
    """
    check_minibatch(full)
    micro = planned_micro_batch(ctx, params, full)
    order = np.random.default_rng([ctx.cfg.trainer.seed, step]).permutation(
        full.response.shape[0])
    sharding = batch_sharding(ctx.mesh)
    lora = ctx.cfg.model.lora
    per_minibatch = []
    for i, rows in enumerate(np.split(order, len(order) // ctx.cfg.trainer.minibatch_size)):
        minibatch = jax.device_put(jax.tree.map(lambda x: x[rows], full), sharding)
        key = dropout_key(ctx.cfg.trainer.seed, step, i) if lora and lora.dropout else None
        params, opt_state, m = ctx.update(params, opt_state, minibatch, micro, key)
        per_minibatch.append(m)
    per_minibatch = jax.device_get(per_minibatch)
    metrics = {name: float(np.mean([m[name] for m in per_minibatch]))
               for name in per_minibatch[0]}
    metrics["skipped_updates"] = float(sum(m["all_rejected"] for m in per_minibatch))
    return params, opt_state, metrics


def rl_step(ctx: StepContext, params, opt_state, step: int, position: int | None = None):
    """RL step ``step`` (0-based) from data cursor ``position`` (prompt batches; None =
    ``step``, right without dynamic sampling): :func:`collect` then :func:`update`; returns
    ``(params, opt_state, metrics)``.

    ``params`` and ``opt_state`` are donated to the optimizer updates: use the returned ones.
    Metrics are Python floats: rollout statistics, correction statistics (rejection rate,
    token mask fraction, mismatch KL), update statistics averaged over the minibatches, the
    seconds spent in each phase, and ``collect_rounds`` (how far the cursor advanced; see
    ``collect_rounds.collect_rollouts``).
    """
    position = step if position is None else position
    full, metrics, clock = collect(ctx, params, position)
    (params, opt_state, update_metrics), t_update = timed(
        update, ctx, params, opt_state, full, step)
    return params, opt_state, step_metrics(ctx, metrics, clock, update_metrics, t_update)


def step_metrics(ctx: StepContext, metrics: dict[str, Any], clock: dict[str, float],
                 update_metrics: dict[str, float], t_update: float) -> dict[str, float]:
    """One step's metrics as Python floats: the collect half's ``metrics`` (device scalars),
    the update's, and the seconds of each phase (``clock``: ``rollout``, ``reward``,
    ``score``; ``t_update``) with their shares and the tokens per second."""
    metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
    metrics.update(update_metrics)
    total = clock["rollout"] + clock["reward"] + clock["score"] + t_update
    metrics.update(
        time_rollout=clock["rollout"], time_reward=clock["reward"], time_score=clock["score"],
        time_update=t_update, time_step=total, rollout_share=clock["rollout"] / total,
        score_share=clock["score"] / total, update_share=t_update / total,
        tokens_per_second=metrics["response_length_mean"] * metrics["prompts_consumed"]
        * ctx.sampling.num_samples / total,
    )
    return metrics
