"""Loading, greedy decode and teacher-forced scoring side by side with google-tunix.

    python benchmarks/bench_tunix.py --tunix-python /tmp/tunixvenv/bin/python \
        [--checkpoint DIR] [--checkout PATH] [--load-only]

One Qwen2 HF checkpoint (``--checkpoint``, else a random 5.2M-param one written with
``transformers`` into a temporary directory), read by each side in its own fresh process:

* ours: ``models.load_pretrained``, ``sampler.generate`` (dense cache, greedy) and
  ``scoring.score``; ``--checkout PATH`` adds the same from another checkout ("before").
* tunix: ``qwen2.params.create_model_from_safe_tensors`` (its ``ModelConfig`` written from
  ``config.json``), ``generate.sampler.Sampler`` (greedy) and
  ``rl.common.compute_per_token_logps``; run with ``--tunix-python``, an interpreter that has
  the ``tunix`` extra (``google-tunix``, which pins ``safetensors<0.8``, so keep it in its
  own virtual environment).

Cells: the first load in the process (after the imports, from the page cache: the files are
read once before; GB/s = safetensors bytes / wall seconds), the compile seconds of one
decode and one score shape (first call minus a steady call), and steady decode (``--batch``
rows, ``--prompt`` + ``--new`` tokens) and scoring (``--batch`` x ``--score-len``) seconds,
the best of ``--repeats``. Each cell reports wall and process CPU seconds; on a shared
machine CPU seconds are the fairer number. The script checks and prints that both sides (and
``transformers``) produce the same greedy tokens and the same log-probs. ``--load-only``
times only the load (e.g. a 1.5B checkpoint).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _since(start: tuple[float, float]) -> list[float]:
    wall, cpu = _clock()
    return [wall - start[0], cpu - start[1]]


def _timed(fn, repeats: int) -> dict:
    """``first`` call (compile + run), ``steady`` (best of ``repeats`` later calls, by CPU
    seconds), ``compile`` = first - steady, each ``[wall, cpu]``; and the last result."""
    start = _clock()
    out = fn()
    first = _since(start)
    steady = None
    for _ in range(repeats):
        start = _clock()
        out = fn()
        t = _since(start)
        steady = t if steady is None or t[1] < steady[1] else steady
    return {"first": first, "steady": steady,
            "compile": [max(f - s, 0.0) for f, s in zip(first, steady)], "out": out}


def _inputs(vocab: int, batch: int, prompt: int, score_len: int):
    """Prompt ``[B, P]`` and the scored ``[B, score_len - P]`` response, ids in [3, vocab)
    (tunix treats id 0 as padding)."""
    import numpy as np

    rng = np.random.default_rng(0)
    return (rng.integers(3, vocab, (batch, prompt)).astype(np.int32),
            rng.integers(3, vocab, (batch, score_len - prompt)).astype(np.int32))


def worker_ours(args) -> dict:
    """Our side, in a fresh process importing the library from ``args.checkout``."""
    start = _clock()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import models
    from sparse_rl_jax.kv.compression_config import CompressionConfig
    from sparse_rl_jax.rollout.sampler import generate
    from sparse_rl_jax.rollout.sampling_config import SamplingConfig
    from sparse_rl_jax.rollout.scoring import score
    result = {"import": _since(start)}
    dtype = jnp.dtype(args.dtype)
    start = _clock()
    jax.block_until_ready(nnx.state(models.load_pretrained(args.checkpoint, dtype=dtype)))
    result["load"] = _since(start)
    start = _clock()
    model = models.load_pretrained(args.checkpoint, dtype=dtype)
    jax.block_until_ready(nnx.state(model))
    result["load_again"] = _since(start)
    if args.load_only:
        return result
    graphdef, params = nnx.split(model)
    vocab = model.config.vocab_size
    prompt, response = _inputs(vocab, args.batch, args.prompt, args.score_len)
    mask = np.ones_like(prompt)
    sampling = SamplingConfig(max_new_tokens=args.new, greedy=True, eos_ids=(vocab,),
                              prompt_bucket=args.prompt)
    dense = CompressionConfig(method="none")

    def decode():
        return np.asarray(generate(graphdef, params, prompt, mask, jax.random.key(0), sampling,
                                   dense).response)

    def scores():
        return np.asarray(score(graphdef, params, prompt, mask, response).logp)

    for name, fn in (("decode", decode), ("score", scores)):
        timed = _timed(fn, args.repeats)
        result[name] = {k: v for k, v in timed.items() if k != "out"}
        result[name + "_out"] = timed["out"].tolist()
    return result


class _IdTokenizer:
    """Token ids as space-separated text, for tunix's ``Sampler`` (which takes strings);
    ``bos_id`` 0 means no BOS is prepended, ``pad_id`` 0 (prompt ids are >= 3)."""

    def encode(self, text, **_):
        return [int(t) for t in text.split()]

    def decode(self, ids, **_):
        return " ".join(map(str, ids))

    def bos_id(self):
        return 0

    def eos_id(self):
        return 2

    def pad_id(self):
        return 0


def tunix_config(hf: dict, dtype):
    """tunix's Qwen2 ``ModelConfig`` from a ``config.json`` dict."""
    from tunix.models.qwen2 import model as qwen2

    rope = hf.get("rope_parameters") or {}
    return qwen2.ModelConfig(
        num_layers=hf["num_hidden_layers"], vocab_size=hf["vocab_size"],
        embed_dim=hf["hidden_size"], hidden_dim=hf["intermediate_size"],
        num_heads=hf["num_attention_heads"],
        head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        num_kv_heads=hf["num_key_value_heads"],
        rope_theta=int(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        norm_eps=hf["rms_norm_eps"], use_tied_embedding=hf["tie_word_embeddings"],
        dtype=dtype, param_dtype=dtype)


def worker_tunix(args) -> dict:
    """tunix's side (run under an interpreter that has google-tunix)."""
    start = _clock()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from tunix.generate import sampler as tunix_sampler
    from tunix.models.qwen2 import params as qwen2_params
    from tunix.rl import common
    result = {"import": _since(start)}
    dtype = jnp.dtype(args.dtype)
    hf = json.loads((Path(args.checkpoint) / "config.json").read_text())
    cfg = tunix_config(hf, dtype)

    def load():
        return qwen2_params.create_model_from_safe_tensors(args.checkpoint, cfg, dtype=dtype)

    start = _clock()
    jax.block_until_ready(nnx.state(load()))
    result["load"] = _since(start)
    start = _clock()
    model = load()
    jax.block_until_ready(nnx.state(model))
    result["load_again"] = _since(start)
    if args.load_only:
        return result
    vocab = cfg.vocab_size
    prompt, response = _inputs(vocab, args.batch, args.prompt, args.score_len)
    sampler = tunix_sampler.Sampler(model, _IdTokenizer(), tunix_sampler.CacheConfig(
        cache_size=args.prompt + args.new, num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim))
    texts = [" ".join(map(str, row)) for row in prompt]
    graphdef, state = nnx.split(model)

    def decode():
        out = sampler(texts, max_generation_steps=args.new, max_prompt_length=args.prompt,
                      eos_tokens=[vocab])
        return np.stack([np.asarray(t) for t in out.tokens])

    def scores():
        return np.asarray(common.compute_per_token_logps(
            graphdef, state, jnp.asarray(prompt), jnp.asarray(response), pad_id=0,
            eos_id=vocab))

    for name, fn in (("decode", decode), ("score", scores)):
        timed = _timed(fn, args.repeats)
        result[name] = {k: v for k, v in timed.items() if k != "out"}
        result[name + "_out"] = timed["out"].tolist()
    return result


def make_checkpoint(path: Path) -> None:
    """A random Qwen2 checkpoint: vocab 4096, hidden 256, 7 layers, 4 / 2 heads (5.2M
    params), fp32, tied embeddings."""
    import torch
    import transformers

    torch.manual_seed(0)
    transformers.utils.logging.disable_progress_bar()
    cfg = transformers.Qwen2Config(
        vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=7,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=10000.0, bos_token_id=1,
        eos_token_id=2, pad_token_id=0)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(path)


def hf_greedy(path: str, prompt, new: int):
    """``transformers`` greedy continuation ``[B, new]`` of ``prompt`` (the oracle)."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        out = model.generate(input_ids=torch.as_tensor(prompt, dtype=torch.long),
                             max_new_tokens=new, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[:, prompt.shape[1]:].numpy()


def run_child(side: str, python: str, checkout: str, args) -> dict:
    """One side in a fresh process; its JSON result."""
    cmd = [python, __file__, "--worker", side, "--checkpoint", args.checkpoint,
           "--dtype", args.dtype, "--batch", str(args.batch), "--prompt", str(args.prompt),
           "--new", str(args.new), "--score-len", str(args.score_len),
           "--repeats", str(args.repeats)] + (["--load-only"] if args.load_only else [])
    env = dict(os.environ, PYTHONPATH=checkout, JAX_PLATFORMS=os.environ.get(
        "JAX_PLATFORMS", "cpu"))
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"{side} worker failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def report(results: dict[str, dict], nbytes: int, args) -> None:
    """The side-by-side table: each cell wall / CPU seconds, and ours / tunix."""
    import numpy as np

    sides = list(results)
    cells = [("load (first in process)", lambda r: r["load"]),
             ("load (again)", lambda r: r["load_again"])]
    if not args.load_only:
        cells += [("decode compile", lambda r: r["decode"]["compile"]),
                  (f"decode {args.batch}x({args.prompt}+{args.new})",
                   lambda r: r["decode"]["steady"]),
                  ("score compile", lambda r: r["score"]["compile"]),
                  (f"score {args.batch}x{args.score_len}", lambda r: r["score"]["steady"])]
    head = "".join(f"{s + ' wall/cpu s':>22}" for s in sides)
    ratios = [s for s in sides if s != "tunix"] if "tunix" in sides else []
    print(f"\n{'cell':<26}{head}" + "".join(f"{s + '/tunix wall/cpu':>24}" for s in ratios))
    for name, get in cells:
        vals = {s: get(results[s]) for s in sides}
        row = "".join(f"{v[0]:>12.3f}/{v[1]:<9.3f}" for v in vals.values())
        row += "".join(f"{vals[s][0] / vals['tunix'][0]:>15.2f}x/"
                       f"{vals[s][1] / vals['tunix'][1]:.2f}x".ljust(24) for s in ratios)
        print(f"{name:<26}{row}")
    gbs = "".join(f"{nbytes / 1e9 / results[s]['load'][0]:>22.3f}" for s in sides)
    print(f"{'first load GB/s (wall)':<26}{gbs}")
    print(f"checkpoint: {args.checkpoint} ({nbytes / 1e9:.3f} GB safetensors), "
          f"dtype {args.dtype}")
    if args.load_only:
        return
    tokens = {s: np.asarray(results[s]["decode_out"]) for s in sides}
    ref = hf_greedy(args.checkpoint, _inputs(args.vocab, args.batch, args.prompt,
                                             args.score_len)[0], args.new)
    for s in sides:
        rows = (tokens[s] == ref).all(axis=1)
        steps = (tokens[s] == ref).all(axis=0)
        print(f"greedy tokens {s} == transformers: {int(rows.sum())}/{len(rows)} rows, "
              f"{int(steps.argmin()) if not steps.all() else len(steps)} leading steps equal")
    logp = {s: np.asarray(results[s]["score_out"]) for s in sides}
    for s in sides[1:]:
        print(f"score log-probs max |{s} - {sides[0]}|: "
              f"{float(np.abs(logp[s] - logp[sides[0]]).max()):.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", help="Qwen2 HF checkpoint dir (default: a random one)")
    parser.add_argument("--tunix-python", default=sys.executable,
                        help="interpreter with google-tunix installed")
    parser.add_argument("--checkout", help="also run ours from this checkout (before)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--score-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--load-only", action="store_true")
    parser.add_argument("--worker", choices=["ours", "tunix"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps((worker_ours if args.worker == "ours" else worker_tunix)(args)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        if args.checkpoint is None:
            args.checkpoint = str(Path(tmp) / "qwen2")
            make_checkpoint(Path(args.checkpoint))
        files = sorted(Path(args.checkpoint).glob("*.safetensors"))
        nbytes = sum(f.stat().st_size for f in files)
        for file in files:  # into the page cache, so every side reads from memory
            with open(file, "rb") as f:
                while f.read(1 << 26):
                    pass
        args.vocab = json.loads((Path(args.checkpoint) / "config.json").read_text())["vocab_size"]
        results = {"ours": run_child("ours", sys.executable, str(ROOT), args)}
        if args.checkout:
            results["before"] = run_child("ours", sys.executable, args.checkout, args)
        results["tunix"] = run_child("tunix", args.tunix_python, str(ROOT), args)
        report(results, nbytes, args)


if __name__ == "__main__":
    main()
