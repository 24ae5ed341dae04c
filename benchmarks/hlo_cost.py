"""XLA cost model: FLOPs and bytes per call of the decode step, compression, score and
update at a real model shape, compiled from abstract inputs on whatever backend is present.

    python benchmarks/hlo_cost.py --shape qwen2.5-1.5b --batch 32 --context 4096 \
        --dtype float32 [--only decode_static_none ...] [--quant int8] [--json FILE] \
        [--dump-hlo DIR] [--top N]
    python benchmarks/hlo_cost.py --hlo FILE [--loop-trips N] [--json FILE] [--top N]
    python benchmarks/hlo_cost.py --plan-grid [--json FILE]   # kit/hlo_cost_plan.py

Functions (``--only``; default all): ``decode_{static,continuous}_{none,rkv,sparrow}`` (one
decode step of ``--batch`` rows each holding ``--context`` tokens; ``rkv`` keeps
``--budget`` (default ``context / 2``) + ``--buffer`` slots), ``compress_rkv`` (one R-KV
compression of that cache), ``score`` (dense log-probs of ``--score-batch`` x
``(--prompt-len + --context)``) and ``update`` (one AdamW update of ``--update-batch`` such
sequences in micro-batches of ``--micro-batch``, remat ``--remat``, LoRA rank
``--lora-rank``). ``--quant`` stores the decode steps' and the compression's KV as
``compression.quant`` codes (their KV floors then count codes and scales). Each is lowered from
``jax.ShapeDtypeStruct`` arguments (``kit/hlo_cost_functions.py``; no weights), compiled, and its
optimised HLO walked by ``kit/hlo_walk.py`` with every loop's trip count multiplied in: XLA's
``known_trip_count`` (the layer scan) or, for the page loop of a paged decode step, whose
count is traced, ``ceil(context / chunk)`` (``--chunk-pages`` sets the chunk; XLA:CPU's
default is 2 pages, elsewhere 32). ``cost_analysis()`` would count each loop body once.

Columns: walked FLOPs and bytes per call against their floors (``hlo_cost_functions``'s
docstring), ``x`` = walked / floor; ``bytes`` assumes slices fuse into their consumers (a
GPU reads a layer's weights or a KV chunk in place), ``compiled x`` counts each slice as the
copy XLA:CPU makes. ``ratio`` (JSON) is the bound's ``x``: bytes for the decode steps and the
compression, FLOPs for the score and update. For the compression, ``per step`` is its bytes
spread over the ``--buffer`` decode steps between compressions, as a share of the R-KV decode
step's floor. For the update, ``peak`` is ``memory_analysis()`` (arguments + outputs + temp -
aliased) and ``plan`` ``memory_plan.estimate`` (+ the float32 gradient accumulator when it
runs micro-batches). On XLA:CPU bf16 work turns into f32 conversions: compare bytes in f32.

``--hlo FILE`` walks an HLO text dumped elsewhere (``--dump-hlo DIR`` writes each compiled
function's, ``XLA_FLAGS=--xla_dump_to=DIR`` a GPU's ``*after_optimizations.txt``) without
compiling; ``--loop-trips N`` counts loops without a known trip count N times (default once,
listed). ``--top N`` lists each function's ``N`` heaviest kernels by bytes per call (loops
multiplied in, slices fused), with the ``op_name`` that says which line of code made each.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.kit import hlo_walk  # noqa: E402
from benchmarks.kit.hlo_measure import measure, walk_record  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    from benchmarks.kit import hlo_cost_functions as fns

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen2.5-1.5b",
                   help=f"model shape: one of {', '.join(fns.SHAPES)}")
    p.add_argument("--batch", type=int, default=32, help="decode rows")
    p.add_argument("--context", type=int, default=4096,
                   help="tokens each decode row holds; response columns of score/update")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--budget", type=int, help="R-KV budget (default context / 2)")
    p.add_argument("--buffer", type=int, default=128)
    p.add_argument("--window", type=int, default=8)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--quant", default="none", choices=["none", "int8", "fp8", "int4"],
                   help="compression.quant of the decode steps' and compression's KV (their "
                        "KV floors count its codes and scales)")
    p.add_argument("--score-batch", type=int, default=8)
    p.add_argument("--update-batch", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=8, help="0: the whole update batch")
    p.add_argument("--remat", default="full")
    p.add_argument("--lora-rank", type=int, default=0,
                   help="update: rank of LoRA adapters on every projection (0: full)")
    p.add_argument("--plan-grid", action="store_true",
                   help="only the update's memory plan against XLA's peak, over the grid of "
                        "hlo_cost_plan.py (1.5B micro 8/16/32, 7B micro 1; full and LoRA "
                        "rank --lora-rank or 8; f32 and bf16)")
    p.add_argument("--chunk-pages", type=int,
                   help="pages per paged decode loop iteration (models.paged_cache; default "
                        "the backend's)")
    p.add_argument("--only", nargs="+", metavar="NAME",
                   help=f"compile only these: {', '.join(fns.BUILDERS)}")
    p.add_argument("--json", help="write one record per function here")
    p.add_argument("--dump-hlo", metavar="DIR", help="write each optimised HLO to DIR/NAME.hlo")
    p.add_argument("--hlo", metavar="FILE", help="walk this HLO text instead of compiling")
    p.add_argument("--top", type=int, metavar="N",
                   help="also list each function's N heaviest kernels by bytes")
    p.add_argument("--loop-trips", type=int,
                   help="--hlo: count loops without a known trip count this many times")
    args = p.parse_args(argv)
    if args.hlo is None:
        fns.model_config(args.shape)  # ValueError naming the known shapes
        unknown = sorted(set(args.only or ()) - set(fns.BUILDERS))
        if unknown:
            p.error(f"--only: unknown {unknown}; known: {', '.join(fns.BUILDERS)}")
        if args.prompt_len >= args.context:
            p.error(f"--prompt-len {args.prompt_len} must be below --context {args.context}")
    return args


def sizes_of(args):
    """``hlo_cost_functions.Sizes`` of the command line."""
    from benchmarks.kit import hlo_cost_functions as fns

    budget = args.budget or args.context // 2
    return fns.Sizes(shape=args.shape, batch=args.batch, context=args.context,
                     prompt_len=args.prompt_len, dtype=args.dtype, budget=budget,
                     buffer=args.buffer, window=args.window, page_size=args.page_size,
                     score_batch=args.score_batch, update_batch=args.update_batch,
                     micro_batch=args.micro_batch, remat=args.remat,
                     lora_rank=args.lora_rank, quant=args.quant)


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f}{unit}"
    return f"{x:.0f}"


def table(records: list[dict]) -> str:
    """The printed table: one row per record."""
    head = (f"{'function':<24}{'FLOPs':>9}{'floor':>9}{'x':>7}{'bytes':>9}{'floor':>9}{'x':>7}"
            f"{'compiled x':>11}  notes")
    lines = [head, "-" * len(head)]
    for r in records:
        fx = r["flops"] / r["floor_flops"] if r.get("floor_flops") else None
        bx = r["bytes"] / r["floor_bytes"] if r.get("floor_bytes") else None
        cx = r["bytes_compiled"] / r["floor_bytes"] if r.get("floor_bytes") else None
        notes = []
        if "per_step" in r:
            notes.append(f"per step {100 * r['per_step']:.1f}% of the decode floor")
        if r.get("plan_bytes") is not None:
            peak = r["peak_bytes"]
            notes.append(f"peak {_num(peak)}B plan {_num(r['plan_bytes'])}B"
                         + (f" plan/peak {r['plan_bytes'] / peak:.3f}" if peak else ""))
        if r.get("unknown_loops"):
            notes.append(f"{len(r['unknown_loops'])} loop(s) x {r['loop_trips']}")
        fmt = lambda x: f"{x:>7.2f}" if x is not None else f"{'-':>7}"  # noqa: E731
        lines.append(f"{r['name']:<24}{_num(r['flops']):>9}{_num(r.get('floor_flops')):>9}"
                     f"{fmt(fx)}{_num(r['bytes']):>9}{_num(r.get('floor_bytes')):>9}{fmt(bx)}"
                     f"{fmt(cx):>11}  {'; '.join(notes)}")
    return "\n".join(lines)


def heaviest(text: str, n: int, *, by: str = "bytes", **options) -> list[dict]:
    """The ``n`` kernels of HLO module ``text`` that cost the most ``by`` (``bytes`` or
    ``flops``) per call, loops multiplied in; ``options`` as ``hlo_walk.walk``. Each is
    ``{name, opcode, shape, times, bytes, flops, op_name}`` (``bytes``/``flops``: all runs)."""
    rows = [dict(name=instr.name, opcode=instr.opcode, shape=instr.shape, times=times,
                 bytes=times * cost.bytes, flops=times * cost.flops,
                 op_name=hlo_walk.Walker._label(instr))
            for times, instr, cost in hlo_walk.Walker(text, **options).kernels()]
    return sorted(rows, key=lambda r: -r[by])[:n]


def top_table(name: str, rows: list[dict]) -> str:
    """The ``--top`` listing of one function: its heaviest kernels by bytes."""
    lines = [f"{name}: heaviest kernels per call (loops multiplied in)",
             f"  {'bytes':>9}{'FLOPs':>9}{'runs':>7}  kernel"]
    for r in rows:
        lines.append(f"  {_num(r['bytes']):>9}{_num(r['flops']):>9}{r['times']:>7.0f}  "
                     f"{r['opcode']} {r['shape'][:60]}  {r['op_name'][-90:]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Runs the command line (see the module docstring)."""
    args = parse_args(argv)
    tops = []
    if args.hlo:
        text = Path(args.hlo).read_text()
        records = [walk_record(Path(args.hlo).stem, text, args.loop_trips)]
        tops.append((records[0]["name"], text, args.loop_trips))
    else:
        import jax

        from benchmarks.kit import hlo_cost_functions as fns

        if args.chunk_pages:
            from models import paged_cache

            paged_cache.CHUNK_PAGES = {jax.default_backend(): args.chunk_pages}
        sizes = sizes_of(args)
        if args.plan_grid:
            from benchmarks.kit import hlo_cost_plan

            print(f"update of {args.update_batch} x ({args.prompt_len} + {args.context}), "
                  f"remat {args.remat}, on {jax.devices()[0].device_kind}", flush=True)
            records = hlo_cost_plan.run_grid(sizes, args.lora_rank or 8)
            if args.json:
                Path(args.json).write_text(json.dumps(records, indent=1))
            return
        abstract = fns.Abstract(sizes)
        names = args.only or list(fns.BUILDERS)
        print(f"{args.shape}, {args.dtype}, decode batch {args.batch} x context "
              f"{args.context}, prompt {args.prompt_len}, R-KV {sizes.budget} + "
              f"{sizes.buffer}, KV quant {args.quant}, on {jax.devices()[0].device_kind} ({os.cpu_count()} cores)",
              flush=True)
        records, start = [], time.perf_counter()
        for name in names:
            print(f"  [{time.perf_counter() - start:6.0f}s] compiling {name} ...", end="",
                  flush=True)
            fn = fns.BUILDERS[name](abstract)
            rec, text = measure(fn, args.dump_hlo)
            records.append(rec)
            tops.append((name, text, fn.loop_trips))
            print(f" {rec['compile_s']:.0f}s, x{rec['ratio']:.2f} of the {rec['bound']} floor",
                  flush=True)
    print(table(records))
    for name, text, trips in tops if args.top else ():
        print(top_table(name, heaviest(text, args.top, default_trips=trips)))
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
