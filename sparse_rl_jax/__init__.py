"""sparse_rl_jax: GRPO with KV-compressed rollouts and Sparse-RL corrections, in JAX.

The functional API in one namespace (``docs/api.md`` lists it, from these docstrings)::

    rollout = sparse_rl_jax.generate(graphdef, params, ids, mask, key, sampling, compression)
    dense = sparse_rl_jax.score(graphdef, params, rollout.prompt, rollout.prompt_mask,
                                rollout.response).logp
    corr = sparse_rl_jax.compute_corrections(dense, rollout.logp, rollout.response_mask,
                                             sparse_rl_jax.CorrectionConfig())

or those steps and the reward in one call (what the trainer, evaluation and the experiments
use)::

    out = sparse_rl_jax.collect_prompts(sparse_rl_jax.RolloutPolicy(graphdef, tokenizer,
                                        sampling, reward_fn, compression), params, prompts,
                                        answers, key)   # out.rewards, out.logp_old, ...

``sparse_rl_jax.update_step`` is one optimizer update on a ``Minibatch``;
``sparse_rl_jax.train(cfg)`` runs the whole loop (``python run.py``, or the ``sparse-rl``
console script). ``train`` is imported on first use: the trainer's imports (orbax, the
plots, the metrics backends) take seconds that the rest of the package does not need.
"""

import models.versions  # noqa: F401  (first: importing models checks the jax/flax pair)
from sparse_rl_jax.kv.compression_config import CompressionConfig
from sparse_rl_jax.kv.compression_sections import (AdaptConfig, AlphaConfig, EvictionConfig,
                                                   SparrowConfig)
from sparse_rl_jax.rl.advantages import AdvantageConfig, compute_advantages, group_advantages
from sparse_rl_jax.rl.corrections import Corrections, compute_corrections
from sparse_rl_jax.rl.grpo_loss import LossBatch, grpo_loss
from sparse_rl_jax.rl.loss_config import CorrectionConfig, GRPOLossConfig
from sparse_rl_jax.rl.optim import OptimConfig, make_optimizer
from sparse_rl_jax.rl.update_step import Minibatch, update_step
from sparse_rl_jax.rollout.engine import generate_continuous, generate_rollout
from sparse_rl_jax.rollout.sampler import Prefilled, Rollout, decode, generate, prefill
from sparse_rl_jax.rollout.sampling_config import SamplingConfig
from sparse_rl_jax.rollout.scoring import ReplayRecord, ScoreOutput, response_logprobs, score
from sparse_rl_jax.tasks.rewards import get_reward_fn, repeat_answers
from sparse_rl_jax.training.collect import Collected, RolloutPolicy, collect_prompts
from sparse_rl_jax.training.run_config import RunConfig, TrainerConfig

__all__ = [
    # rollouts
    "generate", "prefill", "decode", "Prefilled", "Rollout", "ReplayRecord",
    "generate_continuous", "generate_rollout",
    # rewards
    "get_reward_fn", "repeat_answers",
    # scoring and corrections
    "score", "ScoreOutput", "response_logprobs", "compute_corrections", "Corrections",
    # advantages and the loss
    "group_advantages", "compute_advantages", "LossBatch", "grpo_loss",
    # rollout, reward, scores and corrections in one call
    "collect_prompts", "RolloutPolicy", "Collected",
    # the update and the loop
    "update_step", "Minibatch", "make_optimizer", "train",
    # configs
    "RunConfig", "SamplingConfig", "CompressionConfig", "EvictionConfig", "SparrowConfig",
    "AlphaConfig", "AdaptConfig", "CorrectionConfig", "GRPOLossConfig",
    "AdvantageConfig", "OptimConfig", "TrainerConfig",
]

_LAZY = {"train": "sparse_rl_jax.training.trainer"}


def __getattr__(name: str):
    """PEP 562: the names of :data:`_LAZY`, imported from their module on first use."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The module's names, the lazy ones included."""
    return sorted(set(globals()) | set(_LAZY))
