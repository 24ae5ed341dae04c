"""``hlo_cost.py --plan-grid``: the memory plan of an update against XLA's peak, over the
grid issue 38 targets (plan / peak in [0.95, 1.25]).

Each cell compiles one ``update_step`` from abstract inputs (``hlo_cost_functions.update``:
``--update-batch`` sequences of ``--prompt-len`` + ``--context`` tokens, remat ``--remat``)
and compares ``memory_analysis()`` (arguments + outputs + temporaries - aliased) with
``memory_plan.estimate("update", ...)``. Cells: Qwen2.5-1.5B at micro-batch 8, 16 and 32 and
Qwen2.5-7B at micro-batch 1, each full and LoRA (rank ``--lora-rank`` on every projection),
float32 and bfloat16. A row prints as soon as its cell is compiled.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Iterator

GRID = (("qwen2.5-1.5b", (8, 16, 32)), ("qwen2.5-7b", (1,)))
DTYPES = ("float32", "bfloat16")
TARGET = (0.95, 1.25)
HEAD = (f"{'shape':<14}{'dtype':<10}{'train':<7}{'micro':>6}{'peak GiB':>10}{'plan GiB':>10}"
        f"{'plan/peak':>11}{'compile s':>11}  target")


def cells(lora_rank: int) -> Iterator[tuple[str, int, str, int]]:
    """``(shape, micro_batch, dtype, lora_rank)`` of every cell, the cheaper shape first."""
    for shape, micros in GRID:
        for micro in micros:
            for dtype in DTYPES:
                for rank in (0, lora_rank):
                    yield shape, micro, dtype, rank


def measure_cell(sizes, shape: str, micro: int, dtype: str, lora_rank: int) -> dict:
    """Compile one cell's update (``sizes`` with these fields replaced): its record."""
    from benchmarks.kit import hlo_cost_functions as fns
    from benchmarks.kit.update_cells import xla_peak_bytes

    cell = dataclasses.replace(sizes, shape=shape, micro_batch=micro, dtype=dtype,
                               lora_rank=lora_rank)
    fn = fns.update(fns.Abstract(cell))
    start = time.perf_counter()
    stats = fn.lower().compile().memory_analysis()
    return dict(shape=shape, dtype=dtype, lora_rank=lora_rank, micro_batch=micro,
                update_batch=sizes.update_batch, context=sizes.context,
                prompt_len=sizes.prompt_len, remat=sizes.remat,
                peak_bytes=None if stats is None else xla_peak_bytes(stats),
                plan_bytes=fn.plan_bytes, compile_s=time.perf_counter() - start)


def row(rec: dict) -> str:
    """One printed line of :data:`HEAD`'s table."""
    peak, plan = rec["peak_bytes"], rec["plan_bytes"]
    ratio = plan / peak if peak else None
    verdict = "-" if ratio is None else ("meets" if TARGET[0] <= ratio <= TARGET[1] else
                                         "UNDER" if ratio < TARGET[0] else "OVER")
    train = f"lora{rec['lora_rank']}" if rec["lora_rank"] else "full"
    return (f"{rec['shape']:<14}{rec['dtype']:<10}{train:<7}{rec['micro_batch']:>6}"
            f"{'-' if peak is None else f'{peak / 2**30:.1f}':>10}{plan / 2**30:>10.1f}"
            f"{'-' if ratio is None else f'{ratio:.3f}':>11}{rec['compile_s']:>11.0f}  "
            f"{verdict}")


def run_grid(sizes, lora_rank: int) -> list[dict]:
    """Every cell of :func:`cells`, printing :data:`HEAD` then each row as it finishes."""
    print(HEAD, flush=True)
    records = []
    for cell in cells(lora_rank):
        records.append(measure_cell(sizes, *cell))
        print(row(records[-1]), flush=True)
    return records
