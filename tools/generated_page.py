"""The command line the doc generators share: write a generated page, or with ``--check``
write nothing and exit 1 (naming the command to run) when the page is stale."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable


def main(argv: list[str] | None, *, description: str, render: Callable[[], str], output: Path,
         command: str, source: str) -> int:
    """Writes ``render()`` to ``output``, or with ``--check`` compares them; ``source`` names
    what the page is generated from (in the ``--check`` help)."""
    parser = argparse.ArgumentParser(description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help=f"write nothing; exit 1 when {output.name} differs from {source}")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not output.is_file() or output.read_text() != text:
            print(f"{output.relative_to(output.parents[1])} is stale: run `{command}`",
                  file=sys.stderr)
            return 1
        return 0
    output.write_text(text)
    return 0
