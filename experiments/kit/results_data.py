"""The walk experiments' committed outputs (``docs/results/<name>/*.json``, each a verbatim copy
of one ``experiments/reproduce.py`` run's ``results.json``) and the per-seed statistics the
result pages are made of. Plain functions over the loaded runs; no JAX."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"
DEGRADED_BY = 0.1
"""A seed degrades when its held-out dense pass@1 falls more than this below the
dense-trained policy's of the same seed (issue 41)."""
EARLY_STEPS = 10
"""The first steps over which the gradient share of the ``r < 1e-4`` sequences is read."""


@dataclasses.dataclass(frozen=True)
class Experiment:
    """One experiment's runs, merged over its parts (reproduce.py calls, e.g. one per group of
    seeds), and each part's provenance (commit, date, machine, command, wall_s)."""
    name: str
    runs: tuple[dict, ...]
    parts: tuple[dict, ...]

    def arm(self, label: str) -> list[dict]:
        """The runs of arm ``label``, in seed order; empty when the arm did not run."""
        return sorted((r for r in self.runs if r["arm"] == label), key=lambda r: r["seed"])

    def arms(self) -> list[str]:
        """Every arm's label, in the order the experiment ran them."""
        return list(dict.fromkeys(r["arm"] for r in self.runs))

    def seeds(self) -> list[int]:
        return sorted({r["seed"] for r in self.runs})


def load(name: str, root: Path = RESULTS) -> Experiment | None:
    """The experiment stored in ``root/name``, or None when it has no part. Parts may split
    a seed's arms; an arm's seed that two parts both ran is an error (which copy the page
    shows would be arbitrary)."""
    files = sorted((root / name).glob("*.json"))
    if not files:
        return None
    runs, parts, seen = [], [], {}
    for path in files:
        written = json.loads(path.read_text())
        for key in ("provenance", "runs"):
            if key not in written:
                raise ValueError(f"{path}: no '{key}' (not a results.json of reproduce.py)")
        parts.append(written["provenance"])
        for run in written["runs"]:
            where = (run["arm"], run["seed"])
            if where in seen:
                raise ValueError(f"{path}: arm {run['arm']!r} seed {run['seed']} is also in "
                                 f"{seen[where]}")
            seen[where] = path.name
            runs.append(run)
    return Experiment(name, tuple(runs), tuple(parts))


def pass1(run: dict, mode: str) -> float:
    """The run's final policy's greedy pass@1 under inference ``mode`` (``dense``, or
    ``run["own_eval"]`` for its own compression)."""
    for row in run["eval"]:
        if row["mode"] == mode:
            return float(row["pass_at_1"])
    raise KeyError(f"arm {run['arm']!r} seed {run['seed']}: no eval under {mode!r}")


def early_mean(run: dict, key: str, steps: int = EARLY_STEPS) -> float:
    """Mean of a per-step metric over the run's first ``steps`` steps (NaN if not logged)."""
    values = [v for v in run["steps"].get(key, [])[:steps] if v is not None]
    return float(np.mean(values)) if values else float("nan")


def degraded(runs: list[dict], dense: list[dict]) -> list[bool]:
    """Per run: whether its held-out dense pass@1 is more than ``DEGRADED_BY`` below the
    dense-trained policy's of the same seed. A seed without a dense run is an error."""
    reference = {r["seed"]: pass1(r, "dense") for r in dense}
    missing = [r["seed"] for r in runs if r["seed"] not in reference]
    if missing:
        raise ValueError(f"no dense arm for seeds {missing}: the degradation test needs one")
    return [pass1(r, "dense") < reference[r["seed"]] - DEGRADED_BY for r in runs]


def paired_gap(runs: list[dict], reference: list[dict]) -> list[float]:
    """Per seed: held-out dense pass@1 of ``runs`` minus that of ``reference``'s same seed."""
    ref = {r["seed"]: pass1(r, "dense") for r in reference}
    missing = [r["seed"] for r in runs if r["seed"] not in ref]
    if missing:
        raise ValueError(f"no reference run for seeds {missing}")
    return [pass1(r, "dense") - ref[r["seed"]] for r in runs]


def verdict(gap: list[float], within: float, arm: str) -> str:
    """Whether the mean paired gap of ``arm`` over its reference is no worse than
    ``-within``; a gap above ``+within`` is named (``arm`` higher), with whether it spans
    2 standard errors."""
    mean, se = mean_se(gap)
    if mean < -within:
        word = "does not hold"
    elif mean <= within:
        word = "holds"
    else:
        spans = "beyond" if se and mean > 2 * se else "within"
        word = f"holds, {arm} higher ({spans} 2 SE of 0)"
    return f"{word} ({mean:+.3f} ± {se:.3f})"


def mean_se(values) -> tuple[float, float]:
    """Mean and standard error (sample std / sqrt(n); 0 for one value)."""
    values = np.asarray(list(values), float)
    se = float(values.std(ddof=1) / np.sqrt(len(values))) if len(values) > 1 else 0.0
    return float(values.mean()), se


def cell(values, digits: int = 2) -> str:
    """``mean ± SE (v1, v2, ...)``: the per-seed values in brackets."""
    values = list(values)
    mean, se = mean_se(values)
    text = f"{mean:.{digits}f}"
    if len(values) > 1:
        text += f" ± {se:.{digits}f} (" + ", ".join(f"{v:.{digits}f}" for v in values) + ")"
    return text


def count(flags) -> str:
    """``k/n`` of a list of booleans."""
    flags = list(flags)
    return f"{sum(map(bool, flags))}/{len(flags)}"


def provenance(exp: Experiment) -> str:
    """Where every number of ``exp`` came from: one line per reproduce.py call."""
    lines = [f"Measured by {len(exp.parts)} call{'s' * (len(exp.parts) > 1)} of "
             "`experiments/reproduce.py` (the seeds of one call do not depend on the others'):"]
    for part in exp.parts:
        dirty = (f" (uncommitted edits to {', '.join(f'`{f}`' for f in part['dirty'])})"
                 if part.get("dirty") else "")
        lines.append(f"- `{part['command']}`: commit `{part['commit']}`{dirty}, {part['date']}, "
                     f"{part['wall_s']} s; {part['machine']}")
    return "\n".join(lines)
