"""HF checkpoint directories (config.json + safetensors) <-> :class:`Decoder`.

Loading validates every tensor name, shape and dtype from the safetensors headers before any
data is read, builds the model abstractly, then places one tensor at a time directly into its
``NamedSharding`` (each device's shard is read from the memory-mapped file, so the full model
never sits in host memory).
"""

from __future__ import annotations

import json
import logging
import math
import types
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from models.config import SUPPORTED_MODEL_TYPES, ModelConfig
from models.decoder import Decoder
from models.gguf import checkpoint_dir
from models.json_file import read_json
from models.partitioning import is_layer_stacked, make_mesh, param_shardings, path_str
from models.weight_magnitude import MAX_ABS_WEIGHT, copy_max_abs

log = logging.getLogger(__name__)

_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
INDEX_FILE = "model.safetensors.index.json"


def hf_name(path: str) -> tuple[str, bool]:
    """HF tensor name for an NNX param path, and whether the tensor is stored transposed.

    ``layers/0/self_attn/q_proj/kernel`` -> (``model.layers.0.self_attn.q_proj.weight``, True);
    ``embed_tokens/embedding`` -> ``model.embed_tokens.weight``; ``lm_head/kernel`` ->
    ``lm_head.weight``; norms' ``weight`` and biases keep their names.
    """
    *module, leaf = path.split("/")
    prefix = "" if module[0] == "lm_head" else "model."
    return prefix + ".".join(module) + (".bias" if leaf == "bias" else ".weight"), leaf == "kernel"


def hf_tensors(path: str, shape: tuple[int, ...]) -> list[tuple[str, bool, tuple[int, ...]]]:
    """``(HF name, transposed, shape of the NNX slice)`` of every HF tensor behind the param at
    ``path``: one per layer for a layer-stacked param (``layers/mlp/up_proj/kernel`` of shape
    ``[L, ...]`` -> ``model.layers.{i}.mlp.up_proj.weight``), else one."""
    if not is_layer_stacked(path):
        return [(*hf_name(path), tuple(shape))]
    rest = path[len("layers/"):]
    return [(*hf_name(f"layers/{i}/{rest}"), tuple(shape[1:])) for i in range(shape[0])]


def read_config(path: str | Path) -> ModelConfig:
    """ModelConfig from ``path/config.json``; a GGUF ``path`` is converted first
    (``models.gguf.checkpoint_dir``). A config.json that leaves family defaults implicit is
    read through ``transformers.AutoConfig`` (local only)."""
    path = checkpoint_dir(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"config.json not found in checkpoint directory {path}")
    hf_config = read_json(config_file)
    if not isinstance(hf_config, dict):
        raise ValueError(f"{config_file}: must hold a JSON object")
    model_type = hf_config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{config_file}: model_type: unsupported {model_type!r}; supported: "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    if _complete(hf_config):  # every field from_hf reads is spelled out: no family defaults
        return ModelConfig.from_hf(types.SimpleNamespace(**hf_config))
    import transformers  # a few seconds to import (torch): only for configs that lean on defaults

    return ModelConfig.from_hf(transformers.AutoConfig.from_pretrained(path, local_files_only=True))


_EXPLICIT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
                    "max_position_embeddings", "tie_word_embeddings", "bos_token_id",
                    "eos_token_id")
"""config.json fields whose absence means a family default (``transformers`` supplies those);
the other fields :meth:`ModelConfig.from_hf` reads default the same in every family."""


def _complete(hf_config: dict) -> bool:
    """Whether ``config.json`` spells out every field whose default differs by family
    (``head_dim`` for qwen3, a RoPE theta), so it maps without ``transformers``."""
    rope = hf_config.get("rope_parameters")
    theta = "rope_theta" in hf_config or (isinstance(rope, dict) and "rope_theta" in rope)
    return (theta and all(k in hf_config for k in _EXPLICIT_FIELDS)
            and (hf_config["model_type"] != "qwen3" or "head_dim" in hf_config))


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of the HF checkpoint directory ``path`` (from its index when
    sharded); ValueError / FileNotFoundError naming a broken index or a missing file."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = set(weight_map.values())
        except (ValueError, KeyError, TypeError, AttributeError) as e:  # JSON/UTF-8 included
            raise ValueError(f"{index}: not a valid safetensors index (a JSON object with a "
                             f"'weight_map' of tensor -> file): {e!r}") from e
        if not all(isinstance(name, str) for name in names):
            raise ValueError(f"{index}: 'weight_map' values must be file names")
        files = [path / name for name in sorted(names)]
        for file in files:
            if not file.is_file():
                raise FileNotFoundError(f"{index} lists shard {file.name}, which does not exist")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in checkpoint directory {path}")
    return files


_NP_DTYPES = {"F16": np.float16, "BF16": jnp.bfloat16, "F32": np.float32, "F64": np.float64}
def _open_safetensors(file: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file as a read-only view into its memory map (no data
    read yet): ``name -> array`` (float dtypes) or ``name -> (dtype string, shape)`` (others,
    refused by :func:`_check_tensors`). ValueError naming the file if the header is not a
    safetensors header or a tensor lies outside the file."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            if size < 8 or header_len > size - 8:
                raise ValueError(f"header of {header_len} bytes in a {size}-byte file")
            header = json.loads(f.read(header_len))
        data = (np.memmap(file, np.uint8, mode="r", offset=8 + header_len)
                if size > 8 + header_len else np.zeros(0, np.uint8))
        views = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            begin, stop = info["data_offsets"]
            shape, dtype = tuple(info["shape"]), info["dtype"]
            if not 0 <= begin <= stop <= data.size:
                raise ValueError(f"tensor {name!r} lies outside the file")
            if dtype not in _NP_DTYPES:
                views[name] = (dtype, shape)
                continue
            itemsize = np.dtype(_NP_DTYPES[dtype]).itemsize
            if stop - begin != math.prod(shape) * itemsize:
                raise ValueError(f"tensor {name!r}: {stop - begin} bytes for shape {shape}")
            views[name] = np.asarray(data[begin:stop]).view(_NP_DTYPES[dtype]).reshape(shape)
        return views
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{file}: not a readable safetensors file: {e}") from e


def _check_tensors(state: Any, tensors: dict[str, Any]) -> None:
    """Every expected tensor exists with the expected shape and a float dtype, else ValueError."""
    problems, expected = [], set()
    slices = [tensor for key_path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]
              for tensor in hf_tensors(path_str(key_path), leaf.shape)]
    for name, transpose, shape in slices:
        expected.add(name)
        shape = tuple(reversed(shape)) if transpose else shape
        if name not in tensors:
            problems.append(f"missing tensor {name!r} (expected shape {shape})")
            continue
        tensor = tensors[name]
        dtype, actual = tensor if isinstance(tensor, tuple) else (None, tensor.shape)
        if actual != shape:
            problems.append(f"tensor {name!r} has wrong shape: expected {shape}, got {actual}")
        elif dtype is not None:
            problems.append(f"tensor {name!r} has dtype {dtype}, expected one of "
                            f"{', '.join(_FLOAT_DTYPES)}")
    if problems:
        raise ValueError("checkpoint does not match the config:\n  " + "\n  ".join(problems))
    extra = sorted(set(tensors) - expected)
    if extra:
        log.info("ignoring %d unexpected checkpoint tensors: %s", len(extra), ", ".join(extra))


def _abstract_decoder(config: ModelConfig, dtype) -> Decoder:
    """A :class:`Decoder` to trace under ``nnx.eval_shape`` (shapes only). Its draw counter is
    a host integer: a traced counter makes every draw stage an update whose bookkeeping
    scans the whole trace so far, which made tracing quadratic in the number of params."""
    rngs = nnx.Rngs(params=0)
    rngs.params.count.set_raw_value(np.zeros((), np.uint32))
    return Decoder(config, dtype=dtype, param_dtype=dtype, rngs=rngs)


def load_pretrained(path: str | Path, dtype=jnp.bfloat16, mesh: Mesh | None = None) -> Decoder:
    """Load a local HF checkpoint directory into a :class:`Decoder` with params in ``dtype``.

    Each device's shard is read from the memory-mapped files, checked for NaN/inf and
    implausible magnitudes (:data:`MAX_ABS_WEIGHT`) and converted in one host pass (a
    layer-stacked param's layers into one buffer); the device copy applies the HF -> NNX
    transposition. Nothing is compiled; at most one host copy of one param exists at a time.

    Args:
      path: directory with ``config.json`` and ``*.safetensors`` (optionally sharded with
        ``model.safetensors.index.json``), or a GGUF file / a directory holding one
        (converted once, see ``models.gguf``). Never downloads.
      dtype: param and compute dtype.
      mesh: a ('data', 'fsdp', 'tensor') mesh; params are placed with
        :func:`models.partitioning.param_shardings`. Default: the first device.

    Raises:
      FileNotFoundError: missing directory, config.json or safetensors files.
      ValueError: invalid config.json / index JSON, unsupported model_type/feature, missing
        tensor, wrong shape or dtype (all checked before any tensor data is read), or a
        tensor holding NaN/inf or a |w| above :data:`MAX_ABS_WEIGHT` (all such tensors named,
        with their largest |w| and file, once every tensor was read). No
        partial model is returned. Only safetensors are read: pickle ``*.bin`` files and
        ``auto_map`` code are ignored.
    """
    path = checkpoint_dir(path)
    config = read_config(path)
    files = checkpoint_files(path)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: _abstract_decoder(config, dtype)))
    tensors, sources = {}, {}
    for file in files:
        opened = _open_safetensors(file)
        tensors.update(opened)
        sources.update(dict.fromkeys(opened, file.name))
    _check_tensors(state, tensors)
    mesh = mesh if mesh is not None else make_mesh(devices=jax.devices()[:1])
    peaks = dict.fromkeys(tensors, 0.0)

    def read(name, transpose, index, out=None):
        """HF tensor ``name``'s part at NNX ``index`` (HF layout; into ``out`` if given) and
        whether it is a fresh host array, not a memory-map view; its largest |value| goes
        into ``peaks``."""
        part = tensors[name][tuple(reversed(index)) if transpose else index]
        fresh = out is not None or part.dtype != dtype
        if out is None and fresh:
            out = np.empty(part.shape, dtype)
        peaks[name] = max(peaks[name], copy_max_abs(part, out))
        return (out, True) if fresh else (part, False)  # a view: the device copy is the one

    def place(key_path, leaf, sharding):
        param = path_str(key_path)
        hf = hf_tensors(param, leaf.shape)
        shards = []
        for device, index in sharding.addressable_devices_indices_map(leaf.shape).items():
            index = tuple(slice(None) if i is None else i for i in index)
            if not is_layer_stacked(param):
                part, fresh = read(*hf[0][:2], index)
            else:
                layers = range(leaf.shape[0])[index[0]]
                shape = tuple(len(range(n)[i]) for n, i in zip(leaf.shape[1:], index[1:]))
                part = np.empty((len(layers), *(shape[::-1] if hf[0][1] else shape)), dtype)
                for row, i in enumerate(layers):
                    read(*hf[i][:2], index[1:], out=part[row])
                fresh = True
            if hf[0][1]:  # [..., out, in] -> [..., in, out], done by the device copy
                part = np.swapaxes(part, -1, -2)
            shards.append(jax.device_put(part, device, may_alias=fresh))
        return jax.make_array_from_single_device_arrays(leaf.shape, sharding, shards)

    state = jax.tree_util.tree_map_with_path(place, state, param_shardings(state, mesh))
    _check_magnitudes(path, state, peaks, sources)
    return nnx.merge(graphdef, state)


def _check_magnitudes(path: Path, state, peaks: dict[str, float],
                      sources: dict[str, str]) -> None:
    """ValueError naming (in param order) the HF tensors holding NaN/inf, else those whose
    largest |w| exceeds :data:`MAX_ABS_WEIGHT`, with that |w| and their file (``sources``).
    ``peaks``: the largest |value| per tensor this process read (inf for NaN/inf), combined
    across processes, so every process raises, or none."""
    if jax.process_count() > 1:
        names = sorted(peaks)
        local = np.array([peaks[name] for name in names], np.float32)
        gathered = multihost_utils.process_allgather(local).reshape(-1, len(names))
        peaks = dict(zip(names, gathered.max(axis=0).tolist()))
    ordered = [name for key_path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]
               for name, _, _ in hf_tensors(path_str(key_path), leaf.shape)]
    nonfinite = [name for name in ordered if math.isinf(peaks[name])]
    if nonfinite:
        raise ValueError(f"checkpoint {path}: tensor(s) {', '.join(nonfinite)} hold NaN or inf "
                         f"values")
    large = [f"{name} (max |w| {peaks[name]:.2g} in {sources[name]})" for name in ordered
             if peaks[name] > MAX_ABS_WEIGHT]
    if large:
        raise ValueError(f"checkpoint {path}: tensor(s) {', '.join(large)} exceed the "
                         f"plausible weight magnitude {MAX_ABS_WEIGHT:g} (a corrupted file, "
                         f"e.g. a flipped exponent bit)")
