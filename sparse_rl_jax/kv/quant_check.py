"""The guardrail of a quantized KV cache: how far ``compression.quant`` moves a model's keys.

Per-token scales cope with keys of even magnitude; keys whose few outlier channels swamp the
scale (models without QK-norm) lose every other channel to rounding. :func:`key_quant_error`
measures the largest relative error per layer on real rows (``models.QuantProbe``, a
full-precision forward); :class:`QuantErrorWarning` warns once, naming the layer and level,
when it passes the level's threshold.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

import models

WARN_ERROR = {"int8": 0.05, "fp8": 0.1, "int4": 0.3}
"""Relative key error (L2 over a head's ``D`` channels) above which a level warns: about 2.5x
what Gaussian keys of head_dim 128 give (int8 ~0.009, fp8 ~0.03, int4 ~0.11)."""


@nnx.jit(static_argnames=("quant",))
def _probe(model: models.Decoder, tokens: jax.Array, mask: jax.Array, quant: str) -> jax.Array:
    probe = models.QuantProbe(jnp.zeros(model.config.num_layers, jnp.float32), quant=quant)
    return model(tokens, attention_mask=mask, kv=probe, return_logits=False).kv.key_error


def key_quant_error(graphdef, params, tokens: jax.Array, mask: jax.Array,
                    quant: str) -> jax.Array:
    """``[L]`` float32: per layer, the largest relative error ``quant`` puts on the key of any
    real token (``mask [B, T]`` 1) of ``tokens [B, T]`` and KV head."""
    return _probe(nnx.merge(graphdef, params), jnp.asarray(tokens), jnp.asarray(mask), quant)


@dataclasses.dataclass
class QuantErrorWarning:
    """Warns once (through ``log``) when a step's ``kv_quant_key_error`` passes the level's
    :data:`WARN_ERROR`; the warning names the worst layer and the level."""

    quant: str
    log: Callable[[str], None]
    warned: bool = False

    def observe(self, metrics: dict) -> None:
        """Looks at one step's metrics (``kv_quant_key_error`` and ``..._layer``)."""
        error = metrics.get("kv_quant_key_error")
        if self.warned or error is None or float(error) <= WARN_ERROR[self.quant]:
            return
        self.warned = True
        self.log(f"warning: compression.quant={self.quant} moves the keys of layer "
                 f"{int(metrics['kv_quant_key_error_layer'])} by {float(error):.3f} of their norm "
                 f"(threshold {WARN_ERROR[self.quant]}): outlier channels may swamp the per-token "
                 f"scale; the sampler then differs from the learner beyond what the replay shows. "
                 f"Try a finer level (int8, fp8) or quant=none")
