#!/usr/bin/env python
"""A short fingerprint of the walk experiment in the regime: the first steps of seed 0's naive
and Sparse-RL arms (``experiments/reproduce.py --config configs/walk/local.yaml --methods rkv
--budgets 32``), per-step training reward, loss, gradient norm, mismatch k3 and rejection rate.

``docs/results/fingerprint.json`` stores it beside the results it summarises, and
``tests/test_results_fingerprint.py`` runs it again: when sampling, scoring, a correction or
the loss changes what the experiment measures, the values move and the test names the commands
that regenerate the results. An intended change re-runs the experiment, regenerates the pages
(``experiments/results_page.py``) and rewrites this file (``--write``) in the same commit.

  python experiments/fingerprint.py            # print the fingerprint and compare (~30 s)
  python experiments/fingerprint.py --write    # store it in docs/results/fingerprint.json
  python experiments/fingerprint.py loss.seq_denominator=kept   # what a change would show
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from experiments.kit.overrides_cli import parse_with_overrides  # noqa: E402
from experiments.kit.provenance import provenance  # noqa: E402
from experiments.kit.regime_fingerprint import (CONFIG, SEED, STEPS, STORED,  # noqa: E402
                                                differences, fingerprint)


def main(argv=None) -> int:
    """Measures the fingerprint, then stores it (``--write``) or compares it with the stored one."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true",
                        help=f"store the fingerprint in {STORED.relative_to(ROOT)}")
    args = parse_with_overrides(parser, argv)
    if args.write and args.overrides:
        parser.error("--write stores the experiment's own fingerprint: drop the overrides")
    with tempfile.TemporaryDirectory() as work:
        measured = fingerprint(Path(work), tuple(args.overrides))
    print(json.dumps(measured, indent=1))
    if args.write:
        STORED.parent.mkdir(parents=True, exist_ok=True)
        STORED.write_text(json.dumps({"provenance": provenance(), "config": CONFIG,
                                      "seed": SEED, "steps": STEPS, "arms": measured},
                                     indent=1) + "\n")
        return 0
    stale = differences(json.loads(STORED.read_text()), measured)
    print("\n".join(stale) or "matches the stored fingerprint")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
