"""Low-rank adapters (LoRA) on the decoder's projections, their merge, and the trainable split.

:func:`add_lora` gives each named projection of every layer an :class:`LoRA` (Flax's
``nnx.LoRA`` with ``nnx.LoRAParam`` weights, scaled by ``alpha / rank`` as in PEFT), so the
projection computes ``x @ W + (alpha / rank) * x @ A @ B``. The adapter lives in the module:
every forward (rollouts, scoring, the update) uses the adapted model. Parameter paths append
``lora/lora_a`` (``[L, in, r]``) and ``lora/lora_b`` (``[L, r, out]``) to the projection's
path (``layers/self_attn/q_proj/lora/lora_a``); the base ``kernel`` / ``bias`` keep theirs.
:func:`split_trainable` separates the adapter params (trained) from the frozen base;
:func:`merge_lora` folds the adapters into the kernels (the export); :func:`without_adapters`
turns them off (the base model, e.g. the KL reference).
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


class LoRADropoutKey(nnx.Variable):
    """Per-layer PRNG keys ``[L]`` of one adapter's input dropout (set by
    :func:`drop_adapter_inputs` on a model built for one update, never saved)."""


class LoRA(nnx.LoRA):
    """``nnx.LoRA`` whose output is scaled by ``alpha / rank``: ``x [..., in]`` ->
    ``(alpha / rank) * dropout(x) @ lora_a @ lora_b`` ``[..., out]``.

    Built for the stacked layers: ``lora_a`` is ``[L, in, r]`` (He-uniform per layer),
    ``lora_b`` ``[L, r, out]`` (zeros, so a fresh adapter changes nothing); the decoder's
    layer scan calls it on one layer's slices. ``dropout`` is the rate at which input
    entries are zeroed (the kept ones scaled by ``1 / (1 - dropout)``, as in PEFT); it acts
    only while ``dropout_key`` holds keys (:func:`drop_adapter_inputs`), otherwise the
    adapter is deterministic.
    """

    def __init__(self, in_features: int, rank: int, out_features: int, *, alpha: float,
                 num_layers: int, dtype, param_dtype, rngs: nnx.Rngs, dropout: float = 0.0):
        super().__init__(
            in_features, rank, out_features, dtype=dtype, param_dtype=param_dtype,
            a_initializer=_stacked(nnx.initializers.he_uniform(batch_axis=(0,)), num_layers),
            b_initializer=_stacked(nnx.initializers.zeros, num_layers), rngs=rngs)
        self.alpha = alpha
        self.dropout = dropout
        self.dropout_key = nnx.data(None)

    @property
    def rank(self) -> int:
        return self.lora_a.shape[-1]

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.dropout_key is not None:
            keep = jax.random.bernoulli(self.dropout_key[...], 1.0 - self.dropout, x.shape)
            x = jnp.where(keep, x / (1.0 - self.dropout), jnp.zeros_like(x))
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
             mesh: Mesh | None = None, dropout: float = 0.0) -> None:
    """Adds an adapter of ``rank`` and ``alpha`` to each projection in ``targets`` of every
    layer of the ``models.Decoder`` ``model`` (in place), with input ``dropout`` in [0, 1)
    (active only under :func:`drop_adapter_inputs`). Params take the base kernel's dtype;
    with ``mesh`` they are placed by ``models.partitioning``'s rules.

    Raises ValueError when a target names no projection (see :data:`LORA_TARGETS`), the
    dropout is outside [0, 1) or the model already has adapters.
    """
    unknown = [name for name in targets if name not in LORA_TARGETS]
    if unknown:
        raise ValueError(f"lora targets {unknown} name no module; the decoder's projections "
                         f"are {list(LORA_TARGETS)}")
    if not 0 <= dropout < 1:
        raise ValueError(f"lora dropout={dropout!r} must be in [0, 1)")
    if has_lora(model):
        raise ValueError("the model already has LoRA adapters")
    for name in targets:
        linear = _projection(model, name)
        num_layers, fan_in, fan_out = linear.kernel.shape
        linear.lora = LoRA(fan_in, rank, fan_out, alpha=alpha, num_layers=num_layers,
                           dtype=model.dtype, param_dtype=linear.kernel.dtype, rngs=rngs,
                           dropout=dropout)
    if mesh is not None:
        state = nnx.state(model, nnx.LoRAParam)
        nnx.update(model, jax.device_put(state, param_shardings(state, mesh)))


def drop_adapter_inputs(model, key: jax.Array) -> None:
    """Turns on the input dropout of every adapter of ``model`` whose rate is > 0 (in place;
    for a model built for one training forward/backward, e.g. inside a jitted update): its
    forwards then drop with per-layer keys drawn from ``key`` (a typed PRNG key), one stream
    per projection name, the same masks on every call (so a rematerialised forward repeats
    them)."""
    for name, linear in adapted(model):
        lora = linear.lora
        if lora.dropout > 0:
            keys = jax.random.split(jax.random.fold_in(key, LORA_TARGETS.index(name)),
                                    lora.lora_a.shape[0])
            lora.dropout_key = LoRADropoutKey(keys)


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


def without_adapters(state: nnx.State) -> nnx.State:
    """A policy's ``nnx.split`` ``state`` with every adapter param zeroed, so the adapted
    projections compute ``x @ W + 0`` (exactly the base model); the base arrays are shared,
    not copied (only the small adapter leaves are new)."""
    lora, base = nnx.split_state(state, nnx.LoRAParam, ...)
    return nnx.merge_state(jax.tree.map(jnp.zeros_like, lora), base)


def split_trainable(state: nnx.State) -> tuple[nnx.State, nnx.State]:
    """``(trainable, frozen)`` parts of a policy's ``nnx.split`` state: the LoRA params and
    the frozen base when it holds adapters, else the whole state and an empty one.
    ``nnx.merge_state(trainable, frozen)`` rebuilds ``state``."""
    lora, base = nnx.split_state(state, nnx.LoRAParam, ...)
    return (lora, base) if jax.tree.leaves(lora) else (base, lora)
