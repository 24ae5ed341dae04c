#!/usr/bin/env python
"""Where does KV compression change the rollouts? A sweep over KV budget and problem size.

For one warm-started policy (no RL), every cell (method, n labelled digits, budget) samples
the same prompts twice with the same PRNG key, once with a dense cache and once compressed.
The sampler draws every token by Gumbel-max from one key stream, so the two rollouts are
identical until compression moves the distribution far enough to flip a draw: the first
differing token is where compression changed the sample. The sparse rollout is then scored
densely (what the learner sees) and put through Sparse-RL's corrections. Per cell:

  kv saved mean / peak   1 - resident KV tokens of the compressed cache / of a dense cache
  seq changed            fraction of sequences whose sparse sample differs from the dense one
  first diff             mean response position of the first differing token (changed rows)
  rejection, tok masked  Sparse-RL's sequence rejection rate and token mask fraction
  mismatch k3            KL(pi_sparse || pi_dense) estimate on the sparse samples
  acc dense / sparse     mean reward of the dense and the compressed samples
  greedy dense / sparse  greedy (pass@1) accuracy, dense and compressed

  python experiments/regime_sweep.py                    # the default grid (~4 min, 2 cores)
  python experiments/regime_sweep.py --quick            # a smoke version (< 1 min)
  python experiments/regime_sweep.py --n 8 12 --budgets 40 48 --methods rkv

Writes ``<out>/sweep.md`` and ``<out>/sweep.json``. Extra ``key=value`` arguments override
the run config (e.g. ``warm_start.steps=2000``); the warm start is trained on
``data.task.n_min..max(--n)`` so every cell's problem size is in distribution.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import jax
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from experiments.kit.overrides_cli import parse_with_overrides  # noqa: E402
from experiments.kit.sweep_output import cell_footer, write_results  # noqa: E402
from sparse_rl_jax.core.config_io import load_config  # noqa: E402
from sparse_rl_jax.kv.compression_config import CompressionConfig  # noqa: E402
from sparse_rl_jax.rl.rollout_metrics import kv_token_savings  # noqa: E402
from sparse_rl_jax.tasks.rewards import get_reward_fn  # noqa: E402
from sparse_rl_jax.tasks.task import TaskDataset, prompt_length, solution_length  # noqa: E402
from sparse_rl_jax.training.collect import RolloutPolicy, collect_prompts  # noqa: E402
from sparse_rl_jax.training.policy import load_policy, policy_path, resolve_sampling  # noqa: E402
from sparse_rl_jax.training.run_config import RunConfig  # noqa: E402


def first_difference(a: np.ndarray, b: np.ndarray, mask_a: np.ndarray,
                     mask_b: np.ndarray) -> np.ndarray:
    """Per row, the first response position where two rollouts differ, or -1 if they agree.

    Args:
      a, b: ``[N, M]`` response tokens; mask_a, mask_b: ``[N, M]`` their response masks.
        A position differs when exactly one row has a token there or both have different
        tokens (so an early EOS in one rollout counts as a difference).
    """
    a_on, b_on = mask_a.astype(bool), mask_b.astype(bool)
    differs = (a_on != b_on) | (a_on & b_on & (a != b))
    return np.where(differs.any(1), differs.argmax(1), -1)


def sweep_policy(cfg: RunConfig, graphdef, tokenizer, reward_fn, sampling) -> RolloutPolicy:
    """The run's :class:`RolloutPolicy`, with Sparse-RL's corrections on the whole response
    mask whatever the config trains with: what the sweep's mismatch columns measure."""
    policy = RolloutPolicy.from_run(cfg, graphdef, tokenizer, reward_fn, sampling)
    return dataclasses.replace(policy, correction=dataclasses.replace(cfg.correction,
                                                                      kind="sparse_rl"),
                               mask_truncated=False)


def measure_cell(policy: RolloutPolicy, params, prompts, answers,
                 compression: CompressionConfig, key, dense_runs: tuple) -> dict:
    """The statistics of one (compression, prompt set) cell; see the module docstring.

    ``dense_runs`` is ``dense_reference(...)`` of the same policy, prompts and key.
    """
    dense, greedy_dense = dense_runs
    args = (policy, params, prompts, answers, key)
    sparse = collect_prompts(*args, compression=compression)
    greedy = dataclasses.replace(policy.sampling, greedy=True, num_samples=1)
    greedy_sparse = collect_prompts(*args, compression=compression, sampling=greedy,
                                    score=False).rewards
    stats = jax.device_get(sparse.corrections.metrics)
    first = first_difference(*(np.asarray(x) for x in (
        dense.rollout.response, sparse.rollout.response, dense.rollout.response_mask,
        sparse.rollout.response_mask)))
    changed = first >= 0
    rollout = sparse.rollout
    return {
        "kv_saved_mean": float(kv_token_savings(rollout.kv_mean, rollout.dense_kv_mean)),
        "kv_saved_peak": float(kv_token_savings(rollout.kv_peak, rollout.dense_kv_peak)),
        "seq_changed": float(changed.mean()),
        "first_diff": float(first[changed].mean()) if changed.any() else float("nan"),
        "rejection_rate": float(stats["rejection_rate"]),
        "token_mask_fraction": float(stats["token_mask_fraction"]),
        "mismatch_k3": float(stats["mismatch_k3"]),
        "acc_dense": float(np.mean(dense.rewards)),
        "acc_sparse": float(np.mean(sparse.rewards)),
        "greedy_dense": float(np.mean(greedy_dense)),
        "greedy_sparse": float(np.mean(greedy_sparse)),
    }


def dense_reference(policy: RolloutPolicy, params, prompts, answers, key) -> tuple:
    """The dense sampled rollout with its rewards (``collect.Collected``, unscored), and the
    dense greedy rewards: what every cell of one prompt set is compared against (computed
    once per prompt set)."""
    args = (policy, params, prompts, answers, key)
    dense = CompressionConfig(method="none")
    greedy = dataclasses.replace(policy.sampling, greedy=True, num_samples=1)
    return (collect_prompts(*args, compression=dense, score=False),
            collect_prompts(*args, compression=dense, sampling=greedy, score=False).rewards)


COLUMNS = (("kv_saved_mean", "KV saved mean"), ("kv_saved_peak", "KV saved peak"),
           ("seq_changed", "seq changed"), ("first_diff", "first diff"),
           ("rejection_rate", "rejection"), ("token_mask_fraction", "tok masked"),
           ("mismatch_k3", "mismatch k3"), ("acc_dense", "acc dense"),
           ("acc_sparse", "acc sparse"), ("greedy_dense", "greedy dense"),
           ("greedy_sparse", "greedy sparse"))


def format_table(rows: list[dict]) -> str:
    """A markdown table of the sweep, one line per cell."""
    names = ["method", "n", "context", "budget"] + [title for _, title in COLUMNS]
    lines = ["| " + " | ".join(names) + " |", "|" + "---|" * len(names)]
    for r in rows:
        cells = [r["method"], str(r["n"]), str(r["context"]), str(r["budget"])]
        cells += [f"{r[key]:.1f}" if key == "first_diff" else f"{r[key]:.3f}"
                  for key, _ in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    """Runs the grid and writes the table."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/regime_sweep")
    parser.add_argument("--quick", action="store_true", help="a tiny grid (smoke test)")
    parser.add_argument("--methods", nargs="+", default=["rkv", "snapkv"])
    parser.add_argument("--n", nargs="+", type=int, default=[4, 6, 8],
                        help="labelled digits per problem (one problem size per cell)")
    parser.add_argument("--budgets", nargs="+", type=int, default=[16, 24, 32, 40, 48, 56])
    parser.add_argument("--prompts", type=int, default=32, help="prompts per cell")
    args = parse_with_overrides(parser, argv)
    if args.quick:
        args.n, args.budgets, args.prompts = args.n[:1], args.budgets[:2], 8
    out = Path(args.out)
    n_max, defaults = max(args.n), RunConfig()
    cfg = load_config(RunConfig, None, [
        f"run_dir={out}", f"data.task.n_max={n_max}",
        f"data.task.n_min={min(args.n + [defaults.data.task.n_min])}",
        "sampling.max_new_tokens="
        f"{max(solution_length(n_max) + 1, defaults.sampling.max_new_tokens)}",
        f"compression.eviction.budget={prompt_length(n_max)}", *args.overrides])
    started = time.monotonic()
    graphdef, params, tokenizer = load_policy(cfg, policy_path(cfg))
    sampling = resolve_sampling(cfg, tokenizer)
    policy = sweep_policy(cfg, graphdef, tokenizer, get_reward_fn(cfg.data.reward), sampling)
    key = jax.random.key(cfg.trainer.seed)
    rows = []
    for n in args.n:
        task = dataclasses.replace(cfg.data.task, n_min=n, n_max=n, seed=cfg.eval.task_seed)
        problems = TaskDataset(task, args.prompts)[:]
        prompts, answers = [p.prompt for p in problems], [p.answer for p in problems]
        context = prompt_length(n) + solution_length(n) + 1
        dense_runs = dense_reference(policy, params, prompts, answers, key)
        for method in args.methods:
            for budget in args.budgets:
                # alpha metric off: the sweep reports no acceptance (a record would cost
                # two more forwards per sequence)
                comp = cfg.compression
                compression = dataclasses.replace(
                    comp, method=method, alpha=dataclasses.replace(comp.alpha, metric="off"),
                    eviction=dataclasses.replace(comp.eviction, budget=budget))
                if compression.capacity < prompt_length(n):
                    continue  # the prompt alone overflows the cache: not a valid setting
                row = {"method": method, "n": n, "context": context, "budget": budget}
                row.update(measure_cell(policy, params, prompts, answers, compression, key,
                                        dense_runs))
                rows.append(row)
                print(format_table([row]).splitlines()[-1], flush=True)
    write_results(out, "sweep", rows, format_table(rows), cell_footer(
        args.prompts, sampling.num_samples, started))
    return 0


if __name__ == "__main__":
    sys.exit(main())
