"""Low-rank adapters (LoRA) on the decoder's projections, their merge, and the trainable split.

:func:`add_lora` gives each named projection of every layer an :class:`LoRA` (Flax's
``nnx.LoRA`` with ``nnx.LoRAParam`` weights, scaled by ``alpha / rank`` as in PEFT), so the
projection computes ``x @ W + (alpha / rank) * x @ A @ B``. The adapter lives in the module:
every forward (rollouts, scoring, the update) uses the adapted model. Parameter paths append
``lora/lora_a`` (``[L, in, r]``) and ``lora/lora_b`` (``[L, r, out]``) to the projection's
path (``layers/self_attn/q_proj/lora/lora_a``); the base ``kernel`` / ``bias`` keep theirs.
:func:`split_trainable` separates the adapter params (trained) from the frozen base;
:func:`merge_lora` folds the adapters into the kernels (the export).
"""

from __future__ import annotations

from collections.abc import Iterator

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from models.partitioning import param_shardings

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
LORA_TARGETS = ATTENTION_TARGETS + MLP_TARGETS
"""The projections an adapter can target (HF / PEFT module names)."""


def _stacked(init, num_layers: int):
    """``init`` for a per-layer shape, drawing ``[num_layers, *shape]`` (fan-in per layer)."""
    return lambda key, shape, dtype: init(key, (num_layers, *shape), dtype)


class LoRA(nnx.LoRA):
    """``nnx.LoRA`` whose output is scaled by ``alpha / rank``: ``x [..., in]`` ->
    ``(alpha / rank) * x @ lora_a @ lora_b`` ``[..., out]``.

    Built for the stacked layers: ``lora_a`` is ``[L, in, r]`` (He-uniform per layer),
    ``lora_b`` ``[L, r, out]`` (zeros, so a fresh adapter changes nothing); the decoder's
    layer scan calls it on one layer's slices.
    """

    def __init__(self, in_features: int, rank: int, out_features: int, *, alpha: float,
                 num_layers: int, dtype, param_dtype, rngs: nnx.Rngs):
        super().__init__(
            in_features, rank, out_features, dtype=dtype, param_dtype=param_dtype,
            a_initializer=_stacked(nnx.initializers.he_uniform(batch_axis=(0,)), num_layers),
            b_initializer=_stacked(nnx.initializers.zeros, num_layers), rngs=rngs)
        self.alpha = alpha

    @property
    def rank(self) -> int:
        return self.lora_a.shape[-1]

    def __call__(self, x: jax.Array) -> jax.Array:
        return super().__call__(x) * (self.alpha / self.rank)


def _projection(model, name: str) -> nnx.Linear:
    """The stacked projection ``name`` of ``model``'s layers (kernel ``[L, in, out]``)."""
    block = model.layers.self_attn if name in ATTENTION_TARGETS else model.layers.mlp
    return getattr(block, name)


def adapted(model) -> Iterator[tuple[str, nnx.Linear]]:
    """``(name, projection)`` for every projection of ``model`` that carries an adapter."""
    for name in LORA_TARGETS:
        linear = _projection(model, name)
        if linear.lora is not None:
            yield name, linear


def has_lora(model) -> bool:
    """Whether any projection of ``model`` carries an adapter."""
    return any(True for _ in adapted(model))


def add_lora(model, rank: int, alpha: float, targets: tuple[str, ...], *, rngs: nnx.Rngs,
             mesh: Mesh | None = None) -> None:
    """Adds an adapter of ``rank`` and ``alpha`` to each projection in ``targets`` of every
    layer of the ``models.Decoder`` ``model`` (in place). Params take the base kernel's dtype;
    with ``mesh`` they are placed by ``models.partitioning``'s rules.

    Raises ValueError when a target names no projection (see :data:`LORA_TARGETS`) or the
    model already has adapters.
    """
    unknown = [name for name in targets if name not in LORA_TARGETS]
    if unknown:
        raise ValueError(f"lora targets {unknown} name no module; the decoder's projections "
                         f"are {list(LORA_TARGETS)}")
    if has_lora(model):
        raise ValueError("the model already has LoRA adapters")
    for name in targets:
        linear = _projection(model, name)
        num_layers, fan_in, fan_out = linear.kernel.shape
        linear.lora = LoRA(fan_in, rank, fan_out, alpha=alpha, num_layers=num_layers,
                           dtype=model.dtype, param_dtype=linear.kernel.dtype, rngs=rngs)
    if mesh is not None:
        state = nnx.state(model, nnx.LoRAParam)
        nnx.update(model, jax.device_put(state, param_shardings(state, mesh)))


def merge_lora(model):
    """A copy of ``model`` whose kernels hold the adapted weights ``W + (alpha / r) A @ B``
    (summed in float32, stored in the kernel's dtype) and that has no adapters; ``model``
    itself when it has none."""
    if not has_lora(model):
        return model
    merged = nnx.clone(model)
    for _, linear in adapted(merged):
        lora = linear.lora
        delta = jnp.einsum("lir,lro->lio", lora.lora_a[...].astype(jnp.float32),
                           lora.lora_b[...].astype(jnp.float32)) * (lora.alpha / lora.rank)
        kernel = linear.kernel[...]
        linear.kernel[...] = (kernel.astype(jnp.float32) + delta).astype(kernel.dtype)
        linear.lora = None
    return merged


def split_trainable(state: nnx.State) -> tuple[nnx.State, nnx.State]:
    """``(trainable, frozen)`` parts of a policy's ``nnx.split`` state: the LoRA params and
    the frozen base when it holds adapters, else the whole state and an empty one.
    ``nnx.merge_state(trainable, frozen)`` rebuilds ``state``."""
    lora, base = nnx.split_state(state, nnx.LoRAParam, ...)
    return (lora, base) if jax.tree.leaves(lora) else (base, lora)
