"""Supervised next-token training on task problems: the batch layout, the loss and the
optimizer that the warm start and the walk experiments share."""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import models
from sparse_rl_jax.tasks.task import Problem


def supervised_batch(
    tokenizer: models.Tokenizer, problems: Sequence[Problem], eos_id: int,
    masked_columns: Sequence[Sequence[int]] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Right-padded ``prompt + solution + EOS`` rows for next-token training.

    Args:
      masked_columns: per problem, solution characters whose target is left out of the loss
        (needs a tokenizer with one token per character, as the task's).

    Returns:
      ``(tokens [B, T], attention_mask [B, T], loss_mask [B, T])``; ``loss_mask`` marks the
      positions whose *next* token is part of the solution (or the EOS).
    """
    rows, starts = [], []
    for problem in problems:
        prompt = tokenizer.hf(problem.prompt, add_special_tokens=False)["input_ids"]
        solution = tokenizer.hf(problem.solution, add_special_tokens=False)["input_ids"]
        rows.append(prompt + solution + [eos_id])
        starts.append(len(prompt))
    width = max(len(r) for r in rows)
    tokens = np.zeros((len(rows), width), np.int32)
    attention = np.zeros((len(rows), width), np.int32)
    loss_mask = np.zeros((len(rows), width), np.float32)
    for i, (row, start) in enumerate(zip(rows, starts)):
        tokens[i, : len(row)] = row
        attention[i, : len(row)] = 1
        loss_mask[i, start - 1 : len(row) - 1] = 1.0
    for i, columns in enumerate(masked_columns or ()):
        if columns and len(rows[i]) - starts[i] - 1 != len(problems[i].solution):
            raise ValueError(f"masked_columns needs one token per solution character; "
                             f"{problems[i].solution!r} has {len(rows[i]) - starts[i] - 1}")
        loss_mask[i, [starts[i] - 1 + c for c in columns]] = 0.0
    return tokens, attention, loss_mask


def sft_loss(model, tokens, attention, loss_mask, kv=None):
    """Mean next-token cross-entropy on ``loss_mask`` (``supervised_batch``'s arrays); ``kv``
    an optional full-forward ``models.KVView`` (e.g. an ``ExpiryRecord`` hiding keys)."""
    logits = model(tokens, attention_mask=attention, kv=kv).logits[:, :-1]
    targets = tokens[:, 1:]
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]
    mask = loss_mask[:, :-1]
    return -(logp * mask).sum() / jnp.maximum(mask.sum(), 1.0)


def _cosine(lr: float, warmup: int, steps: int) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(0.0, lr, warmup, steps, lr * 0.05)


def _constant(lr: float, warmup: int, steps: int) -> optax.Schedule:
    return optax.join_schedules(
        [optax.linear_schedule(0.0, lr, warmup), optax.constant_schedule(lr)], [warmup])


SCHEDULES = {"cosine": _cosine, "constant": _constant}
"""Learning-rate schedules by name: ``(lr, warmup, steps) -> optax schedule``, both rising
linearly from 0 over ``warmup`` steps; ``cosine`` then decays to 5% at ``steps``."""


def sft_optimizer(model, lr: float, steps: int, *, warmup: int = 50,
                  schedule: str = "cosine") -> nnx.Optimizer:
    """A supervised stage's optimizer: AdamW (weight decay 0.01, global-norm clip 1.0) at
    ``lr`` under ``SCHEDULES[schedule]`` with a warmup of ``min(warmup, steps // 10 + 1)``
    steps."""
    schedule_fn = SCHEDULES[schedule](lr, min(warmup, steps // 10 + 1), steps)
    return nnx.Optimizer(model, optax.chain(optax.clip_by_global_norm(1.0),
                                            optax.adamw(schedule_fn, weight_decay=0.01)),
                         wrt=nnx.Param)
