"""The run config's ``model`` section: which policy to train, in which dtype, with which
rematerialisation, adapters and decode attention (``RunConfig.model``)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from models.attention_backends import (KernelShapes, attention_choices, attention_error,
                                       resolve_attention)
from models.decoder import REMAT_POLICIES
from sparse_rl_jax.core.config_checks import FieldError, check_choice
from sparse_rl_jax.rl.lora_config import LoraConfig


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """Which policy to train.

    Attributes:
      path: a local HF checkpoint directory (config.json, safetensors, tokenizer). None
        builds the embedded default: a tiny Qwen2-shaped model warm-started on the shipped
        task (see ``warm_start``) and cached in the run directory.
      dtype: parameter and compute dtype (``float32`` or ``bfloat16``).
      remat: activation rematerialisation of the layer scan in the update's backward pass:
        ``none``, ``full`` (keep each layer's input only) or ``dots_saveable`` (keep matmul
        outputs); see ``models.decoder.REMAT_POLICIES``. Same values, less memory, more time.
      lora: train low-rank adapters instead of the weights (:class:`LoraConfig`); None
        (the default) trains every weight.
      attention: how decode steps read the paged KV cache: ``xla`` (the default until the
        kernels are measured on a GPU and a TPU), ``auto`` (the Pallas page kernel of this
        platform, ``pallas_gpu`` or ``pallas_tpu``, where it takes the model's heads and
        ``compression.page_size``; XLA elsewhere), or a kernel by name (an error off its
        platform, or for shapes it cannot take: :meth:`backend`, once the model's config is
        read, before anything compiles; not here, where touching the JAX backend would come
        before ``jax.distributed.initialize``).
    """

    path: str | None = None
    dtype: Literal["float32", "bfloat16"] = "float32"
    remat: Literal["none", "full", "dots_saveable"] = "none"
    lora: LoraConfig | None = None
    attention: Literal["auto", "xla", "pallas_gpu", "pallas_tpu"] = "xla"

    def __post_init__(self):
        check_choice(self, "dtype", ("float32", "bfloat16"))
        check_choice(self, "remat", REMAT_POLICIES)
        check_choice(self, "attention", attention_choices())

    def backend(self, platform: str, model_config, page_size: int, quant: str = "none") -> str:
        """The attention backend ``attention`` selects on ``platform`` for a model of
        ``model_config`` (``models.ModelConfig``) paged in ``page_size``-token pages of KV
        stored as ``quant`` (``compression.quant``); :class:`FieldError` naming
        ``model.attention``, why and the choices that work here when the kernel cannot run
        there or take those shapes (``auto`` falls back to XLA)."""
        shapes = KernelShapes(page_size, model_config.num_heads, model_config.num_kv_heads,
                              model_config.head_dim, quant)
        problem = attention_error(self.attention, platform, shapes)
        if problem is not None:
            raise FieldError("model", "attention", problem, self.attention)
        return resolve_attention(self.attention, platform, shapes)
