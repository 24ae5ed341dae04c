"""Fault matrix, model and tokenizer directories (issues 17 and 21): a broken checkpoint or
tokenizer is one ``error:`` line naming the file or tensor, exit 2, before the run directory
exists; remote code and pickles next to a checkpoint are never run or read."""

from __future__ import annotations

import json
import os
import pickle
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import models
from fault_helpers import refused, run_args
from sparse_rl_jax.core.config_io import load_config
from sparse_rl_jax.training.run_config import RunConfig
from tiny_hf import make_tiny_hf

pytest_plugins = ("fault_helpers",)  # the tiny model + data fixture


def _break_config(path):
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (path / "config.json").write_text(json.dumps(cfg))


def _rewrite_tensors(path, change):
    tensors = load_file(path / "model.safetensors")
    change(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def _shard(path):
    (path / "model.safetensors").rename(path / "model-00001-of-00002.safetensors")
    weight_map = {name: "model-00001-of-00002.safetensors"
                  for name in load_file(path / "model-00001-of-00002.safetensors")}
    weight_map["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _nan_tensor(t):
    t["model.layers.1.mlp.up_proj.weight"][0, 0] = np.nan


def _huge_tensor(t):
    t["model.layers.1.mlp.up_proj.weight"][0, 0] = 1e38  # finite: a flipped exponent bit


def _drop_tokenizer(path):
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (path / name).unlink(missing_ok=True)


def _not_json(name):
    """A fault writing ``{oops`` into the checkpoint's file ``name``."""
    return lambda path: (path / name).write_text("{oops")


MODEL_FAULTS = {
    "unsupported_model_type": (_break_config, "model_type: unsupported 'gpt2'"),
    "config_not_json": (_not_json("config.json"), "config.json: invalid JSON"),
    "empty_safetensors": (lambda p: (p / "model.safetensors").write_bytes(b""),
                          "not a readable safetensors file"),
    "garbage_safetensors": (lambda p: (p / "model.safetensors").write_bytes(os.urandom(4096)),
                            "not a readable safetensors file"),
    "truncated_safetensors": (
        lambda p: (p / "model.safetensors").write_bytes(
            (p / "model.safetensors").read_bytes()[:5000]), "not a readable safetensors file"),
    "wrong_shape": (lambda p: _rewrite_tensors(p, lambda t: t.update(
        {"lm_head.weight": np.zeros((128, 32), np.float32)})),
        "tensor 'lm_head.weight' has wrong shape: expected (128, 64), got (128, 32)"),
    "wrong_dtype": (lambda p: _rewrite_tensors(p, lambda t: t.update(
        {"lm_head.weight": np.zeros((128, 64), np.int32)})),
        "tensor 'lm_head.weight' has dtype I32"),
    "missing_tensor": (lambda p: _rewrite_tensors(p, lambda t: t.pop("lm_head.weight")),
                       "missing tensor 'lm_head.weight'"),
    "missing_shard": (_shard, "lists shard model-00002-of-00002.safetensors, which does not "
                              "exist"),
    "index_not_json": (lambda p: (p / "model.safetensors.index.json").write_text("{"),
                       "model.safetensors.index.json: not a valid safetensors index"),
    "nan_tensor": (lambda p: _rewrite_tensors(p, _nan_tensor),
                   "tensor(s) model.layers.1.mlp.up_proj.weight hold NaN or inf values"),
    "huge_tensor": (lambda p: _rewrite_tensors(p, _huge_tensor),
                    "tensor(s) model.layers.1.mlp.up_proj.weight (max |w| 1e+38 in "
                    "model.safetensors)"),
    "no_tokenizer": (_drop_tokenizer, "no tokenizer in"),
    "tokenizer_json_not_json": (_not_json("tokenizer.json"),
                                "tokenizer.json: invalid JSON: Expecting property name"),
    "tokenizer_config_not_json": (_not_json("tokenizer_config.json"),
                                  "tokenizer_config.json: invalid JSON: Expecting property name"),
    "generation_config_not_json": (_not_json("generation_config.json"),
                                   "generation_config.json: invalid JSON: Expecting property"),
}


@pytest.mark.parametrize("fault", sorted(MODEL_FAULTS))
def test_broken_model_dir_is_one_error_line_before_any_state(tiny, tmp_path, capsys, fault):
    _, model, data = tiny
    broken = tmp_path / "model"
    shutil.copytree(model, broken)
    make_fault, expected = MODEL_FAULTS[fault]
    make_fault(broken)
    refused(capsys, run_args(broken, data, tmp_path / "run"), expected)
    assert not (tmp_path / "run").exists()


def test_tokenizer_larger_than_embedding_names_both_numbers(tiny, tmp_path, capsys):
    _, _, data = tiny
    small = make_tiny_hf(tmp_path, "qwen2", name="small", vocab_size=64)  # tokenizer: 102 ids
    refused(capsys, run_args(small, data, tmp_path / "run"),
            "token '~' has id 101 (vocabulary of 102 entries)", "embedding of 64 rows")
    assert not (tmp_path / "run").exists()


def _remap_token(path, token: str, token_id: int) -> None:
    """Rewrite ``path/tokenizer.json`` so ``token`` has id ``token_id`` (same vocab count)."""
    tokenizer = json.loads((path / "tokenizer.json").read_text())
    tokenizer["model"]["vocab"][token] = token_id
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))


def test_token_id_beyond_embedding_is_refused_naming_the_token(tiny, tmp_path, capsys):
    """A vocab entry past the embedding (same entry count, so ``len(tokenizer)`` still fits)
    would make every rollout NaN: refused naming the token, its id and the embedding."""
    _, model, data = tiny
    broken = tmp_path / "model"
    shutil.copytree(model, broken)
    _remap_token(broken, "=", 128 + 50)
    refused(capsys, run_args(broken, data, tmp_path / "run"),
            "token '=' has id 178", "embedding of 128 rows")
    assert not (tmp_path / "run").exists()


def test_remote_code_and_pickle_are_never_executed_or_read(tiny, tmp_path):
    """auto_map code next to the checkpoint and a pickle pytorch_model.bin stay untouched."""
    _, model, _ = tiny
    target = tmp_path / "model"
    shutil.copytree(model, target)
    sentinel = tmp_path / "executed"
    (target / "evil.py").write_text(f"open({str(sentinel)!r}, 'w').write('code')\n"
                                    "class Evil: pass\n")
    for name, key in (("config.json", "AutoConfig"), ("tokenizer_config.json", "AutoTokenizer")):
        cfg = json.loads((target / name).read_text())
        cfg["auto_map"] = {key: "evil.Evil", "AutoModelForCausalLM": "evil.Evil"}
        (target / name).write_text(json.dumps(cfg))

    class Payload:
        def __reduce__(self):
            return (open, (str(sentinel), "w"))

    (target / "pytorch_model.bin").write_bytes(pickle.dumps(Payload()))
    cfg = load_config(RunConfig, None, [f"model.path={target}"])
    from sparse_rl_jax.training.preflight import load_checked_policy

    tokenizer, loaded = load_checked_policy(str(target), cfg, models.make_mesh())
    assert loaded.config.vocab_size == 128 and tokenizer.vocab_size == 102
    assert not sentinel.exists()
