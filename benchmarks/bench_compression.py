"""Cost of one KV compression vs one decode step, and the amortised overhead per token.

A compression runs once every ``buffer`` decode steps, so its overhead per generated token is
``compress_time / buffer / decode_step_time``. The decode step is timed as a jitted
``fori_loop`` of ``buffer`` greedy ``models.Decoder`` steps over the full ``budget + buffer``
cache (donated state, query-ring push included) divided by ``buffer``; one compression as a
jitted, donated ``kv_state.compress`` of a full cache. Medians over ``--repeats``.
Defaults: the paper's cache shape (budget 512, buffer 128, window 8) on a CPU-sized model
(8 layers, 8 query / 2 KV heads, head_dim 64, batch 8), float32.

    python benchmarks/bench_compression.py [--batch 8 --layers 8 --repeats 5 ...]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from models import Decoder, ModelConfig
from sparse_rl_jax.kv import state as kv_state
from sparse_rl_jax.kv.compression_config import CompressionConfig
from sparse_rl_jax.kv.compression_sections import EvictionConfig

# (label, method, EvictionConfig fields beyond the budget, buffer and window of the flags)
VARIANTS = [
    ("snapkv", "snapkv", {}),
    ("snapkv shared", "snapkv", dict(head_mode="shared")),
    ("snapkv kvpress", "snapkv", dict(importance="kvpress_snapkv")),
    ("rkv", "rkv", {}),
    ("rkv shared", "rkv", dict(head_mode="shared")),
    ("streaming", "streaming", {}),
]


def _time(fn, state, *args, repeats: int) -> float:
    """Median seconds of ``fn(fresh copy of state, *args)`` (``state`` is donated) after a
    warm-up (compile) call; the copy is made outside the timed region."""
    jax.block_until_ready(fn(jax.tree.map(jnp.copy, state), *args))
    times = []
    for _ in range(repeats):
        fresh = jax.block_until_ready(jax.tree.map(jnp.copy, state))
        start = time.perf_counter()
        jax.block_until_ready(fn(fresh, *args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _filled_state(cfg: CompressionConfig, model_cfg: ModelConfig, batch: int, index: int):
    """A state holding random keys/values/queries for positions ``[0, index)``."""
    state = kv_state.init_state(
        cfg, num_layers=model_cfg.num_layers, batch=batch, num_heads=model_cfg.num_heads,
        num_kv_heads=model_cfg.num_kv_heads, head_dim=model_cfg.head_dim, max_len=4 * cfg.capacity,
    )
    rng = np.random.default_rng(0)
    c = state.cache
    slot = jnp.arange(cfg.capacity, dtype=jnp.int32)
    cache = c.replace(
        k=jnp.asarray(rng.normal(size=c.k.shape), c.k.dtype),
        v=jnp.asarray(rng.normal(size=c.v.shape), c.v.dtype),
        pos=jnp.broadcast_to(jnp.where(slot < index, slot, -1), c.pos.shape),
        index=jnp.int32(index),
        queries=jnp.asarray(rng.normal(size=c.queries.shape), c.queries.dtype),
    )
    return state.replace(cache=cache)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--buffer", type=int, default=128)
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    model_cfg = ModelConfig(
        model_type="qwen2", vocab_size=args.vocab, hidden_size=args.heads * args.head_dim,
        intermediate_size=args.intermediate, num_layers=args.layers, num_heads=args.heads,
        num_kv_heads=args.kv_heads, head_dim=args.head_dim, attention_bias=True,
    )
    model = Decoder(model_cfg, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    base = dict(budget=args.budget, buffer=args.buffer, window=args.window)

    def chunk(state, params):
        """``buffer`` greedy decode steps from ``index = budget`` (positions continue)."""

        def step(i, carry):
            state, tokens = carry
            positions = jnp.full((args.batch, 1), args.budget + i, jnp.int32)
            out = nnx.merge(graphdef, params)(tokens, positions, kv=state.cache)
            state = state.replace(cache=out.kv)
            return state, jnp.argmax(out.logits[:, -1], axis=-1)[:, None].astype(jnp.int32)

        return lax.fori_loop(0, args.buffer, step, (state, jnp.zeros((args.batch, 1), jnp.int32)))

    chunk_jit = jax.jit(chunk, donate_argnums=0)
    compress_jit = jax.jit(kv_state.compress, static_argnums=1, donate_argnums=0)
    cfg0 = CompressionConfig(eviction=EvictionConfig(**base))
    start = _filled_state(cfg0, model_cfg, args.batch, args.budget)
    t_chunk = _time(chunk_jit, start, params, repeats=args.repeats)
    t_decode = t_chunk / args.buffer

    print(
        f"device={jax.devices()[0].device_kind}  model: L={args.layers} Hq={args.heads} "
        f"Hkv={args.kv_heads} D={args.head_dim} hidden={args.heads * args.head_dim} "
        f"vocab={args.vocab}  batch={args.batch}  cache: budget={args.budget} "
        f"buffer={args.buffer} window={args.window} (C={cfg0.capacity}), float32"
    )
    print(f"decode step (Decoder + query push, in a fori_loop): {t_decode * 1e3:.3f} ms")
    header = f"{'method':<16}{'compress ms':>13}{'x decode':>10}{'overhead/token':>16}"
    print(header)
    print("-" * len(header))
    for name, method, kw in VARIANTS:
        cfg = CompressionConfig(method=method, eviction=EvictionConfig(**base, **kw))
        full = _filled_state(cfg, model_cfg, args.batch, cfg.capacity)
        t_comp = _time(compress_jit, full, cfg, repeats=args.repeats)
        overhead = 100.0 * t_comp / args.buffer / t_decode
        print(f"{name:<16}{t_comp * 1e3:13.3f}{t_comp / t_decode:10.2f}{overhead:15.2f}%")


if __name__ == "__main__":
    main()
