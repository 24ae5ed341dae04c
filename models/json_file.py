"""Reading the JSON files of a checkpoint directory with errors that name the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json(path: str | Path) -> Any:
    """The content of the JSON file ``path``; ValueError ``<path>: invalid JSON: ...`` when
    it is not UTF-8 JSON (``transformers`` and ``tokenizers`` would report the parser's
    position without the file)."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise ValueError(f"{path}: invalid JSON: {e}") from e
