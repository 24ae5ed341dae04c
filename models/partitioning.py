"""How parameters are laid out over a ('data', 'fsdp', 'tensor') device mesh, in one place.

Params are replicated over 'data', sharded over 'fsdp' along the model dimension and over
'tensor' along heads / the MLP hidden dimension (Megatron style: column-parallel q/k/v/gate/up,
row-parallel o/down). A dimension that the mesh axis size does not divide stays replicated.
"""

from __future__ import annotations

import math
import re
from typing import Any

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")

# First matching rule wins; the regex is searched in the '/'-joined parameter path.
PARTITION_RULES: tuple[tuple[str, P], ...] = (
    (r"embed_tokens/embedding$", P("tensor", "fsdp")),  # [V, H]
    (r"lm_head/kernel$", P("fsdp", "tensor")),  # [H, V]
    (r"(q_proj|k_proj|v_proj|gate_proj|up_proj)/kernel$", P("fsdp", "tensor")),  # [H, out]
    (r"(q_proj|k_proj|v_proj|gate_proj|up_proj)/bias$", P("tensor")),
    (r"(o_proj|down_proj)/kernel$", P("tensor", "fsdp")),  # [in, H]
    (r"(o_proj|down_proj)/bias$", P()),
    (r"(norm|layernorm)/weight$", P()),
    # LoRA adapters (models.lora): A follows its kernel's input dim, B its output dim.
    (r"(q_proj|k_proj|v_proj|gate_proj|up_proj)/lora/lora_a$", P("fsdp")),  # [H, r]
    (r"(q_proj|k_proj|v_proj|gate_proj|up_proj)/lora/lora_b$", P(None, "tensor")),  # [r, out]
    (r"(o_proj|down_proj)/lora/lora_a$", P("tensor")),  # [in, r]
    (r"(o_proj|down_proj)/lora/lora_b$", P(None, "fsdp")),  # [r, H]
)


def path_str(path: tuple[Any, ...]) -> str:
    """'/'-joined parameter path from an NNX state path or a JAX key path."""
    parts = []
    for key in path:
        if isinstance(key, jax.tree_util.GetAttrKey):
            continue  # the Variable's `.value` leaf
        for attr in ("key", "idx", "name"):
            if hasattr(key, attr):
                key = getattr(key, attr)
                break
        parts.append(str(key))
    return "/".join(parts)


def is_layer_stacked(path: str) -> bool:
    """Whether the parameter at ``path`` holds every layer (``layers/mlp/...``, leading axis
    ``L``) rather than one (``layers/0/mlp/...``)."""
    return re.match(r"layers/[^/\d]", path) is not None


def partition_spec(path: str, shape: tuple[int, ...], mesh: Mesh) -> P:
    """The PartitionSpec for the parameter at ``path`` with ``shape`` on ``mesh``.

    A layer-stacked parameter (:func:`is_layer_stacked`) keeps its leading layer axis
    unsharded and follows its rule on the remaining dims.
    Raises ValueError if no rule matches (every parameter must have a deliberate layout).
    """
    if is_layer_stacked(path):
        spec = partition_spec("layers/0/" + path[len("layers/"):], tuple(shape[1:]), mesh)
        return P(None, *spec) if len(spec) else P()
    for pattern, spec in PARTITION_RULES:
        if re.search(pattern, path):
            break
    else:
        raise ValueError(f"no partition rule matches parameter {path!r}; "
                         "add one to PARTITION_RULES")
    if len(spec) > len(shape):
        raise ValueError(f"partition rule {spec} for {path!r} has more dims than its shape {shape}")
    dims = []
    for size, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        names = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        names = tuple(a for a in names if a in mesh.shape)
        ways = math.prod(mesh.shape[a] for a in names)
        if not names or size % ways:
            dims.append(None)
        else:
            dims.append(names[0] if len(names) == 1 else names)
    while dims and dims[-1] is None:
        dims.pop()
    return P(*dims)


def param_shardings(state: Any, mesh: Mesh) -> Any:
    """A pytree like ``state`` (an ``nnx.State`` or dict of arrays / ShapeDtypeStructs) whose
    leaves are the ``NamedSharding`` of each parameter."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: NamedSharding(mesh, partition_spec(path_str(path), x.shape, mesh)), state)


def mesh_size_error(sizes: dict[str, int]) -> tuple[str, str] | None:
    """The first bad size of ``{axis: size}`` as ``(axis, rule it breaks)``, or None: each size
    is a positive int or -1 (the rest of the devices), and at most one is -1."""
    for name, size in sizes.items():
        if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != -1):
            return name, "must be a positive int or -1"
    free = [name for name, size in sizes.items() if size == -1]
    if len(free) > 1:
        return free[1], f"must not be -1 as {free[0]} is: only one mesh axis may be -1"
    return None


def make_mesh(data: int = 1, fsdp: int = -1, tensor: int = 1, devices=None) -> Mesh:
    """A ('data', 'fsdp', 'tensor') mesh over ``devices`` (default all); one size may be -1
    (the rest). Axes are ``Auto`` so jit partitions activations itself."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = {"data": data, "fsdp": fsdp, "tensor": tensor}
    bad = mesh_size_error(sizes)
    if bad:
        axis, rule = bad
        raise ValueError(f"mesh axis {axis}={sizes[axis]!r} {rule}")
    free = [name for name, size in sizes.items() if size == -1]
    known = math.prod(size for size in sizes.values() if size != -1)
    if free:
        if len(devices) % known:
            raise ValueError(f"{free[0]}: {len(devices)} devices are not divisible by the other "
                             f"axes' product {known}")
        sizes[free[0]] = len(devices) // known
    if math.prod(sizes.values()) != len(devices):
        raise ValueError(f"data, fsdp, tensor: sizes {sizes} need {math.prod(sizes.values())} "
                         f"devices, have {len(devices)}")
    return jax.make_mesh(tuple(sizes.values()), MESH_AXES, axis_types=(AxisType.Auto,) * 3,
                         devices=devices)
