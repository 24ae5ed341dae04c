"""Steps/s of synchronous vs asynchronous GRPO (``trainer.mode``, issue 39) on 2 CPU devices,
side by side in one run, plus a timeline PNG of each run's phases per device.

    python benchmarks/bench_async.py [--lags 1 2] [--steps 8] [--warmup 3] [--prompts 4]
        [--samples 4] [--max-new-tokens 96] [--minibatch 16] [--hidden 64] [--layers 2]
        [--warm-steps 2] [--png benchmarks/results/async_timeline.png] [--json FILE]

The process forces 2 host devices (``--xla_force_host_platform_device_count=2``). Rows:
``sync`` runs every phase on both (the learner's fsdp mesh); ``async k`` gives device 0 to the
rollouts and device 1 to the learner (``mesh.rollout_devices: 1``) and draws step t's rollout
from the params after update t - k; ``async k=0`` is the sync schedule (bit for bit) on that
same split, the baseline with the same placement, so ``x k=0`` is the overlap alone. Model: the default policy's architecture at ``--hidden`` x
``--layers`` after ``--warm-steps`` supervised steps on the shipped task (one prompt length,
so one compiled shape; 2 steps leave it close to random, so responses run to
``--max-new-tokens`` instead of stopping at an early EOS); the sizes are chosen so that one
rollout (sample, reward, dense score) and one step of updates take comparable time. Each run goes through the trainer's own pieces
(``run_inputs.prepare``, ``trainer.build_step_context``, ``step_modes.STEP_MODES``); steps/s is
taken over the steps after ``--warmup`` (compilation), from the wall clock.

The fake devices share the host's cores: a phase on device 0 and one on device 1 compete for
the same CPUs, so the overlap async buys on separate accelerators shows up here only as far
as the cores are not already busy; the timeline shows where each run's time goes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=2").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# one compilation cache for the three runs (each builds its own jitted functions)
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="bench_async_jit_"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PHASE_COLOURS = {"rollout": "tab:blue", "reward": "tab:orange", "score": "tab:green",
                 "update": "tab:red", "weight_sync": "tab:purple"}


def run_mode(policy: str, mode: str, lag: int, args, out: Path) -> dict:
    """One run of ``args.steps`` steps; its steps/s, mean phase seconds and timeline."""
    import jax

    from sparse_rl_jax.core.config_io import load_config
    from sparse_rl_jax.tasks.rewards import get_reward_fn
    from sparse_rl_jax.training.policy import make_run_mesh
    from sparse_rl_jax.training.role_mesh import rollout_mesh
    from sparse_rl_jax.training.run_config import RunConfig
    from sparse_rl_jax.training.run_inputs import prepare
    from sparse_rl_jax.training.step_modes import STEP_MODES
    from sparse_rl_jax.training.trainer import build_step_context

    split = ["trainer.mode=async", f"trainer.max_lag={lag}", "mesh.rollout_devices=1"]
    cfg = load_config(RunConfig, None, [
        f"run_dir={out / f'{mode}{lag}'}", f"model.path={policy}", "data.task.n_min=4",
        "data.task.n_max=4", f"sampling.max_new_tokens={args.max_new_tokens}",
        f"sampling.num_samples={args.samples}", "sampling.prompt_bucket=32",
        "compression.method=rkv", "compression.eviction.budget=24",
        "compression.eviction.buffer=8", "compression.eviction.window=4",
        f"trainer.steps={args.steps}", f"trainer.prompts_per_step={args.prompts}",
        f"trainer.minibatch_size={args.minibatch}", "trainer.logp_chunk=16",
        *(split if mode == "async" else [])])
    mesh = make_run_mesh(cfg)
    ctx, params, opt_state = build_step_context(cfg, prepare(cfg, mesh, lambda _: None), mesh,
                                                get_reward_fn(cfg.data.reward))
    runner = STEP_MODES.get(mode)(ctx, params, 0, 0, [], rollout_mesh(cfg))
    ends, records, sync_spans = [], [], []
    with runner:
        for step in range(args.steps):
            begin = time.perf_counter()
            params, opt_state, metrics = runner.step(ctx, params, opt_state, step, step)
            ends.append(time.perf_counter())
            records.append(metrics)
            for phase in ("rollout", "reward", "score", "update"):  # sync: in this order
                seconds = metrics[f"time_{phase}"]
                sync_spans.append(("both", phase, step, begin, begin + seconds))
                begin += seconds
    jax.block_until_ready(params)
    spans = [s for s in (runner.timeline if mode == "async" else sync_spans)
             if s[2] >= args.warmup]  # the steady steps, from the first of them
    origin = min(s[3] for s in spans)
    steady = records[args.warmup:]

    def mean(key):
        return sum(r.get(key, 0.0) for r in steady) / len(steady)

    return dict(mode=mode, lag=lag, steps_per_s=len(steady) / (ends[-1] - ends[args.warmup - 1]),
                rollout=mean("time_rollout") + mean("time_reward") + mean("time_score"),
                update=mean("time_update"), wait_rollout=mean("time/wait_rollout"),
                wait_learner=mean("time/wait_learner"), weight_sync=mean("time/weight_sync"),
                reward=mean("reward_mean"),
                spans=[(role, phase, step, a - origin, b - origin)
                       for role, phase, step, a, b in spans])


def plot_timeline(results: list[dict], path: Path) -> None:
    """One panel per run: a lane per device role, a bar per phase span of the steady steps,
    labelled by step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), 1, figsize=(12, 1.6 * len(results) + 1))
    for ax, result in zip(axes, results):
        lanes = sorted({role for role, *_ in result["spans"]})
        for lane, role in enumerate(lanes):
            for r, phase, step, a, b in result["spans"]:
                if r == role:
                    ax.barh(lane, b - a, left=a, color=PHASE_COLOURS[phase], edgecolor="k",
                            linewidth=0.3)
                    if phase in ("rollout", "update") and b - a > 0.05:
                        ax.text((a + b) / 2, lane, str(step), ha="center", va="center",
                                fontsize=7)
        names = {"both": "devices 0+1", "rollout": "device 0 (rollout)",
                 "learner": "device 1 (learner)"}
        ax.set_yticks(range(len(lanes)), [names[role] for role in lanes])
        label = "sync" if result["mode"] == "sync" else f"async k={result['lag']}"
        ax.set_title(f"{label}: {result['steps_per_s']:.3f} steps/s", fontsize=9)
    axes[-1].set_xlabel("seconds since the first steady (post warm-up) step began")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in PHASE_COLOURS.values()]
    fig.legend(handles, list(PHASE_COLOURS), loc="upper right", ncol=5, fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lags", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--minibatch", type=int, default=16)
    parser.add_argument("--warm-steps", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--png", type=Path, default=ROOT / "benchmarks" / "results"
                        / "async_timeline.png")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if not 0 < args.warmup < args.steps:
        parser.error("--warmup must be in [1, --steps)")

    import jax

    from sparse_rl_jax.tasks.task import TaskConfig
    from sparse_rl_jax.training.run_config import WarmStartConfig
    from sparse_rl_jax.training.warm_start import build_default_model

    assert jax.device_count() == 2, f"needs 2 devices, has {jax.devices()}"
    out = Path(tempfile.mkdtemp(prefix="bench_async_"))
    policy = build_default_model(
        out / "policy", WarmStartConfig(hidden_size=args.hidden, num_layers=args.layers,
                                        num_heads=2, num_kv_heads=1,
                                        intermediate_size=2 * args.hidden,
                                        steps=args.warm_steps,
                                        batch_size=8),
        TaskConfig(n_min=4, n_max=4), log=lambda _: None)
    results = [run_mode(policy, "sync", 0, args, out)]
    results += [run_mode(policy, "async", k, args, out) for k in [0, *args.lags]]
    base, split = results[0]["steps_per_s"], results[1]["steps_per_s"]
    print(f"{jax.devices()[0].platform} x{jax.device_count()}, {args.steps} steps "
          f"({args.warmup} warm-up), {args.prompts} x {args.samples} rows, "
          f"{args.max_new_tokens} new tokens, hidden {args.hidden} x {args.layers} layers")
    print("| mode | steps/s | x sync | x k=0 | rollout+reward+score s | update s "
          "| wait rollout s | wait learner s | weight sync s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        label = "sync" if r["mode"] == "sync" else f"async k={r['lag']}"
        print(f"| {label} | {r['steps_per_s']:.3f} | {r['steps_per_s'] / base:.2f} | "
              f"{r['steps_per_s'] / split:.2f} | "
              f"{r['rollout']:.2f} | {r['update']:.2f} | {r['wait_rollout']:.2f} | "
              f"{r['wait_learner']:.2f} | {r['weight_sync']:.3f} |")
    plot_timeline(results, args.png)
    print(f"timeline: {args.png}")
    if args.json:
        args.json.write_text(json.dumps(results))


if __name__ == "__main__":
    main()
