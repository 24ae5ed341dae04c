#!/usr/bin/env python
"""Teaches a walk policy local attention: supervised training with stale-key dropout.

The tiny model trained on full contexts spreads its attention over the whole stale walk
trace, so score-based eviction ruins it (docs/tasks.md, "The walk task"). This script trains (or
fine-tunes) a walk policy on the same teacher-forced solutions, but every row of every batch
sees a random subset of its past (``models.ExpiryRecord``, the same key-expiry view that
replays an eviction record): per layer, KV head and key,

- the newest ``--window`` (drawn per row from [min, max)) response tokens are always visible;
  an older response token stays visible with probability ``--keep-old``, else it expires
  ``U[0, --extra)`` tokens after leaving the window;
- the first ``--protect`` prompt tokens (``k=9 `` in the fixed fact order) are always
  visible; every later prompt token (the other facts, the distractors, ``?``) expires with
  probability ``1 - --keep-prompt`` at ``P + --hide-after + U[0, 20)`` (``P`` the prompt
  length; default ``--hide-after``: just after the first echo of ``h, c``, or after the first
  step without echoes);
- a ``--full-rows`` share of the rows sees everything (the dense policy stays intact).

``--plain`` trains without dropout (phase 1 of a policy from scratch). The result is an HF
directory (weights + tokenizer) to pass as ``model.path`` to ``walk_calibration.py``.

  python experiments/walk_local_attention.py --out runs/local/p1 --plain --steps 2500 \\
      --lr 3e-3 data.walk.echo_every=2
  python experiments/walk_local_attention.py --out runs/local/p2 --init runs/local/p1 \\
      --steps 1200 data.walk.echo_every=2
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import models  # noqa: E402
from experiments.kit.overrides_cli import parse_with_overrides  # noqa: E402
from sparse_rl_jax.core.config_io import load_config  # noqa: E402
from sparse_rl_jax.records.step_rate import LoopClock  # noqa: E402
from sparse_rl_jax.tasks.task_tokenizer import build_task_tokenizer  # noqa: E402
from sparse_rl_jax.tasks.walk_task import synthetic_dataset  # noqa: E402
from sparse_rl_jax.training.run_config import RunConfig  # noqa: E402
from sparse_rl_jax.training.supervised import (sft_loss, sft_optimizer, supervised_batch)  # noqa: E402
from sparse_rl_jax.training.warm_start import tiny_model_config  # noqa: E402

NEVER = 2**30
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclasses.dataclass(frozen=True)
class Dropout:
    """The stale-key dropout of the module docstring (``window`` is ``[min, max)``)."""

    window: tuple[int, int] = (11, 16)
    keep_old: float = 0.1
    extra: int = 20
    protect: int = 4
    keep_prompt: float = 0.2
    hide_after: int = 5
    full_rows: float = 0.1


def stale_key_expiry(prompt_lengths: np.ndarray, width: int, layers: int, kv_heads: int,
                     drop: Dropout, rng: np.random.Generator) -> np.ndarray:
    """Expiry positions ``[L, B, Hkv, width]`` int32 of right-padded rows whose prompts hold
    ``prompt_lengths [B]`` tokens: key ``s`` is hidden from queries at positions
    ``>= expiry[..., s]`` (``NEVER`` = always visible)."""
    b = len(prompt_lengths)
    shape = (layers, b, kv_heads, width)
    pos = np.arange(width)[None, None, None, :]
    prompt = np.asarray(prompt_lengths)[None, :, None, None]
    window = rng.integers(*drop.window, size=(1, b, 1, 1))
    old = pos + window + rng.integers(0, drop.extra, size=shape)
    response = np.where(rng.random(shape) < drop.keep_old, NEVER, old)
    hidden_from = prompt + drop.hide_after + rng.integers(0, 20, size=shape)
    facts = np.where(rng.random(shape) < drop.keep_prompt, NEVER, hidden_from)
    expiry = np.where(pos >= prompt, response, np.where(pos >= drop.protect, facts, NEVER))
    full = rng.random((1, b, 1, 1)) < drop.full_rows
    return np.where(full, NEVER, expiry).astype(np.int32)


def _loss(model, tokens, attention, loss_mask, expiry):
    return sft_loss(model, tokens, attention, loss_mask, models.ExpiryRecord(expiry))


def main(argv=None) -> int:
    """Trains and writes the policy (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--config", default=str(ROOT / "configs/walk/common.yaml"))
    parser.add_argument("--init", default=None, help="a walk policy dir (default: fresh)")
    parser.add_argument("--plain", action="store_true", help="no dropout")
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seed", type=int, default=4242, help="task data and dropout seed")
    parser.add_argument("--window", type=int, nargs=2, default=list(Dropout.window))
    parser.add_argument("--keep-old", type=float, default=Dropout.keep_old)
    parser.add_argument("--extra", type=int, default=Dropout.extra)
    parser.add_argument("--protect", type=int, default=Dropout.protect)
    parser.add_argument("--keep-prompt", type=float, default=Dropout.keep_prompt)
    parser.add_argument("--hide-after", type=int, default=None)
    parser.add_argument("--full-rows", type=float, default=Dropout.full_rows)
    args = parse_with_overrides(parser, argv)
    cfg = load_config(RunConfig, args.config, args.overrides)
    task = dataclasses.replace(cfg.data.walk, seed=args.seed)
    echo = task.echo_every
    drop = Dropout(tuple(args.window), args.keep_old, args.extra, args.protect,
                   args.keep_prompt, args.hide_after if args.hide_after is not None
                   else (5 * echo + 4 if echo else 5), args.full_rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.init:
        for name in TOKENIZER_FILES:
            shutil.copy(Path(args.init) / name, out / name)
    else:
        build_task_tokenizer(out)
    tokenizer = models.Tokenizer(out)
    eos = tokenizer.eos_ids[0]
    model = (models.load_pretrained(args.init, dtype=jnp.float32) if args.init else
             models.Decoder(tiny_model_config(cfg.warm_start, tokenizer.vocab_size, eos,
                                              tokenizer.pad_id),
                            dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0)))
    layers, kv_heads = model.config.num_layers, model.config.num_kv_heads
    optimizer = sft_optimizer(model, args.lr, args.steps)

    @nnx.jit
    def train_step(model, optimizer, tokens, attention, loss_mask, expiry):
        loss, grads = nnx.value_and_grad(_loss)(model, tokens, attention, loss_mask, expiry)
        optimizer.update(model, grads)
        return loss

    width = task.max_prompt_tokens + task.max_response_tokens
    rng = np.random.default_rng(args.seed)

    def batch(problems, dropout: bool):
        tokens, attention, loss_mask = supervised_batch(tokenizer, problems, eos)
        pad = ((0, 0), (0, width - tokens.shape[1]))
        lengths = [len(tokenizer.hf(p.prompt, add_special_tokens=False)["input_ids"])
                   for p in problems]
        expiry = (stale_key_expiry(np.array(lengths), width, layers, kv_heads, drop, rng)
                  if dropout else np.full((layers, len(problems), kv_heads, width), NEVER,
                                          np.int32))
        return np.pad(tokens, pad), np.pad(attention, pad), np.pad(loss_mask, pad), expiry

    data = synthetic_dataset(task, (args.steps + 4) * args.batch)
    held = data[args.steps * args.batch:]
    clock = LoopClock(args.steps)
    for step in range(args.steps):
        rows = data[step * args.batch:(step + 1) * args.batch]
        with clock.compiles:
            loss = train_step(model, optimizer, *batch(rows, not args.plain))
        if step % max(1, args.steps // 10) == 0 or step == args.steps - 1:
            print(f"step {step + 1}/{args.steps} loss {float(loss):.4f} {clock.lap(step + 1)}",
                  flush=True)
    dense, dropped = (float(nnx.jit(_loss)(model, *batch(held, d))) for d in (False, True))
    print(f"held-out loss: full context {dense:.4f}, with stale-key dropout {dropped:.4f}")
    models.save_pretrained(model, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
