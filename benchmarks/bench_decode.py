"""Decode throughput and KV memory of the rollout sampler: ``none`` vs ``rkv`` vs ``snapkv``
vs ``sparrow``, against ``transformers`` greedy ``generate``, a bytes/FLOPs floor and (dense
and ``sparrow``) the cost model ``sparse_rl_jax.kv.sparrow_cost``.

    python benchmarks/bench_decode.py [--lengths 256 1024 4096] [--batches 8 32]
        [--max-tokens 32768] [--hf-lengths 256] [--torch-threads 2 1] [--no-profile]
    python benchmarks/bench_decode.py --profile-only [--profile-cell 8 1024]
    python benchmarks/bench_decode.py --methods none sparrow --schedule 0:8 --lengths 1024 2048 \
        --batches 16 --hf-lengths --no-profile  # Sparrow vs dense, CPU grid
    python benchmarks/bench_decode.py --shape qwen2.5-1.5b --dtype bfloat16 --prompt-len 128 \
        --budget 512 --buffer 128 --batches 32 128 256 --lengths 1024 4096 --no-profile  # GPU grid
    python benchmarks/bench_decode.py --methods none --layouts dense paged --lengths 256 1024 \
        --batches 8 --hf-lengths --no-profile  # dense vs paged cache layout, CPU

Files: this driver, and in ``kit/``: ``decode_grid.py`` (flags, the methods' configs, the
grid, the ``transformers`` rows), ``decode_cells.py`` (the loaded model and each cell's
rollouts), ``model_setup.py`` (bench model, checkpoint, ``transformers`` child), ``timing.py``
(machine measurement), ``decode_report.py`` (tables and targets), ``decode_profile.py`` (the
profile).

Model: the CPU bench model (Qwen2-shaped, hidden 512, 8 layers, 8 query / 2 KV heads,
head_dim 64, intermediate 1408, vocab 32000, tied embeddings, ~39M params, random weights,
fp32), built with ``transformers`` in a child process, saved, and loaded here with
``models.load_pretrained(..., dtype=float32)``. Prompts: 32 random tokens per row.
Every row runs to ``max_new_tokens``: the only EOS id is ``vocab_size``, which the model can
never emit. Decoding is greedy (``--temperature T`` samples instead).
``--shape qwen2.5-1.5b`` builds Qwen2.5-1.5B's architecture instead, ``--dtype`` sets the
params/compute/KV dtype and ``--prompt-len`` the prompt. JAX runs on whatever platform is
present (GPU, TPU, CPU); ``transformers`` runs on CUDA when torch sees a GPU, else CPU.

Timing excludes compilation: each cell first runs the public ``sampler.prefill`` and
``sampler.decode`` with the same shapes and a first token equal to that EOS id (zero loop
iterations), which compiles both; the timed rollouts (prefill then decode, timed apart; each
method of a cell in turn, ``--repeats`` rounds, the fastest kept) are then checked not to have
compiled anything (``compile_count.count_compiles``). ``transformers``
runs in its own child process (``torch.set_num_threads`` = each ``--torch-threads``; on a
shared machine one thread can beat all cores) on the same weights, prompts, batch and length,
after a short warm-up generate; the ratio is taken against each.

Floor per decode step: bytes (all weights + the resident KV of every row, mean over the
response) over the measured memory bandwidth, and FLOPs over the measured matmul throughput;
the floor is the larger. ``--max-tokens`` skips cells with batch x length above it.
``sparrow`` (``--schedule START:K ...``, ``--page-size``, ``--dense-layers``) samples with the
selection record and reports alpha's 5th percentile per 2000-token bin of response position
(``sparse_rl_jax.rollout.acceptance``, exact, on the first ``--alpha-rows`` rows, at temperature 1
when greedy), and its speed against ``none`` of the same cell.
``--layouts`` runs each method on each of these cache layouts it takes (``compression.layout``;
a row is labelled ``method/layout`` unless the layout is the method's own) and prints them side
by side with the speed ratio and whether the tokens agree; ``--chunk-pages`` sets
the pages per iteration of the paged decode loop (``models.paged_cache.CHUNK_PAGES``) for
the run.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.kit import decode_profile, decode_report, timing  # noqa: E402
from benchmarks.kit import model_setup as setup  # noqa: E402
from benchmarks.kit.decode_cells import Bench  # noqa: E402
from benchmarks.kit.decode_grid import (compression_configs, parse_args, run_grid,  # noqa: E402
                                        transformers_rows)


def main() -> None:
    args = parse_args(description=__doc__.splitlines()[0])
    if args.worker:
        return setup.child(args)
    setup.configure(args)
    if args.chunk_pages:
        import jax

        from models import paged_cache

        paged_cache.CHUNK_PAGES = {jax.default_backend(): args.chunk_pages}
    wall = time.perf_counter()

    with tempfile.TemporaryDirectory() as tmp:
        setup.run_child("build", tmp, args, __file__)
        bench = Bench.load(Path(tmp), args.temperature)
        machine = timing.measure_machine()
        configs = compression_configs(args)
        rows, skipped = ([], []) if args.profile_only else run_grid(
            args, bench, machine, log=lambda line: print(line, file=sys.stderr, flush=True))
        hf = (transformers_rows(args, tmp, rows)
              if args.hf_lengths and not args.profile_only else [])
        profile = None
        method = next((m for m in ("rkv", "snapkv") if m in configs), None)
        if not args.no_profile and method and "none" in configs:
            profile = decode_profile.profile(bench, *args.profile_cell, configs, method,
                                             args.profile_repeats, max(args.lengths))
    decode_report.report(args, bench, machine, rows, skipped, hf, profile,
                         time.perf_counter() - wall)


if __name__ == "__main__":
    main()
