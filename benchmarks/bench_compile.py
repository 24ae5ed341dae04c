"""Compile seconds of one decode shape, one score shape and one update shape vs model depth.

    python benchmarks/bench_compile.py [--layers 2 8 28] [--checkout PATH]

A tiny-width Qwen2-shaped model (hidden 64, 4 query / 2 KV heads, head_dim 16, vocab 512) with
random weights, so the time is the compiler's, not the arithmetic's. Each cell lowers and
compiles a fresh ``jax.jit`` (no compilation cache): one cached decode step (batch 8, 1 token,
cache of 256 slots), dense ``scoring.score`` (4 rows x (16 + 64) tokens) and the gradient of
the summed score log-probs (the update step's shape). Each depth runs in its own child
process; ``--checkout`` imports the library from another checkout (e.g. the main branch) so
a before/after table comes from one command.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worker(layers: int) -> dict:
    """Compile seconds of the three shapes for a ``layers``-deep model (run in a child)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import models
    from sparse_rl_jax.rollout.scoring import response_logprobs

    jax.config.update("jax_enable_compilation_cache", False)
    cfg = models.ModelConfig("qwen2", vocab_size=512, hidden_size=64, intermediate_size=128,
                             num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=16,
                             attention_bias=True)
    model = models.Decoder(cfg, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    batch, capacity = 8, 256
    cache = models.init_cache(layers, batch, cfg.num_kv_heads, capacity, cfg.head_dim)
    token = jnp.zeros((batch, 1), jnp.int32)

    def decode(params, cache, token):
        out = nnx.merge(graphdef, params)(token, token, kv=cache, return_logits=False)
        return out.hidden, out.kv

    n, p, m = 4, 16, 64
    prompt, mask = jnp.ones((n, p), jnp.int32), jnp.ones((n, p), jnp.int32)
    response = jnp.ones((n, m), jnp.int32)

    def score(params):
        model = nnx.merge(graphdef, params)
        return response_logprobs(model, prompt, mask, response).logp

    def update(params):
        return jax.grad(lambda p: jnp.sum(score(p)))(params)

    def compile_seconds(fn, *args) -> float:
        start = time.perf_counter()
        jax.jit(fn).lower(*args).compile()
        return time.perf_counter() - start

    return {"layers": layers, "decode": compile_seconds(decode, params, cache, token),
            "score": compile_seconds(score, params), "update": compile_seconds(update, params)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8, 28])
    parser.add_argument("--checkout", default=str(ROOT), help="library checkout to import")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        print(json.dumps(worker(args.worker)))
        return
    env = dict(os.environ, PYTHONPATH=args.checkout, JAX_PLATFORMS=os.environ.get(
        "JAX_PLATFORMS", ""))
    rows = []
    for layers in args.layers:
        out = subprocess.run([sys.executable, __file__, "--worker", str(layers)], env=env,
                             check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    import jax
    print(f"checkout {args.checkout}  device {jax.devices()[0].device_kind}")
    print(f"{'layers':>6} {'decode s':>9} {'score s':>8} {'update s':>9}")
    for row in rows:
        print(f"{row['layers']:>6} {row['decode']:>9.2f} {row['score']:>8.2f} {row['update']:>9.2f}")
    first = rows[0]
    for row in rows[1:]:
        print(f"ratio {row['layers']}/{first['layers']} layers: decode "
              f"{row['decode'] / first['decode']:.2f}x, score {row['score'] / first['score']:.2f}x, "
              f"update {row['update'] / first['update']:.2f}x")


if __name__ == "__main__":
    main()
