"""The trainer's update batch from rounds of ``collect.collect_prompts`` at the data cursor.

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

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sparse_rl_jax.kv.quant_check import key_quant_error
from sparse_rl_jax.rl.overlong import overlong_penalty
from sparse_rl_jax.rl.rollout_metrics import acceptance_metrics, kv_token_savings, rollout_metrics
from sparse_rl_jax.rollout.sampler import Rollout
from sparse_rl_jax.rollout.scoring import ReplayRecord, concatenate_records
from sparse_rl_jax.tasks.anomaly_control import control_rows, inject_missed_increment
from sparse_rl_jax.tasks.rewards import repeat_answers
from sparse_rl_jax.training.budget_control import bin_p5, p5_metrics
from sparse_rl_jax.training.collect import Collected, collect_prompts
from sparse_rl_jax.training.memory_plan import kv_bytes_per_token
from sparse_rl_jax.training.mismatch_sources import mismatch_by_source

_rollout_metrics = jax.jit(rollout_metrics)


class UpdateBatch(NamedTuple):
    """The rows one RL step trains on (``N = prompts_per_step x num_samples``).

    Attributes:
      prompt, prompt_mask: ``[N, P]`` left-padded prompts (``P`` the widest round's).
      response: ``[N, M]`` sampled tokens.
      loss_mask: ``[N, M]`` response tokens entering the loss (0 on padding rows and, with
        ``overlong.mask_truncated``, on truncated responses).
      logp_sparse: ``[N, M]`` sampler log-probs; logp_old: ``[N, M]`` dense scorer log-probs
        (None when the rows were collected unscored).
      rewards: ``[N]`` float32 task reward plus the overlong penalty.
      valid: ``[N]`` bool, False on padding rows (whole groups).
      record: None, or (``correction.replay``: shadow_mask) the rows' replay record
        (``Rollout.record``, rows first, so it splits into minibatches like every other leaf),
        widened for the common prompt width ``P`` (``scoring.concatenate_records``).
    """

    prompt: jax.Array
    prompt_mask: jax.Array
    response: jax.Array
    loss_mask: jax.Array
    logp_sparse: jax.Array
    logp_old: jax.Array | None
    rewards: np.ndarray
    valid: np.ndarray
    record: ReplayRecord | None = None


def group_filter(rewards: np.ndarray, in_loss: np.ndarray, group_size: int) -> np.ndarray:
    """Which groups carry a training signal: ``[N]`` rewards, ``[N]`` bool -> ``[N / G]`` bool.

    A group is dropped when all its rewards are equal (every group-baselined advantage is 0)
    or fewer than 2 of its sequences have a token left in the loss.
    """
    groups = np.asarray(rewards).reshape(-1, group_size)
    informative = np.any(groups != groups[:, :1], axis=1)
    return informative & (np.asarray(in_loss).reshape(-1, group_size).sum(axis=1) >= 2)


def _control_edit(ctx, position: int, prompts: list[str]) -> Callable[[Rollout], Rollout] | None:
    """The positive control's rewrite of prompt batch ``position``'s rollout
    (``data.control_missed_increment``, see ``anomaly_control``), or None when it is off."""
    cfg, sampling = ctx.cfg, ctx.sampling
    if not cfg.data.control_missed_increment:
        return None

    def edit(rollout: Rollout) -> Rollout:
        rows = control_rows(cfg.trainer.seed, position, len(rollout.response),
                            cfg.data.control_missed_increment)
        return inject_missed_increment(
            rollout, rows, repeat_answers(prompts, sampling.num_samples),
            ctx.tokenizer, sampling.eos_ids[0], sampling.pad_id, cfg.data.synthetic.echo_every)
    return edit


def _round(ctx, params, position: int, score: bool) -> tuple[Collected, np.ndarray]:
    """Collects prompt batch ``position`` with key ``fold_in(key(seed), position)``; returns
    it and which of its groups carry a training signal (``[B]`` bool, :func:`group_filter`;
    unscored, a row is in the loss when any of its tokens is)."""
    batch = ctx.source.batch(position)
    key = jax.random.fold_in(jax.random.key(ctx.cfg.trainer.seed), position)
    out = collect_prompts(ctx.policy, params, batch.prompts, batch.answers, key, score=score,
                          edit=_control_edit(ctx, position, batch.prompts))
    corr = out.corrections
    in_loss = np.asarray(jnp.any(out.loss_mask, axis=1) if corr is None else
                         corr.seq_mask & jnp.any(corr.token_mask, axis=1))
    return out, group_filter(out.rewards, in_loss, ctx.sampling.num_samples)


def _left_pad(x: jax.Array, width: int, value: int) -> jax.Array:
    return jnp.pad(x, ((0, 0), (width - x.shape[1], 0)), constant_values=value)


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
    if ctx.cfg.correction.replay and rounds[0].rollout.record is not None:
        record = jax.tree.map(lambda x: x[rows],
                              concatenate_records([out.rollout.record for out in rounds]))
    return UpdateBatch(
        prompt=cat(lambda o: o.rollout.prompt, ctx.sampling.pad_id),
        prompt_mask=cat(lambda o: o.rollout.prompt_mask, 0),
        response=cat(lambda o: o.rollout.response),
        loss_mask=loss_mask * jnp.asarray(valid_rows, loss_mask.dtype)[:, None],
        logp_sparse=cat(lambda o: o.rollout.logp),
        logp_old=None if rounds[0].logp_old is None else cat(lambda o: o.logp_old),
        rewards=rewards[rows].astype(np.float32),
        valid=valid_rows,
        record=record,
    )


QUANT_PROBE_ROWS = 4
"""Rows of each step's first round whose keys the quantization guardrail measures."""


def _metrics(rounds: list[Collected], ctx) -> dict[str, jax.Array]:
    """Rollout statistics over every sequence rolled out this step (all rounds)."""
    def cat(get):
        return jnp.concatenate([get(out.rollout) for out in rounds], axis=0)

    rewards = np.concatenate([out.rewards for out in rounds])
    mask = cat(lambda r: r.response_mask)
    metrics = _rollout_metrics(jnp.asarray(rewards), cat(lambda r: r.response), mask,
                               ~cat(lambda r: r.finished), cat(lambda r: r.kv_mean),
                               cat(lambda r: r.dense_kv_mean), logp=cat(lambda r: r.logp))
    kv_peak, dense_peak = cat(lambda r: r.kv_peak), cat(lambda r: r.dense_kv_peak)
    metrics["kv_peak_tokens"] = jnp.max(kv_peak)
    metrics["dense_kv_peak_tokens"] = jnp.max(dense_peak)
    metrics["kv_peak_savings"] = kv_token_savings(kv_peak, dense_peak)
    metrics["compressions"] = sum(out.rollout.num_compressions for out in rounds)
    if ctx.cfg.overlong.buffer_len:
        metrics["overlong_penalty_mean"] = jnp.mean(overlong_penalty(
            np.asarray(mask).sum(1), ctx.sampling.max_new_tokens, ctx.cfg.overlong))
    if all(out.alpha is not None for out in rounds):
        alpha = jnp.concatenate([out.alpha for out in rounds])
        metrics.update(acceptance_metrics(alpha, mask, ctx.cfg.compression.alpha.threshold))
        if ctx.cfg.compression.adapt.enabled:  # the closed loop's input: p5 per schedule bin
            plen = np.concatenate([np.asarray(out.rollout.prompt_mask).sum(1) for out in rounds])
            metrics.update(p5_metrics(bin_p5(ctx.cfg.compression, alpha, mask, plen)))
    return metrics


def collect_rollouts(ctx, params, position: int, score: bool = True
                     ) -> tuple[UpdateBatch, dict[str, Any], dict[str, float]]:
    """Rollouts, rewards and dense old-policy scores of one RL step, starting at prompt batch
    ``position``: rounds of :func:`collect_prompts` (``rl_step.collect`` adds the reference
    scores, the corrections of the assembled batch and the advantages).

    Args:
      ctx: the ``rl_step.StepContext``.
      params: the policy (sampling and old-policy scoring).
      position: the data cursor, in prompt batches.
      score: False leaves the dense scores out (``logp_old`` None; async mode's lagged rows,
        which the learner scores under its own params).

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
        out, keep = _round(ctx, params, position + len(rounds), score)
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
    quant = ctx.cfg.compression.quant
    metrics["kv_bytes_per_token"] = float(kv_bytes_per_token(
        nnx.merge(ctx.graphdef, params).config, quant, ctx.cfg.model.dtype))
    if quant != "none":  # the guardrail (kv.quant_check), on the first round's first rows
        first = rounds[0].rollout
        rows = slice(0, QUANT_PROBE_ROWS)
        error = key_quant_error(
            ctx.graphdef, params, jnp.concatenate([first.prompt[rows], first.response[rows]], 1),
            jnp.concatenate([first.prompt_mask[rows], first.response_mask[rows]], 1), quant)
        metrics["kv_quant_key_error"] = jnp.max(error)
        metrics["kv_quant_key_error_layer"] = jnp.argmax(error).astype(jnp.float32)
        # the mismatch by source, where a record was kept
        metrics.update(mismatch_by_source(ctx.policy, params, first, rounds[0].loss_mask))
    passes = np.concatenate(keeps)
    per_round = len(keeps[0])
    metrics["groups_kept"] = float(sum(passes[r * per_round + k] for r, k in kept))
    metrics["collect_rounds"] = float(len(rounds))
    metrics["prompts_consumed"] = float(len(rounds) * target)
    clock = {phase: sum(out.seconds[phase] for out in rounds)
             for phase in ("rollout", "reward", "score")}
    return batch, metrics, clock
