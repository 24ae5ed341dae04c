"""The reference policy of the KL term (``loss.kl_coef > 0``): the policy the run started from.

:func:`kl_reference` gives the step a function from the current params to the reference's.
Training every weight, the reference is a frozen copy of the initial params (one more copy
of the weights on the device). With LoRA (``model.lora``) the base weights never change and
fresh adapters add nothing, so the reference is the current params with the adapters turned
off (``models.lora.without_adapters``): no second copy of the base is held.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from models.lora import split_trainable, without_adapters


def kl_reference(params) -> Callable[[Any], Any]:
    """``current params -> reference params`` for a run whose initial params are ``params``
    (an ``nnx.split`` state): ``without_adapters`` when ``params`` holds LoRA adapters, else
    a function returning a copy of ``params`` made now (so donating ``params`` later is
    safe)."""
    if jax.tree.leaves(split_trainable(params)[1]):  # a frozen part: the policy has adapters
        return without_adapters
    initial = jax.tree.map(jnp.copy, params)
    return lambda _: initial
