"""HF checkpoint loading/export: round trips through `transformers`, config mapping, bad input."""

from __future__ import annotations

import json
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file, save_file

import models
from models.config import ModelConfig
from tiny_hf import LLAMA3_ROPE, hf_logits, load_hf, make_tiny_hf

TOKENS = np.random.default_rng(0).integers(6, 128, (2, 9)).astype(np.int32)


def params_of(model) -> dict:
    return {k: np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.mark.parametrize("family, overrides", [
    ("llama", dict(tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE)),
    ("qwen3", dict(head_dim=32)),
])
def test_save_pretrained_round_trips_into_transformers(tmp_path, family, overrides):
    src = make_tiny_hf(tmp_path, family, **overrides)
    model = models.load_pretrained(src, dtype=jnp.float32)
    out = tmp_path / "exported"
    models.save_pretrained(model, out)
    exported = load_hf(out)
    assert type(exported) is type(load_hf(src))
    np.testing.assert_allclose(hf_logits(exported, TOKENS), hf_logits(src, TOKENS), atol=1e-5,
                               rtol=0)
    assert models.read_config(out) == model.config
    reloaded = params_of(models.load_pretrained(out, dtype=jnp.float32))
    for key, value in params_of(model).items():
        np.testing.assert_array_equal(reloaded[key], value)


def test_sharded_bf16_export_loads_in_both(tmp_path):
    src = make_tiny_hf(tmp_path, "qwen2")
    model = models.load_pretrained(src)  # bf16
    out = tmp_path / "sharded"
    models.save_pretrained(model, out, max_shard_bytes=40_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all((out / f).is_file() for f in files)
    assert load_file(out / files[0])[next(iter(load_file(out / files[0])))].dtype == jnp.bfloat16
    reloaded = params_of(models.load_pretrained(out))
    for key, value in params_of(model).items():
        np.testing.assert_array_equal(reloaded[key], value)
    # transformers reads the bf16 shards; its logits equal the bf16-rounded source model's.
    rounded = load_hf(src)
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    np.testing.assert_allclose(hf_logits(load_hf(out), TOKENS), hf_logits(rounded, TOKENS),
                               atol=1e-5, rtol=0)
    (out / files[-1]).unlink()
    with pytest.raises(FileNotFoundError, match=f"lists shard {files[-1]}, which does not exist"):
        models.load_pretrained(out)


def rewrite_tensor(path, name, value=None):
    """Replace (or with value=None drop) one tensor of ``path/model.safetensors``."""
    tensors = load_file(f"{path}/model.safetensors")
    if value is None:
        del tensors[name]
    else:
        tensors[name] = value
    save_file(tensors, f"{path}/model.safetensors", metadata={"format": "pt"})


def forbid_placement(monkeypatch):
    def placed(*args, **kwargs):
        raise AssertionError("tensor data placed before validation finished")

    monkeypatch.setattr(jax, "make_array_from_callback", placed)
    monkeypatch.setattr(jax, "device_put", placed)


def test_missing_directory_and_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="checkpoint directory not found"):
        models.load_pretrained(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json not found"):
        models.load_pretrained(tmp_path)
    path = make_tiny_hf(tmp_path, "llama", tokenizer=False)
    (tmp_path / "llama-0" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*.safetensors files"):
        models.load_pretrained(path)


def test_missing_tensor_is_named_before_any_placement(tmp_path, monkeypatch):
    path = make_tiny_hf(tmp_path, "qwen2", tokenizer=False)
    rewrite_tensor(path, "model.layers.1.self_attn.k_proj.bias")
    forbid_placement(monkeypatch)
    with pytest.raises(ValueError, match=r"missing tensor 'model.layers.1.self_attn.k_proj.bias'"):
        models.load_pretrained(path)


def test_wrong_shape_names_tensor_and_both_shapes(tmp_path, monkeypatch):
    path = make_tiny_hf(tmp_path, "llama", tokenizer=False)
    rewrite_tensor(path, "model.layers.0.mlp.down_proj.weight", np.zeros((64, 100), np.float32))
    forbid_placement(monkeypatch)
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.down_proj.weight' has wrong shape: "
                                         r"expected \(64, 128\), got \(64, 100\)"):
        models.load_pretrained(path)


def test_unsupported_model_type_lists_supported(tmp_path):
    transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="unsupported 'gpt2'; supported: llama, qwen2, qwen3"):
        models.load_pretrained(tmp_path)
    with pytest.raises(ValueError, match="supported: llama, qwen2, qwen3"):
        ModelConfig.from_hf(transformers.GPT2Config())


def test_unsupported_features_are_clear_errors():
    with pytest.raises(ValueError, match="use_sliding_window"):
        ModelConfig.from_hf(transformers.Qwen2Config(use_sliding_window=True, sliding_window=64))
    yarn = dict(rope_type="yarn", rope_theta=1e4, factor=4.0, original_max_position_embeddings=64)
    with pytest.raises(ValueError, match="unsupported 'yarn'; supported: default, llama3"):
        ModelConfig.from_hf(transformers.LlamaConfig(rope_parameters=yarn))
    with pytest.raises(ValueError, match="num_kv_heads: must divide num_heads=4, got 3"):
        ModelConfig("llama", 128, 64, 128, 2, num_heads=4, num_kv_heads=3, head_dim=16)
    with pytest.raises(ValueError, match="qk_norm"):
        ModelConfig("qwen3", 128, 64, 128, 2, num_heads=4, num_kv_heads=2, head_dim=16)


def test_config_from_hf_both_spellings_and_back():
    legacy = types.SimpleNamespace(  # transformers 4.x attribute spelling
        model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
        max_position_embeddings=256, tie_word_embeddings=True, rope_theta=5e5,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=64),
        bos_token_id=1, eos_token_id=[2, 3])
    cfg = ModelConfig.from_hf(legacy)
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling == models.RopeScaling(8.0, 1.0, 4.0, 64)
    assert cfg.head_dim == 16 and cfg.eos_token_ids == (2, 3) and cfg.tie_word_embeddings
    current = transformers.LlamaConfig(**{k: v for k, v in vars(legacy).items()
                                          if k not in ("model_type", "rope_theta", "rope_scaling")},
                                       rope_parameters={**legacy.rope_scaling, "rope_theta": 5e5})
    assert ModelConfig.from_hf(current) == cfg
    kwargs = cfg.to_hf_dict()
    assert ModelConfig.from_hf(transformers.AutoConfig.for_model(kwargs.pop("model_type"),
                                                                 **kwargs)) == cfg


@pytest.mark.parametrize("family, overrides", [
    ("llama", dict(tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE)),
    ("qwen2", {}),
    ("qwen3", dict(head_dim=32)),
])
def test_read_config_without_transformers_equals_autoconfig(tmp_path, monkeypatch, family,
                                                            overrides):
    """config.json read directly (no transformers import) maps like AutoConfig; one that leaves
    a family default implicit (qwen3's head_dim 128, llama's rope theta) goes through
    AutoConfig and gets that default."""
    path = Path(make_tiny_hf(tmp_path, family, tokenizer=False, **overrides))
    expected = ModelConfig.from_hf(transformers.AutoConfig.from_pretrained(path))
    with monkeypatch.context() as patch:
        patch.setattr(transformers.AutoConfig, "from_pretrained", None)  # not called
        assert models.read_config(path) == expected
    auto = lambda p: ModelConfig.from_hf(transformers.AutoConfig.from_pretrained(p))  # noqa: E731
    config = json.loads((path / "config.json").read_text())
    implicit = "head_dim" if family == "qwen3" else "rope_parameters"
    config.pop(implicit)
    (path / "config.json").write_text(json.dumps(config))
    assert models.read_config(path) == auto(path)
    if family == "qwen3":
        assert models.read_config(path).head_dim == 128


@pytest.mark.parametrize("src_dtype, out_dtype", [
    (np.float32, None), (np.float16, None), (np.float64, None), (jnp.bfloat16, None),
    (np.float32, jnp.bfloat16), (jnp.bfloat16, np.float32), (np.float64, np.float16),
])
def test_copy_max_abs_agrees_with_numpy_on_every_dtype(src_dtype, out_dtype):
    """The loader's bit-level largest |value| (chunked, fused with the copy; inf for NaN/inf)
    against numpy on the copy, for each float width, across chunk boundaries (3-row chunks),
    with a negative peak so the sign bit must be ignored."""
    from models.weight_magnitude import copy_max_abs

    rng = np.random.default_rng(0)
    for bad in (None, np.nan, np.inf, -np.inf, 1e300, -3e4):
        src = rng.standard_normal((10, 7)).astype(src_dtype)
        if bad is not None:
            src[7, 3] = np.asarray(bad).astype(src_dtype)  # 1e300: inf in every narrower type
        out = None if out_dtype is None else np.empty(src.shape, out_dtype)
        row_bytes = 7 * np.dtype(out_dtype or src_dtype).itemsize
        peak = copy_max_abs(src, out, chunk_bytes=3 * row_bytes)
        copy = (src if out is None else out).astype(np.float64)
        if out is not None:
            np.testing.assert_array_equal(copy, src.astype(out_dtype).astype(np.float64))
        expected = np.abs(copy).max() if np.isfinite(copy).all() else np.inf
        assert peak == expected, (bad, copy[7, 3])


def test_implausibly_large_weight_is_refused_naming_tensor_and_file(tmp_path):
    """A finite 1e38 (a flipped exponent bit) in one tensor is refused by name, value and
    file; the untouched checkpoint loads."""
    path = Path(make_tiny_hf(tmp_path, "qwen2", tokenizer=False))
    models.load_pretrained(path, dtype=jnp.float32)
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"][3, 5] = -1e38
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"tensor\(s\) model\.layers\.0\.self_attn\.k_proj\."
                                         r"weight \(max \|w\| 1e\+38 in model\.safetensors\)"):
        models.load_pretrained(path, dtype=jnp.bfloat16)
