"""The embedded default policy: a tiny Qwen2-shaped model taught the shipped task by a short
supervised stage, saved as an HF checkpoint directory (weights + tokenizer).

No pretrained weights can be downloaded, so the default run makes its own and then loads the
result through ``models.load_pretrained`` exactly like a real Qwen2.5 checkpoint. The result
is cached: a directory whose ``warm_start.json`` matches the config is reused as is.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import models
from sparse_rl_jax.task import TaskConfig
from sparse_rl_jax.task_tokenizer import build_task_tokenizer
from sparse_rl_jax.walk_task import WalkTaskConfig, synthetic_dataset
from sparse_rl_jax.warm_start_config import WarmStartConfig

MARKER = "warm_start.json"


def tiny_model_config(cfg, vocab_size: int, eos_id: int, pad_id: int) -> models.ModelConfig:
    """The default's Qwen2-shaped architecture (q/k/v bias, tied embeddings)."""
    return models.ModelConfig(
        model_type="qwen2",
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.hidden_size // cfg.num_heads,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        attention_bias=True,
        eos_token_ids=(eos_id,),
        pad_token_id=pad_id,
    )


def supervised_batch(
    tokenizer: models.Tokenizer, problems, eos_id: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Right-padded ``prompt + solution + EOS`` rows for next-token training.

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
    return tokens, attention, loss_mask


def sft_loss(model, tokens, attention, loss_mask, kv=None):
    """Mean next-token cross-entropy on ``loss_mask`` (``supervised_batch``'s arrays); ``kv``
    an optional full-forward ``models.KVView`` (e.g. an ``ExpiryRecord`` hiding keys)."""
    logits = model(tokens, attention_mask=attention, kv=kv).logits[:, :-1]
    targets = tokens[:, 1:]
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]
    mask = loss_mask[:, :-1]
    return -(logp * mask).sum() / jnp.maximum(mask.sum(), 1.0)


def sft_optimizer(model, lr: float, steps: int) -> nnx.Optimizer:
    """The supervised stage's optimizer: AdamW (weight decay 0.01, global-norm clip 1.0) at
    ``lr`` after a linear warmup of ``min(50, steps // 10 + 1)`` steps, cosine-decayed to 5%
    at ``steps``."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, min(50, steps // 10 + 1), steps,
                                                  lr * 0.05)
    return nnx.Optimizer(model, optax.chain(optax.clip_by_global_norm(1.0),
                                            optax.adamw(schedule, weight_decay=0.01)),
                         wrt=nnx.Param)


def build_default_model(
    out_dir: str | Path,
    warm: WarmStartConfig,
    task: TaskConfig | WalkTaskConfig,
    *,
    log: Callable[[str], None] = print,
) -> str:
    """Creates (or reuses) the warm-started default checkpoint in ``out_dir``; returns it.

    Trains on problems drawn with a seed distinct from RL's (``warm.seed`` offsets the task
    seed) so the warm start never sees RL's exact prompts. ``task`` is either shipped task
    (``data.synthetic``).
    """
    out = Path(out_dir)
    signature = {"warm_start": dataclasses.asdict(warm), "task": dataclasses.asdict(task)}
    marker = out / MARKER
    if marker.is_file() and json.loads(marker.read_text()) == signature:
        log(f"warm start: reusing {out}")
        return str(out)
    out.mkdir(parents=True, exist_ok=True)
    build_task_tokenizer(out)
    tokenizer = models.Tokenizer(out)
    eos_id = tokenizer.eos_ids[0]
    config = tiny_model_config(warm, tokenizer.vocab_size, eos_id, tokenizer.pad_id)
    model = models.Decoder(config, dtype=jnp.float32, param_dtype=jnp.float32,
                           rngs=nnx.Rngs(warm.seed))
    optimizer = sft_optimizer(model, warm.lr, warm.steps)

    @nnx.jit
    def train_step(model, optimizer, tokens, attention, loss_mask):
        loss, grads = nnx.value_and_grad(sft_loss)(model, tokens, attention, loss_mask)
        optimizer.update(model, grads)
        return loss

    data = synthetic_dataset(dataclasses.replace(task, seed=task.seed + 1_000_003 + warm.seed),
                             warm.steps * warm.batch_size)
    # Pad to the task's longest problem so every step reuses one compiled program.
    full = task.max_prompt_tokens + task.max_response_tokens
    start = time.monotonic()
    for step in range(warm.steps):
        batch = data[step * warm.batch_size : (step + 1) * warm.batch_size]
        tokens, attention, loss_mask = supervised_batch(tokenizer, batch, eos_id)
        pad = ((0, 0), (0, max(0, full - tokens.shape[1])))
        loss = train_step(model, optimizer, np.pad(tokens, pad), np.pad(attention, pad),
                          np.pad(loss_mask, pad))
        if step % max(1, warm.steps // 10) == 0 or step == warm.steps - 1:
            log(f"warm start: step {step + 1}/{warm.steps} loss {float(loss):.4f} "
                f"({time.monotonic() - start:.0f}s)")
    models.save_pretrained(model, out)
    marker.write_text(json.dumps(signature, indent=1))
    return str(out)
