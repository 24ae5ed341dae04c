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
import math
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from experiments.kit.overrides_cli import parse_with_overrides  # noqa: E402
from experiments.kit.provenance import provenance  # noqa: E402
from experiments.kit.results_data import cell, pass1  # noqa: E402
from sparse_rl_jax.core.config_io import load_config  # noqa: E402
from sparse_rl_jax.records.metrics_writer import read_metrics  # noqa: E402
from sparse_rl_jax.records.plots import plot_comparison  # noqa: E402
from sparse_rl_jax.rl.loss_config import CorrectionConfig  # noqa: E402
from sparse_rl_jax.tasks.rewards import get_reward_fn  # noqa: E402
from sparse_rl_jax.training.evaluation import evaluate, eval_set, mode_name  # noqa: E402
from sparse_rl_jax.training.policy import load_policy, policy_path, resolve_sampling  # noqa: E402
from sparse_rl_jax.training.run_config import RunConfig  # noqa: E402
from sparse_rl_jax.training.trainer import train  # noqa: E402

DISTILL = 0.1  # shadow-mask arm's loss.distill_coef (the paper's value is not public)
COMPARE_KEYS = ("reward_mean", "rejection_rate", "clip_fraction", "mismatch_k3",
                "repetition_fraction", "kv_token_savings", "kv_peak_savings",
                "response_length_mean", "token_mask_fraction", "truncated_fraction",
                "low_r_sequence_fraction", "low_r_grad_share", "entropy_estimate",
                "mismatch_k3_from_quant", "mismatch_k3_from_eviction", "is_ess",
                "kept_token_fraction")
# Collapse, defined before any run (issue 14): a run collapses when, for at least a quarter
# of its steps in a row, its training reward (smoothed over a tenth of the run) sits at least
# COLLAPSE_DROP below its peak while its truncated fraction (smoothed alike) is at least
# COLLAPSE_TRUNCATION x its baseline (its first tenth) and at least COLLAPSE_TRUNCATION_FLOOR.
# An arm collapses when at least 2 of 3 seeds (2/3 of its seeds) do.
COLLAPSE_DROP = 0.2
COLLAPSE_TRUNCATION = 3.0
COLLAPSE_TRUNCATION_FLOOR = 0.05


ARM_KINDS = ("dense", "naive", "sparse-rl", "shadow-mask")  # the first word of an arm's label


def correction_arm(name: str) -> list[str]:
    """The overrides of a ``--corrections`` arm: the named preset
    (``correction_presets.CORRECTION_PRESETS``), the low-r gradient share logged, and the
    shadow-mask arm's distillation where the preset replays the record."""
    replays = CorrectionConfig(kind=name).replay
    return [f"correction.kind={name}", "trainer.low_r_grad_share=true",
            *([f"loss.distill_coef={DISTILL}"] if replays else [])]


def arms(methods: list[str], budgets: list[int], controls: tuple[float, ...] = (),
         lags: tuple[int, ...] = (), quants: tuple[str, ...] = (),
         corrections: tuple[str, ...] = (), quant_alone: bool = True
         ) -> list[tuple[str, list[str]]]:
    """(label, overrides) of every arm: dense once, then naive and Sparse-RL on the positive
    control per rate in ``controls`` (dense rollouts, ``data.control_missed_increment``; walk
    task only), then naive, Sparse-RL and shadow-mask per budget and method. With ``lags``,
    the per-budget arms are asynchronous instead (``trainer.mode: async``), one pair per lag
    ``k``: Sparse-RL under the decoupled objective, against naive = standard PPO with the
    ratio to the sampler's log-probs (``correction.kind: ppo_behaviour``). With ``quants``
    (quantized KV, ``compression.quant``), naive and Sparse-RL per level instead: on
    quantization alone (``<kind> none <level>``, a dense cache of that level) and on each
    budget's eviction with it (``<kind> <method> <budget> <level>``; without ``quant_alone``,
    only the latter). With ``corrections``
    (preset names), every place that has a naive / Sparse-RL (/ shadow-mask) set has one arm
    per named correction instead, labelled by its name (``<name> <method> <budget>``,
    ``<name> control <q>``, ``... lag <k>``, ``... <level>``; :func:`correction_arm`); a
    replaying one (shadow_mask) has no control arm: the injected rows carry no record."""
    def kinds(*default, replay=True):
        return [(name, correction_arm(name)) for name in corrections
                if replay or not CorrectionConfig(kind=name).replay] or list(default)
    naive = ("naive", ["correction.kind=none", "trainer.low_r_grad_share=true"])
    plain_naive = ("naive", ["correction.kind=none"])
    sparse_rl = ("sparse-rl", ["correction.kind=sparse_rl"])
    out = [("dense", ["compression.method=none", "correction.kind=none"])]
    for rate in controls:
        setting = ["compression.method=none", f"data.control_missed_increment={rate}"]
        out += [(f"{kind} control {rate:g}", [*setting, *over])
                for kind, over in kinds(naive, sparse_rl, replay=False)]
    for quant in quants if quant_alone else ():
        alone = ["compression.method=none", "compression.layout=dense",
                 f"compression.quant={quant}"]
        out += [(f"{kind} none {quant}", [*alone, *over])
                for kind, over in kinds(plain_naive, sparse_rl)]
    for budget in budgets:
        for method in methods:
            setting = [f"compression.method={method}", f"compression.eviction.budget={budget}"]
            for quant in quants:
                # the record lets the run log its mismatch split by source (mismatch_sources)
                both = [*setting, f"compression.quant={quant}", "sampling.record_evictions=true"]
                out += [(f"{kind} {method} {budget} {quant}", [*both, *over])
                        for kind, over in kinds(plain_naive, sparse_rl)]
            for lag in lags:
                timing = [*setting, "trainer.mode=async", f"trainer.max_lag={lag}"]
                out += [(f"{kind} {method} {budget} lag {lag}", [*timing, *over])
                        for kind, over in kinds(("naive", ["correction.kind=ppo_behaviour"]),
                                                sparse_rl)]
            if lags or quants:
                continue
            shadow = ("shadow-mask",
                      ["correction.kind=shadow_mask", f"loss.distill_coef={DISTILL}"])
            # the naive arm also logs the gradient share a 1e-4 veto would have removed
            out += [(f"{kind} {method} {budget}", [*setting, *over])
                    for kind, over in kinds(naive, sparse_rl, shadow)]
    return out


def collapse_steps(records: list[dict]) -> int:
    """The longest run of consecutive collapsed steps (see COLLAPSE_DROP) in one run."""
    steps = len(records)
    if not steps:
        return 0
    window = max(1, steps // 10)

    def smooth(key):
        values = np.array([r.get(key, np.nan) for r in records], float)
        return np.array([np.nanmean(values[max(0, i - window + 1):i + 1]) for i in range(steps)])

    reward, truncated = smooth("reward_mean"), smooth("truncated_fraction")
    baseline = truncated[window - 1]
    bad = ((reward <= np.nanmax(reward) - COLLAPSE_DROP)
           & (truncated >= max(COLLAPSE_TRUNCATION * baseline, COLLAPSE_TRUNCATION_FLOOR)))
    longest = current = 0
    for flag in bad:
        current = current + 1 if flag else 0
        longest = max(longest, current)
    return longest


def collapsed(records: list[dict]) -> bool:
    """Whether one run collapsed: ``collapse_steps`` spans at least a quarter of its steps."""
    return bool(records) and collapse_steps(records) >= max(1, len(records) // 4)


def summarize(records: list[dict], tail: int) -> dict:
    """Means over the first and the last ``tail`` steps of a run's metrics (reward), and
    over the whole run (everything else)."""
    def mean(rows, key):
        return _mean([r[key] for r in rows if key in r])
    first, last = records[:tail], records[-tail:]
    return {
        "reward_first": mean(first, "reward_mean"), "reward_last": mean(last, "reward_mean"),
        "collapsed": collapsed(records),
        **{key: mean(records, key) for key in COMPARE_KEYS if key != "reward_mean"},
    }


def step_curves(records: list[dict]) -> dict[str, list[float | None]]:
    """Per-step values of every compared metric a run logged (None where a step lacks it),
    kept in results.json so tables of curves are generated from it, not from run dirs."""
    keys = [key for key in COMPARE_KEYS if any(key in r for r in records)]
    return {key: [None if r.get(key) is None else round(float(r[key]), 6) for r in records]
            for key in keys}


def mean_records(runs: list[list[dict]]) -> list[dict]:
    """Step-by-step means of several runs' metrics (the steps the runs share); exactly
    rounded sums (``math.fsum``: Python 3.12's ``sum`` compensates, 3.11's does not, and a
    mean on a rounding boundary then prints differently in the stored tables)."""
    return [{"step": steps[0]["step"],
             **{key: math.fsum(step[key] for step in steps) / len(steps) for key in COMPARE_KEYS
                if all(key in step for step in steps)}} for steps in zip(*runs)]


def plot_by_budget(runs: list[tuple[str, list[dict]]], budgets: list[int], out: Path) -> None:
    """One comparison figure per budget (``out/budget<b>/``): dense and that budget's arms;
    and one of dense and the positive-control arms (``out/control/``) when there are any."""
    for budget in budgets:
        # "<kind> <method> <budget>[ lag <k> | <quant>]", "<kind> none <quant>"
        chosen = [run for run in runs if run[0] == "dense" or " none " in run[0]
                  or (run[0].split(" ")[2:3] == [str(budget)] and " control " not in run[0])]
        if chosen:
            plot_comparison(chosen, out / f"budget{budget}", COMPARE_KEYS, smooth=5)
    controls = [run for run in runs if run[0] == "dense" or " control " in run[0]]
    if len(controls) > 1:
        plot_comparison(controls, out / "control", COMPARE_KEYS, smooth=5)


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


def _mean(values: list[float]) -> float:
    """The mean (an exactly rounded sum, as in ``mean_records``), NaN for no values."""
    return math.fsum(values) / len(values) if values else float("nan")


def _optional(value: float) -> str:
    """A metric only some arms log: the value, or a dash where it is NaN (not logged)."""
    return "–" if np.isnan(value) else f"{value:.3f}"


def _by_arm(results: list[dict], per_seed: bool) -> list[tuple[str, list[dict]]]:
    """Results grouped by arm in first-seen order (one group per arm and seed if per_seed)."""
    groups: dict[str, list[dict]] = {}
    for r in results:
        groups.setdefault(f"{r['arm']} | {r['seed']}" if per_seed else r["arm"], []).append(r)
    return list(groups.items())


def training_table(results: list[dict], per_seed: bool = False) -> str:
    """Markdown table of the training statistics (means over the run) and the final policy's
    greedy accuracy dense and under its own compression. Seeds are averaged (per-seed values
    in brackets for the reward and the accuracies) unless ``per_seed``."""
    digits = 3 if per_seed else 2
    head = ("| arm | " + ("seed | " if per_seed else "")
            + "reward first→last quarter | rejection | tok masked | clip frac | mismatch k3 | "
            "repetition | truncated | seq r<1e-4 | grad share r<1e-4 | collapsed | "
            "KV saved mean / peak | "
            "eval pass@1 dense | eval pass@1 own sparse |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, rows in _by_arm(results, per_seed):
        col = lambda key: _mean([r[key] for r in rows])  # noqa: E731
        own = [pass1(r, r["own_eval"]) for r in rows]
        lines.append(
            f"| {name} | {_mean([r['reward_first'] for r in rows]):.3f} → "
            f"{cell([r['reward_last'] for r in rows], digits)} | {col('rejection_rate'):.3f} | "
            f"{col('token_mask_fraction'):.3f} | {col('clip_fraction'):.4f} | "
            f"{col('mismatch_k3'):.3f} | {col('repetition_fraction'):.3f} | "
            f"{col('truncated_fraction'):.3f} | {col('low_r_sequence_fraction'):.3f} | "
            f"{_optional(col('low_r_grad_share'))} | "
            f"{sum(r.get('collapsed', False) for r in rows)}/{len(rows)} | "
            f"{col('kv_token_savings'):.3f} / {col('kv_peak_savings'):.3f} | "
            f"{cell([pass1(r, 'dense') for r in rows], digits)} | "
            f"{cell(own, digits) if rows[0]['own_eval'] != 'dense' else '–'} |")
    return "\n".join(lines)


def reward_curve_table(curves: dict[str, list[list[dict]]], blocks: int = 4) -> str:
    """Markdown table: mean reward over each of ``blocks`` equal spans of the steps per arm
    (seeds averaged), so a late drift or collapse shows in numbers, not only in the plots."""
    lines = [f"| arm | reward over {blocks} spans of the steps (seed mean) |", "|---|---|"]
    for label, runs in curves.items():
        steps = mean_records(runs)
        spans = [chunk for chunk in np.array_split(np.arange(len(steps)), blocks) if chunk.size]
        means = [_mean([steps[i]["reward_mean"] for i in chunk]) for chunk in spans]
        lines.append(f"| {label} | " + " → ".join(f"{m:.3f}" for m in means) + " |")
    return "\n".join(lines)


def inference_table(results: list[dict]) -> str:
    """Markdown table: greedy pass@1 (mean over seeds) of every final policy under dense
    inference and under every sparse setting; avg@k in brackets."""
    modes = [e["mode"] for e in results[0]["eval"]]
    lines = ["| policy \\ inference | " + " | ".join(modes) + " |",
             "|" + "---|" * (len(modes) + 1)]
    for name, rows in _by_arm(results, per_seed=False):
        cells = []
        for mode in modes:
            evals = [next(e for e in r["eval"] if e["mode"] == mode) for r in rows]
            cells.append(f"{_mean([e['pass_at_1'] for e in evals]):.3f} "
                         f"({_mean([e['avg_at_k'] for e in evals]):.3f})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
