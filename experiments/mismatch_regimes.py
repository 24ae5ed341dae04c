#!/usr/bin/env python
"""The study regimes' untrained sampler/learner mismatch beside a real LLM's (issue 53, item
2): one batch per regime and seed, rolled out at the regime's study budget, against
SmolLM2-135M-Instruct's stored statistics under R-KV at 64 slots.

    python experiments/mismatch_regimes.py                 # seeds 0 1 2 (~1 min on 2 idle cores)

Regimes (:data:`REGIMES`): ``diffuse`` (``configs/walk/diffuse.yaml`` under R-KV 22: the
walk policy sampled at temperature 1.6, docs/regimes.md) and ``walk`` (the walk study's,
``configs/walk/local.yaml`` under R-KV 32). Each batch is ``experiments/correction_stats.py``'s:
``--prompts`` held-out problems x ``--samples`` samples at the rollout ``--seed``, rewarded and
scored densely (``kit.correction_batch``), and the learner's batch under ``sparse_rl``,
``decoupled_seq_is`` and ``decoupled_seq_is_rs`` as the trainer builds it. Prints one markdown
table, a row per statistic with its target band (``kit/results_mismatch_regimes.py``), a
column for SmolLM2 and one per regime and seed, each cell ``value yes|no`` (in band); then
where each batch's mismatch sits (``results_mismatch_regimes.diffuseness``: spread over many
tokens, or in a few). Writes it all, with this call's provenance, to ``--store``
(``docs/results/mismatch_regimes.json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from flax import nnx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from experiments.kit.arms import correction_arm  # noqa: E402
from experiments.kit.correction_batch import (budget_overrides, correction_batch,  # noqa: E402
                                              fitting_prompts, roll_out)
from experiments.kit.provenance import provenance  # noqa: E402
from experiments.kit.results_data import RESULTS  # noqa: E402
from experiments.kit.results_mismatch_regimes import (BANDED, CORRECTIONS, REFERENCE,  # noqa: E402
                                                      STATS, columns_of, diffuseness,
                                                      format_table, in_band, read_stats,
                                                      shape_table, shapes_of, verdicts)
from sparse_rl_jax.core.config_io import load_config  # noqa: E402
from sparse_rl_jax.tasks.rewards import get_reward_fn  # noqa: E402
from sparse_rl_jax.training.policy import make_run_mesh, policy_path  # noqa: E402
from sparse_rl_jax.training.preflight import load_checked_policy  # noqa: E402
from sparse_rl_jax.training.run_config import RunConfig  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Regime:
    """A study regime: its run ``config`` (relative to the repository root), the R-KV
    ``budget`` its study trains at, and the ``overrides`` that pick R-KV on top."""

    name: str
    config: str
    budget: int
    overrides: tuple[str, ...] = ("compression.method=rkv",)

    @property
    def label(self) -> str:
        """The table's name for it: ``<name> R-KV <budget>``."""
        return f"{self.name} R-KV {self.budget}"

    def run_config(self, samples: int, correction: str) -> RunConfig:
        """Its run config for a batch of ``samples`` per prompt under ``correction``, as
        ``correction_stats.py`` builds it (the budget's overrides, the study arm's)."""
        return load_config(RunConfig, str(ROOT / self.config), [
            *budget_overrides(self.budget), f"sampling.num_samples={samples}",
            *self.overrides, *correction_arm(correction)])


REGIMES = (Regime("diffuse", "configs/walk/diffuse.yaml", 22),
           Regime("walk", "configs/walk/local.yaml", 32))
"""The regimes measured: the new one, then the walk study's (docs/results.md)."""
REFERENCE_LABEL = "SmolLM2-135M R-KV 64"


def reference(path: Path = REFERENCE) -> dict:
    """SmolLM2's stored statistics (``label``, ``source``, ``config``, ``budget``, ``seed``,
    ``stats``, and ``calls``: the provenance of the runs that measured them)."""
    record = json.loads(path.read_text())
    return {"label": REFERENCE_LABEL, "source": str(path.relative_to(ROOT)),
            "config": record["config"], "budget": record["budget"], "seed": record["seed"],
            "stats": read_stats(record), "calls": record.get("calls", [])}


def measure(regime: Regime, seeds: list[int], prompts: int, samples: int,
            log=print) -> dict[str, dict]:
    """One untrained batch of ``regime`` per rollout seed: per seed its statistics, their
    verdicts, where its mismatch sits (``diffuseness``) and the batch's summary."""
    cfgs = {name: regime.run_config(samples, name) for name in CORRECTIONS}
    first = cfgs[CORRECTIONS[0]]
    tokenizer, model = load_checked_policy(policy_path(first), first, make_run_mesh(first))
    graphdef, params = nnx.split(model)
    texts, answers, _ = fitting_prompts(first, tokenizer, prompts, first.compression.capacity)
    out = {}
    for seed in seeds:
        batch, summary = roll_out(first, graphdef, params, tokenizer,
                                  get_reward_fn(first.data.reward), texts, answers, seed)
        record = {"budget": regime.budget, "config": regime.config, "batch": summary,
                  "corrections": {name: correction_batch(cfg, batch, graphdef, params,
                                                         tokenizer)[1]
                                  for name, cfg in cfgs.items()}}
        stats = read_stats(record)
        out[str(seed)] = {
            "stats": stats, "in_band": verdicts(stats), "all_in_band": in_band(stats),
            "diffuseness": diffuseness(batch.logp_sparse, batch.logp_old, batch.loss_mask),
            "capacity": first.compression.capacity, "batch": summary,
            "corrections": record["corrections"]}
        log(f"{regime.label} seed {seed}: rolled out in {summary['rollout_s']} s")
    return out


def summary(result: dict) -> list[str]:
    """One line per regime: the seeds on which all four issue bands held."""
    lines = []
    for regime in result["regimes"].values():
        held = [s for s, v in regime["seeds"].items() if v["all_in_band"]]
        lines.append(f"{regime['label']}: all of {', '.join(BANDED)} in band on "
                     f"{len(held)}/{len(regime['seeds'])} seeds"
                     + (f" ({', '.join(held)})" if held else ""))
    return lines


def main(argv=None) -> int:
    """Measures every regime and seed, prints the tables, stores the result."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2],
                        help="rollout seeds (one batch per regime and seed)")
    parser.add_argument("--regimes", nargs="+", default=[r.name for r in REGIMES],
                        choices=[r.name for r in REGIMES])
    parser.add_argument("--prompts", type=int, default=32, help="held-out problems per batch")
    parser.add_argument("--samples", type=int, default=8, help="samples per problem")
    parser.add_argument("--store", default=str(RESULTS / "mismatch_regimes.json"))
    args = parser.parse_args(argv)
    started = time.monotonic()
    result = {"provenance": provenance(None if argv is None else [__file__, *argv]),
              "prompts": args.prompts, "samples": args.samples,
              "bands": {s.key: [s.low, s.high] for s in STATS},
              "reference": reference(), "regimes": {}}
    for regime in (r for r in REGIMES if r.name in args.regimes):
        result["regimes"][regime.name] = {
            "label": regime.label, "config": regime.config, "budget": regime.budget,
            "overrides": list(regime.overrides),
            "seeds": measure(regime, args.seeds, args.prompts, args.samples,
                             log=lambda line: print(line, flush=True))}
    result["provenance"]["wall_s"] = round(time.monotonic() - started)
    store = Path(args.store)
    store.parent.mkdir(parents=True, exist_ok=True)
    store.write_text(json.dumps(result, indent=1) + "\n")
    print(format_table(columns_of(result)))
    print("\n".join(summary(result)))
    print(shape_table(shapes_of(result)))
    print(f"stored in {store}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
