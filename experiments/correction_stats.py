#!/usr/bin/env python
"""Every correction's statistics on one batch of a real LLM's compressed rollouts, without
training (issue 47, item 5: is "average rejection rate ~0.07" true of a real model?).

    python experiments/correction_stats.py --budgets 64 96 128 --out runs/correction_stats

Per KV budget: one batch of ``--prompts`` eval problems x ``--samples`` samples, rolled out
under the config's compression (default ``configs/smollm2/smollm2_rkv.yaml``: SmolLM2-135M-
Instruct, R-KV with ``budget + buffer`` slots, temperature 0.7, 256 new tokens) with its
eviction record kept, rewarded and scored densely. The prompts are the first ``--prompts``
of the config's eval set whose prompt fits the smallest budget's cache (prompts are never
truncated), so every budget rolls out the same ones; GRPO advantages over each prompt's
samples. Then for every correction (by default every registered preset but aliases) the
learner's batch exactly as the trainer builds it (``rl_step.learner_batch`` under the study's
overrides, ``kit.arms.correction_arm``; ``shadow_mask`` replays the record, with its
distillation) and:

  rejection     sequences dropped whole (``rejection_rate``)
  kept tokens   loss-mask tokens left after token and sequence rejection
  ESS           Kish's effective sample fraction of the final IS weights (``is_ess``)
  seq r<1e-4    sequences holding a token with r < 1e-4 (the same for every correction)
  OPSM, veto    sequences off-policy sequence masking / the veto drops
  grad share    ``<g_low, g> / |g|^2``: the share of the whole batch's first-update gradient
                (parameter space, the batch as one minibatch) carried by the r < 1e-4
                sequences under that correction's loss (``correction_grads``), with
                ``|g_low| / |g|``; for ``--grad-corrections`` only (default: all). A
                correction whose loss cotangent equals an earlier one's reuses its numbers.

The statistics cost one rollout and one dense scoring per budget; each gradient share one
backward of the rows that carry a gradient. Writes ``<out>/budget<k>.json`` after every step,
with the provenance of every call that added to it, and keeps the rolled-out batch in
``<out>/budget<k>.batch.pkl``: a rerun skips a finished budget and resumes an unfinished one
at its next correction. ``--no-grads`` stops after the statistics. Prints a markdown table per
budget. Extra ``key=value`` arguments override the run config.
"""

from __future__ import annotations

import argparse
import json
import pickle
import resource
import sys
import time
from pathlib import Path
from typing import Callable

import jax.numpy as jnp
from flax import nnx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from experiments.kit.arms import correction_arm  # noqa: E402
from experiments.kit.correction_batch import (budget_overrides, correction_batch,  # noqa: E402
                                              fitting_prompts, grad_stats, roll_out)
from experiments.kit.correction_grads import loss_cotangent  # noqa: E402
from experiments.kit.overrides_cli import parse_with_overrides  # noqa: E402
from experiments.kit.provenance import provenance  # noqa: E402
from experiments.kit.results_correction_stats import format_row, format_table  # noqa: E402
from sparse_rl_jax.core.config_io import load_config  # noqa: E402
from sparse_rl_jax.rl.correction_presets import CORRECTION_PRESETS  # noqa: E402
from sparse_rl_jax.tasks.rewards import get_reward_fn  # noqa: E402
from sparse_rl_jax.training.policy import make_run_mesh, policy_path  # noqa: E402
from sparse_rl_jax.training.preflight import load_checked_policy  # noqa: E402
from sparse_rl_jax.training.run_config import RunConfig  # noqa: E402

CONFIG = ROOT / "configs" / "smollm2" / "smollm2_rkv.yaml"


def peak_rss_gb() -> float:
    """This process's peak resident memory so far, GB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


def run_budget(path: Path, budget: int, cfg_for: Callable[[str], RunConfig], names,
               grad_names, model, prompts: tuple, args, log=print) -> dict:
    """Measures one budget into ``path`` (``budget<k>.json``), resuming what it holds: the
    batch (``.batch.pkl`` beside it, else rolled out), every correction's ``STATS``, then the
    gradient shares of ``grad_names`` not yet there; the file is rewritten after each, with
    this call's provenance as it started (the checkout it ran) and its wall time so far.
    ``model``: ``(graphdef, params, tokenizer)``; ``prompts``: :func:`fitting_prompts`'s."""
    graphdef, params, tokenizer = model
    started, call, origin = time.perf_counter(), time.time(), provenance()
    record = json.loads(path.read_text()) if path.is_file() else {"corrections": {}}
    cache = path.with_suffix(".batch.pkl")
    base = cfg_for(names[0])

    def save():
        record["peak_rss_gb"] = max(record.get("peak_rss_gb", 0), round(peak_rss_gb(), 2))
        calls = [c for c in record.get("calls", []) if c.get("call") != call]
        record["calls"] = calls + [{**origin, "call": call,
                                    "wall_s": round(time.perf_counter() - started)}]
        path.write_text(json.dumps(record, indent=1) + "\n")

    record.update(budget=budget, capacity=base.compression.capacity,
                  method=base.compression.method, config=args.config_name,
                  prompts=len(prompts[0]), samples=args.samples, seed=args.seed,
                  skipped_prompts=prompts[2], temperature=base.sampling.temperature,
                  max_new_tokens=base.sampling.max_new_tokens, overrides=args.overrides,
                  micro=args.micro)
    if cache.is_file():
        batch = pickle.loads(cache.read_bytes())
    else:
        batch, record["batch"] = roll_out(base, graphdef, params, tokenizer, get_reward_fn(
            base.data.reward), prompts[0], prompts[1], args.seed)
        cache.write_bytes(pickle.dumps(batch))
        save()
        log(f"rolled out {record['batch']['rows']} rows in {record['batch']['rollout_s']} s, "
            f"scored in {record['batch']['score_s']} s")
    seen = []
    for name in names:
        cfg = cfg_for(name)
        full, stats = correction_batch(cfg, batch, graphdef, params, tokenizer)
        row = {**record["corrections"].get(name, {}), **stats}
        record["corrections"][name] = row
        if name in grad_names and "low_r_grad_share" not in row:
            save()
            row.update(grad_stats(cfg, full, jnp.asarray(batch.logp_old), graphdef, params,
                                  micro=args.micro, seen=seen))
            log(format_row(name, row))
        elif "grad_norm" in row and "same_as" not in row and not cfg.correction.replay:
            seen.append((name, loss_cotangent(full, cfg.loss, jnp.asarray(batch.logp_old)),
                         {k: row[k] for k in row if k.startswith(("low_r_grad", "grad_"))
                          and k != "grad_seconds"}))
    save()
    return record


def main(argv=None) -> int:
    """Measures every budget not yet finished and prints its table."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(CONFIG))
    parser.add_argument("--budgets", nargs="+", type=int, default=[64, 96, 128])
    parser.add_argument("--prompts", type=int, default=32, help="eval problems per batch")
    parser.add_argument("--samples", type=int, default=8, help="samples per problem")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--corrections", nargs="+", default=[
        n for n in CORRECTION_PRESETS.names() if CORRECTION_PRESETS.get(n).alias_of is None],
                        help="correction presets (default: every registered one but aliases)")
    parser.add_argument("--grad-corrections", nargs="*", default=None,
                        help="those whose gradient share is computed (default: all)")
    parser.add_argument("--no-grads", action="store_true", help="statistics only")
    parser.add_argument("--micro", type=int, default=4,
                        help="rows per backward (SmolLM2: ~4.7 GB peak at 4)")
    parser.add_argument("--out", default="runs/correction_stats")
    args = parse_with_overrides(parser, argv)
    grad_names = set([] if args.no_grads else args.grad_corrections or args.corrections)
    args.config_name = str(Path(args.config).resolve().relative_to(ROOT))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def cfg_for(budget: int) -> Callable[[str], RunConfig]:
        return lambda name: load_config(RunConfig, args.config, [
            *budget_overrides(budget), f"sampling.num_samples={args.samples}",
            *args.overrides, *correction_arm(name)])

    first = cfg_for(min(args.budgets))(args.corrections[0])
    tokenizer, model = load_checked_policy(policy_path(first), first, make_run_mesh(first))
    graphdef, params = nnx.split(model)
    prompts = fitting_prompts(first, tokenizer, args.prompts, first.compression.capacity)
    for budget in args.budgets:
        path = out / f"budget{budget}.json"
        done = json.loads(path.read_text())["corrections"] if path.is_file() else {}
        if all(n in done and (n not in grad_names or "low_r_grad_share" in done[n])
               for n in args.corrections):
            print(f"budget {budget}: {path} is complete, skipped")
            continue
        print(f"budget {budget}: {args.prompts} prompts x {args.samples} samples", flush=True)
        record = run_budget(path, budget, cfg_for(budget), args.corrections, grad_names,
                            (graphdef, params, tokenizer), prompts, args,
                            log=lambda line: print(line, flush=True))
        print(format_table(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
