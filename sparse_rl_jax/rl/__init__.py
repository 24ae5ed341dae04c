"""Learning from rollouts: Sparse-RL's corrections, the GRPO-family losses and advantage
estimators, overlong shaping, the KL reference, the optimizer, LoRA and one update step.

Imports ``core``, ``kv`` and ``rollout``.
"""
