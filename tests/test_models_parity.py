"""Logit parity of models.Decoder with `transformers` (PyTorch CPU, fp32) per family/feature."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from models.decoder import resolve_positions
from tiny_hf import (LLAMA3_ROPE, hf_logits, left_padded_batch, load_hf, make_tiny_hf,
                     positions_from_mask)

# (family, HF config overrides); together they cover GQA ratios 1, 2 and 4, tied and untied
# embeddings, llama3 rope scaling (all three frequency bands occur), q/k/v bias (qwen2),
# llama's attention + MLP biases, q/k norm (qwen3) and head_dim != hidden / heads.
CASES = {
    "llama-mha-tied-llama3rope": ("llama", dict(num_key_value_heads=4, tie_word_embeddings=True,
                                                rope_parameters=LLAMA3_ROPE)),
    "llama-gqa4-biases": ("llama", dict(num_attention_heads=8, attention_bias=True, mlp_bias=True)),
    "qwen2-gqa2-tied": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen3-gqa4-headdim32": ("qwen3", dict(num_key_value_heads=1, head_dim=32)),
}


def jitted_forward(model: models.Decoder, **kwargs):
    """The pipeline's pattern: split once, merge inside jit. Returns (logits, unembed(hidden))."""
    graphdef, params = nnx.split(model)

    @jax.jit
    def fwd(params, tokens, positions):
        m = nnx.merge(graphdef, params)
        out = m(tokens, positions, **kwargs)
        return out.logits, m.unembed(out.hidden)

    return lambda tokens, positions: jax.tree.map(np.asarray, fwd(params, tokens, positions))


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(tmp_path, case):
    family, overrides = CASES[case]
    path = make_tiny_hf(tmp_path, family, **overrides)
    hf = load_hf(path)
    model = models.load_pretrained(path, dtype=jnp.float32)
    assert model.config.model_type == family
    forward = jitted_forward(model)
    rng = np.random.default_rng(0)

    full, ones = left_padded_batch(rng, [12, 12, 12], 12)
    ref = hf_logits(hf, full, ones)
    logits, unembedded = forward(full, positions_from_mask(ones))
    assert logits.shape == (3, 12, 128) and logits.dtype == np.float32
    np.testing.assert_allclose(logits, ref, atol=1e-4, rtol=0)
    np.testing.assert_allclose(unembedded, ref, atol=1e-4, rtol=0)

    padded, mask = left_padded_batch(rng, [12, 7, 2], 12)
    ref = hf_logits(hf, padded, mask)
    logits, _ = forward(padded, positions_from_mask(mask))
    np.testing.assert_allclose(logits[mask == 1], ref[mask == 1], atol=1e-4, rtol=0)
    assert np.isfinite(logits).all()


def test_default_positions():
    tokens, mask = left_padded_batch(np.random.default_rng(1), [6, 3], 6)
    from_mask = resolve_positions(tokens, None, mask, None)
    np.testing.assert_array_equal(np.asarray(from_mask), positions_from_mask(mask))
    masked = resolve_positions(tokens, np.full((2, 6), 5), mask, None)
    np.testing.assert_array_equal(np.asarray(masked), np.where(mask == 1, 5, -1))
    arange = resolve_positions(tokens, None, None, None)
    np.testing.assert_array_equal(np.asarray(arange), np.tile(np.arange(6), (2, 1)))
    with pytest.raises(ValueError, match=r"positions: expected \[B, T\] = \[2, 6\], got \[2, 5\]"):
        resolve_positions(tokens, np.zeros((2, 5), np.int32), None, None)


def test_bf16_default_is_close_to_fp32(tmp_path):
    path = make_tiny_hf(tmp_path, "qwen3")
    model = models.load_pretrained(path)  # default dtype: bf16 params and activations
    assert model.layers.self_attn.q_proj.kernel[...].dtype == jnp.bfloat16
    tokens = np.random.default_rng(3).integers(6, 128, (2, 8)).astype(np.int32)
    logits, _ = jitted_forward(model)(tokens, np.tile(np.arange(8, dtype=np.int32), (2, 1)))
    assert logits.dtype == np.float32
    ref = hf_logits(path, tokens)
    assert np.abs(logits - ref).max() < 0.05 * np.abs(ref).max()


def test_unrolled_layers_match_transformers_and_the_scan(tmp_path):
    """``Decoder.unroll_layers`` (the layer scan unrolled: the GPU suite's decode_unrolled
    cell) gives transformers' logits and the scanned forward's, and really unrolls: its
    lowered program has fewer while loops (the layer scan's is gone)."""
    path = make_tiny_hf(tmp_path, "qwen2", tie_word_embeddings=True)
    model = models.load_pretrained(path, dtype=jnp.float32)
    tokens, mask = left_padded_batch(np.random.default_rng(0), [12, 7, 2], 12)
    positions = positions_from_mask(mask)
    loops = {}
    for unroll in (False, True):
        model.unroll_layers = unroll
        graphdef, params = nnx.split(model)
        lowered = jax.jit(lambda p, t, q: nnx.merge(graphdef, p)(t, q).logits).lower(
            params, tokens, positions)
        loops[unroll] = lowered.as_text().count("stablehlo.while")
        logits, _ = jitted_forward(model)(tokens, positions)
        if unroll:
            np.testing.assert_allclose(logits, scanned, atol=1e-5, rtol=0)
        scanned = logits
    ref = hf_logits(load_hf(path), tokens, mask)
    np.testing.assert_allclose(scanned[mask == 1], ref[mask == 1], atol=1e-4, rtol=0)
    assert loops[True] < loops[False], loops
