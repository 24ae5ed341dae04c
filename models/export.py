"""Writing a :class:`Decoder` back out: an HF checkpoint directory (config.json + safetensors)
that ``transformers`` and vLLM load, or its LoRA adapters alone as a PEFT adapter directory."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from safetensors.numpy import save_file

from models.decoder import Decoder
from models.loading import INDEX_FILE, hf_tensors
from models.lora import ATTENTION_TARGETS, adapted, merge_lora
from models.partitioning import is_layer_stacked, path_str


def _to_host(x: jax.Array) -> np.ndarray:
    """The full value of ``x`` on this host (gathered across processes if needed)."""
    if x.is_fully_addressable:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def save_pretrained(model: Decoder, path: str | Path, max_shard_bytes: int = 5 * 2**30) -> None:
    """Write ``config.json`` + safetensors that ``transformers`` (and vLLM) load.

    A model with LoRA adapters is written merged (:func:`models.lora.merge_lora`); see
    :func:`save_adapter` for the adapters alone. Tensors are gathered one shard file at a
    time (``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` + index when larger
    than ``max_shard_bytes``).
    On multi-host runs every process must call this; process 0 writes.
    """
    import transformers

    model = merge_lora(model)
    cfg = model.config
    tensors = []  # (hf name, transpose, param, layer index of a stacked param or None)
    for key_path, param in jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]:
        param_path = path_str(key_path)
        for i, (name, transpose, _) in enumerate(hf_tensors(param_path, param.shape)):
            tensors.append((name, transpose, param, i if is_layer_stacked(param_path) else None))
    shards, size = [[]], 0
    for name, transpose, param, layer in tensors:
        nbytes = param.size * param.dtype.itemsize // (1 if layer is None else param.shape[0])
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, transpose, param, layer))
        size += nbytes
    writer = jax.process_index() == 0
    path = Path(path)
    if writer:
        path.mkdir(parents=True, exist_ok=True)
        hf_kwargs = cfg.to_hf_dict()
        hf_config = transformers.AutoConfig.for_model(hf_kwargs.pop("model_type"), **hf_kwargs)
        hf_config.dtype = jnp.dtype(tensors[0][2].dtype).name
        hf_config.save_pretrained(path)
    weight_map = {}
    for i, shard in enumerate(shards):
        filename = ("model.safetensors" if len(shards) == 1
                    else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors")
        arrays, gathered = {}, (None, None)
        for name, transpose, param, layer in shard:
            if gathered[0] is not param:  # a stacked param's layers are consecutive
                gathered = (param, _to_host(param))
            host = gathered[1] if layer is None else gathered[1][layer]
            arrays[name] = np.ascontiguousarray(host.T if transpose else host)
            weight_map[name] = filename
        if writer:
            save_file(arrays, path / filename, metadata={"format": "pt"})
    if writer and len(shards) > 1:
        total = sum(math.prod(p.shape) * p.dtype.itemsize
                    for p in {id(t[2]): t[2] for t in tensors}.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / INDEX_FILE).write_text(json.dumps(index, indent=2))


ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def save_adapter(model: Decoder, path: str | Path) -> None:
    """Write ``model``'s LoRA adapters alone as a PEFT adapter directory.

    ``adapter_model.safetensors`` holds, for layer ``i`` and projection ``p``,
    ``base_model.model.model.layers.{i}.{self_attn|mlp}.{p}.lora_A.weight`` ``[r, in]`` and
    ``...lora_B.weight`` ``[out, r]`` (``lora_a`` / ``lora_b`` transposed);
    ``adapter_config.json`` holds ``peft_type: LORA``, ``r``, ``lora_alpha`` and
    ``target_modules``, so ``peft.PeftModel.from_pretrained(base, path)`` applies them to the
    base checkpoint. ValueError if the model has no adapters. Process 0 writes.
    """
    arrays, targets, rank, alpha, dropout = {}, [], None, None, 0.0
    for name, linear in adapted(model):
        block = "self_attn" if name in ATTENTION_TARGETS else "mlp"
        a, b = _to_host(linear.lora.lora_a[...]), _to_host(linear.lora.lora_b[...])
        for i in range(a.shape[0]):
            prefix = f"base_model.model.model.layers.{i}.{block}.{name}"
            arrays[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a[i].T)
            arrays[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b[i].T)
        targets.append(name)
        rank, alpha, dropout = linear.lora.rank, linear.lora.alpha, linear.lora.dropout
    if not targets:
        raise ValueError("save_adapter: the model has no LoRA adapters")
    if jax.process_index() != 0:
        return
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(arrays, path / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
              "target_modules": targets, "lora_dropout": dropout, "bias": "none",
              "fan_in_fan_out": False, "use_rslora": False, "base_model_name_or_path": None}
    (path / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
