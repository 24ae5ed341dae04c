"""One batch of compressed rollouts and what each correction makes of it, without training
(``experiments/correction_stats.py``): the prompts that fit the cache, the batch rolled out,
rewarded and densely scored, the learner's batch under a correction exactly as the trainer
builds it with its statistics, and the share of the gradient its low-r sequences carry."""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.kit.correction_grads import loss_cotangent, low_r_grad_share
from sparse_rl_jax.rl.advantages import compute_advantages
from sparse_rl_jax.rl.overlong import overlong_penalty
from sparse_rl_jax.rl.rollout_metrics import kv_token_savings
from sparse_rl_jax.rl.update_step import Minibatch
from sparse_rl_jax.training.collect import RolloutPolicy, collect_prompts
from sparse_rl_jax.training.collect_rounds import UpdateBatch
from sparse_rl_jax.training.evaluation import eval_set
from sparse_rl_jax.training.policy import resolve_sampling
from sparse_rl_jax.training.rl_step import StepContext, learner_batch
from sparse_rl_jax.training.run_config import RunConfig

STATS = ("rejection_rate", "kept_token_fraction", "is_ess", "low_r_sequence_fraction",
         "opsm_fraction", "veto_fraction", "token_mask_fraction", "mismatch_k3")
"""The correction metrics (``corrections.compute_corrections``) each correction reports."""
ALL_PROMPTS = 2 ** 31 - 1
"""``eval.num_prompts`` that reads a whole eval set."""


def budget_overrides(budget: int) -> list[str]:
    """The overrides of one budget: its eviction budget, the record kept (shadow-mask replays
    it; keeping it changes no sample), no acceptance metric (two more forwards a row)."""
    return [f"compression.eviction.budget={budget}", "sampling.record_evictions=true",
            "compression.alpha.metric='off'"]


def fitting_prompts(cfg: RunConfig, tokenizer, count: int, capacity: int
                    ) -> tuple[list[str], list[str], list[int]]:
    """``(prompts, answers, skipped)``: the first ``count`` problems of ``cfg``'s eval set (all
    of a file's, whatever ``eval.num_prompts`` says; a generated one's ``eval.num_prompts``
    held-out problems) whose prompt holds at most ``capacity`` tokens, and the eval-set
    indices of those passed over; ValueError when fewer fit."""
    generated = cfg.eval.tfds is None and cfg.eval.jsonl is None  # an endless synthetic task
    whole = cfg.eval if generated else dataclasses.replace(cfg.eval, num_prompts=ALL_PROMPTS)
    texts, answers = eval_set(dataclasses.replace(cfg, eval=whole), tokenizer.hf)
    ids = tokenizer.hf(texts, add_special_tokens=cfg.data.add_special_tokens)["input_ids"]
    fits = [i for i, row in enumerate(ids) if len(row) <= capacity]
    if len(fits) < count:
        raise ValueError(f"--prompts {count}: only {len(fits)} of the eval set's {len(texts)} "
                         f"prompts fit the {capacity}-slot cache")
    chosen = fits[:count]
    skipped = [i for i in range(chosen[-1] + 1) if i not in chosen]
    return [texts[i] for i in chosen], [answers[i] for i in chosen], skipped


def roll_out(cfg: RunConfig, graphdef, params, tokenizer, reward_fn, prompts, answers,
             seed: int) -> tuple[UpdateBatch, dict]:
    """One batch under ``cfg``'s compression and sampling, rewarded (plus the overlong
    penalty) and densely scored: ``(batch with its record, batch statistics and seconds)``."""
    sampling = resolve_sampling(cfg, tokenizer)
    policy = RolloutPolicy.from_run(cfg, graphdef, tokenizer, reward_fn, sampling)
    out = collect_prompts(policy, params, prompts, answers, jax.random.key(seed))
    rollout = out.rollout
    lengths = np.asarray(rollout.response_mask).sum(axis=1)
    rewards = out.rewards + overlong_penalty(lengths, sampling.max_new_tokens, cfg.overlong)
    batch = UpdateBatch(rollout.prompt, rollout.prompt_mask, rollout.response, out.loss_mask,
                        rollout.logp, out.logp_old, rewards.astype(np.float32),
                        np.ones(len(rewards), bool), rollout.record)
    groups = out.rewards.reshape(-1, sampling.num_samples)
    advantages = compute_advantages(jnp.asarray(batch.rewards), sampling.num_samples,
                                    cfg.advantage, out.loss_mask, batch.valid)
    signal = np.asarray(out.corrections.low_r) & (np.asarray(advantages) != 0)
    stats = {k: float(v) for k, v in jax.device_get(out.corrections.metrics).items()
             if k in ("low_r_sequence_fraction", "low_r_token_fraction", "mismatch_k3")}
    stats.update(
        rows=int(len(rewards)), reward_mean=float(np.mean(out.rewards)),
        response_length_mean=float(lengths.mean()),
        truncated_fraction=float(1 - np.mean(np.asarray(rollout.finished))),
        kv_saved_mean=float(kv_token_savings(rollout.kv_mean, rollout.dense_kv_mean)),
        groups=int(len(groups)), groups_with_signal=int(np.sum(np.any(
            groups != groups[:, :1], axis=1))), low_r_rows_with_signal=int(signal.sum()),
        rollout_s=round(out.seconds["rollout"], 1), score_s=round(out.seconds["score"], 1))
    return jax.device_get(batch), stats


def correction_batch(cfg: RunConfig, batch: UpdateBatch, graphdef, params, tokenizer
                     ) -> tuple[Minibatch, dict[str, float]]:
    """The learner's batch of ``batch`` under ``cfg`` (its ``correction`` and ``loss``
    sections), exactly the trainer's (``rl_step.learner_batch``; the record only where the
    correction replays it), and its ``STATS``."""
    replay = cfg.correction.replay
    ctx = StepContext(cfg=cfg, sampling=resolve_sampling(cfg, tokenizer), graphdef=graphdef,
                      tokenizer=tokenizer, source=None, reward_fn=None, update=None, mesh=None)
    full, metrics, _ = learner_batch(ctx, params, batch._replace(
        record=batch.record if replay else None), jnp.asarray(batch.logp_old))
    return full, {k: float(metrics[k]) for k in STATS}


def grad_stats(cfg: RunConfig, full: Minibatch, logp_old, graphdef, params, *, micro: int,
               seen: list, bucket: int | None = 64) -> dict:
    """``correction_grads.low_r_grad_share`` of ``full`` under ``cfg.loss``, with the seconds
    it took and ``same_as`` (a correction ``seen`` earlier whose loss cotangent at the dense
    scores is equal, whose numbers it reuses; not for a replaying correction). ``seen``:
    ``(name, cotangent, stats)`` of the corrections computed so far; this one is added."""
    name = cfg.correction.kind
    cotangent = None if cfg.correction.replay else loss_cotangent(full, cfg.loss, logp_old)
    for other, earlier, stats in seen:
        if cotangent is not None and np.allclose(cotangent, earlier, rtol=1e-6, atol=1e-12):
            return {**stats, "same_as": other, "grad_seconds": 0.0}
    start = time.perf_counter()
    stats = low_r_grad_share(graphdef, params, full, loss_cfg=cfg.loss, micro=micro,
                             chunk_size=cfg.trainer.logp_chunk,
                             temperature=cfg.sampling.temperature, bucket=bucket)
    if cotangent is not None:
        seen.append((name, cotangent, stats))
    return {**stats, "grad_seconds": round(time.perf_counter() - start, 1)}
