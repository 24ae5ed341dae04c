#!/usr/bin/env python
"""Reproduce the Sparse-RL claims at small scale on the shipped task.

Arms, same seed, same warm-started policy, same data:
  dense                     full KV cache (the reference)
  naive <method> <budget>   compressed rollouts, no correction (pi_sparse treated as pi_dense)
  sparse-rl <method> <b.>   compressed rollouts with Sparse-RL's rejection + reweighting
  shadow-mask <method> <b.> compressed rollouts, learner scored under the sampler's eviction
                            record (on-policy for the sparse policy) + distillation to dense
for every <method> (R-KV, SnapKV) and KV <budget> (a harsh and a moderate one by default; see
``experiments/regime_sweep.py`` for where compression starts to change the samples), and for
every seed. ``--controls q ...`` (walk task) adds the positive control per rate q:
  naive control <q>         dense rollouts with a fraction q of the sequences rewritten as
                            after a bad eviction (``data.control_missed_increment``)
  sparse-rl control <q>     the same rollouts with Sparse-RL's correction
Each final policy is evaluated under dense inference and under every sparse setting. Writes
``<out>/results.md`` (tables), ``<out>/results.json`` (every run's summary, eval and per-step
curves, with the commit, date, machine and command: ``experiments/results_page.py`` makes
docs/results.md's tables from it) and comparison plots
``<out>/plots/seed<k>/budget<b>/compare_*.png`` (``.../control/`` for the control arms; and
``plots/seed_mean/``: seeds averaged).

  python experiments/reproduce.py              # the full experiment (< 1 h on a 2-core CPU)
  python experiments/reproduce.py --quick      # a smoke version (< 1 min)
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

from experiments.kit.arms import ARM_KINDS, arms  # noqa: E402
from experiments.kit.budget_plots import plot_by_budget  # noqa: E402
from experiments.kit.overrides_cli import parse_with_overrides  # noqa: E402
from experiments.kit.provenance import provenance  # noqa: E402
from experiments.kit.reproduce_tables import (inference_table, reward_curve_table,  # noqa: E402
                                              training_table)
from experiments.kit.run_summary import mean_records, step_curves, summarize  # noqa: E402
from sparse_rl_jax.core.config_io import load_config  # noqa: E402
from sparse_rl_jax.records.metrics_writer import read_metrics  # noqa: E402
from sparse_rl_jax.rl.loss_config import CorrectionConfig  # noqa: E402
from sparse_rl_jax.tasks.rewards import get_reward_fn  # noqa: E402
from sparse_rl_jax.training.evaluation import evaluate, eval_set, mode_name  # noqa: E402
from sparse_rl_jax.training.policy import load_policy, policy_path, resolve_sampling  # noqa: E402
from sparse_rl_jax.training.run_config import RunConfig  # noqa: E402
from sparse_rl_jax.training.trainer import train  # noqa: E402


def main(argv=None) -> int:
    """Runs every arm, evaluates the final policies, writes the results."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/reproduce")
    parser.add_argument("--config", default=None,
                        help="a run YAML for every arm (e.g. configs/walk/common.yaml); without "
                             "it, the shipped digit task at its documented settings")
    parser.add_argument("--quick", action="store_true",
                        help="a few steps per arm, first seed and budget only (smoke test)")
    parser.add_argument("--methods", nargs="+", default=["rkv", "snapkv"])
    parser.add_argument("--budgets", nargs="*", type=int, default=[32, 40],
                        help="KV budgets of the sparse arms (see experiments/regime_sweep.py); "
                             "none: no sparse arms")
    parser.add_argument("--controls", nargs="*", type=float, default=[],
                        help="positive-control rates q (walk task): naive and Sparse-RL arms "
                             "trained on dense rollouts with q of the sequences rewritten as "
                             "after a bad eviction (data.control_missed_increment)")
    parser.add_argument("--lags", nargs="*", type=int, default=[],
                        help="asynchronous arms instead of the per-budget ones: naive (standard "
                             "PPO to the sampler's log-probs) and Sparse-RL (decoupled "
                             "objective) at each trainer.max_lag given")
    parser.add_argument("--quants", nargs="*", default=[],
                        help="quantized-KV arms instead of the per-budget ones: naive and "
                             "Sparse-RL at each compression.quant level given, on quantization "
                             "alone and with each budget's eviction")
    parser.add_argument("--no-quant-alone", dest="quant_alone", action="store_false",
                        help="with --quants: only the arms that stack quantization on a "
                             "budget's eviction, not those on quantization alone")
    parser.add_argument("--corrections", nargs="*", default=[],
                        help="one arm per named correction (correction.kind presets, e.g. "
                             "none sparse_rl icepop opsm) wherever the naive / Sparse-RL arms "
                             "would run (per budget, control rate, lag, quant level)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--only", nargs="*", choices=ARM_KINDS, default=list(ARM_KINDS),
                        help="train only these kinds of arm (e.g. to add arms to an experiment "
                             "whose dense arm already ran with the same settings; none: only "
                             "the --corrections arms)")
    args = parse_with_overrides(parser, argv)
    for name in args.corrections:  # an unknown name fails here, before any arm runs
        CorrectionConfig(kind=name)
    out = Path(args.out)
    # The settings of the documented runs (docs/reproduce_*.md), which predate today's
    # defaults of the embedded run; the command-line overrides still come last.
    base = [] if args.config else ["optim.lr=3e-4", "trainer.steps=50", "warm_start.steps=1000"]
    if args.quick:
        # Eval batches shaped like training rollouts (8 prompts x 8 samples) reuse the
        # compiled sampler, which keeps the quick mode's compile time down.
        base += ["trainer.steps=2", "trainer.prompts_per_step=8", "trainer.minibatch_size=64",
                 "warm_start.steps=30", "eval.num_prompts=8", "eval.batch_size=8",
                 "eval.samples=8"]
        args.seeds, args.budgets = args.seeds[:1], args.budgets[:1]
    base += args.overrides
    started = time.monotonic()
    origin = provenance(None if argv is None else [__file__, *argv])
    shared = load_config(RunConfig, args.config, [f"run_dir={out / 'shared'}"] + base)
    policy = policy_path(shared)  # one warm start, shared by every arm
    # Every policy is evaluated dense and under every sparse setting that an arm trains with.
    comp = shared.compression
    inference = [dataclasses.replace(comp, method=m,
                                     eviction=dataclasses.replace(comp.eviction, budget=b))
                 for b in args.budgets for m in args.methods]
    # quantized arms are also evaluated under their own setting: each sparse one and the
    # dense cache at each level
    inference += [dataclasses.replace(c, quant=q) for q in args.quants
                  for c in [dataclasses.replace(comp, method="none"), *inference]]
    results, curves = [], {}
    for seed in args.seeds:
        runs = []
        for label, arm in arms(args.methods, args.budgets, tuple(args.controls),
                               tuple(args.lags), tuple(args.quants), tuple(args.corrections),
                               args.quant_alone):
            if label.split(" ")[0] not in (*args.only, *args.corrections):
                continue
            run_dir = out / f"seed{seed}" / label.replace(" ", "_")
            cfg = load_config(RunConfig, args.config, [
                f"run_dir={run_dir}", f"model.path={policy}", f"trainer.seed={seed}",
                "trainer.plots=false", *base, *arm])
            print(f"== {label} (seed {seed}) -> {run_dir}", flush=True)
            train(cfg)
            records = read_metrics(run_dir / "metrics.jsonl")
            runs.append((label, records))
            curves.setdefault(label, []).append(records)
            graphdef, params, tokenizer = load_policy(cfg, str(run_dir / "final"))
            prompts, answers = eval_set(cfg, tokenizer.hf)
            rows = evaluate(graphdef, params, tokenizer, prompts, answers,
                            get_reward_fn(cfg.data.reward), resolve_sampling(cfg, tokenizer),
                            inference, samples=cfg.eval.samples,
                            temperature=cfg.eval.temperature, batch_size=cfg.eval.batch_size,
                            seed=seed, add_special_tokens=cfg.data.add_special_tokens)
            results.append({"arm": label, "seed": seed,
                            "own_eval": mode_name(cfg.compression),
                            **summarize(records, max(1, len(records) // 4)),
                            "eval": [dataclasses.asdict(r) for r in rows],
                            "steps": step_curves(records)})
        plot_by_budget(runs, args.budgets, out / "plots" / f"seed{seed}")
    plot_by_budget([(label, mean_records(r)) for label, r in curves.items()], args.budgets,
                   out / "plots" / "seed_mean")
    (out / "results.json").write_text(json.dumps(
        {"provenance": {**origin, "wall_s": round(time.monotonic() - started)},
         "runs": results}, indent=1))
    text = "\n\n".join([training_table(results), inference_table(results),
                         reward_curve_table(curves), training_table(results, per_seed=True)])
    (out / "results.md").write_text(
        text + f"\n\nseeds {args.seeds}; wall time: {time.monotonic() - started:.0f} s\n")
    print(text)
    return 0

if __name__ == "__main__":
    sys.exit(main())
