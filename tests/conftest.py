"""Shared pytest setup: CPU only, fp32 matmuls at full precision for parity tests.

The suite compiles hundreds of tiny programs and runs each briefly, so compilation dominates
its time: ``--xla_backend_optimization_level=0`` (XLA:CPU's backend codegen at its lowest
optimisation level; the numerics tests still hold against their oracles) cut the CPU time of
the reproduction smoke test from 166 s to 116 s. Child
processes (``run.py``, the experiment scripts) inherit it through the environment.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_backend_optimization_level=0").strip()

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
