"""Compile one ``hlo_cost_functions.Function`` and walk its optimised HLO (``hlo_walk``): the
record of its walked FLOPs and bytes against its floors (``hlo_cost.py``'s table and JSON, the
GPU suite's HLO dump)."""

from __future__ import annotations

import time
from pathlib import Path

from benchmarks.kit import hlo_walk


def walk_record(name: str, text: str, loop_trips: int | None) -> dict:
    """The walked costs of one HLO text: slices fused (``flops``, ``bytes``) and as compiled
    (``bytes_compiled``), with the loops it had to count by ``loop_trips``."""
    fused = hlo_walk.walk(text, default_trips=loop_trips)
    compiled = hlo_walk.walk(text, default_trips=loop_trips, fuse_slices=False)
    return dict(name=name, flops=fused.flops, transcendentals=fused.transcendentals,
                bytes=fused.bytes, bytes_compiled=compiled.bytes, loop_trips=loop_trips,
                unknown_loops=[label for _, label, _ in fused.unknown_loops])


def measure(fn, dump_dir: str | None) -> tuple[dict, str]:
    """Compile one ``hlo_cost_functions.Function`` and walk it: its JSON record and its
    optimised HLO text."""
    start = time.perf_counter()
    compiled = fn.lower().compile()
    compile_s = time.perf_counter() - start
    text = compiled.as_text()
    if dump_dir:
        Path(dump_dir).mkdir(parents=True, exist_ok=True)
        Path(dump_dir, f"{fn.name}.hlo").write_text(text)
    rec = walk_record(fn.name, text, fn.loop_trips)
    walked = rec["bytes"] if fn.bound == "bytes" else rec["flops"]
    floor = fn.floor_bytes if fn.bound == "bytes" else fn.floor_flops
    rec.update(floor_flops=fn.floor_flops, floor_bytes=fn.floor_bytes, bound=fn.bound,
               ratio=walked / floor, compile_s=compile_s, **fn.extra)
    if fn.name == "compress_rkv":
        rec["per_step"] = rec["bytes"] / fn.extra["every_steps"] / fn.extra["decode_floor_bytes"]
    if fn.plan_bytes is not None:
        stats = compiled.memory_analysis()
        rec["plan_bytes"] = fn.plan_bytes
        rec["peak_bytes"] = None if stats is None else (
            stats.argument_size_in_bytes + stats.output_size_in_bytes
            + stats.temp_size_in_bytes - stats.alias_size_in_bytes)
    return rec, text
