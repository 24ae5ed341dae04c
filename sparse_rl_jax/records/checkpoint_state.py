"""What a training checkpoint holds, and the base checkpoint a LoRA run's adapters belong to.

The state written at each step is ``{"params": trainable params, "opt_state": ...}``
(:func:`train_state`): every weight when the whole policy is trained; with LoRA adapters
(``model.lora``) the adapters alone (``models.split_trainable``), since the frozen base is
the checkpoint the run loaded, read again on resume. Its meta records that base under
``lora_base`` (:func:`base_record`: the HF directory and :func:`base_fingerprint`), and a
restore onto a different base is refused naming the field (:func:`check_base`). The rest of
the train state (step, data position, seed, ...) is JSON meta, written by the trainer.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from models.lora import split_trainable
from sparse_rl_jax.records.checkpoint_errors import CheckpointError

SAMPLE_BYTES = 4096
"""Bytes of each tensor's head and tail that :func:`base_fingerprint` hashes."""

BASE_KEY = "lora_base"
"""The checkpoint meta key of a LoRA run's base: ``{"path": ..., "fingerprint": ...}``."""


def _hash_safetensors(digest, file: Path) -> None:
    """Feeds ``file``'s name, size, header (tensor names, dtypes, shapes, offsets) and the
    first and last :data:`SAMPLE_BYTES` of every tensor's data to ``digest``."""
    size = file.stat().st_size
    with file.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header_bytes = f.read(header_len)
        header = json.loads(header_bytes)
        digest.update(f"{file.name}:{size}:".encode() + header_bytes)
        start = 8 + header_len
        for name in sorted(k for k in header if k != "__metadata__"):
            begin, end = header[name]["data_offsets"]
            for offset in sorted({begin, max(begin, end - SAMPLE_BYTES)}):
                f.seek(start + offset)
                digest.update(f.read(min(SAMPLE_BYTES, end - offset)))


def base_fingerprint(path: str | Path) -> str:
    """A cheap content fingerprint of the HF checkpoint directory ``path`` (16 hex digits).

    sha256 over ``config.json``'s parsed content and, for every ``*.safetensors`` file (by
    name), its size, its header (every tensor's name, dtype, shape and offsets) and the first
    and last :data:`SAMPLE_BYTES` of each tensor's bytes: at most 8 KiB a tensor (about
    2.7 MiB for the 339 tensors of a Qwen2.5-7B checkpoint), never the whole weights. It
    depends on the content only, never on paths or modification times, so a copied or moved
    checkpoint keeps it; another architecture, dtype or a fine-tune (which changes every
    tensor it touches, so their sampled bytes) gets another one. A change confined to the
    middle of a tensor larger than 8 KiB goes unseen.
    """
    path = Path(path)
    digest = hashlib.sha256()
    config = path / "config.json"
    if config.is_file():
        digest.update(json.dumps(json.loads(config.read_text()), sort_keys=True).encode())
    for file in sorted(path.glob("*.safetensors")):
        _hash_safetensors(digest, file)
    return digest.hexdigest()[:16]


def base_record(path: str | Path) -> dict[str, str]:
    """``{"path", "fingerprint"}`` of the base checkpoint directory ``path`` (meta JSON)."""
    return {"path": str(Path(path).resolve()), "fingerprint": base_fingerprint(path)}


def check_base(meta: dict[str, Any], base: dict[str, str], where: str) -> None:
    """CheckpointError naming ``model.path`` when the checkpoint meta's ``lora_base`` (a
    LoRA checkpoint's) records another base than ``base`` (:func:`base_record` of the
    checkpoint the adapters would be applied to now); ``where`` names the checkpoint. The
    fingerprints are compared, so a moved or copied base passes; so does a meta without
    ``lora_base`` (not a LoRA checkpoint)."""
    recorded = meta.get(BASE_KEY)
    if recorded is not None and recorded.get("fingerprint") != base["fingerprint"]:
        raise CheckpointError(
            f"{where}: its LoRA adapters were trained on the base model at "
            f"{recorded.get('path')} ({BASE_KEY}.fingerprint={recorded.get('fingerprint')}), "
            f"but model.path now loads {base['path']} (fingerprint {base['fingerprint']}); "
            "point model.path at the base the run started from")


def train_state(params, opt_state, lagged=()) -> dict[str, Any]:
    """The pytree a checkpoint stores: ``{"params": the trainable params, "opt_state"}``
    (``models.split_trainable``: the LoRA params alone when ``params`` has adapters), plus,
    when ``lagged`` holds older param versions (async mode's in-flight rollouts are drawn
    from them, ``async_lag``), their trainable parts under ``"lagged"``."""
    state = {"params": split_trainable(params)[0], "opt_state": opt_state}
    if lagged:
        state["lagged"] = [split_trainable(p)[0] for p in lagged]
    return state


def abstract_like(tree):
    """``ShapeDtypeStruct`` s of ``tree``'s leaves (arrays or abstract ones), keeping their
    shardings: a ``Checkpointer.restore`` target."""
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
        tree)


def restore_target(params, opt_state, lagged: int = 0) -> dict[str, Any]:
    """The abstract :func:`train_state` of ``params`` and ``opt_state`` (arrays or abstract;
    their shardings kept) with ``lagged`` older versions shaped like ``params``: the target
    to restore a checkpoint onto."""
    return abstract_like(train_state(params, opt_state, [params] * lagged))


def restored_params(saved, params):
    """The full params from a restored :func:`train_state`'s ``saved["params"]``: with LoRA
    the restored adapters on the frozen base of ``params``, else ``saved["params"]``."""
    return _merged(saved["params"], params)


def restored_lagged(saved, params) -> list:
    """The full older param versions of a restored :func:`train_state` (oldest first; none
    when it holds none), each merged like :func:`restored_params`."""
    return [_merged(p, params) for p in saved.get("lagged", [])]


def _merged(trainable, params):
    """``trainable`` on the frozen part of ``params`` (LoRA), or ``trainable`` itself."""
    frozen = split_trainable(params)[1]
    return nnx.merge_state(trainable, frozen) if jax.tree.leaves(frozen) else trainable
