"""Builds a warm start: ``python warm_start.py OUT_DIR WARM_START_JSON TASK_JSON``, the two
JSON objects holding ``WarmStartConfig`` and ``TaskConfig`` fields (the rest at defaults).

Run by ``tests/test_warm_start_recipe.py`` in a subprocess, so that its 200 training steps
run at an XLA:CPU optimisation level of their own (the ``optimized_env`` fixture).
"""

import json
import sys
from pathlib import Path

# Import this checkout's packages even where another copy is installed.
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from sparse_rl_jax.tasks.task import TaskConfig  # noqa: E402
from sparse_rl_jax.training.warm_start import build_default_model  # noqa: E402
from sparse_rl_jax.training.warm_start_config import WarmStartConfig  # noqa: E402

out, warm, task = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
build_default_model(out, WarmStartConfig(**warm), TaskConfig(**task), log=lambda _: None)
