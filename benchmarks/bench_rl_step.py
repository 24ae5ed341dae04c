"""One full RL step (rollout -> reward -> dense scoring -> corrections -> optimizer updates) on
the CPU bench model through ``sparse_rl_jax.trainer.train``: update tokens/s, peak memory, and
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
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent


def build(path: Path) -> None:
    """The bench model (written by ``bench_decode.build_checkpoint`` in a child process, so
    torch never enters the measured processes) plus the task tokenizer."""
    code = ("import sys; from pathlib import Path; sys.path[:0] = [sys.argv[1], sys.argv[2]]; "
            "import bench_decode; bench_decode.build_checkpoint(Path(sys.argv[3]), 1); "
            "from sparse_rl_jax.task_tokenizer import build_task_tokenizer; "
            "build_task_tokenizer(sys.argv[3])")
    subprocess.run([sys.executable, "-c", code, str(HERE), str(ROOT), str(path)], check=True,
                   capture_output=True)


def worker(args) -> None:
    """Runs the RL steps of one method; writes per-step metrics and peak RSS as JSON."""
    sys.path.insert(0, str(ROOT))
    import jax

    import models
    from sparse_rl_jax.compression import CompressionConfig
    from sparse_rl_jax.loss_config import GRPOLossConfig
    from sparse_rl_jax.metrics_writer import read_metrics
    from sparse_rl_jax.prompt_source import PromptSource
    from sparse_rl_jax.run_config import ModelSection, RunConfig, TrainerConfig
    from sparse_rl_jax.sampler import bucket_prompts
    from sparse_rl_jax.sampling_config import SamplingConfig
    from sparse_rl_jax import trainer

    with open("/proc/self/statm") as f:  # after the imports: the baseline of this process
        base_rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    run_dir = Path(args.out) / f"run_{args.method}"
    cfg = RunConfig(
        run_dir=str(run_dir),
        model=ModelSection(path=args.path, dtype="float32"),
        sampling=SamplingConfig(max_new_tokens=args.max_new_tokens, num_samples=args.samples,
                                temperature=1.0, prompt_bucket=16),
        compression=CompressionConfig(method=args.method, budget=args.budget,
                                      buffer=args.buffer, window=8),
        loss=GRPOLossConfig(group_size=args.samples),
        trainer=TrainerConfig(steps=args.steps, prompts_per_step=args.prompts,
                              minibatch_size=args.minibatch, logp_chunk=64,
                              checkpoint_every=10**6, export_final=False),
    )
    peaks = []  # ru_maxrss (MiB) after each RL step

    def step_and_record(*step_args):
        out = real_rl_step(*step_args)
        peaks.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
        return out

    real_rl_step = trainer.rl_step
    start = time.perf_counter()
    with mock.patch.object(trainer, "rl_step", step_and_record):
        trainer.train(cfg, log=lambda message: None)
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
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--method", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

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
