"""Every correction's statistics on a real model's compressed rollouts (issue 47, item 5), from
the stored ``docs/results/correction_stats/budget<k>.json`` (copies of what
``experiments/correction_stats.py`` wrote): the tables it prints and the block of
docs/results.md. Plain functions over the loaded files; no JAX."""

from __future__ import annotations

import json
from pathlib import Path

from experiments.kit.results_data import RESULTS

NAME = "correction_stats"
COLUMNS = (("rejection_rate", "rejection"), ("kept_token_fraction", "kept tokens"),
           ("is_ess", "ESS"), ("low_r_sequence_fraction", "seq r<1e-4"),
           ("opsm_fraction", "OPSM"), ("veto_fraction", "veto"),
           ("low_r_grad_share", "grad share r<1e-4"), ("low_r_grad_norm_ratio", "‖g_low‖ / ‖g‖"))
"""A correction's table columns: (key in its record, title)."""
BATCH = (("rows", "rows", "{}"), ("reward_mean", "reward", "{:.3f}"),
         ("response_length_mean", "length", "{:.0f}"),
         ("truncated_fraction", "truncated", "{:.3f}"), ("kv_saved_mean", "KV saved", "{:.2f}"),
         ("low_r_sequence_fraction", "seq r<1e-4", "{:.3f}"),
         ("low_r_token_fraction", "token r<1e-4", "{:.4f}"),
         ("mismatch_k3", "mismatch k3", "{:.3f}"))
PAPER_REJECTION = 0.07
"""Sparse-RL's reported average rejection rate; "~0.07" is read here as within a factor of 2."""


def load(root: Path = RESULTS) -> list[dict]:
    """The stored budgets' records, smallest budget first (empty when none is stored)."""
    records = [json.loads(p.read_text()) for p in (root / NAME).glob("budget*.json")]
    return sorted(records, key=lambda r: r["budget"])


def format_row(name: str, row: dict) -> str:
    """One correction's table line (``–`` where a number was not computed)."""
    cells = [name] + [("–" if row.get(k) is None else f"{row[k]:.3f}") for k, _ in COLUMNS]
    return "| " + " | ".join(cells) + " |"


def format_table(record: dict) -> str:
    """A budget's markdown table: one line per correction (:data:`COLUMNS`); a correction
    whose gradient numbers are another's (equal loss cotangents) says which."""
    head = ["correction"] + [title for _, title in COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, row in record["corrections"].items():
        lines.append(format_row(name if "same_as" not in row
                                else f"{name} (gradient = {row['same_as']}'s)", row))
    return "\n".join(lines)


def batch_table(records: list[dict]) -> str:
    """Per budget: the rolled-out batch (reward, length, truncation, KV saved, how many rows
    hold an r < 1e-4 token, the mismatch) and the groups and low-r rows with a gradient."""
    head = (["budget + buffer"] + [title for _, title, _ in BATCH]
            + ["groups with signal", "low-r rows with signal"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in records:
        b = r["batch"]
        cells = [f"{r['budget']} + {r['capacity'] - r['budget']}"]
        cells += [fmt.format(b[key]) for key, _, fmt in BATCH]
        cells += [f"{b['groups_with_signal']} / {b['groups']}", str(b["low_r_rows_with_signal"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def rejection_line(records: list[dict]) -> str:
    """Sparse-RL's rejection rate per budget against the paper's average."""
    low, high = PAPER_REJECTION / 2, PAPER_REJECTION * 2
    parts = []
    for r in records:
        rate = r["corrections"]["sparse_rl"]["rejection_rate"]
        verdict = "within" if low <= rate <= high else "outside"
        parts.append(f"{r['budget']} slots {rate:.3f} ({verdict})")
    return (f"Sparse-RL's rejection rate (sequences dropped) against the paper's average "
            f"~{PAPER_REJECTION} (read as {low:.3f} to {high:.2f}): " + "; ".join(parts) + ".")


def provenance(records: list[dict]) -> str:
    """The script's commands (each call resumes what the one before wrote), then per budget
    the commit, date and wall time of every call that added to it and its peak memory, and
    the machines."""
    calls = [c for r in records for c in r["calls"]]
    lines = ["```bash", *dict.fromkeys(c["command"] for c in calls), "```", ""]
    for r in records:
        done = []
        for c in r["calls"]:
            dirty = (f" (uncommitted edits to {', '.join(f'`{f}`' for f in c['dirty'])})"
                     if c.get("dirty") else "")
            done.append(f"commit `{c['commit']}`{dirty}, {c['date']}, {c['wall_s']} s")
        lines.append(f"- budget {r['budget']}: {'; '.join(done)}; peak resident memory "
                     f"{r['peak_rss_gb']} GB")
    lines += [f"- machine: {m}" for m in dict.fromkeys(c["machine"] for c in calls)]
    return "\n".join(lines)


def block(records: list[dict]) -> str:
    """docs/results.md's generated block: provenance, the batches, Sparse-RL's rejection
    against the paper's, one table per budget."""
    first = records[0]
    text = [f"{first['prompts']} eval problems x {first['samples']} samples per budget (the "
            f"first that fit the smallest cache; eval-set indices passed over: "
            f"{first['skipped_prompts'] or 'none'}), `{first['config']}`, "
            f"{first['method']}, temperature {first['temperature']}, "
            f"{first['max_new_tokens']} new tokens, seed {first['seed']}.", "",
            provenance(records), "", batch_table(records), "", rejection_line(records)]
    for r in records:
        text += ["", f"Budget {r['budget']} + {r['capacity'] - r['budget']} slots:", "",
                 format_table(r)]
    return "\n".join(text)
