"""Command lines of the experiment scripts: options plus ``key=value`` run-config overrides
that may stand anywhere, also right after an option taking several values
(``--seeds 0 1 2 model.path=...``), where plain argparse would read them as one more value."""

from __future__ import annotations

import argparse
import re
import sys
from typing import Sequence

OVERRIDE = re.compile(r"[A-Za-z_][\w.]*=.*", re.DOTALL)
"""A run-config override: a dotted key, ``=``, a value (``trainer.steps=80``)."""


def parse_with_overrides(parser: argparse.ArgumentParser,
                         argv: Sequence[str] | None = None) -> argparse.Namespace:
    """``parser``'s namespace for ``argv`` (default ``sys.argv[1:]``) with every override
    taken out first and returned, in order, as ``namespace.overrides``. The parser declares
    no positional for them; its usage line names them."""
    argv = sys.argv[1:] if argv is None else list(argv)
    overrides = [arg for arg in argv if OVERRIDE.fullmatch(arg)]
    parser.usage = parser.format_usage().removeprefix("usage: ").rstrip() + " [key=value ...]"
    args = parser.parse_args([arg for arg in argv if not OVERRIDE.fullmatch(arg)])
    args.overrides = overrides
    return args
