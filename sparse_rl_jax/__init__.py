"""sparse_rl_jax: GRPO with KV-compressed rollouts and Sparse-RL corrections, in JAX.

The functional API in one namespace::

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

``sparse_rl_jax.trainer.train(cfg)`` runs the whole loop (``python run.py``).
"""

import models.versions  # noqa: F401  (first: importing models checks the jax/flax pair)
from sparse_rl_jax.advantages import AdvantageConfig, compute_advantages, group_advantages
from sparse_rl_jax.collect import Collected, RolloutPolicy, collect_prompts
from sparse_rl_jax.compression_config import CompressionConfig
from sparse_rl_jax.corrections import Corrections, compute_corrections
from sparse_rl_jax.grpo_loss import LossBatch, grpo_loss
from sparse_rl_jax.loss_config import CorrectionConfig, GRPOLossConfig
from sparse_rl_jax.sampler import Rollout, generate, replay_record
from sparse_rl_jax.sampling_config import SamplingConfig
from sparse_rl_jax.scoring import ScoreOutput, response_logprobs, score

__all__ = [
    "AdvantageConfig", "compute_advantages", "CompressionConfig", "CorrectionConfig",
    "Corrections", "GRPOLossConfig", "LossBatch",
    "Rollout", "SamplingConfig", "ScoreOutput", "compute_corrections", "generate",
    "grpo_loss", "group_advantages", "replay_record", "response_logprobs", "score",
    "Collected", "RolloutPolicy", "collect_prompts",
]
