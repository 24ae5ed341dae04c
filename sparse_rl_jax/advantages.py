"""Group-relative (GRPO) advantages."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def group_advantages(rewards: jax.Array, group_size: int, eps: float = 1e-6) -> jax.Array:
    """`A_i = (R_i - mean_G R) / (std_G R + eps)` for rewards `[N]` -> advantages `[N]` (float32).

    The rollout batch is laid out as `N / group_size` consecutive groups of `group_size` samples
    of the same prompt. `std_G` is the *unbiased* sample standard deviation (ddof=1), as
    `torch.Tensor.std` in the official slime / verl GRPO code. A group whose rewards are all
    equal gets advantage exactly 0 (numerator 0, denominator eps), never NaN.
    """
    rewards = jnp.asarray(rewards)
    if rewards.ndim != 1:
        raise ValueError(f"rewards must have shape [N], got {tuple(rewards.shape)}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2:
        raise ValueError(f"group_size must be an int >= 2, got {group_size!r}")
    n = rewards.shape[0]
    if n % group_size != 0:
        raise ValueError(
            f"rewards length {n} is not a multiple of group_size {group_size} "
            "(expected N/G consecutive groups of G samples)"
        )
    groups = rewards.astype(jnp.float32).reshape(n // group_size, group_size)
    # Shift by each group's first reward first: exact zeros for all-equal groups (a float mean
    # of equal values can be off by an ulp, which eps would then blow up to ~1e-3).
    groups = groups - groups[:, :1]
    centered = groups - jnp.mean(groups, axis=1, keepdims=True)
    std = jnp.sqrt(jnp.sum(centered * centered, axis=1, keepdims=True) / (group_size - 1))
    return (centered / (std + eps)).reshape(n)
