"""Quantized rollout KV at equal KV bytes: rows in flight and useful tokens/s of the continuous
engine for ``compression.quant`` none / int8 / int4, with and without R-KV eviction.

    python benchmarks/bench_kv_quant.py [--rows 64] [--slots 8] [--repeats 2]
        [--quants none int8 int4] [--methods none rkv]

The KV byte budget is what ``--slots`` rows take in a bf16 slot cache (``models.KVCache``:
keys, values and positions, ``memory_plan.kv_cache_bytes``) at the method's capacity (dense:
prompt + ``max_new`` slots; ``rkv``: budget + buffer). Each quant level gets as many slots
as fit in that budget (codes, bfloat16 scales and positions included), and the continuous
engine (``engine.run_continuous``) runs ``--rows`` rows with lognormal response caps through
them (the lengths of ``bench_engine.py``; no EOS, so a row's useful tokens are its cap).
``pool`` (``none`` on the paged layout) shares a page pool instead: the budget is the bf16
pages of ``--slots`` max-length rows, each level gets the pages that fit in those bytes
(``memory_plan.page_bytes``), the engine ``4 x`` the slots whose max-length rows the pool
holds (at most ``--rows``), and rows in flight are measured (the schedule's peak), not
arithmetic: rows hold only the pages they fill. Reported per method and level: bytes per
token (keys + values of every layer and KV head), rows in flight, their ratio to none,
seconds (the fastest of ``--repeats`` calls after a warm-up of the same shapes) and useful
tokens/s with its ratio to none. Model: a random
Qwen2-shaped bf16 decoder with head_dim 128 (the Qwen2.5 head size; 2 layers, 2 query / 1 KV
heads, vocab 2048), CPU-sized.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import models  # noqa: E402
from benchmarks.kit.length_caps import LOGNORMAL_MAX_NEW, PROMPT, SAMPLES, long_tail_caps  # noqa: E402
from benchmarks.kit.timing import timed  # noqa: E402
from sparse_rl_jax.kv.compression_config import CompressionConfig  # noqa: E402
from sparse_rl_jax.kv.compression_sections import EvictionConfig  # noqa: E402
from sparse_rl_jax.rollout.engine import run_continuous  # noqa: E402
from sparse_rl_jax.rollout.sampling_config import SamplingConfig  # noqa: E402
from sparse_rl_jax.training.memory_plan import (kv_bytes_per_token, kv_cache_bytes,  # noqa: E402
                                                page_bytes)

METHODS = {"none": dict(method="none", layout="dense"),
           "rkv": dict(method="rkv", eviction=EvictionConfig(budget=48, buffer=16, window=8)),
           "pool": dict(method="none", layout="paged")}
QUANTS = ("none", "int8", "int4")


def bench_model() -> tuple[models.ModelConfig, nnx.GraphDef, nnx.State]:
    """A random bf16 Qwen2-shaped decoder with head_dim 128."""
    cfg = models.ModelConfig("qwen2", vocab_size=2048, hidden_size=256, intermediate_size=512,
                             num_layers=2, num_heads=2, num_kv_heads=1, head_dim=128,
                             attention_bias=True)
    graphdef, params = nnx.split(models.Decoder(cfg, dtype=jnp.bfloat16,
                                                param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    return cfg, graphdef, params


def slots_at_equal_bytes(cfg, comp: CompressionConfig, budget_bytes: int, max_len: int) -> int:
    """Rows of ``comp``'s slot cache (its quant level) that fit in ``budget_bytes``."""
    per_row = kv_cache_bytes(cfg, 1, comp.cache_capacity(max_len), jnp.bfloat16,
                             quant=comp.quant)
    return budget_bytes // per_row


def engine_plan(cfg, comp: CompressionConfig, bf16_rows: int, rows: int,
                max_len: int) -> dict[str, int]:
    """``slots`` (and ``pool_pages`` for the paged layout) of ``comp``'s quant level in the KV
    bytes of ``bf16_rows`` max-length bf16 rows of the same layout."""
    if comp.cache_layout != "paged":
        budget = kv_cache_bytes(cfg, bf16_rows, comp.cache_capacity(max_len), jnp.bfloat16)
        return dict(slots=slots_at_equal_bytes(cfg, comp, budget, max_len))
    row_pages = -(-max_len // comp.page_size)
    budget = bf16_rows * row_pages * page_bytes(cfg, comp.page_size, jnp.bfloat16)
    pages = budget // page_bytes(cfg, comp.page_size, jnp.bfloat16, comp.quant)
    return dict(slots=min(rows, 4 * (pages // row_pages)), pool_pages=pages)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--slots", type=int, default=8, help="bf16 rows the KV budget holds")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quants", nargs="+", default=list(QUANTS), choices=list(QUANTS))
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    args = parser.parse_args(argv)
    if args.rows % SAMPLES:
        parser.error(f"--rows must be a multiple of {SAMPLES}")
    cfg, graphdef, params = bench_model()
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, cfg.vocab_size, (args.rows // SAMPLES, PROMPT)).astype(np.int32)
    mask = np.ones_like(prompt)
    caps = long_tail_caps(rng, args.rows, LOGNORMAL_MAX_NEW)
    useful, max_len = int(caps.sum()), PROMPT + LOGNORMAL_MAX_NEW
    print(f"rows {args.rows}, KV budget = {args.slots} bf16 rows; caps mean {caps.mean():.1f} "
          f"max {caps.max()}, useful tokens {useful}; platform {jax.default_backend()}")
    print("| method | quant | bytes/token | rows in flight | vs none | seconds | useful tok/s "
          "| vs none |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for method in args.methods:
        base = None
        for quant in args.quants:
            comp = CompressionConfig(**METHODS[method], quant=quant)
            plan = engine_plan(cfg, comp, args.slots, args.rows, max_len)
            sampling = SamplingConfig(max_new_tokens=LOGNORMAL_MAX_NEW, num_samples=SAMPLES,
                                      prompt_bucket=PROMPT, engine="continuous", **plan)

            def call(key, sampling=sampling, comp=comp):
                return run_continuous(graphdef, params, prompt, mask, key, sampling, comp,
                                      row_caps=caps)

            schedule = call(jax.random.key(0))[3]  # warm-up: compiles
            in_flight = schedule.peak_live if "pool_pages" in plan else plan["slots"]
            seconds = min(timed(lambda: call(jax.random.key(1)))[1]
                          for _ in range(args.repeats))
            tps = useful / seconds
            base = base or (in_flight, tps)
            label = (f"{method}, {plan['pool_pages']} pages / {plan['slots']} slots"
                     if "pool_pages" in plan else method)
            print(f"| {label} | {quant} | {kv_bytes_per_token(cfg, quant, jnp.bfloat16)} | "
                  f"{in_flight} | {in_flight / base[0]:.2f}x | {seconds:.2f} | {tps:.0f} | "
                  f"{tps / base[1]:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
