"""Timing on this machine: seconds per call (after a warm-up, or of one call with its arrays
ready), and the measured memory bandwidth and matmul throughput of this machine (the decode
benchmark's floors)."""

from __future__ import annotations

import statistics
import time

import numpy as np


def time_calls(run, repeats: int) -> list[float]:
    """Seconds per call of ``run()`` (which must block until done), after one warm-up."""
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return times


def measure_machine() -> dict:
    """Memory bandwidth (numpy copy, jax read) and fp32 matmul throughput of this machine."""
    import jax
    import jax.numpy as jnp

    def median_time(fn):
        return statistics.median(time_calls(fn, 5))

    n = 64 * 2**20  # 256 MiB of float32
    src, dst = np.ones(n, np.float32), np.empty(n, np.float32)
    copy_rate = 2 * src.nbytes / median_time(lambda: np.copyto(dst, src))
    x = jnp.ones(n, jnp.float32)
    total = jax.jit(jnp.sum)
    read_rate = x.nbytes / median_time(lambda: total(x).block_until_ready())
    a = jnp.ones((2048, 2048), jnp.float32)
    dot = jax.jit(jnp.dot)
    flops = 2 * 2048**3 / median_time(lambda: dot(a, a).block_until_ready())
    return dict(copy_rate=copy_rate, read_rate=read_rate, bandwidth=max(copy_rate, read_rate),
                matmul_flops=flops)


def timed(fn):
    """``(result, seconds)`` of ``fn()`` with its device arrays ready."""
    import jax

    start = time.perf_counter()
    out = jax.block_until_ready(fn())
    return out, time.perf_counter() - start
