#!/usr/bin/env python
"""Writes the walk experiments' tables into docs/results.md and the README's Results section
from their stored outputs, so no result number is copied by hand.

Each experiment's outputs are ``docs/results/<name>/*.json``: verbatim copies of the
``results.json`` that ``experiments/reproduce.py`` wrote, one per call (an experiment may run
as several calls, e.g. one per group of seeds). Every table says the commit, date, machine
and command that produced it. The pages hold the generated text between
``<!-- results_page:BLOCK -->`` and ``<!-- /results_page:BLOCK -->`` markers; what lies
outside them is prose, and carries no measured number.

  python experiments/results_page.py           # rewrite the generated blocks (and curves)
  python experiments/results_page.py --check   # exit 1 when a page is stale
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from experiments.kit.results_pages import (COMMAND, pages, write_plots,  # noqa: E402
                                           write_study_plot)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 when a page differs from docs/results/")
    parser.add_argument("--no-plots", action="store_true", help="skip the curve figures")
    args = parser.parse_args(argv)
    new = pages()
    if args.check:
        stale = [page for page, text in new.items()
                 if not page.is_file() or page.read_text() != text]
        for page in stale:
            print(f"{page.relative_to(ROOT)} is stale: run `{COMMAND}`", file=sys.stderr)
        return 1 if stale else 0
    for page, text in new.items():
        page.write_text(text)
    if not args.no_plots:
        write_plots()
        write_study_plot()
    return 0


if __name__ == "__main__":
    sys.exit(main())
