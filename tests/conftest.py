"""Shared pytest setup: CPU only, fp32 matmuls at full precision for parity tests."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
