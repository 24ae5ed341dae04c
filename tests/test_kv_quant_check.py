"""The quantization guardrail (``kv.quant_check``): the per-layer key error of a
``models.QuantProbe`` forward against NumPy on the keys a cache prefill stored, and the one
warning a model with outlier key channels gets."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from sparse_rl_jax.kv.quant_check import QuantErrorWarning, WARN_ERROR, key_quant_error
from test_kv_quant import _numpy_fake
from tiny_hf import left_padded_batch, make_tiny_hf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_hf(tmp_path_factory.mktemp("probe"), "llama", tokenizer=False, std=0.2)
    graphdef, params = nnx.split(models.load_pretrained(path, dtype=jnp.float32))
    tokens, mask = left_padded_batch(np.random.default_rng(2), [10, 6], width=10)
    return graphdef, params, tokens, mask


def _numpy_errors(graphdef, params, tokens, mask, quant):
    """Per layer, the largest relative key error over real tokens, from the keys a
    full-precision cache stores when it prefills ``tokens``."""
    model = nnx.merge(graphdef, params)
    cfg = model.config
    cache = models.init_cache(cfg.num_layers, tokens.shape[0], cfg.num_kv_heads,
                              tokens.shape[1], cfg.head_dim)
    keys = np.asarray(model(jnp.asarray(tokens), attention_mask=jnp.asarray(mask),
                            kv=cache).kv.k)  # [L, B, Hkv, T, D]
    real = np.asarray(mask, bool)[None, :, None, :]  # [1, B, 1, T]
    rms = np.sqrt((keys ** 2 * real[..., None]).sum(axis=(1, 3), keepdims=True) / real.sum())
    rel = (np.linalg.norm((_numpy_fake(quant, keys) - keys) / rms, axis=-1)
           / np.linalg.norm(keys / rms, axis=-1))  # [L, B, Hkv, T], channels in RMS units
    return np.where(real, rel, 0).max(axis=(1, 2, 3))


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_key_error_matches_numpy_on_the_cached_keys(tiny, quant):
    graphdef, params, tokens, mask = tiny
    got = np.asarray(key_quant_error(graphdef, params, tokens, mask, quant))
    np.testing.assert_allclose(got, _numpy_errors(graphdef, params, tokens, mask, quant),
                               rtol=1e-4, atol=1e-6)
    assert got.shape == (2,) and np.all(got > 0) and np.all(got < WARN_ERROR[quant])


def test_outlier_key_channels_warn_once_naming_the_layer_and_level(tiny):
    graphdef, params, tokens, mask = tiny

    def outlier(path, x):  # one huge output channel of layer 1's key projection
        name = jax.tree_util.keystr(path)
        return x.at[1, :, 0].multiply(300.0) if "k_proj" in name and "kernel" in name else x

    loud = jax.tree_util.tree_map_with_path(outlier, params)
    error = np.asarray(key_quant_error(graphdef, loud, tokens, mask, "int4"))
    assert error[1] > WARN_ERROR["int4"] > error[0]
    lines = []
    warning = QuantErrorWarning("int4", lines.append)
    metrics = {"kv_quant_key_error": error.max(), "kv_quant_key_error_layer": error.argmax()}
    warning.observe(metrics)
    warning.observe(metrics)
    assert len(lines) == 1 and "quant=int4" in lines[0] and "layer 1" in lines[0]
    quiet = QuantErrorWarning("int8", lines.append)
    quiet.observe({"kv_quant_key_error": 0.01, "kv_quant_key_error_layer": 0})
    quiet.observe({})  # an unquantized run logs no error
    assert len(lines) == 1
