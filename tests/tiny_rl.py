"""A tiny RL setup for tests of the collect/update seam: a tiny random Qwen2 with a
character tokenizer (``tiny_hf``), a deterministic reward, a ``StepContext`` on the task."""

from __future__ import annotations

import zlib
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

import models
from sparse_rl_jax.core.config_io import load_config
from sparse_rl_jax.tasks.prompt_source import PromptSource
from sparse_rl_jax.training.policy import resolve_sampling
from sparse_rl_jax.training.rl_step import StepContext
from sparse_rl_jax.training.run_config import RunConfig
from tiny_hf import make_tiny_hf

PROMPTS, G, MAX_NEW = 4, 2, 12
TINY_WARM_START = ["warm_start.hidden_size=32", "warm_start.num_layers=1",
                   "warm_start.num_heads=2", "warm_start.num_kv_heads=1",
                   "warm_start.intermediate_size=64"]
"""Overrides that shrink the embedded default model (1 layer, 2 heads): the script tests."""


def hash_reward(completions, answers):
    """A deterministic reward that differs between samples: 1 for half the texts."""
    return np.array([float(zlib.crc32(c.encode()) % 2) for c in completions], np.float32)


def tiny_task_policy(out_dir: str | Path, dtype=jnp.bfloat16):
    """``(path, tokenizer, graphdef, params)`` of a random 1-layer, 2-head Qwen2 (hidden 32,
    one KV head) with a character tokenizer, written to ``out_dir``, params in ``dtype``."""
    path = make_tiny_hf(out_dir, "qwen2", hidden_size=32, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, intermediate_size=64)
    graphdef, params = nnx.split(models.load_pretrained(path, dtype=dtype))
    return path, models.Tokenizer(path), graphdef, params


def step_context(policy, *overrides: str, update=None, mesh=None) -> StepContext:
    """A ``StepContext`` for ``policy`` (:func:`tiny_task_policy`): ``PROMPTS`` task prompts of
    ``G`` samples, ``MAX_NEW`` new tokens, an rkv cache of 16 + 4 slots, ``hash_reward``; then
    the ``key=value`` ``overrides``."""
    path, tokenizer, graphdef, _ = policy
    cfg = load_config(RunConfig, None, [
        f"model.path={path}", "data.task.n_min=2", "data.task.n_max=4",
        f"sampling.max_new_tokens={MAX_NEW}", f"sampling.num_samples={G}",
        "sampling.prompt_bucket=8", "compression.method=rkv", "compression.eviction.budget=16",
        "compression.eviction.buffer=4", "compression.eviction.window=2",
        f"trainer.prompts_per_step={PROMPTS}",
        "trainer.minibatch_size=4", "trainer.logp_chunk=8", *overrides])
    return StepContext(cfg=cfg, sampling=resolve_sampling(cfg, tokenizer), graphdef=graphdef,
                       tokenizer=tokenizer, source=PromptSource(cfg.data, PROMPTS, tokenizer.hf),
                       reward_fn=hash_reward, update=update, mesh=mesh)
