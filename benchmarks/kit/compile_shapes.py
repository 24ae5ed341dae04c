"""Compile seconds of one decode shape, one score shape and one update shape of a tiny-width
model at a given depth (``bench_compile.py``'s docstring says which): ``bench_compile.py``'s
child and the GPU suite's ``compile`` cell. The library is imported when it runs, so the
child of ``bench_compile.py --checkout PATH`` measures that checkout's."""

from __future__ import annotations

import time


def compile_shapes(layers: int) -> dict:
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
