"""One optimizer update on a minibatch of scored rollouts: the GRPO loss through the policy.

A pure function of ``(params, opt_state, minibatch)``; the caller jits it with shardings (the
params' own, the batch split over the ``data``/``fsdp`` mesh axes). A minibatch in which every
token is rejected leaves params and optimizer state untouched (no Adam moment drift), and the
metrics say so (``all_rejected == 1``). Likewise an update whose loss or gradient is not
finite is skipped inside the jitted step (``nonfinite_update == 1``), so a NaN never reaches
the params, the optimizer state or a checkpoint.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from sparse_rl_jax.grpo_loss import LossBatch, grpo_loss
from sparse_rl_jax.loss_config import GRPOLossConfig
from sparse_rl_jax.scoring import response_logprobs, shadow_logprobs


class Minibatch(NamedTuple):
    """The arrays one update needs; ``N`` sequences, ``P`` prompt and ``M`` response columns.

    prompt, prompt_mask: ``[N, P]``; response: ``[N, M]`` int32; loss: the ``LossBatch``
    (``[N, M]`` / ``[N]`` arrays: old log-probs, advantages, masks, IS weights).
    eviction_record: None, or (shadow-mask training) the sampler's record moved to a leading
    sequence axis, ``[N, L, Hkv, P + M]`` int32, so that every leaf splits along axis 0. With
    it the update scores the response under the recorded sparse context (the learner's
    policy) and under the full context (the distillation teacher).
    """

    prompt: jax.Array
    prompt_mask: jax.Array
    response: jax.Array
    loss: LossBatch
    eviction_record: jax.Array | None = None


def update_step(
    graphdef: nnx.GraphDef,
    params,
    opt_state,
    batch: Minibatch,
    *,
    loss_cfg: GRPOLossConfig,
    optimizer: optax.GradientTransformation,
    chunk_size: int = 128,
):
    """Loss, gradients and one optimizer update.

    The loss is aggregated over this minibatch: its sequence and token denominators
    (``loss_cfg.seq_denominator``) count the minibatch's sequences, i.e. the official code's
    "global batch" is ``trainer.minibatch_size``, not the whole rollout.

    Returns:
      ``(params, opt_state, metrics)``; metrics are float32 scalars (``grad_norm`` and
      ``nonfinite_update``, 1.0 when the update was skipped for a non-finite loss/gradient).
    """

    with_entropy = loss_cfg.entropy_coef > 0

    def loss_fn(p):
        model = nnx.merge(graphdef, p)
        if batch.eviction_record is None:
            out = response_logprobs(
                model, batch.prompt, batch.prompt_mask, batch.response, chunk_size=chunk_size,
                with_entropy=with_entropy,
            )
            return grpo_loss(out.logp, batch.loss, loss_cfg, entropy=out.entropy)
        scores = shadow_logprobs(
            model, batch.prompt, batch.prompt_mask, batch.response,
            jnp.moveaxis(batch.eviction_record, 0, 1), chunk_size=chunk_size,
            with_kl=loss_cfg.distill_kind == "full", with_entropy=with_entropy,
        )
        return grpo_loss(scores.logp_sparse, batch.loss, loss_cfg, entropy=scores.entropy,
                         logp_dense=scores.logp_dense, kl_full=scores.kl_full)

    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    metrics["grad_norm"] = optax.global_norm(grads)
    nonfinite = ~(jnp.isfinite(loss) & jnp.isfinite(metrics["grad_norm"]))
    metrics["nonfinite_update"] = nonfinite.astype(jnp.float32)

    def apply(operand):
        p, s = operand
        updates, s = optimizer.update(grads, s, p)
        return optax.apply_updates(p, updates), s

    params, opt_state = jax.lax.cond(
        (metrics["all_rejected"] > 0) | nonfinite, lambda operand: operand, apply,
        (params, opt_state)
    )
    return params, opt_state, metrics


def init_optimizer(optimizer: optax.GradientTransformation, params, mesh):
    """Optimizer state laid out on ``mesh``, and its shardings.

    Moment buffers take the sharding of their parameter (jit propagates it); leaves jit
    leaves on one device (step counters) are replicated over the mesh.
    """
    opt_state = jax.jit(optimizer.init)(params)
    replicated = NamedSharding(mesh, PartitionSpec())
    shardings = jax.tree.map(
        lambda x: x.sharding if isinstance(x.sharding, NamedSharding) else replicated, opt_state)
    return jax.device_put(opt_state, shardings), shardings


def jit_update_step(
    graphdef: nnx.GraphDef,
    *,
    loss_cfg: GRPOLossConfig,
    optimizer: optax.GradientTransformation,
    param_shardings,
    opt_shardings,
    batch_sharding,
    chunk_size: int = 128,
):
    """``update_step`` jitted with explicit shardings; params and optimizer state are donated.

    Args:
      graphdef: the policy's ``nnx.GraphDef``.
      loss_cfg, optimizer, chunk_size: as in :func:`update_step`.
      param_shardings: pytree of ``NamedSharding`` like the params.
      opt_shardings: pytree of ``NamedSharding`` like the optimizer state.
      batch_sharding: one ``NamedSharding`` splitting every minibatch leaf's leading
        (sequence) axis over the batch mesh axes.

    Returns:
      ``step(params, opt_state, batch) -> (params, opt_state, metrics)``.
    """

    def step(params, opt_state, batch):
        return update_step(
            graphdef, params, opt_state, batch,
            loss_cfg=loss_cfg, optimizer=optimizer, chunk_size=chunk_size,
        )

    return jax.jit(
        step,
        in_shardings=(param_shardings, opt_shardings, batch_sharding),
        out_shardings=(param_shardings, opt_shardings, None),
        donate_argnums=(0, 1),
    )
