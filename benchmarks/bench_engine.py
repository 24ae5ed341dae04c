"""Static vs continuous rollouts on long-tail response lengths, at equal KV memory.

    python benchmarks/bench_engine.py [--rows 128] [--slots 16] [--max-new 96] [--chunk 8]
        [--methods none rkv]

``N`` rows (``--rows``; 4 samples per prompt, 32-token prompts) get per-row response caps
drawn from a lognormal with mean a third of ``--max-new`` (sigma 1, clipped to ``[1,
max-new]``); no EOS, so a row's useful tokens are its cap. Both engines hold ``S``
(``--slots``) rows' KV at a time (equal KV memory): the static engine runs the rows in
``N / S`` ``sampler.generate`` calls of ``S`` rows, each to ``max-new`` (a static batch runs
until its longest row: it cannot stop a row early); the continuous engine
(``engine.run_continuous``, chunk ``--chunk``) retires each row at its cap and refills the slot.

Reported per method: seconds (after a warm-up call of the same shapes: no compile time),
useful tokens/s, decode row-steps wasted (computed slot-steps that produced no useful
token), KV bytes allocated and the peak held (a pool's pages in use), peak rows in flight,
and the ratios to static of useful tokens/s and rows in flight. Dense (and Sparrow) rows
of the continuous engine share a KV page pool (``sampling.pool_pages``) of the static
engine's ``S`` max-length rows; the cell ``none (pool, 4S slots)`` is dense at equal KV
memory with ``4 * S`` slots: how many rows the pool keeps in flight when rows hold only
their pages. Model: a random Qwen2-shaped
decoder (hidden 256, 4 layers, 8 query / 2 KV heads, vocab 2048, fp32), CPU-sized.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import models  # noqa: E402
from sparse_rl_jax.kv.compression_config import CompressionConfig  # noqa: E402
from sparse_rl_jax.kv.compression_sections import EvictionConfig  # noqa: E402
from sparse_rl_jax.rollout.engine import run_continuous  # noqa: E402
from sparse_rl_jax.rollout.sampler import generate  # noqa: E402
from sparse_rl_jax.rollout.sampling_config import SamplingConfig  # noqa: E402
from sparse_rl_jax.training.memory_plan import page_bytes  # noqa: E402

SAMPLES, PROMPT = 4, 32
METHODS = {"none": CompressionConfig(method="none"),
           "rkv": CompressionConfig(method="rkv", eviction=EvictionConfig(budget=48, buffer=16, window=8))}


def long_tail_caps(rng: np.random.Generator, n: int, max_new: int) -> np.ndarray:
    """``[n]`` caps: lognormal (sigma 1) with mean ``max_new / 3``, clipped to [1, max_new]."""
    sigma = 1.0
    mu = np.log(max_new / 3) - sigma ** 2 / 2
    return np.clip(np.rint(rng.lognormal(mu, sigma, n)), 1, max_new).astype(np.int32)


def kv_bytes(cfg, comp, slots: int, max_len: int, pool_pages: int = 0) -> int:
    """Keys + values allocated for ``slots`` rows of ``max_len`` positions: a pool of
    ``pool_pages`` pages, or each row's own cache (``budget + buffer`` slots when evicting)."""
    if pool_pages:
        return pool_pages * page_bytes(cfg, comp.page_size, np.float32)
    per_row = comp.cache_capacity(max_len)
    return slots * per_row * page_bytes(cfg, 1, np.float32)


def timed(fn):
    """``(result, seconds)`` of ``fn()`` with its device arrays ready."""
    start = time.perf_counter()
    out = jax.block_until_ready(fn())
    return out, time.perf_counter() - start


def run_static(graphdef, params, prompt, mask, key, sampling, compression, slots):
    """The rows in static batches of ``slots`` rows: ``(seconds, slot-steps computed)``."""
    per_call = slots // SAMPLES
    seconds = 0.0
    for start in range(0, prompt.shape[0], per_call):
        rows = slice(start, start + per_call)
        _, t = timed(lambda: generate(graphdef, params, prompt[rows], mask[rows],
                                      jax.random.fold_in(key, start), sampling, compression))
        seconds += t
    calls = -(-prompt.shape[0] // per_call)
    return seconds, calls * slots * (sampling.max_new_tokens - 1)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--max-new", type=int, default=96)
    parser.add_argument("--chunk", type=int, default=8)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    args = parser.parse_args(argv)
    if args.rows % args.slots or args.slots % SAMPLES:
        parser.error(f"--rows must be a multiple of --slots, --slots of {SAMPLES}")
    cfg = models.ModelConfig("qwen2", vocab_size=2048, hidden_size=256, intermediate_size=512,
                             num_layers=4, num_heads=8, num_kv_heads=2, head_dim=32,
                             attention_bias=True)
    graphdef, params = nnx.split(models.Decoder(cfg, dtype=jnp.float32,
                                                param_dtype=jnp.float32, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(0)
    prompts = args.rows // SAMPLES
    prompt = rng.integers(3, cfg.vocab_size, (prompts, PROMPT)).astype(np.int32)
    mask = np.ones_like(prompt)
    caps = long_tail_caps(rng, args.rows, args.max_new)
    useful = int(caps.sum())
    sampling = SamplingConfig(max_new_tokens=args.max_new, num_samples=SAMPLES,
                              prompt_bucket=PROMPT, slots=args.slots, chunk=args.chunk)
    print(f"rows {args.rows}, slots {args.slots}, chunk {args.chunk}, max_new {args.max_new}, "
          f"caps mean {caps.mean():.1f} median {np.median(caps):.0f} max {caps.max()}, "
          f"useful tokens {useful}; platform {jax.default_backend()}")
    print("| method | engine | seconds | useful tok/s | row-steps computed | wasted | "
          "KV MiB alloc | KV MiB peak | rows in flight | tok/s ratio | rows ratio |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    max_len, mib = PROMPT + args.max_new, 2 ** 20
    row_pages = -(-max_len // METHODS["none"].page_size)
    cells = [(name, engine, args.slots) for name in args.methods
             for engine in ("static", "continuous")]
    if "none" in args.methods:  # dense at equal KV memory: 4S slots over S rows' pages
        cells.append(("none", "continuous", 4 * args.slots))
    results = {}
    for name, engine, slots in cells:
        comp = METHODS[name]
        if engine == "static":
            def call(k):
                seconds, slot_steps = run_static(graphdef, params, prompt, mask, k, sampling,
                                                 comp, args.slots)
                alloc = kv_bytes(cfg, comp, args.slots, max_len)
                return seconds, slot_steps, alloc, alloc, args.slots, 0
        else:
            pool = args.slots * row_pages if name == "none" else 0
            run = dataclasses.replace(sampling, engine="continuous", slots=slots,
                                      pool_pages=pool)

            def call(k):
                (_, s, steps, sched), seconds = timed(lambda: run_continuous(
                    graphdef, params, prompt, mask, k, run, comp, row_caps=caps))
                alloc = kv_bytes(cfg, comp, s, max_len, pool)
                peak = sched.peak_pages * page_bytes(cfg, comp.page_size, np.float32) \
                    if pool else alloc
                return seconds, s * steps, alloc, peak, sched.peak_live, sched.preemptions
        call(jax.random.key(0))  # warm-up: compiles
        seconds, slot_steps, alloc, peak, in_flight, preempted = call(jax.random.key(1))
        # The prefill draws token 0 of every row: decode row-steps make the other ones.
        wasted = 1 - (useful - args.rows) / slot_steps
        base = results.setdefault(name, (useful / seconds, in_flight))
        label = engine if slots == args.slots else (
            f"continuous (pool, {slots} slots, {preempted} rows preempted)")
        print(f"| {name} | {label} | {seconds:.2f} | {useful / seconds:.0f} | {slot_steps} | "
              f"{wasted:.0%} | {alloc / mib:.2f} | {peak / mib:.2f} | {in_flight} | "
              f"{useful / seconds / base[0]:.2f}x | {in_flight / base[1]:.2f}x |")

if __name__ == "__main__":
    main()
