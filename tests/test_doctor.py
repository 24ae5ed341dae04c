"""``python run.py doctor``: platform, devices, versions, memory and whether model.path loads;
and the CLI naming its commands on a typo."""

from __future__ import annotations

import importlib.metadata
import os
import sys
from pathlib import Path

import jax
import pytest

from tiny_hf import make_tiny_hf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import run  # noqa: E402


def doctor(capsys, *overrides):
    code = run.main(["doctor", *overrides])
    return code, capsys.readouterr().out


def test_doctor_reports_this_machine_and_a_loadable_checkpoint(tmp_path, capsys):
    path = make_tiny_hf(tmp_path, "qwen2")
    code, out = doctor(capsys, f"model.path={path}")
    assert code == 0, out
    assert f"jax platform: {jax.default_backend()}" in out
    assert f"{jax.device_count()} device(s) in all" in out
    assert f"jax {importlib.metadata.version('jax')}," in out
    assert f"flax {importlib.metadata.version('flax')}," in out
    assert f"{os.cpu_count()} CPUs" in out
    assert "host memory available: " in out and "GiB" in out
    assert "model: ok (qwen2, 2 layers, hidden 64, 1 safetensors file(s))" in out
    assert "tokenizer: ok (" in out and out.rstrip().endswith("ok")


def test_doctor_names_what_fails(tmp_path, capsys):
    path = make_tiny_hf(tmp_path, "llama", tokenizer=False)
    (Path(path) / "model.safetensors").unlink()
    code, out = doctor(capsys, f"model.path={path}")
    assert code == 1
    assert "model: FAILED: no *.safetensors files" in out
    assert "tokenizer: FAILED: no tokenizer file" in out
    code, out = doctor(capsys, f"model.path={tmp_path / 'nowhere'}")
    assert code == 1 and "checkpoint directory not found" in out


def test_default_model_needs_no_path(capsys):
    code, out = doctor(capsys)
    assert code == 0 and "model.path: null: the embedded default" in out


def test_a_mistyped_command_names_the_commands(capsys):
    with pytest.raises(SystemExit) as exit_:
        run.main(["trian"])
    assert exit_.value.code == 2
    assert "unknown command 'trian'; commands: train, eval, config, doctor" in capsys.readouterr().err
