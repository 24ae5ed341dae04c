"""The decode benchmark's grid: its command line (``bench_decode.py``'s flags), the
``CompressionConfig`` of each method and layout, the rows of every (batch, length) cell, and
``transformers`` generate on the same checkpoint. Used by ``bench_decode.py`` and the GPU
suite's decode cells."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np

from benchmarks.kit import model_setup as setup
from benchmarks.kit.decode_cells import Bench

CHILD = Path(__file__).resolve().parents[1] / "bench_decode.py"
"""The script whose hidden ``--worker`` flag runs ``model_setup.child`` (the checkpoint build
and ``transformers`` halves, each in a child process)."""


def parse_args(argv: list[str] | None = None,
               description: str | None = None) -> argparse.Namespace:
    """``bench_decode.py``'s command line (see its docstring); ``argv`` defaults to
    ``sys.argv[1:]``, ``description`` is the ``--help`` text's."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--methods", nargs="+", default=["none", "rkv", "snapkv"])
    parser.add_argument("--layouts", nargs="+", choices=["dense", "budget", "paged"],
                        help="cache layouts each method runs on (default: the method's own)")
    parser.add_argument("--chunk-pages", type=int,
                        help="pages per paged decode loop iteration (models.paged_cache)")
    parser.add_argument("--max-tokens", type=int, default=0,
                        help="skip cells with batch x length above this (0: run all)")
    parser.add_argument("--hf-lengths", type=int, nargs="*", default=[256],
                        help="lengths at which transformers runs")
    parser.add_argument("--hf-batches", type=int, nargs="*", default=[8])
    parser.add_argument("--torch-threads", type=int, nargs="+", default=[os.cpu_count(), 1],
                        help="torch.set_num_threads values to run transformers with")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--buffer", type=int, default=128)
    parser.add_argument("--window", type=int, default=8)
    parser.add_argument("--schedule", nargs="+", default=["0:8"], metavar="START:K",
                        help="sparrow budget_schedule entries")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--dense-layers", type=int, nargs="*", default=[0, 1])
    parser.add_argument("--alpha-rows", type=int, default=2,
                        help="rows of a sparrow rollout whose acceptance is scored")
    parser.add_argument("--repeats", type=int, default=1,
                        help="timed rollouts per method and cell, round-robin (fastest kept)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--profile-only", action="store_true",
                        help="skip the grid and transformers; run the profile alone")
    parser.add_argument("--profile-cell", type=int, nargs=2, default=[8, 1024],
                        metavar=("BATCH", "LENGTH"))
    parser.add_argument("--profile-repeats", type=int, default=1,
                        help="timed runs of each profiled loop variant (the fastest is kept)")
    parser.add_argument("--shape", choices=sorted(setup.SHAPES), default="cpu-bench",
                        help="model architecture (random weights)")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="params, compute and KV dtype (both frameworks)")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--worker", choices=["build", "torch"], help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def compression_configs(args) -> dict:
    """``CompressionConfig`` of each ``--methods`` entry on each ``--layouts`` entry it takes,
    by label: the method's name on its own layout, ``method/layout`` on another."""
    from sparse_rl_jax.kv.compression_config import CompressionConfig
    from sparse_rl_jax.kv.compression_sections import EvictionConfig, SparrowConfig

    def config(method: str, layout: str | None) -> CompressionConfig:
        if method == "sparrow":
            schedule = tuple(tuple(int(x) for x in entry.split(":")) for entry in args.schedule)
            return CompressionConfig(method=method, layout=layout, page_size=args.page_size,
                                     sparrow=SparrowConfig(budget_schedule=schedule,
                                                           dense_layers=tuple(args.dense_layers)))
        return CompressionConfig(method=method, layout=layout, page_size=args.page_size,
                                 eviction=EvictionConfig(budget=args.budget, buffer=args.buffer,
                                                         window=args.window))

    configs = {}
    for method in args.methods:
        own = config(method, None)
        for layout in args.layouts or [own.natural_layout]:
            if layout in own.valid_layouts:
                label = method if layout == own.natural_layout else f"{method}/{layout}"
                configs[label] = config(method, layout)
    return configs


def run_grid(args, bench: Bench, machine: dict, log=print) -> tuple[list[dict], list]:
    """The rows of every (batch, length) cell of ``args`` and the cells ``--max-tokens``
    skipped; ``log`` gets a progress line per row."""
    configs = compression_configs(args)
    rows, skipped = [], []
    start = time.perf_counter()
    for batch in args.batches:
        for length in args.lengths:
            if args.max_tokens and batch * length > args.max_tokens:
                skipped.append((batch, length))
                continue
            for row in bench.run_cells(batch, length, configs, args.repeats, args.alpha_rows):
                if row["base"] in ("none", "sparrow"):
                    row["pred_step_s"] = bench.predicted_step(
                        batch, length, configs[row["method"]], machine)
                rows.append(row)
                log(f"  [{time.perf_counter() - start:6.0f}s] {row['method']:>10} "
                    f"b{batch:<3} n{length:<5} {row['tok_s']:8.1f} tok/s  "
                    f"compile {row['compile_s']:.1f}s")
    return rows, skipped


def transformers_rows(args, tmp: str, rows: list[dict]) -> list[dict]:
    """``transformers`` generate at each ``--hf-batches`` x ``--hf-lengths`` cell on the
    checkpoint in ``tmp`` (a child process); each result gets ``agree``, the mean number of
    leading greedy tokens equal to the ``none`` row of the same cell, where ``rows`` has one."""
    hf = setup.run_child("torch", tmp, args, str(CHILD))
    for r in hf:
        ours = next((x for x in rows if x["method"] == "none" and x["batch"] == r["batch"]
                     and x["length"] == r["length"]), None)
        if ours is not None:
            theirs = np.load(Path(tmp) / f"hf_{r['threads']}_{r['batch']}_{r['length']}.npy")
            same = np.cumprod(ours["response"] == theirs, axis=1).sum(axis=1)
            r["agree"] = float(np.mean(same))
    return hf
