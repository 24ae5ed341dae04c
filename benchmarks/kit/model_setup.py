"""The benchmarks' bench model: its shapes, its random-weight checkpoint and ``transformers``
generate (each run in a child process). Used by ``bench_decode.py``, ``bench_rl_step.py``,
``bench_model_forward.py``, the HLO functions and the GPU cells."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


SHAPES = {
    "tiny": dict(  # ~0.1M parameters: smoke runs (benchmarks/gpu_suite.py --cpu-scaled)
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=0,
    ),
    "cpu-bench": dict(  # ~38.9M parameters (tied 32k vocab embedding + 8 layers)
        vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=8192,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=0,
    ),
    "qwen2.5-1.5b": dict(  # Qwen2.5-1.5B's architecture (random weights), ~1.54B parameters
        vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
        num_attention_heads=12, num_key_value_heads=2, head_dim=128,
        max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=None, pad_token_id=0,
    ),
}
# Set from the command line by configure() (the parent and every child get the same flags).
CONFIG = SHAPES["cpu-bench"]
PROMPT_LEN = 32
DTYPE = "float32"


def configure(args) -> None:
    """Select the model shape, prompt length and dtype of this run."""
    global CONFIG, PROMPT_LEN, DTYPE
    CONFIG, PROMPT_LEN, DTYPE = SHAPES[args.shape], args.prompt_len, args.dtype


def model_config(config: dict | None = None):
    """``models.ModelConfig`` of ``config`` (a ``transformers`` config's fields; default the
    configured shape): what ``build_checkpoint``'s Qwen2 checkpoint loads as, ``transformers``'
    Qwen2 defaults for the fields ``config`` leaves out, without ``transformers``."""
    import types

    import models

    defaults = dict(model_type="qwen2", rms_norm_eps=1e-6, rope_theta=10000.0)
    return models.ModelConfig.from_hf(types.SimpleNamespace(**{**defaults,
                                                               **(config or CONFIG)}))


def save_random_model(path: Path, family: str, config: dict, name: str, shape: tuple,
                      low: int = 0):
    """Saves a seeded random-weight ``transformers`` ``family`` model (``"Qwen2"``,
    ``"Llama"``) of ``config`` to ``path``, and random token ids ``shape`` in ``[low, vocab)``
    to ``path / name``; returns the torch model. Shared by the benchmarks' checkpoint builders."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)
    model = getattr(transformers, f"{family}ForCausalLM")(
        getattr(transformers, f"{family}Config")(**config))
    model.save_pretrained(path)
    tokens = np.random.default_rng(0).integers(low, config["vocab_size"], shape)
    np.save(path / name, tokens.astype(np.int32))
    return model


def build_checkpoint(path: Path, max_batch: int) -> None:
    """Random-weight Qwen2 bench model + prompts, written to ``path`` (runs in a child)."""
    save_random_model(path, "Qwen2", CONFIG, "prompts.npy", (max_batch, PROMPT_LEN), low=3)


def torch_generate(path: Path, cells: list[tuple[int, int, int]]) -> list[dict]:
    """``transformers`` greedy generate for each ``(threads, batch, length)``: seconds, tokens."""
    import torch
    import transformers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=getattr(torch, DTYPE)).to(device).eval()
    model.generation_config.eos_token_id = None
    prompts = torch.as_tensor(np.load(path / "prompts.npy"), dtype=torch.long).to(device)
    out = []
    with torch.inference_mode():
        for threads, batch, length in cells:
            torch.set_num_threads(threads)
            ids = prompts[:batch]
            kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0)
            model.generate(ids, max_new_tokens=8, **kw)  # warm-up
            start = time.perf_counter()
            tokens = model.generate(ids, max_new_tokens=length, min_new_tokens=length, **kw)
            seconds = time.perf_counter() - start
            np.save(path / f"hf_{threads}_{batch}_{length}.npy",
                    tokens[:, PROMPT_LEN:].cpu().numpy())
            out.append(dict(batch=batch, length=length, seconds=seconds, threads=threads,
                            label=f"transformers {transformers.__version__} "
                                  f"({model.config._attn_implementation}, {device}, "
                                  f"{threads} threads)"))
    return out


def child(args) -> None:
    """The body of a ``--worker`` child process: build the checkpoint or run transformers."""
    configure(args)
    path = Path(args.path)
    if args.worker == "build":
        build_checkpoint(path, max(args.batches + args.hf_batches))
        print(json.dumps({}))
    else:
        cells = [(t, b, n) for t in args.torch_threads for b in args.hf_batches
                 for n in args.hf_lengths]
        print(json.dumps(torch_generate(path, cells)))


def run_child(worker: str, tmp: str, args, script: str) -> list | dict:
    """Runs ``script --worker worker`` (the build or torch half) in a child; its JSON."""
    cmd = [sys.executable, script, "--worker", worker, "--path", tmp,
           "--batches", *map(str, args.batches), "--hf-lengths", *map(str, args.hf_lengths),
           "--hf-batches", *map(str, args.hf_batches),
           "--torch-threads", *map(str, args.torch_threads), "--shape", args.shape,
           "--prompt-len", str(args.prompt_len), "--dtype", args.dtype]
    proc = subprocess.run(cmd, env={**os.environ, "JAX_PLATFORMS": "cpu"}, capture_output=True,
                          text=True)
    if proc.returncode:
        sys.exit(f"{worker} worker failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
