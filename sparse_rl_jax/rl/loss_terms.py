"""The per-token terms of the GRPO objective that a config picks by name: the policy losses
(``loss.policy_loss``) and the KL estimators (``loss.kl_kind``).

Each is registered where it is defined; ``GRPOLossConfig`` takes its allowed values from
:data:`POLICY_LOSSES` and :data:`KL_ESTIMATORS`, and ``grpo_loss`` calls the registered entry.
A new policy loss is one function plus ``POLICY_LOSSES.register(name, PolicyLoss(fn, ...))``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from models.registry import Registry


@dataclasses.dataclass(frozen=True)
class PolicyLoss:
    """A policy loss and the config rules it implies.

    Attributes:
      term: ``term(rho, clipped_rho, adv, log_pi_ratio, cfg) -> (loss, clipped)``, all
        ``[B, T]`` float32 (0 off the mask): the ratio ``rho``, it clipped to ``[1 - eps_low,
        1 + eps_high]``, the advantages, the log ratio whose gradient is ``grad log pi``
        (``grpo_loss``'s module docstring), and the ``GRPOLossConfig``; returns the
        per-token loss ``L_t`` (before the correction weight) and the bool ``[B, T]`` tokens
        counted by the ``clip_fraction`` metric.
      eps_low_max: ``eps_low`` must be below it (ppo_clip: 1, a ratio floor above 0); None:
        any ``eps_low > 0``.
      dual_clip: the loss reads ``clip_c`` (others refuse it).
    """

    term: Callable[..., tuple[jax.Array, jax.Array]]
    eps_low_max: float | None = None
    dual_clip: bool = False


POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")
KL_ESTIMATORS: Registry[Callable[[jax.Array], jax.Array]] = Registry("KL estimator")


def ppo_clip(rho, clipped_rho, adv, log_pi_ratio, cfg: Any) -> tuple[jax.Array, jax.Array]:
    """PPO's clipped surrogate ``max(-rho A, -clip(rho) A)``; with ``cfg.clip_c`` (dual-clip)
    at most ``-clip_c A`` where ``A < 0``. Counts tokens where the clipped branch is strictly
    larger."""
    del log_pi_ratio
    unclipped = -rho * adv
    clipped = -clipped_rho * adv
    policy = jnp.maximum(unclipped, clipped)
    if cfg.clip_c is not None:  # dual-clip: bound the loss of negative advantages
        policy = jnp.where(adv < 0, jnp.minimum(policy, -cfg.clip_c * adv), policy)
    return policy, clipped > unclipped


def cispo(rho, clipped_rho, adv, log_pi_ratio, cfg: Any) -> tuple[jax.Array, jax.Array]:
    """CISPO (MiniMax-M1): ``-sg(clip(rho)) A log rho``, every token keeps the gradient
    ``-w A`` on its log-prob. Counts tokens whose weight is clipped."""
    del cfg
    return -jax.lax.stop_gradient(clipped_rho) * adv * log_pi_ratio, clipped_rho != rho


def pg(rho, clipped_rho, adv, log_pi_ratio, cfg: Any) -> tuple[jax.Array, jax.Array]:
    """Plain policy gradient (REINFORCE, verl's bypass ``reinforce``): ``-A log rho``, the
    gradient ``-A grad log pi`` on every token, no clipping (the correction's weight
    multiplies it). Its value is verl's ``-A log pi`` shifted by the constant ``A log pi_old``.
    Counts no token as clipped."""
    del rho, cfg
    return -adv * log_pi_ratio, jnp.zeros(clipped_rho.shape, jnp.bool_)


POLICY_LOSSES.register("ppo_clip", PolicyLoss(ppo_clip, eps_low_max=1, dual_clip=True))
POLICY_LOSSES.register("cispo", PolicyLoss(cispo))
POLICY_LOSSES.register("pg", PolicyLoss(pg))


@KL_ESTIMATORS.register("k1")
def k1(log_ratio: jax.Array) -> jax.Array:
    """``d`` for ``d = log pi_theta - log pi_ref`` (samples from pi_theta)."""
    return log_ratio


@KL_ESTIMATORS.register("k2")
def k2(log_ratio: jax.Array) -> jax.Array:
    """``d^2 / 2``."""
    return 0.5 * log_ratio * log_ratio


@KL_ESTIMATORS.register("k3")
def k3(log_ratio: jax.Array) -> jax.Array:
    """``exp(-d) - 1 + d`` (non-negative, low variance)."""
    return jnp.exp(-log_ratio) - 1.0 + log_ratio
