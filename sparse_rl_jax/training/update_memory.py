"""The update's terms of the memory plan: what an optimizer update holds beyond its forward.

An update (``update_step.update_step``) peaks in one of two phases, over the same resident
buffers (the weights and the optimizer state, both donated arguments):

- the backward: the gradients, the float32 accumulator of a micro-batched update, the
  residuals the forward saved, one layer's backward next to its recomputed forward and a
  second LM-head chunk;
- the optimizer step (``optax`` update, applied inside the finite-update ``lax.cond``): the
  gradients, the updates tree, and the new trainable params and optimizer state beside the
  old ones (the step keeps both until it knows every new value is finite).

Only the trainable params take gradients, updates and optimizer state: every weight in a
full update, the adapters alone with LoRA (``models.lora``). The optimizer state's dtype is
optax's: :func:`optimizer_state_bytes` asks ``optax`` (``jax.eval_shape`` of the repository's
AdamW ``init``), which keeps the moments in the parameter dtype.
"""

from __future__ import annotations

import functools

import jax
import jaxlib.version
import numpy as np
from packaging.version import Version

from models.config import ModelConfig
from sparse_rl_jax.rl.lora_config import LoraConfig
from sparse_rl_jax.rl.optim import OptimConfig, make_optimizer

_F32 = 4
# one layer's backward holds this fraction of its forward's activations (the recomputed
# forward's and the gradients'), measured against XLA's peak at the Qwen2.5-1.5B and 7B
# shapes (benchmarks/README.md, "memory plan")
LAYER_BACKWARD = (8, 5)
XLA_CPU_KEEPS_BF16 = Version("0.11")
"""The first jaxlib whose XLA:CPU computes bfloat16 work in bfloat16: from it an update's
``memory_analysis()`` follows the plan GPUs and TPUs get (no float32 activations, no float32
copy of the weights), 26-31% below jaxlib 0.10.2's at the tests' bfloat16 shapes (measured
on jaxlib 0.11.2 and 0.12.0.1)."""


def compute_itemsize(itemsize: int, platform: str) -> int:
    """Bytes of an activation element on ``platform`` for params of ``itemsize`` bytes: theirs,
    except float32 on XLA:CPU before jaxlib 0.11 (:data:`XLA_CPU_KEEPS_BF16`)."""
    if platform == "cpu" and Version(jaxlib.version.__version__) < XLA_CPU_KEEPS_BF16:
        return max(itemsize, _F32)
    return itemsize


def lora_param_count(cfg: ModelConfig, lora: LoraConfig) -> int:
    """Adapter params of ``models.add_lora`` with ``lora``'s rank and targets: ``rank x
    (fan_in + fan_out)`` per adapted projection and layer."""
    h, f = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    fans = {"q_proj": h + q, "k_proj": h + kv, "v_proj": h + kv, "o_proj": q + h,
            "gate_proj": h + f, "up_proj": h + f, "down_proj": f + h}
    return cfg.num_layers * lora.rank * sum(fans[name] for name in lora.targets)


@functools.lru_cache(maxsize=None)
def _state_layout(dtype: np.dtype) -> tuple[int, int]:
    """``(bytes per parameter, fixed bytes)`` of the repository's AdamW state over ``dtype``
    params, from the state ``optax`` builds for one and for two parameters."""
    init = make_optimizer(OptimConfig()).init

    def nbytes(n: int) -> int:
        state = jax.eval_shape(init, {"w": jax.ShapeDtypeStruct((n,), dtype)})
        return sum(x.size * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(state))

    per_param = nbytes(2) - nbytes(1)
    return per_param, nbytes(1) - per_param


def optimizer_state_bytes(count: int, dtype) -> int:
    """Bytes of the optimizer state (``optim.make_optimizer``) of ``count`` params of
    ``dtype``: optax's AdamW keeps both moments in the parameter dtype (its ``mu_dtype`` is
    unset), plus scalar step counters. The settings of ``OptimConfig`` change no state size."""
    per_param, fixed = _state_layout(np.dtype(dtype))
    return count * per_param + fixed


def residual_width(cfg: ModelConfig, remat: str, total_len: int, itemsize: int) -> int:
    """Elements per token and layer that the backward pass finds saved under ``remat``."""
    if remat == "full":
        return cfg.hidden_size
    if remat == "dots_saveable":
        width = 3 * cfg.hidden_size + cfg.num_heads * cfg.head_dim
        width += 2 * cfg.num_kv_heads * cfg.head_dim + 2 * cfg.intermediate_size
        return width + cfg.num_heads * total_len * _F32 // itemsize  # attention scores
    # none: XLA keeps six intermediate-wide arrays per layer (the SwiGLU's gate, up, their
    # activations and products), as a compiled update's buffers show
    width = 6 * cfg.hidden_size + 3 * cfg.num_heads * cfg.head_dim
    return width + 2 * cfg.num_kv_heads * cfg.head_dim + 6 * cfg.intermediate_size


def update_parts(parts: dict[str, int], cfg: ModelConfig, *, batch: int, total_len: int,
                 dtype, compute_itemsize: int, remat: str, params: int,
                 lora: LoraConfig | None, accumulate: bool,
                 visibility: int) -> dict[str, int]:
    """The forward's ``parts`` (``weights``, ``activations``, ``lm_head_chunk``, ...) grown
    to an update's, in bytes.

    Args:
      parts: the teacher-forced forward's parts over ``batch`` rows (``memory_plan``).
      cfg, batch, total_len: the model and the (micro-)batch of ``total_len`` columns.
      dtype: the params' dtype (the trainable params, their updates and optimizer state).
      compute_itemsize: bytes of an element of a layer's transients
        (:func:`compute_itemsize`). The gradients take the params' dtype, and so do the
        residuals under ``remat="full"`` (each layer's input). Other policies' saved
        intermediates count half in each dtype: XLA:CPU before jaxlib 0.11 converts some
        stacked bfloat16 ones to float32 before the backward loop (all of them at the
        tests' tiny shape, none at their 6M-parameter one). Where the compute dtype is
        wider, the backward also holds a float32 copy of every weight (``upcast_weights``:
        that XLA:CPU converts them once, outside the layer loop).
      remat: ``model.remat``: what each layer saves for its backward.
      params: every parameter of the model (``memory_plan.param_count``).
      lora: the adapters when only they train (None: every weight trains).
      accumulate: the update runs in micro-batches, summing gradients in float32.
      visibility: bytes of the attention's position-only values kept for the backward
        (``memory_plan``: the forward's ``[T, T]`` visibility, hoisted out of the layer scan).

    Returns:
      ``parts`` with ``activations`` and ``lm_head_chunk`` replaced by ``backward`` (the
      larger of the loss's backward through two LM-head chunks and one layer's backward,
      :data:`LAYER_BACKWARD` times its forward's activations), plus ``residuals``,
      ``visibility``, ``upcast_weights``, ``grads``, ``accumulator``, ``optimizer`` (the
      state) and
      ``optimizer_step``: how much the optimizer step's peak exceeds the backward's (0 when
      the backward peaks), so the total is the larger phase's.
    """
    itemsize = np.dtype(dtype).itemsize
    trainable = lora_param_count(cfg, lora) if lora else params
    parts = dict(parts)
    activations, lm_head = parts.pop("activations"), parts.pop("lm_head_chunk")
    parts["backward"] = max(2 * lm_head, activations * LAYER_BACKWARD[0] // LAYER_BACKWARD[1])
    saved = 2 * itemsize if remat == "full" else itemsize + compute_itemsize  # bytes x 2
    parts["residuals"] = (cfg.num_layers * batch * total_len * saved
                          * residual_width(cfg, remat, total_len, itemsize) // 2)
    parts["visibility"] = visibility
    parts["upcast_weights"] = params * compute_itemsize if compute_itemsize > itemsize else 0
    parts["grads"] = trainable * itemsize
    parts["accumulator"] = trainable * _F32 if accumulate else 0
    parts["optimizer"] = optimizer_state_bytes(trainable, dtype)
    backward = sum(parts[name] for name in (
        "backward", "hidden", "page_replay", "residuals", "visibility", "upcast_weights",
        "grads", "accumulator"))
    # the step's gradients: the accumulator's float32 sum and its cast to the params' dtype
    # (the same buffer for float32 params), or the single pass's own
    grads = parts["grads"] + (parts["accumulator"] if accumulate and itemsize != _F32 else 0)
    new = 2 * trainable * itemsize + parts["optimizer"]  # updates, new params, new state
    parts["optimizer_step"] = max(0, grads + new - backward)
    return parts
