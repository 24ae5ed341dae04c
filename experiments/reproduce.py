#!/usr/bin/env python
"""Reproduce the Sparse-RL claims at small scale on the shipped task.

Arms, same seed, same warm-started policy, same data and KV budget:
  dense            full KV cache (the reference)
  naive <method>   compressed rollouts, no correction (trains on pi_sparse as if it were pi_dense)
  sparse-rl <m.>   compressed rollouts with Sparse-RL's rejection + importance reweighting
for <method> in R-KV and SnapKV. Each final policy is evaluated under dense and under sparse
inference. Writes ``<out>/results.md`` (table), ``<out>/results.json`` and comparison plots
``<out>/plots/compare_*.png``.

  python experiments/reproduce.py              # the full experiment (< 1 h on a 2-core CPU)
  python experiments/reproduce.py --quick      # a smoke version (< 10 min)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sparse_rl_jax.config_io import load_config  # noqa: E402
from sparse_rl_jax.evaluation import HEADER, evaluate, eval_set  # noqa: E402
from sparse_rl_jax.metrics_writer import read_metrics  # noqa: E402
from sparse_rl_jax.plots import plot_comparison  # noqa: E402
from sparse_rl_jax.rewards import get_reward_fn  # noqa: E402
from sparse_rl_jax.run_config import RunConfig  # noqa: E402
from sparse_rl_jax.trainer import load_policy, policy_path, resolve_sampling, train  # noqa: E402

COMPARE_KEYS = ("reward_mean", "rejection_rate", "clip_fraction", "mismatch_k3",
                "repetition_fraction", "kv_token_savings", "response_length_mean",
                "token_mask_fraction")


def arms(methods: list[str]) -> list[tuple[str, list[str]]]:
    """(label, overrides) of every arm."""
    out = [("dense", ["compression.method=none", "correction.kind=none"])]
    for method in methods:
        out.append((f"naive {method}", [f"compression.method={method}", "correction.kind=none"]))
        out.append((f"sparse-rl {method}", [f"compression.method={method}",
                                            "correction.kind=sparse_rl"]))
    return out


def summarize(records: list[dict], tail: int) -> dict:
    """Means over the first and the last ``tail`` steps of a run's metrics."""
    def mean(rows, key):
        values = [r[key] for r in rows if key in r]
        return sum(values) / len(values) if values else float("nan")
    first, last = records[:tail], records[-tail:]
    return {
        "reward_first": mean(first, "reward_mean"), "reward_last": mean(last, "reward_mean"),
        **{key: mean(records, key) for key in COMPARE_KEYS if key != "reward_mean"},
    }


def main(argv=None) -> int:
    """Runs every arm, evaluates the final policies, writes the results."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/reproduce")
    parser.add_argument("--quick", action="store_true", help="a few steps per arm (smoke test)")
    parser.add_argument("--methods", nargs="+", default=["rkv", "snapkv"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for every arm")
    args = parser.parse_args(argv)
    out = Path(args.out)
    base = list(args.overrides)
    if args.quick:
        # Eval batches shaped like training rollouts (8 prompts x 8 samples) reuse the
        # compiled sampler, which keeps the quick mode's compile time down.
        base = ["trainer.steps=2", "trainer.prompts_per_step=8", "trainer.minibatch_size=64",
                "warm_start.steps=30", "eval.num_prompts=8", "eval.batch_size=8",
                "eval.samples=8"] + base
    started = time.monotonic()
    shared = load_config(RunConfig, None, [f"run_dir={out / 'shared'}"] + base)
    policy = policy_path(shared)  # one warm start, shared by every arm
    results = []
    for seed in args.seeds:
        runs = []
        for label, arm in arms(args.methods):
            run_dir = out / f"seed{seed}" / label.replace(" ", "_")
            cfg = load_config(RunConfig, None, [
                f"run_dir={run_dir}", f"model.path={policy}", f"trainer.seed={seed}",
                "trainer.plots=false", *base, *arm])
            print(f"== {label} (seed {seed}) -> {run_dir}", flush=True)
            train(cfg)
            records = read_metrics(run_dir / "metrics.jsonl")
            runs.append((label, records))
            graphdef, params, tokenizer = load_policy(cfg, str(run_dir / "final"))
            prompts, answers = eval_set(cfg)
            sparse_cfg = cfg.compression if cfg.compression.compresses else dataclasses.replace(
                shared.compression, method=args.methods[0])
            rows = evaluate(graphdef, params, tokenizer, prompts, answers,
                            get_reward_fn(cfg.data.reward), resolve_sampling(cfg, tokenizer),
                            sparse_cfg, samples=cfg.eval.samples,
                            temperature=cfg.eval.temperature, batch_size=cfg.eval.batch_size,
                            seed=seed)
            results.append({"arm": label, "seed": seed,
                            **summarize(records, max(1, len(records) // 4)),
                            "eval": [dataclasses.asdict(r) for r in rows]})
        plot_comparison(runs, out / "plots" / f"seed{seed}", COMPARE_KEYS, smooth=5)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    table = format_table(results)
    (out / "results.md").write_text(table + f"\n\nwall time: {time.monotonic() - started:.0f} s\n")
    print(table)
    return 0


def format_table(results: list[dict]) -> str:
    """A markdown table: training statistics and dense / sparse eval per arm and seed."""
    head = ("| arm | seed | reward first→last quarter | rejection | clip frac | mismatch k3 | "
            "repetition | KV saved | eval dense pass@1 / avg@k | eval sparse pass@1 / avg@k |\n"
            "|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in results:
        ev = {row["mode"].split()[0]: row for row in r["eval"]}
        sparse = ev.get("sparse", {})
        lines.append(
            f"| {r['arm']} | {r['seed']} | {r['reward_first']:.3f} → {r['reward_last']:.3f} | "
            f"{r['rejection_rate']:.3f} | {r['clip_fraction']:.4f} | {r['mismatch_k3']:.3f} | "
            f"{r['repetition_fraction']:.3f} | {r['kv_token_savings']:.3f} | "
            f"{ev['dense']['pass_at_1']:.3f} / {ev['dense']['avg_at_k']:.3f} | "
            f"{sparse.get('pass_at_1', float('nan')):.3f} / "
            f"{sparse.get('avg_at_k', float('nan')):.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
