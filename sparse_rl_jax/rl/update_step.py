"""One optimizer update on a minibatch of scored rollouts: the GRPO loss through the policy.

A pure function of ``(params, opt_state, minibatch)``; the caller jits it with shardings (the
params' own, the batch split over the ``data``/``fsdp`` mesh axes). A minibatch in which every
token is rejected leaves params and optimizer state untouched (no Adam moment drift), and the
metrics say so (``all_rejected == 1``). Likewise an update whose loss or gradient is not
finite, or that would make a parameter or an optimizer-state value non-finite (an overflow),
is skipped inside the jitted step (``nonfinite_update == 1``), so a NaN never reaches the
params, the optimizer state or a checkpoint.

With LoRA adapters on the policy (``models.lora``) only the adapter params are
differentiated and updated, and the optimizer state covers them alone; the base weights pass
through unchanged (``models.split_trainable``). Adapters with input dropout drop only here,
in the learner's forward, with a key the caller derives from the seed, RL step and minibatch
(:func:`dropout_key`); rollouts and scoring never drop.

Gradient accumulation: with ``micro_batch_size`` below the minibatch, one jitted step runs
the forward/backward over micro-batches under ``lax.scan``, sums their gradients in float32
and applies one optimizer update. Every micro-batch loss uses the denominators of the whole
minibatch (``grpo_loss.loss_norm``), so the update equals the unsplit one up to float
rounding, for every aggregation and correction kind.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from models.lora import drop_adapter_inputs, split_trainable
from sparse_rl_jax.rl.grpo_loss import LossBatch, LossNorm, combine_metrics, grpo_loss, loss_norm
from sparse_rl_jax.rl.loss_config import GRPOLossConfig
from sparse_rl_jax.rollout.scoring import ReplayRecord, response_logprobs, shadow_logprobs


class Minibatch(NamedTuple):
    """The arrays one update needs; ``N`` sequences, ``P`` prompt and ``M`` response columns.

    prompt, prompt_mask: ``[N, P]``; response: ``[N, M]`` int32; loss: the ``LossBatch``
    (``[N, M]`` / ``[N]`` arrays: old log-probs, advantages, masks, IS weights).
    record: None, or (shadow-mask training) the rows' replay record (``Rollout.record``, any
    ``scoring.ReplayRecord``: arrays rows first, so every leaf splits along axis 0). With it
    the update scores the response under the view the record gives of the sparse context
    (the learner's policy) and under the full context (the distillation teacher).
    """

    prompt: jax.Array
    prompt_mask: jax.Array
    response: jax.Array
    loss: LossBatch
    record: ReplayRecord | None = None


def micro_batches(batch: Minibatch, micro_batch_size: int) -> Minibatch:
    """``batch`` (leaves ``[N, ...]``) as ``K = N / micro_batch_size`` micro-batches, leaves
    ``[K, micro_batch_size, ...]``. Micro-batch ``k`` holds rows ``k, k + K, k + 2K, ...``, so
    with the rows split over devices each micro-batch spreads over all of them."""
    n = batch.response.shape[0]
    if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) or (
            micro_batch_size < 1 or n % micro_batch_size):
        raise ValueError(f"trainer.micro_batch_size={micro_batch_size!r} must be an int >= 1 "
                         f"dividing the minibatch's {n} sequences")
    k = n // micro_batch_size
    return jax.tree.map(lambda x: x.reshape(micro_batch_size, k, *x.shape[1:]).swapaxes(0, 1),
                        batch)


def minibatch_loss(graphdef: nnx.GraphDef, trainable, frozen, batch: Minibatch,
                   norm: LossNorm | None, *, loss_cfg: GRPOLossConfig, chunk_size: int = 128,
                   dropout_key: jax.Array | None = None, temperature: float = 1.0):
    """``(loss, metrics)`` of ``grpo_loss`` on ``batch`` scored by the policy
    ``trainable`` + ``frozen`` (``split_trainable``; dense, or with ``batch.record``
    under the recorded sparse context); ``norm``: the aggregation denominators (None:
    ``batch``'s own); ``dropout_key``: the adapters' input dropout keys
    (``models.lora.drop_adapter_inputs``; None: no dropout); ``temperature``: the rollout's
    sampling temperature, the learner's policy being ``softmax(logits / temperature)`` like
    the sampler's (``scoring.response_logprobs``). Differentiable in ``trainable``."""
    model = nnx.merge(graphdef, trainable, frozen)
    if dropout_key is not None:
        drop_adapter_inputs(model, dropout_key)
    with_entropy = loss_cfg.entropy_coef > 0
    if batch.record is None:
        out = response_logprobs(
            model, batch.prompt, batch.prompt_mask, batch.response, chunk_size=chunk_size,
            with_entropy=with_entropy, temperature=temperature,
        )
        return grpo_loss(out.logp, batch.loss, loss_cfg, entropy=out.entropy, norm=norm)
    scores = shadow_logprobs(
        model, batch.prompt, batch.prompt_mask, batch.response, batch.record,
        chunk_size=chunk_size,
        with_kl=loss_cfg.distill_kind == "full", with_entropy=with_entropy,
        temperature=temperature,
    )
    return grpo_loss(scores.logp_sparse, batch.loss, loss_cfg, entropy=scores.entropy,
                     logp_dense=scores.logp_dense, kl_full=scores.kl_full, norm=norm)


def accumulated_grads(graphdef: nnx.GraphDef, params, frozen, batch: Minibatch,
                      micro_batch_size: int, *, loss_cfg: GRPOLossConfig, chunk_size: int = 128,
                      dropout_key: jax.Array | None = None, norm: LossNorm | None = None,
                      temperature: float = 1.0):
    """``(loss, metrics, grads)`` of the whole minibatch ``batch`` computed over micro-batches
    of ``micro_batch_size`` sequences (``lax.scan``), gradients with respect to the trainable
    ``params`` (``frozen`` held fixed) summed in float32 and returned in the params' dtypes.
    Each micro-batch loss uses the minibatch's ``loss_norm`` (or ``norm`` when given), so the
    sums are the minibatch's loss and gradient; metrics are merged by ``combine_metrics``.
    ``dropout_key`` (None: no adapter dropout) is split into one key per micro-batch;
    ``temperature`` as in :func:`minibatch_loss`."""
    norm = loss_norm(batch.loss, loss_cfg) if norm is None else norm
    grad_fn = jax.value_and_grad(
        lambda p, micro, key: minibatch_loss(graphdef, p, frozen, micro, norm,
                                             loss_cfg=loss_cfg, chunk_size=chunk_size,
                                             dropout_key=key, temperature=temperature),
        has_aux=True)

    def one(acc, xs):
        micro, key = xs
        (loss, metrics), grads = grad_fn(params, micro, key)
        acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads)
        return acc, (loss, metrics)

    micros = micro_batches(batch, micro_batch_size)
    keys = None if dropout_key is None else jax.random.split(dropout_key,
                                                              micros.response.shape[0])
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    acc, (losses, metrics) = jax.lax.scan(one, zeros, (micros, keys))
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), acc, params)
    return jnp.sum(losses), combine_metrics(metrics), grads


def loss_grads(graphdef: nnx.GraphDef, trainable, frozen, batch: Minibatch, *,
               loss_cfg: GRPOLossConfig, chunk_size: int = 128,
               micro_batch_size: int | None = None, dropout_key: jax.Array | None = None,
               norm: LossNorm | None = None, temperature: float = 1.0):
    """``(loss, metrics, grads)`` of ``batch`` with respect to ``trainable``: one
    forward/backward when ``micro_batch_size`` is None or ``N``, else accumulated over
    micro-batches (:func:`accumulated_grads`). ``norm``: the aggregation denominators (None:
    ``batch``'s own); ``temperature`` as in :func:`minibatch_loss`."""
    n = batch.response.shape[0]
    if micro_batch_size is None or micro_batch_size == n:
        (loss, metrics), grads = jax.value_and_grad(
            lambda p: minibatch_loss(graphdef, p, frozen, batch, norm, loss_cfg=loss_cfg,
                                     chunk_size=chunk_size, dropout_key=dropout_key,
                                     temperature=temperature),
            has_aux=True)(trainable)
        return loss, metrics, grads
    return accumulated_grads(graphdef, trainable, frozen, batch, micro_batch_size,
                             loss_cfg=loss_cfg, chunk_size=chunk_size, dropout_key=dropout_key,
                             norm=norm, temperature=temperature)


def low_r_grad_metrics(graphdef: nnx.GraphDef, trainable, frozen, batch: Minibatch, grads, *,
                       loss_cfg: GRPOLossConfig, chunk_size: int = 128,
                       micro_batch_size: int | None = None,
                       dropout_key: jax.Array | None = None,
                       temperature: float = 1.0) -> dict[str, jax.Array]:
    """How much of the update ``grads`` comes from the sequences a 1e-4 veto would drop
    (``batch.loss.low_r``), measured without dropping them: a second backward of the loss
    restricted to those sequences, under the whole minibatch's denominators, so that it is
    exactly their additive part ``g_low`` of ``grads = g_low + g_rest``.

    Returns float32 scalars ``low_r_grad_norm_ratio`` (``|g_low| / |g|``) and
    ``low_r_grad_share`` (``<g_low, g> / |g|^2``: the fraction of the update's length along
    itself that those sequences contribute; the rest contribute ``1 -`` it); both 0 when
    ``|g| == 0``.
    """
    if batch.loss.low_r is None:
        raise ValueError("low_r_grad_share: the minibatch's loss.low_r is None (build the "
                         "LossBatch with LossBatch.from_corrections)")
    norm = loss_norm(batch.loss, loss_cfg)
    low_only = batch._replace(loss=batch.loss.replace(
        seq_mask=batch.loss.seq_mask & batch.loss.low_r))
    _, _, low = loss_grads(graphdef, trainable, frozen, low_only, loss_cfg=loss_cfg,
                           chunk_size=chunk_size, micro_batch_size=micro_batch_size,
                           dropout_key=dropout_key, norm=norm, temperature=temperature)
    return grad_share(low, grads)


def grad_share(part, grads) -> dict[str, jax.Array]:
    """How much of the gradient ``grads`` its additive part ``part`` (a pytree like it)
    carries: float32 scalars ``low_r_grad_norm_ratio`` (``|part| / |grads|``) and
    ``low_r_grad_share`` (``<part, grads> / |grads|^2``), both 0 when ``|grads| == 0``."""
    total_sq = optax.tree.norm(grads, squared=True)
    dot = sum(jnp.vdot(a.astype(jnp.float32), b.astype(jnp.float32))
              for a, b in zip(jax.tree.leaves(part), jax.tree.leaves(grads)))
    safe = jnp.where(total_sq > 0, total_sq, 1.0)
    return {"low_r_grad_norm_ratio": jnp.where(total_sq > 0, optax.tree.norm(part)
                                               / jnp.sqrt(safe), 0.0),
            "low_r_grad_share": jnp.where(total_sq > 0, dot / safe, 0.0)}


def update_step(
    graphdef: nnx.GraphDef,
    params,
    opt_state,
    batch: Minibatch,
    *,
    loss_cfg: GRPOLossConfig,
    optimizer: optax.GradientTransformation,
    chunk_size: int = 128,
    micro_batch_size: int | None = None,
    dropout_key: jax.Array | None = None,
    low_r_share: bool = False,
    temperature: float = 1.0,
):
    """Loss, gradients and one optimizer update.

    The loss is aggregated over this minibatch: its sequence and token denominators
    (``loss_cfg.seq_denominator``) count the minibatch's sequences, i.e. the official code's
    "global batch" is ``trainer.minibatch_size``, not the whole rollout.

    micro_batch_size: None (or ``N``) runs the minibatch in one forward/backward; a divisor
      of ``N`` accumulates gradients over ``N / micro_batch_size`` micro-batches
      (:func:`accumulated_grads`), the same update up to float rounding.
    dropout_key: the LoRA adapters' input dropout key (:func:`dropout_key`; None, or
      adapters of rate 0: no dropout, the update is deterministic).
    low_r_share: also log :func:`low_r_grad_metrics` (a second backward; the update is
      unchanged).
    temperature: the rollouts' sampling temperature; the learner scores
      ``softmax(logits / temperature)``, the policy the sampler drew from and recorded.

    Returns:
      ``(params, opt_state, metrics)``; metrics are float32 scalars (``grad_norm`` and
      ``nonfinite_update``, 1.0 when the update was skipped for a non-finite loss, gradient,
      or updated parameter / optimizer-state value).
    """
    trainable, frozen = split_trainable(params)
    kw = dict(loss_cfg=loss_cfg, chunk_size=chunk_size, micro_batch_size=micro_batch_size,
              dropout_key=dropout_key, temperature=temperature)
    loss, metrics, grads = loss_grads(graphdef, trainable, frozen, batch, **kw)
    metrics["grad_norm"] = optax.tree.norm(grads)
    if low_r_share:
        metrics.update(low_r_grad_metrics(graphdef, trainable, frozen, batch, grads, **kw))
    nonfinite = ~(jnp.isfinite(loss) & jnp.isfinite(metrics["grad_norm"]))

    def apply(operand):
        """The update, or (when it makes a value non-finite) the old state and True."""
        p, s = operand
        updates, new_s = optimizer.update(grads, s, p)
        new = (optax.apply_updates(p, updates), new_s)
        finite = all_finite(new)
        return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, operand), ~finite

    (trainable, opt_state), overflow = jax.lax.cond(
        (metrics["all_rejected"] > 0) | nonfinite,
        lambda operand: (operand, jnp.zeros((), bool)), apply, (trainable, opt_state))
    metrics["nonfinite_update"] = (nonfinite | overflow).astype(jnp.float32)
    return nnx.merge_state(trainable, frozen), opt_state, metrics


def all_finite(tree) -> jax.Array:
    """A bool scalar: every floating-point value of ``tree`` is finite (one reduction per
    leaf, fused by XLA)."""
    flags = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
             if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(flags)) if flags else jnp.ones((), bool)


def init_optimizer(optimizer: optax.GradientTransformation, params, mesh):
    """Optimizer state of the trainable part of ``params`` (``split_trainable``: the LoRA
    params when the policy has adapters) laid out on ``mesh``, and its shardings.

    Moment buffers take the sharding of their parameter (jit propagates it); leaves jit
    leaves on one device (step counters) are replicated over the mesh.
    """
    opt_state = jax.jit(optimizer.init)(split_trainable(params)[0])
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
    low_r_share: bool = False,
    temperature: float = 1.0,
):
    """``update_step`` jitted with explicit shardings (compiled as ``update_minibatch``);
    params and optimizer state are donated.

    Args:
      graphdef: the policy's ``nnx.GraphDef``.
      loss_cfg, optimizer, chunk_size, low_r_share, temperature: as in :func:`update_step`.
      param_shardings: pytree of ``NamedSharding`` like the params.
      opt_shardings: pytree of ``NamedSharding`` like the optimizer state.
      batch_sharding: one ``NamedSharding`` splitting every minibatch leaf's leading
        (sequence) axis over the batch mesh axes.

    Returns:
      ``step(params, opt_state, batch, micro_batch_size=None, dropout_key=None) -> (params,
      opt_state, metrics)``; ``micro_batch_size`` is static (one compile per value),
      ``dropout_key`` as in :func:`update_step` (a key or None: one compile each).
    """

    def update_minibatch(params, opt_state, batch, dropout_key, micro_batch_size):
        return update_step(
            graphdef, params, opt_state, batch, loss_cfg=loss_cfg, optimizer=optimizer,
            chunk_size=chunk_size, micro_batch_size=micro_batch_size, dropout_key=dropout_key,
            low_r_share=low_r_share, temperature=temperature,
        )

    jitted = jax.jit(
        update_minibatch,
        in_shardings=(param_shardings, opt_shardings, batch_sharding, None),
        out_shardings=(param_shardings, opt_shardings, None),
        donate_argnums=(0, 1),
        static_argnums=(4,),
    )

    def call(params, opt_state, batch, micro_batch_size=None, dropout_key=None):
        """The jitted update (jit takes no keyword arguments alongside in_shardings)."""
        return jitted(params, opt_state, batch, dropout_key, micro_batch_size)

    return call


def dropout_key(seed: int, step: int, minibatch: int) -> jax.Array:
    """The adapters' dropout key of minibatch ``minibatch`` (0-based) of RL step ``step``
    of a run seeded ``seed``: a stream of its own (``split(key(seed))[1]``; the rollouts
    fold the data position into ``key(seed)``), folded with the step and minibatch, so a
    resumed run draws the same masks."""
    stream = jax.random.split(jax.random.key(seed))[1]
    return jax.random.fold_in(jax.random.fold_in(stream, step), minibatch)
