"""sparse_rl_jax: GRPO with KV-compressed rollouts and Sparse-RL corrections, in JAX."""
