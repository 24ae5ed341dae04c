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

Files: this driver (cells and flags), ``kit/model_setup.py`` (bench model, checkpoint,
``transformers`` child), ``kit/timing.py`` (machine measurement), ``decode_report.py`` (tables
and targets), ``decode_profile.py`` (the profile).

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

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import decode_profile  # noqa: E402
import decode_report  # noqa: E402
from benchmarks.kit import model_setup as setup  # noqa: E402
from benchmarks.kit import timing  # noqa: E402


class Bench:
    """The loaded model and what every cell needs."""

    def __init__(self, model, prompts: np.ndarray, temperature: float):
        """``model``: a ``models.Decoder``; ``prompts``: int ``[rows, setup.PROMPT_LEN]``."""
        import jax
        import jax.numpy as jnp
        from flax import nnx

        self.jax, self.jnp = jax, jnp
        self.cfg = model.config
        self.graphdef, self.params = nnx.split(model)
        self.prompts = prompts
        self.temperature = temperature
        self.engine = None  # SamplingConfig.engine when set (issue 34's continuous engine)
        leaves = jax.tree.leaves(self.params)
        self.param_bytes = sum(x.nbytes for x in leaves)
        self.num_params = sum(x.size for x in leaves)
        self.itemsize = jnp.dtype(setup.DTYPE).itemsize

    @classmethod
    def load(cls, path: Path, temperature: float) -> "Bench":
        """The checkpoint and prompts ``model_setup.build_checkpoint`` wrote to ``path``."""
        import jax.numpy as jnp

        import models

        return cls(models.load_pretrained(path, dtype=jnp.dtype(setup.DTYPE)),
                   np.load(path / "prompts.npy"), temperature)

    @classmethod
    def random(cls, rows: int, temperature: float, attention: str | None = None) -> "Bench":
        """The configured shape with random weights built in JAX (no ``transformers``, no
        checkpoint) and ``rows`` random prompts, as ``build_checkpoint`` draws them;
        ``attention``: the model's default attention backend (None: the library's)."""
        import jax.numpy as jnp
        from flax import nnx

        import models

        dtype = jnp.dtype(setup.DTYPE)
        model = models.Decoder(setup.model_config(), dtype=dtype, param_dtype=dtype,
                               rngs=nnx.Rngs(0))
        if attention is not None:  # as the trainer sets model.attention's resolved backend
            model.attention = attention
        prompts = np.random.default_rng(0).integers(
            3, setup.CONFIG["vocab_size"], (rows, setup.PROMPT_LEN)).astype(np.int32)
        return cls(model, prompts, temperature)

    def sampling(self, length: int, record: bool = False):
        """Greedy (or ``--temperature``) sampling of ``length`` tokens that never stops early,
        on ``self.engine`` when set."""
        from sparse_rl_jax.rollout.sampling_config import SamplingConfig

        greedy = self.temperature == 0
        engine = {} if self.engine is None else {"engine": self.engine}
        return SamplingConfig(max_new_tokens=length, greedy=greedy,
                              temperature=1.0 if greedy else self.temperature,
                              eos_ids=(self.cfg.vocab_size,), pad_id=0, record_evictions=record,
                              prompt_bucket=setup.PROMPT_LEN, **engine)

    def step_cost(self, batch: int, kv_tokens: float) -> tuple[float, float]:
        """(bytes, FLOPs) of one dense decode step with ``kv_tokens`` resident per row."""
        from sparse_rl_jax.kv.sparrow_cost import decode_step_cost

        cost = decode_step_cost(self.cfg, batch=batch, cached_len=kv_tokens,
                                itemsize=self.itemsize)
        return (self.param_bytes + cost.attention_bytes,
                cost.linear_flops + cost.attention_flops)

    def predicted_step(self, batch: int, length: int, compression, machine: dict) -> float:
        """Cost-model seconds per decode step (mean over the rollout) on the measured machine."""
        from sparse_rl_jax.kv.sparrow_cost import Device, rollout_seconds

        device = Device("measured", machine["bandwidth"], machine["matmul_flops"])
        sparse = compression.page_sparse
        return rollout_seconds(
            self.cfg, device, batch=batch, prompt_len=setup.PROMPT_LEN, new_tokens=length,
            schedule=compression.sparrow.budget_schedule if sparse else None,
            page_size=compression.page_size, dense_layers=compression.sparrow.dense_layers,
            itemsize=self.itemsize) / (length - 1)

    def rollout(self, batch: int, length: int, compression, zero: bool = False):
        """``(DecodeLoop, prefill seconds, decode seconds)`` of one rollout through the public
        ``sampler.prefill`` and ``sampler.decode``; ``zero``: no decode iteration."""
        from sparse_rl_jax.rollout import sampler

        jax, jnp = self.jax, self.jnp
        sampling = self.sampling(length, record=compression.page_sparse)
        prompt = jnp.asarray(self.prompts[:batch])
        mask = jnp.ones_like(prompt)
        k_prefill, k_decode = jax.random.split(jax.random.key(0))
        kw = dict(sampling=sampling, compression=compression)
        start = time.perf_counter()
        prefilled = jax.block_until_ready(sampler.prefill(
            self.graphdef, self.params, prompt, mask, k_prefill,
            max_len=setup.PROMPT_LEN + length, **kw))
        mid = time.perf_counter()
        if zero:  # the EOS id the model never emits: the loop runs no iteration
            prefilled = prefilled._replace(first=jnp.full_like(prefilled.first,
                                                               self.cfg.vocab_size))
        loop = jax.block_until_ready(sampler.decode(self.graphdef, self.params, prefilled,
                                                    k_decode, **kw))
        return loop, mid - start, time.perf_counter() - mid

    def run_cells(self, batch: int, length: int, configs: dict, repeats: int,
                  alpha_rows: int) -> list[dict]:
        """One row per method of ``configs``: compile each rollout, then time them round-robin
        ``repeats`` times and keep each method's fastest (load drift on a shared machine then
        hits every method alike)."""
        from benchmarks.kit.compile_count import count_compiles

        compile_s, best = {}, {}
        for method, compression in configs.items():
            start = time.perf_counter()
            self.rollout(batch, length, compression, zero=True)
            compile_s[method] = time.perf_counter() - start
        with count_compiles() as compiles:
            for _ in range(repeats):
                for method, compression in configs.items():
                    run = self.rollout(batch, length, compression)
                    if method not in best or run[2] < best[method][2]:
                        best[method] = run
        return [self.cell_row(method, batch, length, configs[method], *best[method],
                              compile_s=compile_s[method],
                              recompiled=sum(compiles.values()) > 0, alpha_rows=alpha_rows)
                for method in configs]

    def cell_row(self, method: str, batch: int, length: int, compression, loop,
                 prefill_s: float, decode_s: float, *, compile_s: float, recompiled: bool,
                 alpha_rows: int) -> dict:
        """The table row of one timed rollout: speed and KV statistics from its decode loop."""
        capacity = compression.cache_capacity(setup.PROMPT_LEN + length)
        paged = compression.cache_layout == "paged"
        c = self.cfg
        alloc = 2 * c.num_layers * batch * c.num_kv_heads * capacity * c.head_dim * self.itemsize
        forwards = np.asarray(loop.forwards, np.float64)
        kv_mean = float(np.mean(np.asarray(loop.kv_sum) / forwards))
        floor_bytes, floor_flops = self.step_cost(batch, kv_mean)
        records = [loop.state.evicted_at, loop.page_record]
        return dict(
            method=method, base=compression.method, layout=compression.cache_layout,
            batch=batch, length=length, seconds=prefill_s + decode_s,
            compile_s=compile_s, recompiled=recompiled, prefill_s=prefill_s,
            step_s=decode_s / (length - 1), tok_s=batch * length / (prefill_s + decode_s),
            capacity=capacity, alloc_bytes=alloc,
            state_bytes=sum(x.nbytes for x in records) + alloc,
            kv_peak=float(np.mean(loop.kv_peak)), kv_mean=kv_mean,
            dense_kv_mean=float(np.mean(setup.PROMPT_LEN + (forwards - 1) / 2)),
            compressions=int(loop.compressions), floor_bytes=floor_bytes,
            floor_flops=floor_flops,
            # the slot cache's loop attends over every slot, the paged one over the filled pages
            impl_bytes=self.step_cost(batch, kv_mean if paged else capacity)[0],
            alpha_p5=self.alpha_p5(loop, alpha_rows, compression) if compression.page_sparse
            else None,
            response=np.asarray(loop.response),
        )

    def alpha_p5(self, loop, rows: int, compression) -> list[float]:
        """5th percentile of Sparrow's acceptance per 2000-token bin, first ``rows`` rows."""
        from sparse_rl_jax.rollout.acceptance import acceptance_percentile_per_bin, score_acceptance
        from sparse_rl_jax.kv.page_sparsity import PageRecord

        prompt = self.jnp.asarray(self.prompts[:rows])
        alpha = score_acceptance(
            self.graphdef, self.params, prompt, self.jnp.ones_like(prompt), loop.response[:rows],
            PageRecord(self.jnp.moveaxis(loop.page_record, 1, 0)[:rows], compression.page_size),
            temperature=self.temperature or 1.0)
        alpha = np.asarray(alpha)
        return acceptance_percentile_per_bin(alpha, np.ones_like(alpha)).tolist()

    def time_prefill(self, prompt, mask, key, sampling, compression) -> float:
        """Seconds of the (already compiled) prefill alone."""
        from sparse_rl_jax.rollout import sampler

        start = time.perf_counter()
        self.jax.block_until_ready(sampler.prefill(
            self.graphdef, self.params, self.jnp.asarray(prompt), self.jnp.asarray(mask),
            self.jax.random.split(key)[0], sampling=sampling, compression=compression,
            max_len=setup.PROMPT_LEN + sampling.max_new_tokens))
        return time.perf_counter() - start


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring); ``argv`` defaults to ``sys.argv[1:]``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    hf = setup.run_child("torch", tmp, args, __file__)
    for r in hf:
        ours = next((x for x in rows if x["method"] == "none" and x["batch"] == r["batch"]
                     and x["length"] == r["length"]), None)
        if ours is not None:
            theirs = np.load(Path(tmp) / f"hf_{r['threads']}_{r['batch']}_{r['length']}.npy")
            same = np.cumprod(ours["response"] == theirs, axis=1).sum(axis=1)
            r["agree"] = float(np.mean(same))
    return hf


def main() -> None:
    args = parse_args()
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
