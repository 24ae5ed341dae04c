"""Memory and time of scoring with a Sparrow page-selection replay, this checkout vs another.

    python benchmarks/bench_page_replay.py --before /work/main [--lengths 256 512 1024 2048]

``scoring.score(..., PageRecord(...))`` on a tiny-width Qwen2-shaped model (hidden 64, 4
layers, 4 query / 2 KV heads, head_dim 16, vocab 512, fp32, random weights) for 4 rows of a
64-token prompt plus ``S - 64`` response tokens, with a random selection record of 16-token
pages (k = 8: sink + 8 + 2 newest pages a step, all layers sparse). Each side runs in its own
child process that imports the library from its checkout: XLA's ``memory_analysis()`` of the
compiled call (temp = transient buffers; peak = temp + arguments + outputs, MiB), and the
best of ``--repeats`` steady calls (ms). Ratios are before / this (above 1: this is better).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
ROWS, PROMPT, PAGE, TOP_K = 4, 64, 16, 8


def random_record(rng: np.random.Generator, layers: int, kv_heads: int, new: int) -> np.ndarray:
    """``[L, N, Hkv, M, K]`` int32: per step the sink, ``TOP_K`` random middle pages and the 2
    newest pages of the cached length (``-1`` where fewer pages exist)."""
    k = TOP_K + 3
    record = np.full((layers, ROWS, kv_heads, new, k), -1, np.int32)
    for r in range(new):
        n = -(-(PROMPT + r + 1) // PAGE)
        if n <= k:
            record[:, :, :, r, :n] = np.arange(n)
            continue
        middle = rng.random((layers, ROWS, kv_heads, n - 3)).argsort(-1)[..., :TOP_K] + 1
        record[:, :, :, r] = np.concatenate(
            [np.zeros(middle.shape[:-1] + (1,), np.int32), middle,
             np.broadcast_to([n - 2, n - 1], middle.shape[:-1] + (2,))], axis=-1)
    return record


def worker(length: int, repeats: int) -> dict:
    """Compiled memory and steady time of one page-replay score of ``length`` columns."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import models
    from sparse_rl_jax.kv.page_sparsity import PageRecord
    from sparse_rl_jax.rollout.scoring import score

    cfg = models.ModelConfig("qwen2", vocab_size=512, hidden_size=64, intermediate_size=128,
                             num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
                             attention_bias=True)
    model = models.Decoder(cfg, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    rng = np.random.default_rng(0)
    new = length - PROMPT
    prompt = jnp.asarray(rng.integers(1, 512, (ROWS, PROMPT)), jnp.int32)
    mask = jnp.ones((ROWS, PROMPT), jnp.int32)
    response = jnp.asarray(rng.integers(1, 512, (ROWS, new)), jnp.int32)
    record = jnp.asarray(random_record(rng, cfg.num_layers, cfg.num_kv_heads, new))
    args = (graphdef, params, prompt, mask, response)
    if "[N, L, Hkv, M, K]" in PageRecord.__doc__:  # rows first since Rollout.record
        record = jnp.moveaxis(record, 1, 0)        # (a --before checkout may predate it)
    kw = dict(record=PageRecord(record, PAGE))
    stats = score.lower(*args, **kw).compile().memory_analysis()
    jax.block_until_ready(score(*args, **kw))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(score(*args, **kw).logp)
        times.append(time.perf_counter() - start)
    mib = 2**20
    return {"length": length, "temp": stats.temp_size_in_bytes / mib,
            "peak": (stats.temp_size_in_bytes + stats.argument_size_in_bytes
                     + stats.output_size_in_bytes) / mib, "ms": 1e3 * min(times)}


def run_side(checkout: str, lengths: list[int], repeats: int) -> list[dict]:
    """One child process per length, importing the library from ``checkout``."""
    env = dict(os.environ, PYTHONPATH=checkout)
    rows = []
    for length in lengths:
        out = subprocess.run([sys.executable, __file__, "--worker", str(length),
                              "--repeats", str(repeats)], env=env, check=True,
                             capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", help="checkout to compare against (required)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        print(json.dumps(worker(args.worker, args.repeats)))
        return
    if args.before is None:
        parser.error("--before: the checkout to compare against is required")
    if any(length <= PROMPT for length in args.lengths):
        raise SystemExit(f"--lengths: each must exceed the {PROMPT}-token prompt")
    before = run_side(args.before, args.lengths, args.repeats)
    after = run_side(str(ROOT), args.lengths, args.repeats)
    print(f"before {args.before}  this {ROOT}  ({ROWS} rows, 4 layers, 2 KV heads, "
          f"pages of {PAGE}, k={TOP_K})")
    print(f"{'S':>6} {'temp MiB before/this':>22} {'ratio':>7} {'peak MiB before/this':>22} "
          f"{'ratio':>7} {'ms before/this':>18} {'ratio':>7}")
    for b, a in zip(before, after):
        print(f"{b['length']:>6} {b['temp']:>11.1f}/{a['temp']:<10.1f} "
              f"{b['temp'] / a['temp']:>6.1f}x {b['peak']:>11.1f}/{a['peak']:<10.1f} "
              f"{b['peak'] / a['peak']:>6.1f}x {b['ms']:>9.1f}/{a['ms']:<8.1f} "
              f"{b['ms'] / a['ms']:>6.2f}x")


if __name__ == "__main__":
    main()
