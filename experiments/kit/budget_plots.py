"""The walk experiment's comparison figures (``experiments/reproduce.py``'s plots, and the
results pages' summary figures): one per KV budget, and one of the positive-control arms."""

from __future__ import annotations

from pathlib import Path

from experiments.kit.run_summary import COMPARE_KEYS
from sparse_rl_jax.records.plots import plot_comparison


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
