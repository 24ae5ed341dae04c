"""One full RL step (rollout -> reward -> dense scoring -> corrections -> optimizer updates) on
the CPU bench model through ``sparse_rl_jax.training.trainer.train``: update tokens/s, peak memory, and
the share of the step spent in rollout / reward / scoring / update.

    python benchmarks/bench_rl_step.py [--methods rkv none] [--steps 3] [--prompts 8]
        [--samples 4] [--max-new-tokens 128] [--budget 64] [--buffer 32] [--minibatch 16]
        [--json results.json]

Model: the bench model of ``bench_decode.py`` (Qwen2-shaped, ~39M params, vocab 32000, random
weights, fp32), saved with the shipped task's character tokenizer (ids past its 69 tokens
decode to nothing; the reward is then 0, which changes no cost). The run config is built in
code: the shipped task's prompts (<= 33 tokens, bucketed to 16), ``--prompts`` x ``--samples``
sequences of ``--max-new-tokens`` (temperature 1), ``sparse_rl`` corrections, AdamW, one
optimizer update per ``--minibatch`` sequences. Each method runs ``--steps`` RL steps in its
own child process (so its peak RSS is its own). A step whose prompt batch falls in a new
prompt-width bucket compiles everything again (the first step always does); the row is the
median over the other, steady-state steps. Times are the trainer's own per-phase metrics
(``time_rollout`` ...); peak memory is ``ru_maxrss`` after each step and at the end.

    python benchmarks/bench_rl_step.py --update-grid [--remat none full dots_saveable]
        [--micro 0 4 2] [--minibatch 8] [--max-new-tokens 224] [--layers 4] [--hidden 256]

``--update-grid`` measures one optimizer update alone (``train_step.update_step``, random
weights of a Qwen2-shaped model of ``--layers`` x ``--hidden``, vocab 8192, prompt 32 +
``--max-new-tokens`` response columns, AdamW) for each activation-remat policy
(``model.remat``) x micro-batch size (``trainer.micro_batch_size``; 0 = the whole minibatch):
the compiled program's memory from XLA's ``memory_analysis()`` (temp = transient buffers;
peak = arguments + outputs + temp - donated aliases) and the median step time of 3 runs after
a warm-up, with both as ratios to ``none`` / whole minibatch. ``--lora-rank R`` (> 0) runs
the table with rank-``R`` adapters (alpha ``2R``) on every projection (``model.lora``): the
base weights frozen, gradients and AdamW state for the adapters only.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.kit.update_cells import update_cell, update_model_and_batch  # noqa: E402


def build(path: Path) -> None:
    """The bench model (written by ``model_setup.build_checkpoint`` in a child process, so
    torch never enters the measured processes) plus the task tokenizer."""
    code = ("import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); "
            "from benchmarks.kit import model_setup; "
            "model_setup.build_checkpoint(Path(sys.argv[2]), 1); "
            "from sparse_rl_jax.tasks.task_tokenizer import build_task_tokenizer; "
            "build_task_tokenizer(sys.argv[2])")
    subprocess.run([sys.executable, "-c", code, str(ROOT), str(path)], check=True,
                   capture_output=True)


def worker(args) -> None:
    """Runs the RL steps of one method; writes per-step metrics and peak RSS as JSON."""
    import jax

    import models
    from sparse_rl_jax.kv.compression_config import CompressionConfig
    from sparse_rl_jax.kv.compression_sections import EvictionConfig
    from sparse_rl_jax.rl.loss_config import GRPOLossConfig
    from sparse_rl_jax.records.metrics_writer import read_metrics
    from sparse_rl_jax.tasks.prompt_source import PromptSource
    from sparse_rl_jax.training.run_config import ModelSection, RunConfig, TrainerConfig
    from sparse_rl_jax.rollout.sampler import bucket_prompts
    from sparse_rl_jax.rollout.sampling_config import SamplingConfig
    from sparse_rl_jax.training import trainer

    with open("/proc/self/statm") as f:  # after the imports: the baseline of this process
        base_rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    run_dir = Path(args.out) / f"run_{args.method}"
    cfg = RunConfig(
        run_dir=str(run_dir),
        model=ModelSection(path=args.path, dtype="float32"),
        sampling=SamplingConfig(max_new_tokens=args.max_new_tokens, num_samples=args.samples,
                                temperature=1.0, prompt_bucket=16),
        compression=CompressionConfig(method=args.method, eviction=EvictionConfig(
            budget=args.budget, buffer=args.buffer, window=8)),
        loss=GRPOLossConfig(),
        trainer=TrainerConfig(steps=args.steps, prompts_per_step=args.prompts,
                              minibatch_size=args.minibatch, logp_chunk=64,
                              checkpoint_every=10**6, export_final=False),
    )
    peaks = []  # ru_maxrss (MiB) after each RL step

    start = time.perf_counter()
    trainer.train(cfg, log=lambda message: None, on_step=lambda step, metrics: peaks.append(
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))
    wall = time.perf_counter() - start
    tokenizer = models.Tokenizer(args.path)  # each step's bucketed prompt width
    source = PromptSource(cfg.data, args.prompts, tokenizer.hf)
    widths = []
    for step in range(args.steps):
        prompt, mask = tokenizer.encode(source.batch(step).prompts, add_special_tokens=False)
        widths.append(bucket_prompts(prompt, mask, cfg.sampling.prompt_bucket)[0].shape[1])
    result = dict(prompt_widths=widths,
        method=args.method, records=read_metrics(run_dir / "metrics.jsonl"), wall=wall,
        peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, base_rss_mib=base_rss,
        step_peaks_mib=peaks,
        sequences=cfg.sequences_per_step, device=str(jax.devices()[0]),
    )
    Path(args.out, f"result_{args.method}.json").write_text(json.dumps(result))


def grid_config(layers: int, hidden: int):
    """``models.ModelConfig`` of ``--update-grid``: Qwen2-shaped, ``layers`` x ``hidden``,
    head_dim 64, vocab 8192."""
    import models

    heads = hidden // 64
    return models.ModelConfig(model_type="qwen2", vocab_size=8192, hidden_size=hidden,
                              intermediate_size=4 * hidden, num_layers=layers, num_heads=heads,
                              num_kv_heads=max(1, heads // 2), head_dim=64, attention_bias=True)


def _print_grid(args, rows: list[dict], params_m: float) -> None:
    """The ``--update-grid`` table: one row per remat x micro-batch cell, ratios vs the first."""
    import jax

    print(f"one update: Qwen2-shaped {params_m:.1f}M params ({args.layers} layers x hidden "
          f"{args.hidden}, vocab 8192), fp32, "
          f"{f'LoRA rank {args.lora_rank} on every projection, ' if args.lora_rank else ''}"
          f"{args.minibatch} sequences x (32 + {args.max_new_tokens}) tokens, AdamW, "
          f"{jax.devices()[0].device_kind} ({os.cpu_count()} host cores); step s = median of 3 "
          "after a warm-up; memory from XLA memory_analysis (MiB); ratios vs remat none, "
          "whole minibatch")
    base = rows[0]
    header = (f"{'remat':<14}{'micro':>6}{'temp MiB':>10}{'peak MiB':>10}{'peak ratio':>11}"
              f"{'step s':>8}{'time ratio':>11}{'compile s':>10}")
    print(header)
    print("-" * len(header))
    for r in rows:
        ratio = (f"{r['peak'] / base['peak']:>11.2f}" if r["peak"] is not None
                 else f"{'n/a':>11}")
        mem = (f"{r['temp']:>10.1f}{r['peak']:>10.1f}" if r["peak"] is not None
               else f"{'n/a':>10}{'n/a':>10}")
        print(f"{r['remat']:<14}{r['micro']:>6}{mem}{ratio}{r['step']:>8.3f}"
              f"{r['step'] / base['step']:>11.2f}{r['compile']:>10.1f}")


def update_grid(args) -> None:
    """Prints the remat x micro-batch table of one update (see the module docstring)."""
    import jax
    from flax import nnx

    model, batch = update_model_and_batch(grid_config(args.layers, args.hidden), args.minibatch,
                                          32, args.max_new_tokens, lora_rank=args.lora_rank)
    rows = []
    for remat in args.remat:
        model.remat = remat
        graphdef, params = nnx.split(model)
        for micro in args.micro:
            cell = update_cell(graphdef, params, batch, micro)
            rows.append(dict(remat=remat, micro=micro or args.minibatch, **cell))
    params_m = sum(x.size for x in jax.tree.leaves(nnx.state(model))) / 1e6
    _print_grid(args, rows, params_m)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=["rkv", "none"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--buffer", type=int, default=32)
    parser.add_argument("--minibatch", type=int, default=16)
    parser.add_argument("--json", help="also write the per-step results here")
    parser.add_argument("--update-grid", action="store_true",
                        help="only the remat x micro-batch table of one update")
    parser.add_argument("--remat", nargs="+", default=["none", "full", "dots_saveable"])
    parser.add_argument("--micro", nargs="+", type=int, default=[0, 4, 2],
                        help="micro-batch sizes (0 = the whole minibatch)")
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="--update-grid with LoRA adapters of this rank (0 = none)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--method", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.update_grid:
        return update_grid(args)

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        build(model)
        for method in args.methods:
            flags = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in (
                "steps", "prompts", "samples", "max_new_tokens", "budget", "buffer", "minibatch")]
            proc = subprocess.run(
                [sys.executable, __file__, "--worker", "--method", method, "--path", str(model),
                 "--out", tmp, *flags],
                capture_output=True, text=True)  # on whatever JAX platform is present
            if proc.returncode:
                sys.exit(f"{method} worker failed:\n{proc.stderr[-3000:]}")
            results.append(json.loads(Path(tmp, f"result_{method}.json").read_text()))
    report(args, results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def report(args, results) -> None:
    """One row per method: the median over the steady-state steps (those whose prompt width
    bucket was already used by an earlier step, so nothing compiles)."""
    n = args.prompts * args.samples
    import jax

    print(f"model: bench Qwen2-shaped ~39M params, fp32, {jax.devices()[0].device_kind} "
          f"({os.cpu_count()} host cores); "
          f"{args.prompts} prompts x {args.samples} samples = {n} sequences, max_new_tokens "
          f"{args.max_new_tokens}, minibatch {args.minibatch} ({n // args.minibatch} updates/step),"
          f" compression budget {args.budget} + buffer {args.buffer}, window 8; "
          f"{args.steps} steps: median of the steady-state steps")
    print("(times in s; upd tok/s = response tokens / update time; upd seq-tok/s = (prompt + "
          "response columns) x sequences / update time; step tok/s = response tokens / step "
          "time; KV save = 1 - sparse / dense mean resident KV; RSS MiB: at imports -> "
          "ru_maxrss after step 1 (compiles) -> after the last step -> whole run incl. the final "
          "checkpoint save; step 1 s includes compilation)")
    header = (f"{'method':<7}{'step s':>7}{'rollout':>8}{'reward':>7}{'score':>7}{'update':>7}"
              f"{'roll%':>7}{'score%':>7}{'upd%':>6}{'upd tok/s':>10}{'upd seq-tok/s':>14}"
              f"{'step tok/s':>11}{'KV save':>8}  {'RSS MiB':<24}{'step 1 s':>8}  steps s")
    print(header)
    print("-" * len(header))
    for r in results:
        widths = r["prompt_widths"]
        fresh = [i for i, w in enumerate(widths) if w not in widths[:i]]  # these compile
        steady = [i for i in range(len(widths)) if i not in fresh] or list(range(len(widths)))
        med = {k: statistics.median(r["records"][i][k] for i in steady) for k in r["records"][0]}
        tokens = med["response_length_mean"] * r["sequences"]
        width = statistics.median(widths[i] for i in steady)
        seq_tokens = r["sequences"] * (width + args.max_new_tokens)
        rss = (f"{r['base_rss_mib']:.0f}->{r['step_peaks_mib'][0]:.0f}->"
               f"{r['step_peaks_mib'][-1]:.0f}->{r['peak_rss_mib']:.0f}")
        print(f"{r['method']:<7}{med['time_step']:>7.2f}{med['time_rollout']:>8.2f}"
              f"{med['time_reward']:>7.2f}{med['time_score']:>7.2f}{med['time_update']:>7.2f}"
              f"{med['rollout_share']:>7.1%}{med['score_share']:>7.1%}"
              f"{med['update_share']:>6.1%}{tokens / med['time_update']:>10.0f}"
              f"{seq_tokens / med['time_update']:>14.0f}{med['tokens_per_second']:>11.0f}"
              f"{med.get('kv_token_savings', 0.0):>8.1%}  {rss:<24}"
              f"{r['records'][0]['time_step']:>8.1f}  "
              f"{[round(x['time_step'], 1) for x in r['records']]} (prompt widths {widths}; "
              f"steps {[i + 1 for i in fresh]} compile)")


if __name__ == "__main__":
    main()
