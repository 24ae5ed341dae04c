#!/usr/bin/env python
"""Calibrates the walk task's regime: which KV budget compresses its traces without ruining
them, while still producing rare bad evictions (issue 14, item 2).

For one policy warm-started on the walk task (``configs/walk/walk_dense.yaml`` and any
``key=value`` overrides, e.g. ``data.walk.echo_every=8``; the echo knob is one warm start per
value, so run the script once per knob), every (method, budget) cell samples the same
held-out prompts dense and compressed with one PRNG key and scores the compressed samples
densely. Per cell:

  kv saved          1 - mean resident KV tokens of the compressed cache / of a dense cache
  greedy dense/sparse  greedy pass@1, dense and compressed
  seq r<1e-4        fraction of sampled sequences holding a token with r = p_dense / p_sparse
                    below 1e-4 (a token the dense policy all but rules out: a bad eviction)
  log r q0.1%       the 0.1% quantile of log r over all sampled response tokens
  truncated         fraction of compressed samples that hit max_new_tokens (missing halt)
  alpha p5 / bin    Sparrow's statistic for this evicting cache: the 5th percentile of the
                    per-token acceptance sum_x min(p_sparse, p_dense) per bin of --alpha-bin
                    response positions (exact, replayed from the eviction record)

A budget is *in the regime* when kv saved >= 0.35, greedy sparse >= 0.9 x greedy dense and
3-10% of sequences hold an r < 1e-4 token; the script prints, per method, the smallest such
budget (the most compression), or none.

  python experiments/walk_calibration.py --quick          # smoke version
  python experiments/walk_calibration.py --budgets 48 64 96 128 --prompts 64

Any run config works the same way (its eval set, reward and sampling), e.g. SmolLM2 on the
arithmetic problems: ``--config configs/smollm2/smollm2_dense.yaml``.

Writes ``<out>/calibration.md`` and ``<out>/calibration.json``.
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
from sparse_rl_jax.kv.state import check_prompt_fits  # noqa: E402
from sparse_rl_jax.rl.rollout_metrics import kv_token_savings  # noqa: E402
from sparse_rl_jax.rollout.acceptance import acceptance_percentile_per_bin  # noqa: E402
from sparse_rl_jax.tasks.prompt_source import eval_examples  # noqa: E402
from sparse_rl_jax.tasks.rewards import get_reward_fn  # noqa: E402
from sparse_rl_jax.training.collect import RolloutPolicy, collect_prompts  # noqa: E402
from sparse_rl_jax.training.policy import load_policy, policy_path, resolve_sampling  # noqa: E402
from sparse_rl_jax.training.run_config import RunConfig  # noqa: E402

LOG_R_FLOOR = np.log(1e-4)
COLUMNS = (("kv_saved", "kv saved"), ("greedy_dense", "greedy dense"),
           ("greedy_sparse", "greedy sparse"), ("seq_low_r", "seq r<1e-4"),
           ("log_r_q001", "log r q0.1%"), ("truncated", "truncated"))


def log_ratio_stats(logp_dense: np.ndarray, logp_sparse: np.ndarray, mask: np.ndarray) -> dict:
    """``seq_low_r`` (rows with a token of log r < log 1e-4) and ``log_r_q001`` (0.1%
    quantile of log r) from ``[N, M]`` dense / sampler log-probs on the ``[N, M]`` mask."""
    on = np.asarray(mask).astype(bool)
    log_r = np.asarray(logp_dense, np.float64) - np.asarray(logp_sparse, np.float64)
    low = (log_r < LOG_R_FLOOR) & on
    return {"seq_low_r": float(low.any(1).mean()),
            "log_r_q001": float(np.quantile(log_r[on], 0.001)) if on.any() else float("nan")}


def in_regime(row: dict) -> bool:
    """The issue's calibration target for one cell."""
    return (row["kv_saved"] >= 0.35 and row["greedy_sparse"] >= 0.9 * row["greedy_dense"]
            and 0.03 <= row["seq_low_r"] <= 0.10)


def format_table(rows: list[dict]) -> str:
    """A markdown table of the cells, one line each."""
    names = (["method", "budget"] + [title for _, title in COLUMNS]
             + ["alpha p5 / bin", "in regime"])
    lines = ["| " + " | ".join(names) + " |", "|" + "---|" * len(names)]
    for r in rows:
        cells = [r["method"], str(r["budget"])] + [f"{r[k]:.3f}" for k, _ in COLUMNS]
        cells.append(" / ".join(f"{a:.3f}" for a in r["alpha_p5"]))
        lines.append("| " + " | ".join(cells + ["yes" if in_regime(r) else "no"]) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    """Runs the grid and writes the table."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/walk_calibration")
    parser.add_argument("--config", default=str(ROOT / "configs/walk/walk_dense.yaml"))
    parser.add_argument("--quick", action="store_true", help="a tiny grid (smoke test)")
    parser.add_argument("--methods", nargs="+", default=["rkv", "snapkv"])
    parser.add_argument("--budgets", nargs="+", type=int, default=[48, 64, 96, 128, 160])
    parser.add_argument("--prompts", type=int, default=32, help="held-out prompts per cell")
    parser.add_argument("--alpha-bin", type=int, default=128,
                        help="response positions per bin of the alpha p5 column")
    args = parse_with_overrides(parser, argv)
    if args.quick:
        args.budgets, args.prompts = args.budgets[:2], 4
    out = Path(args.out)
    cfg = load_config(RunConfig, args.config, [f"run_dir={out}", *args.overrides])
    try:  # every cell's config is checked before anything is loaded or sampled
        comp = cfg.compression
        cells = {(m, b): dataclasses.replace(comp, method=m,
                                             eviction=dataclasses.replace(comp.eviction, budget=b))
                 for m in args.methods for b in args.budgets}
    except ValueError as err:
        parser.error(f"--methods/--budgets: {err}")
    started = time.monotonic()
    graphdef, params, tokenizer = load_policy(cfg, policy_path(cfg))
    sampling = resolve_sampling(cfg, tokenizer)
    greedy = dataclasses.replace(sampling, greedy=True, num_samples=1)
    reward_fn = get_reward_fn(cfg.data.reward)
    problems = eval_examples(dataclasses.replace(
        cfg, eval=dataclasses.replace(cfg.eval, num_prompts=args.prompts)), tokenizer.hf)
    encoded = tokenizer.hf([p.prompt for p in problems],
                           add_special_tokens=cfg.data.add_special_tokens)["input_ids"]
    longest = max(len(ids) for ids in encoded)
    for (method, budget), compression in cells.items():  # before the first cell samples
        try:
            check_prompt_fits(compression, longest)
        except ValueError as err:
            parser.error(f"--budgets {budget} ({method}): {err}")
    policy = RolloutPolicy.from_run(cfg, graphdef, tokenizer, reward_fn, sampling)
    run_args = (policy, params, [p.prompt for p in problems], [p.answer for p in problems],
                jax.random.key(cfg.trainer.seed))

    def greedy_accuracy(compression) -> float:
        return float(np.mean(collect_prompts(*run_args, compression=compression,
                                             sampling=greedy, score=False).rewards))

    greedy_dense = greedy_accuracy(dataclasses.replace(cfg.compression, method="none"))
    rows = []
    for method in args.methods:
        for budget in args.budgets:
            compression = cells[method, budget]
            # The eviction record lets the scorer replay the sparse policy for alpha.
            sparse = collect_prompts(*run_args, compression=compression,
                                     sampling=dataclasses.replace(sampling,
                                                                  record_evictions=True))
            rollout = sparse.rollout
            row = {"method": method, "budget": budget,
                   "kv_saved": float(kv_token_savings(rollout.kv_mean, rollout.dense_kv_mean)),
                   "greedy_dense": greedy_dense,
                   "greedy_sparse": greedy_accuracy(compression),
                   "truncated": float(1 - np.mean(np.asarray(rollout.finished)))}
            row.update(log_ratio_stats(sparse.logp_old, rollout.logp, rollout.response_mask))
            row["alpha_p5"] = acceptance_percentile_per_bin(
                sparse.alpha, rollout.response_mask, bin_tokens=args.alpha_bin).tolist()
            rows.append(row)
            print(format_table([row]).splitlines()[-1], flush=True)
    picks = {m: min((r["budget"] for r in rows if r["method"] == m and in_regime(r)),
                    default=None) for m in args.methods}
    table = format_table(rows) + "\n\nsmallest budget in the regime: " + ", ".join(
        f"{m} {b if b is not None else 'none'}" for m, b in picks.items())
    write_results(out, "calibration", {"rows": rows, "picks": picks}, table,
                  cell_footer(args.prompts, sampling.num_samples, started))
    return 0


if __name__ == "__main__":
    sys.exit(main())
