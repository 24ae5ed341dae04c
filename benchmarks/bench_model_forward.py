"""Forward throughput and peak memory: models.Decoder (JAX) vs the same `transformers` model
(PyTorch), same weights, same input, CPU, measured in one run.

    python benchmarks/bench_model_forward.py [--batch 4] [--seq 256] [--repeats 5] [--single-thread]

Each framework runs in its own child process (so peak RSS is its own); the parent builds a
~50M-parameter Llama-shaped checkpoint, runs both, checks they agree, and prints a table.
Throughput: median over ``--repeats`` timed forwards after a warm-up (which includes the JAX
compile). Peak memory: the child's max RSS, and that minus its RSS before the first forward.
``--single-thread`` pins both frameworks to one thread (PyTorch's OpenMP threads degrade badly
when the cores are shared with other work; compare both settings on a busy machine).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CONFIG = dict(  # ~51.7M parameters (untied 32k vocab embeddings + 8 layers)
    vocab_size=32000, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
    num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096,
    tie_word_embeddings=False,
)


def rss_mib() -> float:
    """Current resident set size of this process in MiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mib() -> float:
    """Peak resident set size of this process in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def time_forward(run, repeats: int) -> list[float]:
    """Seconds per call of ``run()`` (which must block until done), after one warm-up."""
    from benchmarks.kit.timing import time_calls

    return time_calls(run, repeats)


def torch_worker(path: str, tokens: np.ndarray, repeats: int):
    import torch
    import transformers

    if os.environ.get("BENCH_SINGLE_THREAD"):
        torch.set_num_threads(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.as_tensor(tokens, dtype=torch.long)
    base = rss_mib()
    with torch.inference_mode():
        out = {}
        times = time_forward(lambda: out.update(logits=model(input_ids=ids).logits), repeats)
        last = out["logits"][:, -1].float().numpy()
    return times, base, last, f"torch {torch.__version__} ({model.config._attn_implementation})"


def jax_worker(path: str, tokens: np.ndarray, repeats: int):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import models

    model = models.load_pretrained(path, dtype=jnp.float32)
    graphdef, params = nnx.split(model)
    forward = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t).logits)
    ids = jnp.asarray(tokens)
    base = rss_mib()
    out = {}
    times = time_forward(lambda: out.update(logits=forward(params, ids).block_until_ready()),
                         repeats)
    return times, base, np.asarray(out["logits"][:, -1]), f"jax {jax.__version__} (jit)"


def worker(args) -> None:
    tokens = np.load(Path(args.path) / "tokens.npy")
    run = torch_worker if args.worker == "torch" else jax_worker
    times, base, last, label = run(args.path, tokens, args.repeats)
    np.save(Path(args.path) / f"last_{args.worker}.npy", last)
    print(json.dumps(dict(label=label, times=times, base_rss=base, peak_rss=peak_rss_mib())))


def build_checkpoint(path: Path, batch: int, seq: int) -> int:
    from benchmarks.kit.model_setup import save_random_model

    model = save_random_model(path, "Llama", CONFIG, "tokens.npy", (batch, seq))
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--single-thread", action="store_true", help="one thread per framework")
    parser.add_argument("--worker", choices=["torch", "jax"], help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    with tempfile.TemporaryDirectory() as tmp:
        n_params = build_checkpoint(Path(tmp), args.batch, args.seq)
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        if args.single_thread:
            env["BENCH_SINGLE_THREAD"] = "1"
            env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false"
                                " intra_op_parallelism_threads=1")
        results = {}
        for name in ("torch", "jax"):
            proc = subprocess.run(
                [sys.executable, __file__, "--worker", name, "--path", tmp,
                 "--repeats", str(args.repeats)],
                env=env, capture_output=True, text=True, check=True)
            results[name] = json.loads(proc.stdout.strip().splitlines()[-1])
        diff = np.abs(np.load(Path(tmp) / "last_jax.npy") - np.load(Path(tmp) / "last_torch.npy"))

    tokens = args.batch * args.seq
    threads = "1 thread" if args.single_thread else f"{os.cpu_count()} cores"
    print(f"model: Llama-shaped, {n_params / 1e6:.1f}M params, fp32, CPU ({threads}); "
          f"input {args.batch}x{args.seq} = {tokens} tokens; median of {args.repeats}; "
          f"last-position logits max |jax - torch| = {diff.max():.2e}")
    header = (f"{'framework':<34}{'ms/forward':>12}{'tokens/s':>12}{'peak RSS MiB':>14}"
              f"{'+fwd MiB':>10}")
    print(header)
    print("-" * len(header))
    rate = {}
    for name, r in results.items():
        ms = statistics.median(r["times"]) * 1e3
        rate[name] = tokens / (ms / 1e3)
        print(f"{r['label']:<34}{ms:>12.1f}{rate[name]:>12.0f}{r['peak_rss']:>14.0f}"
              f"{r['peak_rss'] - r['base_rss']:>10.0f}")
    print(f"{'ratio jax / torch (tokens/s)':<34}{'':>12}{rate['jax'] / rate['torch']:>12.2f}")


if __name__ == "__main__":
    main()
