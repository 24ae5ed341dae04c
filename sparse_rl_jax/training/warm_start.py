"""The embedded default policy: a tiny Qwen2-shaped model taught the shipped task by a short
supervised stage, saved as an HF checkpoint directory (weights + tokenizer).

No pretrained weights can be downloaded, so the default run makes its own and then loads the
result through ``models.load_pretrained`` exactly like a real Qwen2.5 checkpoint. The result
is cached: a directory whose ``warm_start.json`` matches the config is reused as is.

The recipe (``WarmStartConfig``): a curriculum over the task's size, a share of rows whose
labels are shuffled, a constant learning rate, and a held-out check
(``warm_start_check.HeldOutCheck``) that stops once the task is solved and says so in one
warning line when it never is.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable

import jax.numpy as jnp
import numpy as np
from flax import nnx

import models
from sparse_rl_jax.records.step_rate import LoopClock
from sparse_rl_jax.tasks.task import Problem, TaskConfig
from sparse_rl_jax.tasks.task_tokenizer import build_task_tokenizer
from sparse_rl_jax.tasks.walk_task import WalkTaskConfig, synthetic_dataset
from sparse_rl_jax.training.supervised import sft_loss, sft_optimizer, supervised_batch
from sparse_rl_jax.training.warm_start_check import HeldOutCheck, HeldOutScore
from sparse_rl_jax.training.warm_start_config import WarmStartConfig

MARKER = "warm_start.json"
DATA_SEED_OFFSET = 1_000_003
"""The warm start's problems use ``task.seed + DATA_SEED_OFFSET + warm.seed`` (not RL's)."""
CHECK_SEED_OFFSET = 2_000_003
"""Its held-out check uses ``task.seed + CHECK_SEED_OFFSET`` (neither training nor eval)."""


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


def warm_start_problems(warm: WarmStartConfig, task: TaskConfig | WalkTaskConfig,
                        step: int) -> tuple[list[Problem], list[list[int]]]:
    """Step ``step``'s batch of the recipe and each row's masked solution columns.

    Row ``j`` is problem ``step * batch_size + j`` of the task's curriculum distribution at
    ``step / curriculum_steps``; the first ``round(shuffled_fraction * batch_size)`` rows come
    from its shuffled-label twin, with their next-label targets masked (but the first: the
    first label is the prompt's first token). Pure in ``(warm, task, step)``.
    """
    progress = step / warm.curriculum_steps if warm.curriculum_steps else 1.0
    base = dataclasses.replace(task.curriculum(progress),
                               seed=task.seed + DATA_SEED_OFFSET + warm.seed)
    shuffled = base.shuffled()
    n_shuffled = round(warm.shuffled_fraction * warm.batch_size) if shuffled else 0
    first = step * warm.batch_size
    problems = synthetic_dataset(base, first + warm.batch_size)[first + n_shuffled:]
    if n_shuffled:
        problems = synthetic_dataset(shuffled, first + n_shuffled)[first:] + problems
    masked = [task.label_columns(p)[1:] if j < n_shuffled else []
              for j, p in enumerate(problems)]
    return problems, masked


def build_default_model(
    out_dir: str | Path,
    warm: WarmStartConfig,
    task: TaskConfig | WalkTaskConfig,
    *,
    log: Callable[[str], None] = print,
) -> str:
    """Creates (or reuses) the warm-started default checkpoint in ``out_dir``; returns it.

    Trains on problems drawn with a seed distinct from RL's (``warm.seed`` offsets the task
    seed) so the warm start never sees RL's exact prompts, and checks it on another draw.
    ``task`` is either shipped task (``data.synthetic``). Ends with a ``warning:`` line when
    the held-out check never reached ``warm.target_accuracy``.
    """
    out = Path(out_dir)
    signature = {"warm_start": dataclasses.asdict(warm), "task": dataclasses.asdict(task)}
    marker = out / MARKER
    if marker.is_file():
        found = json.loads(marker.read_text())
        if {k: found.get(k) for k in signature} == signature:
            log(f"warm start: reusing {out} ({found.get('result', {}).get('summary', '')})")
            return str(out)
    out.mkdir(parents=True, exist_ok=True)
    build_task_tokenizer(out)
    tokenizer = models.Tokenizer(out)
    eos_id = tokenizer.eos_ids[0]
    config = tiny_model_config(warm, tokenizer.vocab_size, eos_id, tokenizer.pad_id)
    model = models.Decoder(config, dtype=jnp.float32, param_dtype=jnp.float32,
                           rngs=nnx.Rngs(warm.seed))
    optimizer = sft_optimizer(model, warm.lr, warm.steps, warmup=warm.warmup_steps,
                              schedule=warm.lr_schedule)

    @nnx.jit
    def train_step(model, optimizer, tokens, attention, loss_mask):
        loss, grads = nnx.value_and_grad(sft_loss)(model, tokens, attention, loss_mask)
        optimizer.update(model, grads)
        return loss

    # Pad to the task's longest problem so every step reuses one compiled program.
    full = task.max_prompt_tokens + task.max_response_tokens
    check = HeldOutCheck(tokenizer, dataclasses.replace(task, seed=task.seed + CHECK_SEED_OFFSET),
                         warm.check_problems, width=full)
    score: HeldOutScore | None = None
    clock = LoopClock(warm.steps, stops_early=warm.target_accuracy is not None)
    with clock.compiles:
        for step in range(1, warm.steps + 1):
            problems, masked = warm_start_problems(warm, task, step - 1)
            arrays = supervised_batch(tokenizer, problems, eos_id, masked)
            loss = train_step(model, optimizer, *(np.pad(a, ((0, 0), (0, max(0, full - a.shape[1]))))
                                                  for a in arrays))
            if step % warm.check_every and step != warm.steps:
                continue
            score = check(model)
            log(f"warm start: step {step}/{warm.steps} loss {float(loss):.4f} held-out "
                f"{score.summary()} {clock.lap(step)}")
            if warm.target_accuracy is not None and score.solutions >= warm.target_accuracy:
                log(f"warm start: held-out solutions {score.solutions:.3f} >= target "
                    f"{warm.target_accuracy} at step {step}: done")
                break
    assert score is not None
    if warm.target_accuracy is not None and score.solutions < warm.target_accuracy:
        log(f"warning: the warm start did not learn the task in {warm.steps} steps: held-out "
            f"{score.summary()} (target: solutions {warm.target_accuracy}); its policy may "
            f"ignore the prompt. Try warm_start.steps={2 * warm.steps}, another "
            f"warm_start.seed, or warm_start.hidden_size={2 * warm.hidden_size}")
    models.save_pretrained(model, out)
    result = {"steps": step, "loss": float(loss), "summary": score.summary(),
              **dataclasses.asdict(score)}
    marker.write_text(json.dumps({**signature, "result": result}, indent=1))
    return str(out)
