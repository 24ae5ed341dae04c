"""The pluggable pieces the correction parts pick by name: how a per-token quantity becomes a
per-sequence one (:data:`AGGREGATIONS`), the ratio's level (``correction.is_level`` /
``correction.rs_level``, :data:`RATIO_LEVELS`), the IS weight's mode (``correction.is_mode``,
:data:`IS_MODES`) and the divergences a rejection measure bounds (``correction.rs``,
:data:`DIVERGENCES`).

``CorrectionConfig`` takes its allowed values from these registries, ``compute_corrections``
and ``rejection_measures`` call the registered entries. A new level, mode, aggregation or
divergence is one function (or entry) plus its registration.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from models.registry import Registry
from sparse_rl_jax.core.masked_math import masked_max, masked_mean, masked_sum
from sparse_rl_jax.rl.loss_terms import KL_ESTIMATORS

AGGREGATIONS: Registry[Callable[[jax.Array, jax.Array], jax.Array | None]] = Registry(
    "aggregation")
"""``aggregate(x_BxT, valid_BxT) -> per-sequence value [B]``, or None at the token level
(each token keeps its own); rows without a valid token get 0."""

RATIO_LEVELS: Registry[Callable[[jax.Array, jax.Array], jax.Array | None]] = Registry(
    "correction level")
"""``level(log_r_BxT, valid_BxT) -> per-sequence log ratio [B]``, or None at the token level:
the :data:`AGGREGATIONS` entry that level applies to ``log r``."""

IS_MODES: Registry[Callable[[jax.Array, float, float], tuple[jax.Array, jax.Array]]] = Registry(
    "IS mode")
"""``mode(r_BxT, lower, upper) -> (weights_BxT, altered_BxT)``: the IS weight at the ratios
``r`` and the bool positions whose weight differs from ``r`` (truncated or zeroed)."""


@dataclasses.dataclass(frozen=True)
class Divergence:
    """A per-token divergence between the sampler and the learner, from ``d = log(pi_behaviour
    / pi_proximal) = -log r`` (verl's rejection estimators; the same formulas as the KL
    penalty's ``loss_terms.KL_ESTIMATORS`` with the sampler as the sampling policy).

    Attributes:
      estimate: ``d_BxT -> divergence_BxT``.
      banded: the value is signed (k1 = d), so its threshold is a ``lower_upper`` band on
        ``exp(value)`` and no maximum over a sequence bounds it; otherwise (k2, k3, >= 0) the
        threshold is an upper bound.
    """

    estimate: Callable[[jax.Array], jax.Array]
    banded: bool


DIVERGENCES: Registry[Divergence] = Registry("rejection divergence")
"""verl's ``k1`` (``-log r``, banded), ``k2`` (``(log r)^2 / 2``) and ``k3`` (``r - 1 - log r``)."""

for _name in ("k1", "k2", "k3"):
    DIVERGENCES.register(_name, Divergence(KL_ESTIMATORS.get(_name), banded=_name == "k1"))


@AGGREGATIONS.register("token")
def token_aggregate(x: jax.Array, valid: jax.Array) -> None:
    """Each token keeps its own value."""
    del x, valid


@AGGREGATIONS.register("seq_sum")
def seq_sum(x: jax.Array, valid: jax.Array) -> jax.Array:
    """The sum over the response's valid tokens."""
    return masked_sum(x, valid, axis=1)


@AGGREGATIONS.register("seq_mean")
def seq_mean(x: jax.Array, valid: jax.Array) -> jax.Array:
    """The mean over the response's valid tokens."""
    return masked_mean(x, valid, axis=1)


@AGGREGATIONS.register("seq_max")
def seq_max(x: jax.Array, valid: jax.Array) -> jax.Array:
    """The maximum over the response's valid tokens."""
    return masked_max(x, valid, axis=1)


RATIO_LEVELS.register("token", token_aggregate)
RATIO_LEVELS.register("sequence", seq_sum)  # log prod_t r_t
RATIO_LEVELS.register("geometric", seq_mean)  # the log of the geometric mean


def level_log_ratio(log_r_BxT: jax.Array, valid_BxT: jax.Array, level: str, clamp: float
                    ) -> jax.Array:
    """Token log ratios -> the log ratio of ``level`` at every token ``[B, T]`` (0 off the
    mask); a per-sequence aggregate is clamped to ``[-clamp, clamp]`` and broadcast."""
    per_seq = RATIO_LEVELS.get(level)(log_r_BxT, valid_BxT)
    if per_seq is None:
        return log_r_BxT
    per_seq = jnp.clip(per_seq, -clamp, clamp)
    return jnp.where(valid_BxT, per_seq[:, None], 0.0)


def is_sequence_level(level: str) -> bool:
    """Whether ``level`` aggregates over the sequence (its rejection drops whole sequences)."""
    return level != "token"


@IS_MODES.register("truncate")
def truncate(r: jax.Array, lower: float, upper: float) -> tuple[jax.Array, jax.Array]:
    """TIS: ``min(r, upper)`` (``lower`` unused)."""
    del lower
    return jnp.minimum(r, upper), r > upper


@IS_MODES.register("mask")
def mask(r: jax.Array, lower: float, upper: float) -> tuple[jax.Array, jax.Array]:
    """MIS / IcePop: ``r`` inside ``[lower, upper]``, 0 outside (the position stays in the
    loss mask; only its weight is zero)."""
    outside = (r < lower) | (r > upper)
    return jnp.where(outside, 0.0, r), outside


@IS_MODES.register("raw")
def raw(r: jax.Array, lower: float, upper: float) -> tuple[jax.Array, jax.Array]:
    """The ratio itself, neither truncated nor zeroed (NeMo-RL's ``seq-mask-tis`` and AReaL's
    sequence IS keep it raw and bound it by rejection instead; bounds unused)."""
    del lower, upper
    return r, jnp.zeros(r.shape, jnp.bool_)
