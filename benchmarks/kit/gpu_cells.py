"""The measuring cells of ``gpu_suite.py`` (its docstring lists them and their plan): one
function per claim, each yielding its table rows as it measures them.

``cell_decode_pallas`` looks its backend up by name (:data:`PALLAS_BACKEND`) in
``models.attention_backends`` and says "not registered" until one is. With
``Context.dump_hlo`` the decode and update cells also write the compiled HLO of one decode
step (``decode_static_none.hlo``, from ``hlo_cost_functions``) and of the update they ran
(``update.hlo``) for ``hlo_cost.py --hlo FILE``. With no GPU (``Context.gpu`` False) every
cell runs at tiny shapes and a few steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.kit import compile_shapes, timing, update_cells
from benchmarks.kit import decode_grid as grid
from benchmarks.kit import model_setup as setup
from benchmarks.kit.decode_cells import Bench

ROOT = Path(__file__).resolve().parents[2]
PALLAS_BACKEND = "pallas_gpu"  # the Pallas column's name in models.attention_backends


class Skip(Exception):
    """A cell that cannot run here; the message says why."""


@dataclasses.dataclass
class Context:
    """What every cell reads: the mode, a scratch directory and where HLO dumps go."""

    gpu: bool  # full grid; False: --cpu-scaled
    tmp: Path
    dump_hlo: Path | None = None

    def pick(self, gpu, cpu):
        """``gpu`` in the full grid, ``cpu`` in the scaled one."""
        return gpu if self.gpu else cpu


def print_flush(line: str) -> None:
    """A progress line, at once."""
    print(line, flush=True)


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
    return dict(name=f"{kind} (measured)", **timing.measure_machine())



def decode_args(ctx: Context, gpu: list[str], cpu: list[str]):
    """``bench_decode`` flags of a cell (``gpu`` or ``cpu`` per mode), its shape configured."""
    args = grid.parse_args(ctx.pick(
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
            "--batches", "32", "256", "--lengths", "1024", "--methods", "none", "rkv"]
GRID_CPU = ["--prompt-len", "16", "--budget", "24", "--buffer", "8", "--window", "4",
            "--batches", "2", "--lengths", "40", "--methods", "none", "rkv"]


def hlo_sizes(ctx: Context, unroll_layers: bool = False):
    """``hlo_cost_functions.Sizes`` of the suite's decode grid (its first cell), for the
    HLO dumps, with ``Decoder.unroll_layers``."""
    from benchmarks.kit import hlo_cost_functions as fns

    sizes = ctx.pick(
        dict(shape="qwen2.5-1.5b", batch=32, context=128 + 1024, prompt_len=128,
             dtype="bfloat16", budget=512),
        dict(shape="tiny", batch=2, context=16 + 40, prompt_len=16, dtype="float32", budget=24))
    return fns.Sizes(**{**sizes, "buffer": ctx.pick(128, 8), "window": ctx.pick(8, 4),
                        "page_size": 16, "score_batch": 1, "update_batch": 1, "micro_batch": 0,
                        "remat": "full", "unroll_layers": unroll_layers})


def dump_decode_hlo(ctx: Context, unroll_layers: bool = False) -> dict:
    """Compiles one static dense decode step (``hlo_cost_functions``, abstract inputs) and
    writes its optimised HLO to ``ctx.dump_hlo/decode_static_none.hlo`` (unrolled:
    ``decode_unrolled_none.hlo``): the row of its walked costs against the floors."""
    from benchmarks.kit import hlo_cost_functions as fns
    from benchmarks.kit.hlo_measure import measure

    sizes = hlo_sizes(ctx, unroll_layers)
    fn = fns.BUILDERS["decode_static_none"](fns.Abstract(sizes))
    if unroll_layers:
        fn.name = "decode_unrolled_none"
    rec, _ = measure(fn, str(ctx.dump_hlo))
    return dict(method=f"hlo {fn.name}", batch=sizes.batch,
                hlo=str(ctx.dump_hlo / f"{fn.name}.hlo"), walked_gb=rec["bytes"] / 1e9,
                floor_gb=rec["floor_bytes"] / 1e9, walked_x_floor=rec["ratio"],
                compile_s=rec["compile_s"])


def decode_grid(ctx: Context, engine: str | None, methods: list[str] | None = None,
                attention: str | None = None, unroll_layers: bool = False):
    """The decode grid rows on ``engine`` (None: the static ``prefill`` / ``decode``), for
    ``methods`` (default the grid's) with the model's ``attention`` backend (None: its
    default) and ``Decoder.unroll_layers``, each (batch, length) cell's rows as soon as it
    is measured."""
    args = decode_args(ctx, GRID_GPU, GRID_CPU)
    if methods:
        args.methods = methods
    bench = Bench.random(max(args.batches), args.temperature, attention=attention,
                         unroll_layers=unroll_layers)
    bench.engine = engine
    machine = floor_machine()
    for batch in args.batches:
        for length in args.lengths:
            cell = argparse.Namespace(**{**vars(args), "batches": [batch], "lengths": [length]})
            rows, _ = grid.run_grid(cell, bench, machine, log=print_flush)
            for r in rows:
                yield dict(decode_row(r, machine), floor_device=machine["name"])


def cell_decode_static(ctx: Context):
    """The decode grid on the static engine (and, with ``ctx.dump_hlo``, one decode step's
    compiled HLO)."""
    yield from decode_grid(ctx, None)
    if ctx.dump_hlo:
        yield dump_decode_hlo(ctx)


def cell_decode_unrolled(ctx: Context):
    """The static decode grid with the layer scan unrolled (``Decoder.unroll_layers``): on
    the H200 the scanned step copied each layer's weight slice out of the stack before its
    matmuls (2.3x the floor's bytes, 8.6x its time); rows as ``decode_static``'s (and, with
    ``ctx.dump_hlo``, the unrolled step's compiled HLO)."""
    yield from decode_grid(ctx, None, unroll_layers=True)
    if ctx.dump_hlo:
        yield dump_decode_hlo(ctx, unroll_layers=True)


def cell_decode_continuous(ctx: Context):
    """The decode grid on issue 34's continuous engine (``sampling.engine: continuous``)."""
    from sparse_rl_jax.rollout.sampling_config import SamplingConfig

    if "engine" not in {f.name for f in dataclasses.fields(SamplingConfig)}:
        raise Skip("not available in this build: SamplingConfig has no engine field")
    yield from decode_grid(ctx, "continuous")


def cell_decode_pallas(ctx: Context):
    """The dense rows of the grid with the paged cache read by the Pallas GPU kernel: the
    backend looked up by name (:data:`PALLAS_BACKEND`), "not registered" until one is."""
    import jax

    from models import attention_backends

    backends = attention_backends.BACKENDS
    if PALLAS_BACKEND not in backends:
        raise Skip(f"not registered: models.attention_backends has no {PALLAS_BACKEND!r} "
                   f"backend (registered: {', '.join(backends.names())})")
    if not ctx.gpu:
        raise Skip(f"cpu-scaled run: {PALLAS_BACKEND} is timed on a GPU only")
    resolve = getattr(attention_backends, "resolve_attention", None)
    if resolve is not None:  # refuses a kernel this platform cannot run
        try:
            resolve(PALLAS_BACKEND, jax.default_backend())
        except ValueError as e:
            raise Skip(str(e)) from None
    yield from decode_grid(ctx, None, methods=["none"], attention=PALLAS_BACKEND)



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
        setup.run_child("build", tmp, args, str(grid.CHILD))
        bench = Bench.load(Path(tmp), args.temperature)
        rows, _ = grid.run_grid(args, bench, machine, log=print_flush)
        hf = grid.transformers_rows(args, tmp, rows)
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
    bench = Bench.random(1, 0.0)
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
    times = timing.time_calls(lambda: jax.block_until_ready(compiled(*call)), 2)
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
    """One update of N x (P + M), remat ``full``, at the memory plan's micro-batch: the
    device's measured peak memory against the plan's estimate (and XLA's)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from benchmarks.kit import hlo_cost_functions as fns
    from sparse_rl_jax.training import memory_plan

    n, p, m = ctx.pick((64, 128, 4096), (4, 16, 48))
    decode_args(ctx, [], [])
    cfg = setup.model_config()
    dtype = jnp.dtype(setup.DTYPE)
    plan = dict(prompt_len=p, new_tokens=m, dtype=dtype, remat="full", logp_chunk=128)
    micro = memory_plan.micro_batch_size(cfg, n, **plan)
    plan_bytes = fns.update_plan_bytes(cfg, n, micro, **plan)
    limit = memory_plan.device_memory_limit()
    model, batch = update_cells.update_model_and_batch(cfg, n, p, m, dtype=setup.DTYPE)
    model.remat = "full"
    graphdef, params = nnx.split(model)
    dump = ctx.dump_hlo / "update.hlo" if ctx.dump_hlo else None
    cell = update_cells.update_cell(graphdef, params, batch, micro, chunk_size=128,
                                    repeats=ctx.pick(1, 3), dump=dump)
    peak = device_peak_gib()
    yield dict(sequences=n, columns=p + m, micro_batch=micro,
               params_b=sum(x.size for x in jax.tree.leaves(params)) / 1e9,
               step_s=cell["step"], compile_s=cell["compile"], tok_s=n * (p + m) / cell["step"],
               plan_gib=plan_bytes / 2**30, device_peak_gib=peak,
               peak_over_plan=peak * 2**30 / plan_bytes if peak is not None else None,
               xla_peak_gib=cell["peak"] / 1024 if cell["peak"] is not None else None,
               device_limit_gib=limit / 2**30 if limit else None,
               **({"hlo": str(dump)} if dump else {}))



def cell_sparrow_8k(ctx: Context):
    """Sparrow (k = 8 pages, layers 0-1 dense) vs paged dense at an 8K context."""
    args = decode_args(
        ctx, ["--prompt-len", "7680", "--batches", "32", "--lengths", "512",
              "--methods", "none", "sparrow", "--schedule", "0:8"],
        ["--prompt-len", "64", "--batches", "2", "--lengths", "32",
         "--methods", "none", "sparrow", "--schedule", "0:1", "--dense-layers", "0"])
    bench = Bench.random(max(args.batches), args.temperature)
    machine = floor_machine()
    rows, _ = grid.run_grid(args, bench, machine, log=print_flush)
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
        yield compile_shapes.compile_shapes(layers)
