"""Compile seconds of one decode shape, one score shape and one update shape vs model depth.

    python benchmarks/bench_compile.py [--layers 2 8 28] [--checkout PATH]

A tiny-width Qwen2-shaped model (hidden 64, 4 query / 2 KV heads, head_dim 16, vocab 512) with
random weights, so the time is the compiler's, not the arithmetic's. Each cell lowers and
compiles a fresh ``jax.jit`` (no compilation cache): one cached decode step (batch 8, 1 token,
cache of 256 slots), dense ``scoring.score`` (4 rows x (16 + 64) tokens) and the gradient of
the summed score log-probs (the update step's shape). Each depth runs in its own child
process; ``--checkout`` imports the library from another checkout (e.g. the main branch) so
a before/after table comes from one command.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # the kit; the library comes first from PYTHONPATH (--checkout)

from benchmarks.kit.compile_shapes import compile_shapes  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8, 28])
    parser.add_argument("--checkout", default=str(ROOT), help="library checkout to import")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        print(json.dumps(compile_shapes(args.worker)))
        return
    env = dict(os.environ, PYTHONPATH=args.checkout, JAX_PLATFORMS=os.environ.get(
        "JAX_PLATFORMS", ""))
    rows = []
    for layers in args.layers:
        out = subprocess.run([sys.executable, __file__, "--worker", str(layers)], env=env,
                             check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    import jax
    print(f"checkout {args.checkout}  device {jax.devices()[0].device_kind}")
    print(f"{'layers':>6} {'decode s':>9} {'score s':>8} {'update s':>9}")
    for row in rows:
        print(f"{row['layers']:>6} {row['decode']:>9.2f} {row['score']:>8.2f} {row['update']:>9.2f}")
    first = rows[0]
    for row in rows[1:]:
        print(f"ratio {row['layers']}/{first['layers']} layers: decode "
              f"{row['decode'] / first['decode']:.2f}x, score {row['score'] / first['score']:.2f}x, "
              f"update {row['update'] / first['update']:.2f}x")


if __name__ == "__main__":
    main()
