"""What a sweep script (``experiments/regime_sweep.py``, ``experiments/walk_calibration.py``)
writes: its table's footer, and the JSON and markdown files beside each other."""

from __future__ import annotations

import json
import time
from pathlib import Path


def cell_footer(prompts: int, samples: int, started: float) -> str:
    """The line under a sweep table: its cell size and the wall time since ``started``."""
    return (f"{prompts} prompts x {samples} samples per cell; "
            f"wall time {time.monotonic() - started:.0f} s")


def write_results(out: Path, stem: str, data, table: str, footer: str) -> None:
    """Writes ``out/<stem>.json`` (``data``) and ``out/<stem>.md`` (``table``, then
    ``footer``), and prints the table."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(data, indent=1))
    (out / f"{stem}.md").write_text(f"{table}\n\n{footer}\n")
    print(table)
