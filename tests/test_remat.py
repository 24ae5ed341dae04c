"""Activation remat of the scanned layer body: the update's gradients are the same under every
``model.remat`` policy (oracle: ``remat: none``), the policy really changes the compiled
backward, and a bad policy is a config error naming the field."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from models.decoder import REMAT_POLICIES
from sparse_rl_jax.core.config_io import load_config
from sparse_rl_jax.rollout.scoring import response_logprobs
from sparse_rl_jax.training.run_config import RunConfig
from tiny_hf import left_padded_batch, make_tiny_hf


def _grads(model, remat, prompt, prompt_mask, response, weights):
    """Gradient of a weighted sum of the response log-probs under ``remat``, and the compiled
    backward's HLO text."""
    model.remat = remat
    graphdef, params = nnx.split(model)

    def loss(p):
        out = response_logprobs(nnx.merge(graphdef, p), prompt, prompt_mask, response,
                                chunk_size=4)
        return jnp.sum(out.logp * weights)

    fn = jax.jit(jax.grad(loss))
    return fn(params), fn.lower(params).as_text()


def test_gradients_equal_across_remat_policies(tmp_path):
    path = make_tiny_hf(tmp_path, "qwen3", tokenizer=False, std=0.2, hidden_size=32,
                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                        intermediate_size=64, head_dim=16)
    model = models.load_pretrained(path, dtype=jnp.float32)
    rng = np.random.default_rng(0)
    prompt, prompt_mask = left_padded_batch(rng, [5, 3, 4], width=5)
    response = jnp.asarray(rng.integers(3, 100, (3, 6)), jnp.int32)
    weights = jnp.asarray(rng.normal(0, 1, (3, 6)), jnp.float32)
    reference, plain = _grads(model, "none", prompt, prompt_mask, response, weights)
    assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(reference)) > 1e-3
    for remat in REMAT_POLICIES[1:]:
        grads, hlo = _grads(model, remat, prompt, prompt_mask, response, weights)
        assert hlo != plain  # the checkpoint policy is in the program
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5),
                     grads, reference)


def test_bad_remat_is_a_config_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {remat: everything}\n")
    with pytest.raises(ValueError, match="model.remat"):
        load_config(RunConfig, bad)
