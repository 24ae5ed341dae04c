#!/usr/bin/env python
"""The README's table for the embedded default (``python run.py``): the warm start on several
seeds, then the default GRPO run on R-KV rollouts on several RL seeds, each evaluated dense
and under R-KV on held-out problems. Prints the tables as markdown and writes them (with the
package versions and the machine) to ``<out>/table.md`` and ``<out>/table.json``.

  python experiments/default_table.py --warm-seeds 0 1 2 3 4 --seeds 0 1 2   # ~25 min, 2 cores

Warm start ``w`` is ``python run.py warm_start.seed=w``'s; RL seed ``s`` is ``python run.py
trainer.seed=s`` (from warm-start seed 0, as the default run): ``python run.py`` is warm seed 0
with RL seed 0. ``key=value`` overrides apply to every run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from experiments.kit.overrides_cli import parse_with_overrides  # noqa: E402
from experiments.kit.provenance import environment  # noqa: E402
from sparse_rl_jax.core.config_io import load_config  # noqa: E402
from sparse_rl_jax.records.metrics_writer import read_metrics  # noqa: E402
from sparse_rl_jax.training.evaluation import evaluate_checkpoint  # noqa: E402
from sparse_rl_jax.training.policy import policy_path  # noqa: E402
from sparse_rl_jax.training.run_config import RunConfig  # noqa: E402
from sparse_rl_jax.training.trainer import train  # noqa: E402
from sparse_rl_jax.training.warm_start import MARKER  # noqa: E402

COLUMNS = ("dense pass@1", "sparse pass@1", "dense avg@k", "sparse avg@k")


def evaluate_policy(cfg: RunConfig, checkpoint: str) -> dict[str, float]:
    """Greedy pass@1 and avg@k, dense and under the run's compression, on the eval set."""
    (dense, sparse), _ = evaluate_checkpoint(cfg, checkpoint, log=lambda _: None)
    return dict(zip(COLUMNS, (dense.pass_at_1, sparse.pass_at_1, dense.avg_at_k,
                              sparse.avg_at_k)))


def mean_se(values) -> str:
    """``mean +- SE`` of per-seed values (SE = sample std / sqrt(n); 0 for one seed)."""
    values = np.asarray(values, float)
    se = values.std(ddof=1) / np.sqrt(len(values)) if len(values) > 1 else 0.0
    return f"{values.mean():.3f} +- {se:.3f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--warm-seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                        help="RL seeds (trainer.seed), each from warm-start seed 0")
    parser.add_argument("--prompts", type=int, default=256, help="held-out eval problems")
    parser.add_argument("--samples", type=int, default=8, help="k of avg@k")
    parser.add_argument("--out", default="runs/default_table")
    args = parse_with_overrides(parser, argv)
    out = Path(args.out)
    common = [f"eval.num_prompts={args.prompts}", f"eval.samples={args.samples}",
              *args.overrides]
    start = time.monotonic()

    warm_rows = []
    for seed in args.warm_seeds:
        cfg = load_config(RunConfig, None, [f"run_dir={out}/warm{seed}",
                                            f"warm_start.seed={seed}", *common])
        began = time.monotonic()
        path = policy_path(cfg, log=lambda line, s=seed: print(f"[warm {s}] {line}",
                                                               flush=True))
        built = time.monotonic() - began
        result = json.loads((Path(path) / MARKER).read_text()).get("result", {})
        warm_rows.append({"seed": seed, "steps": result.get("steps"), "seconds": built,
                          "held-out solutions": result.get("solutions"),
                          **evaluate_policy(cfg, path)})
        print(f"[warm {seed}] {warm_rows[-1]}", flush=True)

    rl_rows = []
    for seed in args.seeds:
        cfg = load_config(RunConfig, None, [f"run_dir={out}/rl{seed}", f"trainer.seed={seed}",
                                            *common])
        last_step = f"step {cfg.trainer.steps}/"
        began = time.monotonic()  # the run builds its warm start (seed 0's) as run.py does
        train(cfg, log=lambda line, s=seed: print(f"[rl {s}] {line}", flush=True)
              if not line.startswith("step ") or line.startswith(last_step) else None)
        rewards = [m["reward_mean"] for m in read_metrics(cfg.run_dir) if "reward_mean" in m]
        quarter = max(1, len(rewards) // 4)
        rl_rows.append({"seed": seed, "seconds": time.monotonic() - began,
                        "warm start": json.loads((Path(cfg.run_dir) / "warm_start" / MARKER)
                                                 .read_text())["result"]["summary"],
                        "reward first quarter": float(np.mean(rewards[:quarter])),
                        "reward last quarter": float(np.mean(rewards[-quarter:])),
                        **evaluate_policy(cfg, cfg.run_dir)})
        print(f"[rl {seed}] {rl_rows[-1]}", flush=True)

    text = render(warm_rows, rl_rows, args)
    print(text)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(text + "\n")
    (out / "table.json").write_text(json.dumps(
        {"warm_start": warm_rows, "rl": rl_rows, "environment": environment(),
         "seconds": time.monotonic() - start}, indent=1))
    return 0


def render(warm_rows: list[dict], rl_rows: list[dict], args) -> str:
    """The two markdown tables (warm start per seed; before/after RL per RL seed)."""
    lines = [f"Held-out problems: {args.prompts} (eval.task_seed), greedy pass@1 and avg@"
             f"{args.samples} at temperature 1, dense and under R-KV (the run's compression).",
             "", "| warm-start seed | steps | seconds | held-out solutions | "
             + " | ".join(COLUMNS) + " |", "|---" * (4 + len(COLUMNS)) + "|"]
    for row in warm_rows:
        lines.append(f"| {row['seed']} | {row['steps']} | {row['seconds']:.0f} | "
                     f"{row['held-out solutions']:.3f} | "
                     + " | ".join(f"{row[c]:.3f}" for c in COLUMNS) + " |")
    if len(warm_rows) > 1:
        lines.append("| mean +- SE | | | | " + " | ".join(
            mean_se([r[c] for r in warm_rows]) for c in COLUMNS) + " |")
    if rl_rows:
        before = next((r for r in warm_rows if r["seed"] == 0), None)
        seeds = [r["seed"] for r in rl_rows]
        lines += ["", "| | warm start (seed 0) | " + " | ".join(f"RL seed {s}" for s in seeds)
                  + " | mean +- SE |", "|---" * (3 + len(seeds)) + "|"]
        first = [r["reward first quarter"] for r in rl_rows]
        last = [r["reward last quarter"] for r in rl_rows]
        lines.append("| training reward, first -> last quarter | - | " + " | ".join(
            f"{a:.3f} -> {b:.3f}" for a, b in zip(first, last))
            + f" | {np.mean(first):.3f} -> {mean_se(last)} |")
        for c in COLUMNS:
            lines.append(f"| {c} | {before[c]:.3f} | " if before else f"| {c} | - | ")
            lines[-1] += " | ".join(f"{r[c]:.3f}" for r in rl_rows) + \
                f" | {mean_se([r[c] for r in rl_rows])} |"
        lines.append("| `python run.py` seconds (warm start + RL) | - | " + " | ".join(
            f"{r['seconds']:.0f}" for r in rl_rows) + " | |")
    lines += ["", f"Measured with {environment()}."]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
