"""Static vs continuous rollouts on long-tail response lengths, at equal KV memory.

    python benchmarks/bench_engine.py [--rows 128] [--slots 16] [--chunk 8]
        [--insert-prompts 0] [--repeats 2] [--methods none rkv]
        [--dists lognormal walk smollm2]

``N`` rows (``--rows``; 4 samples per prompt, 32-token prompts) get per-row response caps
from a length distribution; no EOS, so a row's useful tokens are its cap:

- ``lognormal``: a lognormal (sigma 1) with mean a third of ``--max-new`` (96), clipped to
  ``[1, max-new]``;
- ``walk``: the walk task's trace lengths (``tasks.walk_task``, default config: its
  solutions plus EOS, i.e. the lengths of a policy that solves every problem; the task's
  ``max_response_tokens`` is the cap);
- ``smollm2``: SmolLM2-135M-Instruct's sampled response lengths on the arithmetic eval set
  (temperature 0.7, cap 256), read from ``benchmarks/results/smollm2_lengths.json``, which
  ``benchmarks/smollm2_lengths.py`` writes (minutes of sampling on a CPU); the first
  ``--rows`` of them, so ``--rows`` is at most the file's row count. Without the file the
  distribution is left out and the output says how to make it.

Both engines hold ``S`` (``--slots``) rows' KV at a time (equal KV memory): the static engine
runs the rows in ``N / S`` ``sampler.generate`` calls of ``S`` rows, each to the cap (a static
batch runs until its longest row: it cannot stop a row early); the continuous engine
(``engine.run_continuous``, chunk ``--chunk``, ``--insert-prompts`` per insert) retires
each row at its cap and refills the slot.

Reported per distribution and method, in one table: seconds (after a warm-up call of the
same shapes: no compile time; the fastest of ``--repeats`` calls, the engines taking
turns), useful tokens/s, decode row-steps wasted (computed slot-steps that produced no
useful token), and the continuous/static ratio of useful tokens/s. Then a
profile per engine from a second, waited-for pass: static ``sampler.prefill`` / ``decode``
seconds, continuous ``insert`` / ``decode_chunk`` seconds and calls, and the host's share
(the rest of the wall time). Last, dense at equal KV memory (lognormal caps): KV bytes
allocated and the peak held, and rows in flight, of the static engine's ``S`` max-length rows
against the continuous engine with ``4 * S`` slots over a shared page pool
(``sampling.pool_pages``) of those ``S`` rows' pages, where rows hold only the pages they
filled. Model: a random Qwen2-shaped decoder (hidden 256, 4 layers, 8 query / 2 KV heads,
vocab 2048, fp32), CPU-sized.
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
from benchmarks.kit.length_caps import (LOGNORMAL_MAX_NEW, PROMPT, SAMPLES,  # noqa: E402
                                        long_tail_caps, smollm2_caps, walk_caps)
from benchmarks.kit.timing import timed  # noqa: E402
from sparse_rl_jax.kv.compression_config import CompressionConfig  # noqa: E402
from sparse_rl_jax.kv.compression_sections import EvictionConfig  # noqa: E402
from sparse_rl_jax.rollout.engine import run_continuous  # noqa: E402
from sparse_rl_jax.rollout.sampler import bucket_prompts, decode, prefill  # noqa: E402
from sparse_rl_jax.rollout.sampling_config import SamplingConfig  # noqa: E402
from sparse_rl_jax.training.memory_plan import page_bytes  # noqa: E402

METHODS = {"none": CompressionConfig(method="none"),
           "rkv": CompressionConfig(method="rkv", eviction=EvictionConfig(budget=48, buffer=16, window=8))}


def run_static(graphdef, params, prompt, mask, key, sampling, compression, slots,
               profile=None):
    """The rows in static batches of ``slots`` rows, each ``sampler.prefill`` then
    ``sampler.decode`` to the cap: ``(seconds, slot-steps computed)``. ``profile``: a dict
    that gets the seconds of the two halves added (each then waited for)."""
    per_call = slots // SAMPLES
    start = time.perf_counter()
    for first in range(0, prompt.shape[0], per_call):
        rows = slice(first, first + per_call)
        tokens, tokens_mask = bucket_prompts(prompt[rows], mask[rows], sampling.prompt_bucket,
                                             compression)
        key_call = jax.random.fold_in(key, first)
        halves = {"prefill": lambda: prefill(
            graphdef, params, jnp.asarray(tokens), jnp.asarray(tokens_mask), key_call,
            sampling=sampling, compression=compression,
            max_len=tokens.shape[1] + sampling.max_new_tokens)}
        halves["decode"] = lambda: decode(graphdef, params, done, key_call, sampling=sampling,
                                          compression=compression)
        for name in ("prefill", "decode"):
            if profile is None:
                done = halves[name]()
            else:
                done, seconds = timed(halves[name])
                profile[name] = profile.get(name, 0.0) + seconds
        jax.block_until_ready(done)
    calls = -(-prompt.shape[0] // per_call)
    return time.perf_counter() - start, calls * slots * (sampling.max_new_tokens - 1)


def profile_line(engine: str, seconds: float, profile: dict) -> str:
    """``engine: part s (share), ..., host s (share)`` of a profiled pass of ``seconds``."""
    parts = {k: v for k, v in profile.items() if isinstance(v, float)}
    calls = {k: v for k, v in profile.items() if isinstance(v, int)}
    host = max(seconds - sum(parts.values()), 0.0)
    text = ", ".join(f"{k} {v:.2f} s ({v / seconds:.0%})" for k, v in parts.items())
    counts = "".join(f", {v} {k}" for k, v in calls.items())
    return f"{engine}: {text}, host {host:.2f} s ({host / seconds:.0%}){counts}"


def bench_cell(graphdef, params, prompt, mask, caps, sampling, comp, slots, repeats):
    """``{engine: (seconds, slot-steps, profile line)}`` for one distribution and method:
    the fastest of ``repeats`` timed calls per engine, the engines taking turns."""
    def static_call(k, profile=None):
        return run_static(graphdef, params, prompt, mask, k, sampling, comp, slots, profile)

    def continuous_call(k, profile=None):
        (_, s, steps, _), seconds = timed(lambda: run_continuous(
            graphdef, params, prompt, mask, k, dataclasses.replace(sampling, engine="continuous"),
            comp, row_caps=caps, profile=profile))
        return seconds, s * steps

    calls = {"static": static_call, "continuous": continuous_call}
    for call in calls.values():
        call(jax.random.key(0))  # warm-up: compiles
    runs = {engine: [] for engine in calls}
    for _ in range(repeats):
        for engine, call in calls.items():
            runs[engine].append(call(jax.random.key(1)))
    results = {}
    for engine, call in calls.items():
        profile = {}
        profiled, _ = call(jax.random.key(1), profile)
        seconds, slot_steps = min(runs[engine])
        results[engine] = seconds, slot_steps, profile_line(engine, profiled, profile)
    return results


def kv_bytes(cfg, comp, slots: int, max_len: int, pool_pages: int = 0) -> int:
    """Keys + values allocated for ``slots`` rows of ``max_len`` positions: a pool of
    ``pool_pages`` pages, or each row's own cache (``budget + buffer`` slots when evicting)."""
    if pool_pages:
        return pool_pages * page_bytes(cfg, comp.page_size, np.float32)
    return slots * comp.cache_capacity(max_len) * page_bytes(cfg, 1, np.float32)


def memory_rows(cfg, graphdef, params, prompt, mask, caps, sampling, slots) -> list[str]:
    """Dense at equal KV memory: the static engine's ``slots`` max-length rows against the
    continuous engine with ``4 * slots`` slots over a pool of those rows' pages (table rows:
    KV MiB allocated / peak held, rows in flight, rows preempted, their ratio)."""
    comp, mib = METHODS["none"], 2 ** 20
    max_len = PROMPT + sampling.max_new_tokens
    pool = slots * -(-max_len // comp.page_size)
    static = kv_bytes(cfg, comp, slots, max_len)
    run = dataclasses.replace(sampling, engine="continuous", slots=4 * slots, pool_pages=pool)
    _, s, _, sched = run_continuous(graphdef, params, prompt, mask, jax.random.key(1), run, comp,
                                    row_caps=caps)
    peak = sched.peak_pages * page_bytes(cfg, comp.page_size, np.float32)
    return [f"| static, {slots} slots | {static / mib:.2f} | {static / mib:.2f} | {slots} | 0 "
            f"| 1.00x |",
            f"| continuous, {s} slots, pool of {pool} pages | "
            f"{kv_bytes(cfg, comp, s, max_len, pool) / mib:.2f} | {peak / mib:.2f} | "
            f"{sched.peak_live} | {sched.preemptions} | "
            f"{sched.peak_live / slots:.2f}x |"]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=SamplingConfig.chunk)
    parser.add_argument("--insert-prompts", type=int, default=SamplingConfig.insert_prompts)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--dists", nargs="+", default=["lognormal", "walk", "smollm2"],
                        choices=["lognormal", "walk", "smollm2"])
    args = parser.parse_args(argv)
    if args.rows % args.slots or args.slots % SAMPLES:
        parser.error(f"--rows must be a multiple of --slots, --slots of {SAMPLES}")
    cfg = models.ModelConfig("qwen2", vocab_size=2048, hidden_size=256, intermediate_size=512,
                             num_layers=4, num_heads=8, num_kv_heads=2, head_dim=32,
                             attention_bias=True)
    graphdef, params = nnx.split(models.Decoder(cfg, dtype=jnp.float32,
                                                param_dtype=jnp.float32, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, cfg.vocab_size, (args.rows // SAMPLES, PROMPT)).astype(np.int32)
    mask = np.ones_like(prompt)
    dists = {"lognormal": (long_tail_caps(rng, args.rows, LOGNORMAL_MAX_NEW), LOGNORMAL_MAX_NEW)}
    if "walk" in args.dists:
        dists["walk"] = walk_caps(args.rows)
    skipped = {}
    if "smollm2" in args.dists:
        found = smollm2_caps(args.rows)
        if isinstance(found, str):
            skipped["smollm2"] = found
        else:
            dists["smollm2"] = found
    print(f"rows {args.rows}, slots {args.slots}, chunk {args.chunk}, insert_prompts "
          f"{args.insert_prompts}; platform {jax.default_backend()}")
    for name in args.dists:
        if name in dists:
            caps, max_new = dists[name]
            print(f"{name}: max_new {max_new}, caps mean {caps.mean():.1f} median "
                  f"{np.median(caps):.0f} max {caps.max()}, useful tokens {caps.sum()}")
        else:
            print(f"{name}: {skipped[name]}")
    print("| dist | method | static s | continuous s | static tok/s | continuous tok/s | "
          "wasted static | wasted continuous | ratio |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    profiles = []
    for dist in (d for d in args.dists if d in dists):
        caps, max_new = dists[dist]
        sampling = SamplingConfig(max_new_tokens=max_new, num_samples=SAMPLES,
                                  prompt_bucket=PROMPT, slots=args.slots, chunk=args.chunk,
                                  insert_prompts=args.insert_prompts)
        useful = int(caps.sum())
        for name in args.methods:
            res = bench_cell(graphdef, params, prompt, mask, caps, sampling, METHODS[name],
                             args.slots, args.repeats)
            # The prefill draws token 0 of every row: decode row-steps make the other ones.
            wasted = {e: 1 - (useful - args.rows) / r[1] for e, r in res.items()}
            tps = {e: useful / r[0] for e, r in res.items()}
            print(f"| {dist} | {name} | {res['static'][0]:.2f} | {res['continuous'][0]:.2f} | "
                  f"{tps['static']:.0f} | {tps['continuous']:.0f} | {wasted['static']:.0%} | "
                  f"{wasted['continuous']:.0%} | {tps['continuous'] / tps['static']:.2f}x |")
            profiles += [f"{dist} {name} {r[2]}" for r in res.values()]
    print("\nprofile (a second, waited-for pass):")
    print("\n".join(profiles))
    caps, max_new = dists["lognormal"]
    print("\ndense (none) at equal KV memory, lognormal caps:")
    print("| engine | KV MiB alloc | KV MiB peak | rows in flight | preempted | rows ratio |")
    print("|---|---:|---:|---:|---:|---:|")
    print("\n".join(memory_rows(cfg, graphdef, params, prompt, mask, caps, SamplingConfig(
        max_new_tokens=max_new, num_samples=SAMPLES, prompt_bucket=PROMPT, chunk=args.chunk,
        insert_prompts=args.insert_prompts), args.slots)))


if __name__ == "__main__":
    main()
