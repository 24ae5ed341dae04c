"""Cost of one dense decode step against the tokens a row holds: the slot cache
(``models.KVCache``, attends over every slot) vs the paged cache (``models.PagedKVCache``,
reads only the filled pages) at several chunk sizes of its loop.

Each cell times a jitted ``fori_loop`` of ``--steps`` greedy ``models.Decoder`` forwards (one
token per row; the write index is held at ``fill``, so every step sees the same ``fill``
resident tokens) in a cache of ``--capacity`` slots, random keys/values; best of
``--repeats`` rounds, cells round-robin so load drift on a shared machine hits all alike.
Model: the decode benchmark's CPU shape (Qwen2-like, hidden 512, 8 layers, 8 query / 2 KV
heads, head_dim 64, intermediate 1408, vocab 32000), random weights, float32.

    python benchmarks/bench_paged_step.py [--fills 256 1024 4096] [--chunks 1 2 4 8 16]
        [--capacity 4128] [--batch 8]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import Decoder, ModelConfig, init_cache, init_paged_cache


def filled(cache, fill: int):
    """``cache`` holding random keys/values at positions ``[0, fill)``, index ``fill``."""
    rng = np.random.default_rng(0)
    slot = jnp.arange(cache.capacity, dtype=jnp.int32)
    return cache.replace(
        k=jnp.asarray(rng.normal(size=cache.k.shape), cache.k.dtype),
        v=jnp.asarray(rng.normal(size=cache.v.shape), cache.v.dtype),
        pos=jnp.broadcast_to(jnp.where(slot < fill, slot, -1), cache.pos.shape),
        index=jnp.int32(fill))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fills", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4, 8, 16],
                        help="pages per iteration of the paged loop")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--capacity", type=int, default=4128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    cfg = ModelConfig(model_type="qwen2", vocab_size=32000, hidden_size=512,
                      intermediate_size=1408, num_layers=8, num_heads=8, num_kv_heads=2,
                      head_dim=64, attention_bias=True, tie_word_embeddings=True)
    graphdef, params = nnx.split(Decoder(cfg, dtype=jnp.float32, param_dtype=jnp.float32,
                                         rngs=nnx.Rngs(0)))
    dims = (cfg.num_layers, args.batch, cfg.num_kv_heads)
    caches = {"dense": init_cache(*dims, args.capacity, cfg.head_dim)}
    for c in args.chunks:
        caches[f"paged c{c}"] = init_paged_cache(*dims, args.capacity, cfg.head_dim,
                                                 page_size=args.page_size, chunk_pages=c)

    @jax.jit
    def steps(params, cache):
        model = nnx.merge(graphdef, params)

        def step(_, carry):
            cache, tokens = carry
            positions = jnp.broadcast_to(cache.index, (args.batch, 1))
            out = model(tokens, positions, kv=cache, return_logits=False)
            tokens = jnp.argmax(model.unembed(out.hidden[:, 0]), -1)[:, None]
            return out.kv.replace(index=cache.index), tokens.astype(jnp.int32)

        start = (cache, jnp.zeros((args.batch, 1), jnp.int32))
        return jax.lax.fori_loop(0, args.steps, step, start)

    cells = [(fill, name) for fill in args.fills for name in caches]
    states = {(fill, name): filled(caches[name], fill) for fill, name in cells}
    best = {}
    for cell in cells:  # compile
        jax.block_until_ready(steps(params, states[cell]))
    for _ in range(args.repeats):
        for cell in cells:
            start = time.perf_counter()
            jax.block_until_ready(steps(params, states[cell]))
            seconds = (time.perf_counter() - start) / args.steps
            best[cell] = min(best.get(cell, seconds), seconds)

    print(f"decode step ms (best of {args.repeats} x {args.steps} steps), batch {args.batch}, "
          f"capacity {args.capacity} slots, page size {args.page_size}, "
          f"{jax.devices()[0].device_kind}; ratio = dense / paged")
    names = list(caches)
    print(f"{'fill':>6}" + "".join(f"{n:>10}" for n in names)
          + "".join(f"{'x ' + n[6:]:>8}" for n in names[1:]))
    for fill in args.fills:
        dense = best[(fill, "dense")]
        print(f"{fill:>6}" + "".join(f"{best[(fill, n)] * 1e3:>10.2f}" for n in names)
              + "".join(f"{dense / best[(fill, n)]:>8.2f}" for n in names[1:]))


if __name__ == "__main__":
    main()
