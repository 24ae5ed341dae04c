"""The decode benchmark's report: the table of cells, the ratios against the targets, the
Sparrow lines (speed vs dense, cost model, alpha p5) and the profile. Used by
``bench_decode.py``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from benchmarks.kit import model_setup as setup


def report(args, bench, machine, rows, skipped, hf, profile, wall) -> None:
    """Prints the table, the ratios against the targets, Sparrow's lines and the profile."""
    print_table(args, bench, machine, rows, skipped, hf, wall)
    print_targets(args, machine, rows, hf)
    print_sparrow(rows)
    print_layouts(rows)
    if profile:
        print_profile(profile)
    if args.json:
        for r in rows:
            r.pop("response")
        Path(args.json).write_text(json.dumps(dict(machine=machine, rows=rows, hf=hf,
                                                   profile=profile), indent=1, default=str))



def print_table(args, bench, machine, rows, skipped, hf, wall) -> None:
    """Prints the run's setup and one line per cell (sets each row's ``floor_s``)."""
    mib = 2**20
    bw, peak = machine["bandwidth"], machine["matmul_flops"]
    import jax

    print(f"model: {args.shape}, {bench.num_params / 1e6:.1f}M params ({bench.param_bytes / mib:.0f}"
          f" MiB {setup.DTYPE}), {jax.devices()[0].device_kind} ({os.cpu_count()} host cores); "
          f"prompt {setup.PROMPT_LEN} tokens; "
          f"{'greedy' if args.temperature == 0 else f'temperature {args.temperature}'}; "
          f"compression budget {args.budget} + buffer {args.buffer}, window {args.window}")
    print(f"machine: copy {machine['copy_rate'] / 1e9:.1f} GB/s (read+write), jax read "
          f"{machine['read_rate'] / 1e9:.1f} GB/s -> bandwidth {bw / 1e9:.1f} GB/s; fp32 matmul "
          f"{peak / 1e9:.1f} GFLOP/s")
    print(f"grid: batches {args.batches} x lengths {args.lengths}; skipped (batch, length) "
          f"{skipped or 'none'}; total wall {wall / 60:.1f} min")
    header = (f"{'method':<11}{'batch':>6}{'len':>6}{'tok/s':>9}{'ms/step':>9}{'prefill':>8}"
              f"{'alloc KV':>10}{'state':>8}{'KV peak':>8}{'KV mean':>8}{'dense':>7}{'#cmp':>5}"
              f"{'floor ms':>9}{'x floor':>8}")
    print("(alloc KV / state: MiB of k+v cache / + eviction record; KV peak/mean/dense: resident"
          " tokens per row, dense = what a dense cache holds on average; floor: max(bytes, FLOPs)"
          " per step)")
    print(header)
    print("-" * len(header))
    for r in rows:
        floor = max(r["floor_bytes"] / bw, r["floor_flops"] / peak)
        r["floor_s"] = floor
        print(f"{r['method']:<11}{r['batch']:>6}{r['length']:>6}{r['tok_s']:>9.1f}"
              f"{r['step_s'] * 1e3:>9.1f}{r['prefill_s'] * 1e3:>8.0f}"
              f"{r['alloc_bytes'] / mib:>10.1f}{r['state_bytes'] / mib:>8.1f}{r['kv_peak']:>8.0f}"
              f"{r['kv_mean']:>8.0f}{r['dense_kv_mean']:>7.0f}{r['compressions']:>5}"
              f"{floor * 1e3:>9.1f}{r['step_s'] / floor:>8.2f}"
              + ("  RECOMPILED" if r["recompiled"] else ""))
    for r in hf:
        print(f"{'HF':<11}{r['batch']:>6}{r['length']:>6}{r['batch'] * r['length'] / r['seconds']:>9.1f}"
              f"{r['seconds'] / r['length'] * 1e3:>9.1f}   {r['label']}")


def print_targets(args, machine, rows, hf) -> None:
    """Prints the measured ratios against the targets of the evicting methods and dense."""
    mib = 2**20
    bw, peak = machine["bandwidth"], machine["matmul_flops"]
    print("\ntargets")
    dense = {(r["batch"], r["length"]): r for r in rows if r["method"] == "none"}
    for method in [m for m in args.methods if m not in ("none", "sparrow")]:
        mine = [r for r in rows if r["method"] == method]
        for batch in args.batches:
            seq = sorted((r for r in mine if r["batch"] == batch), key=lambda r: r["length"])
            if len(seq) > 1:
                flat = len({r["alloc_bytes"] for r in seq}) == 1
                print(f"  {method} b{batch}: alloc KV {[round(r['alloc_bytes'] / mib, 1) for r in seq]}"
                      f" MiB, KV peak {[round(r['kv_peak']) for r in seq]} tokens over lengths "
                      f"{[r['length'] for r in seq]}: flat {'MET' if flat else 'NOT MET'}")
        for r in mine:
            d = dense.get((r["batch"], r["length"]))
            if d is None:
                continue
            measured = r["tok_s"] / d["tok_s"]
            predicted = d["floor_s"] / r["floor_s"]
            impl = max(d["impl_bytes"] / bw, d["floor_flops"] / peak) / max(
                r["impl_bytes"] / bw, r["floor_flops"] / peak)
            longest = r["length"] == max(x["length"] for x in mine)
            verdict = (" -> target (>= 80%) " + ("MET" if measured >= 0.8 * predicted
                                                  else "NOT MET")) if longest else ""
            print(f"  {method}/none speed b{r['batch']} n{r['length']}: measured {measured:.2f}x, "
                  f"bytes model {predicted:.2f}x ({measured / predicted:.0%}); model with the "
                  f"slots the loop actually reads {impl:.2f}x{verdict}")
    for r in hf:
        d = dense.get((r["batch"], r["length"]))
        if d is not None:
            ratio = d["tok_s"] / (r["batch"] * r["length"] / r["seconds"])
            print(f"  none vs transformers ({r['threads']} threads) b{r['batch']} n{r['length']}: "
                  f"{ratio:.2f}x "
                  f"(target >= 1.5x: {'MET' if ratio >= 1.5 else 'NOT MET'}); greedy tokens agree "
                  f"on the first {r.get('agree', float('nan')):.0f} of {r['length']} (mean/row)")
    for r in rows:
        if r["method"] == "none":
            x = r["step_s"] / r["floor_s"]
            print(f"  none b{r['batch']} n{r['length']}: {x:.2f}x the floor "
                  f"(target <= 2x: {'MET' if x <= 2 else 'NOT MET'})")


def print_sparrow(rows) -> None:
    """Prints, per cell with both ``none`` and ``sparrow``: ms/step of each, the measured
    speedup, the cost model's per-step times and speedup, and sparrow's alpha p5 per bin."""
    dense = {(r["batch"], r["length"]): r for r in rows if r["method"] == "none"}
    cells = [(dense.get((r["batch"], r["length"])), r) for r in rows if r["method"] == "sparrow"]
    if not cells:
        return
    print("\nsparrow vs none (same run; model = sparse_rl_jax.kv.sparrow_cost on the measured "
          "bandwidth and FLOP/s)")
    print(f"  {'batch':>5}{'len':>6}{'dense ms':>10}{'sparrow ms':>12}{'speedup':>9}"
          f"{'model dense':>13}{'model sparrow':>15}{'model x':>9}  alpha p5 per 2000-token bin")
    for d, s in cells:
        if d is None:
            continue
        print(f"  {s['batch']:>5}{s['length']:>6}{d['step_s'] * 1e3:>10.2f}"
              f"{s['step_s'] * 1e3:>12.2f}{d['step_s'] / s['step_s']:>8.2f}x"
              f"{d['pred_step_s'] * 1e3:>13.2f}{s['pred_step_s'] * 1e3:>15.2f}"
              f"{d['pred_step_s'] / s['pred_step_s']:>8.2f}x  "
              + ", ".join(f"{a:.3f}" for a in s["alpha_p5"]))


def print_layouts(rows) -> None:
    """Prints, per cell and method run on several cache layouts: each layout's ms/step and
    prefill ms side by side, the speed ratio against the ``dense`` layout (or the first) and
    whether the greedy tokens agree with it."""
    cells: dict[tuple, list[dict]] = {}
    for r in rows:
        cells.setdefault((r["batch"], r["length"], r["base"]), []).append(r)
    cells = {cell: runs for cell, runs in cells.items() if len(runs) > 1}
    if not cells:
        return
    print("\ncache layouts (same run; ratio = base ms/step / layout ms/step, > 1 is faster; "
          "base = the dense layout)")
    print(f"  {'method':<8}{'batch':>5}{'len':>6}{'layout':>8}{'ms/step':>9}{'prefill ms':>11}"
          f"{'alloc KV':>10}{'compile s':>10}{'ratio':>7}  tokens = base")
    for (batch, length, method), runs in cells.items():
        base = next((r for r in runs if r["layout"] == "dense"), runs[0])
        for r in runs:
            same = bool(np.array_equal(r["response"], base["response"]))
            print(f"  {method:<8}{batch:>5}{length:>6}{r['layout']:>8}{r['step_s'] * 1e3:>9.2f}"
                  f"{r['prefill_s'] * 1e3:>11.1f}{r['alloc_bytes'] / 2**20:>10.1f}"
                  f"{r['compile_s']:>10.1f}{base['step_s'] / r['step_s']:>6.2f}x  {same}")


def print_profile(p: dict) -> None:
    """Prints the profile of one cell: loop variants, copies and the traced source lines."""
    steps = p["length"] - 1
    print(f"\nprofile b{p['batch']} n{p['length']}: prefill "
          + ", ".join(f"{m} {t * 1e3:.0f} ms" for m, t in p["prefill_s"].items())
          + f"; one {p['method']} compression alone {p['compress_s'] * 1e3:.1f} ms "
          f"(cache {p['cache_mib']:.1f} MiB k+v)")
    print("decode loops (each a fresh jit; best of "
          f"{len(p['variants'][0]['times'])}). copies = whole k or v / pos buffers copied in "
          "the compiled loop: 'cond' inside the compression cond's branches, 'other' elsewhere")
    print(f"  {'method':<7}{'variant':<44}{'ms':>7}{'ms/step':>9}{'#cmp':>5}"
          f"{'cond kv/pos':>12}{'other kv/pos':>13}  tokens+record same  max|dlogp|")
    for v in p["variants"]:
        c = v["copies"]
        print(f"  {v['method']:<7}{v['variant']:<44}{v['seconds'] * 1e3:7.0f}"
              f"{v['seconds'] / steps * 1e3:9.2f}{v['compressions']:>5}"
              f"{c['cond kv']:>8}/{c['cond pos']:<3}{c['other kv']:>9}/{c['other pos']:<3}  "
              f"{str(v['same_tokens']):<19}{v['logp_diff']:.1e}")
    print("  (#cmp counts index resets for the reset variant)")
    for t in p["traces"]:
        total = sum(x for _, x in t["lines"])
        print(f"jax.profiler trace, {t['method']} b{t['batch']} n{t['length']} in a "
              f"{t['capacity']}-slot cache: "
              f"{t['seconds'] / steps * 1e3:.2f} ms/step wall; executed HLO ops by source "
              f"line (ms/step, share of op time)")
        for label, x in t["lines"][:10]:
            print(f"  {x / steps * 1e3:7.2f} {x / total:6.1%}  {label}")
        rest = sum(x for _, x in t["lines"][10:])
        print(f"  {rest / steps * 1e3:7.2f} {rest / total:6.1%}  everything else")
