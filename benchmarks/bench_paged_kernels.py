"""One decode step's attention over one layer of a full paged cache: the Pallas page kernel
(``model.attention: pallas_gpu`` / ``pallas_tpu``) vs the XLA chunked read (``xla``).

    PYTHONPATH=. python benchmarks/bench_paged_kernels.py            # Qwen2.5-1.5B heads
    PYTHONPATH=. python benchmarks/bench_paged_kernels.py --cpu-scaled   # tiny, interpreted

Prints ms per call, the bytes floor (every resident key and value read once) and each
path's time against the HBM floor given ``--hbm-gbps``, and the side-by-side ratio. Off the
kernel's platform the kernel runs in Pallas interpret mode: those times only show that it
runs, nothing about speed.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from models.attention_backends import resolve_attention
from models.paged_cache import PagedKVCache


def _time(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` after one warm-up (compile) call."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main(argv=None) -> list[dict]:
    """Run the comparison; returns one row per path."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--kernel", default="auto", choices=("auto", "pallas_gpu", "pallas_tpu"))
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--hbm-gbps", type=float, default=4800.0, help="H200: 4.8 TB/s")
    parser.add_argument("--cpu-scaled", action="store_true",
                        help="tiny shapes (batch 2, context 64, 2 repeats) for a CPU")
    args = parser.parse_args(argv)
    if args.cpu_scaled:
        args.batch, args.context, args.repeats, args.head_dim = 2, 64, 2, 16
    kernel = args.kernel
    if kernel == "auto":  # this platform's kernel, else the GPU one interpreted
        kernel = resolve_attention("auto", jax.default_backend())
        kernel = "pallas_gpu" if kernel == "blockwise" else kernel
    dtype = jnp.dtype(args.dtype)
    rng = np.random.default_rng(0)
    shape = (1, args.batch, args.kv_heads, args.context, args.head_dim)
    k, v = (jnp.asarray(rng.normal(size=shape), dtype) for _ in range(2))
    cache = PagedKVCache(k=k, v=v, pos=jnp.broadcast_to(jnp.arange(args.context, dtype=jnp.int32),
                                                        (args.batch, args.context)),
                         index=jnp.asarray(args.context, jnp.int32), page_size=args.page_size,
                         chunk_pages=32)
    q = jnp.asarray(rng.normal(size=(args.batch, 1, args.heads, args.head_dim)), dtype)
    q_pos = jnp.full((args.batch, 1), args.context - 1, jnp.int32)
    floor_bytes = 2 * k.size * dtype.itemsize
    rows = []
    for name, backend in (("xla", "blockwise"), (kernel, kernel)):
        read = jax.jit(lambda c, q, p, b=backend: c.read(jnp.asarray(0), q, p, b))
        seconds = _time(lambda: read(cache, q, q_pos), args.repeats)
        rows.append(dict(path=name, ms=seconds * 1e3,
                         x_floor=seconds / (floor_bytes / (args.hbm_gbps * 1e9))))
    print(f"backend {jax.default_backend()}, batch {args.batch}, context {args.context}, "
          f"page {args.page_size}, heads {args.heads}/{args.kv_heads} x {args.head_dim}, "
          f"{args.dtype}: floor {floor_bytes / 1e6:.1f} MB per layer")
    print("| path | ms per call | x HBM floor |\n|---|---|---|")
    for row in rows:
        print(f"| {row['path']} | {row['ms']:.3f} | {row['x_floor']:.2f} |")
    print(f"kernel / xla time: {rows[1]['ms'] / rows[0]['ms']:.2f}x")
    return rows


if __name__ == "__main__":
    main()
