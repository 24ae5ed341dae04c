"""Layers run under one ``lax.scan`` over stacked params: the traced program of a forward
(full, cached, replayed, and its gradient) has the same size whatever the depth."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import models


def _program_size(num_layers: int, kind: str) -> int:
    cfg = models.ModelConfig("qwen3", 64, 16, 32, num_layers, num_heads=2, num_kv_heads=1,
                             head_dim=8, qk_norm=True)
    model = models.Decoder(cfg, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    tokens = jnp.zeros((2, 6), jnp.int32)
    cache = models.init_cache(num_layers, 2, 1, 8, 8, num_heads=2, window=2)  # with a query ring
    expiry = models.ExpiryRecord(jnp.full((num_layers, 2, 1, 6), 4, jnp.int32))

    def forward(params):
        m = nnx.merge(graphdef, params)
        if kind == "cache":
            return m(tokens, kv=cache).hidden
        if kind == "replay":
            return m(tokens, kv=expiry).logits
        return m(tokens).logits

    fn = (lambda p: jax.grad(lambda q: jnp.sum(forward(q)))(p)) if kind == "grad" else forward
    return len(str(jax.make_jaxpr(fn)(params)).splitlines())


@pytest.mark.parametrize("kind", ["full", "cache", "replay", "grad"])
def test_traced_program_does_not_grow_with_depth(kind):
    assert _program_size(2, kind) == _program_size(5, kind)


def test_stacked_params_have_a_leading_layer_axis_and_match_per_layer_init():
    cfg = models.ModelConfig("qwen2", 64, 16, 32, 3, num_heads=2, num_kv_heads=1, head_dim=8,
                             attention_bias=True)
    model = models.Decoder(cfg, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    assert model.layers.mlp.up_proj.kernel[...].shape == (3, 16, 32)
    assert model.layers.input_layernorm.weight[...].shape == (3, 16)
    kernels = model.layers.self_attn.q_proj.kernel[...]
    assert not jnp.allclose(kernels[0], kernels[1])  # each layer its own random init
