"""Rejection measures: ``correction.rs``, ``correction.rs_threshold`` and
``correction.rs_target_rate``, in verl 0.9's grammar (``rollout_rs`` /
``rollout_rs_threshold``, verl ``rollout_corr_helper.py``).

A measure is ``<aggregation>_<divergence>``: a divergence of
:data:`~sparse_rl_jax.rl.correction_parts.DIVERGENCES` per token (``k1 = -log r``, ``k2 =
(log r)^2 / 2``, ``k3 = r - 1 - log r``, with ``log r`` clamped to +-20), kept per token
(``token``) or aggregated over the response (``seq_sum``, ``seq_mean``, ``seq_max`` of
:data:`~sparse_rl_jax.rl.correction_parts.AGGREGATIONS`): verl's eleven options ``token_k1``
... ``seq_max_k3`` (a maximum bounds no signed divergence, so there is no ``seq_max_k1``).
``rs`` lists one or more, comma-separated (duplicates dropped, ``none`` for no measure); a
token measure rejects tokens, a sequence measure whole sequences, and whatever any measure
rejects leaves the loss.

``rs_threshold`` holds one entry for every measure or one per measure, comma-separated. A k1
entry is a band ``"lower_upper"`` on ``exp(k1) = pi_behaviour / pi_proximal = 1 / r`` (verl
keeps ``log lower <= -log r <= log upper``): ``"0.999_1.001"`` keeps ``1/1.001 <= r <=
1/0.999``; a single number ``u`` is the band ``1/u_u``. A k2 or k3 entry is an upper bound.
YAML reads ``0.5_2`` as the number 0.52 (digit separators): write both bounds with a decimal
point (``0.5_2.0``) or quote them.

``rs_target_rate`` (ours) makes one sequence-level k2 / k3 measure adaptive: each batch it
rejects the sequences whose value exceeds ``max(rs_threshold, the (1 - rs_target_rate)
quantile of the values of the sequences with a loss-mask token)``, so it rejects about that
share of a batch whose mismatch is above the floor and nothing where all of it is below.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from sparse_rl_jax.core.masked_math import masked_quantile
from sparse_rl_jax.rl.correction_parts import AGGREGATIONS, DIVERGENCES


class RejectionSpecError(ValueError):
    """A bad ``rs`` / ``rs_threshold`` / ``rs_target_rate``: ``field`` is the part to name,
    ``rule`` what it must satisfy."""

    def __init__(self, field: str, rule: str):
        self.field, self.rule = field, rule
        super().__init__(f"{field} {rule}")


@dataclasses.dataclass(frozen=True)
class Criterion:
    """One rejection measure with its threshold.

    Attributes:
      option: the measure's name (``seq_mean_k3``).
      aggregation, divergence: its two halves.
      lower: a banded (k1) measure's lower bound on ``exp(value)``; None otherwise.
      upper: the upper bound: on ``exp(value)`` when banded, on the value otherwise (the
        adaptive threshold's floor with ``rs_target_rate``).
    """

    option: str
    aggregation: str
    divergence: str
    lower: float | None
    upper: float

    @property
    def per_sequence(self) -> bool:
        """Whether it rejects whole sequences (any aggregation but ``token``)."""
        return self.aggregation != "token"


def measure_names() -> tuple[str, ...]:
    """Every valid measure (``token_k1`` ... ``seq_max_k3``)."""
    return tuple(f"{agg}_{div}" for agg in AGGREGATIONS.names() for div in DIVERGENCES.names()
                 if not (agg == "seq_max" and DIVERGENCES.get(div).banded))


def _options(rs) -> list[str]:
    """The measures ``rs`` lists, validated, without duplicates (``[]`` for ``none``)."""
    rule = f"must be 'none' or a comma-separated list of {measure_names()}"
    if not isinstance(rs, str):
        raise RejectionSpecError("rs", rule)
    options = list(dict.fromkeys(o.strip() for o in rs.split(",") if o.strip()))
    if options == ["none"]:
        return []
    if not options or any(o not in measure_names() for o in options):
        raise RejectionSpecError("rs", rule)
    return options


def _number(text: str, option: str) -> float:
    """A positive finite bound from ``text`` (one entry of ``rs_threshold``)."""
    try:
        value = float(text)
    except ValueError:
        raise RejectionSpecError("rs_threshold", f"has {text!r} for {option}: not a number"
                                 ) from None
    if not (math.isfinite(value) and value > 0):
        raise RejectionSpecError("rs_threshold", f"has {text!r} for {option}: must be a "
                                                 "positive finite number")
    return value


def _criterion(option: str, spec: str) -> Criterion:
    """``option`` with its threshold entry ``spec``."""
    aggregation, _, divergence = option.rpartition("_")
    if not DIVERGENCES.get(divergence).banded:
        if "_" in spec:
            raise RejectionSpecError("rs_threshold", f"has {spec!r} for {option}: a k2/k3 "
                                                     "measure takes one upper bound, no band")
        return Criterion(option, aggregation, divergence, None, _number(spec, option))
    if "_" in spec:
        low_text, up_text = spec.split("_", 1)
        lower, upper = _number(low_text, option), _number(up_text, option)
    else:
        upper = _number(spec, option)
        lower = 1.0 / upper
    if lower > upper:
        raise RejectionSpecError(
            "rs_threshold", f"has {spec!r} for {option}: the band's lower bound {lower:g} "
            f"exceeds its upper bound {upper:g} (a single k1 bound u is the band 1/u_u, so "
            "u >= 1; YAML reads 0.5_2 as 0.52: write 0.5_2.0)")
    return Criterion(option, aggregation, divergence, lower, upper)


def parse_rejection(rs, rs_threshold, rs_target_rate: float | None = None
                    ) -> tuple[Criterion, ...]:
    """The criteria of ``rs`` with their ``rs_threshold`` entries (the module docstring's
    grammar); ``()`` for ``rs: none``.

    Raises:
      RejectionSpecError: naming ``rs``, ``rs_threshold`` or ``rs_target_rate``.
    """
    options = _options(rs)
    if not options:
        if rs_target_rate is not None:
            raise RejectionSpecError("rs_target_rate", "needs a rejection measure in rs")
        return ()
    if rs_threshold is None:
        raise RejectionSpecError("rs_threshold", f"must be set with rs={rs!r}")
    if isinstance(rs_threshold, bool) or not isinstance(rs_threshold, (str, int, float)):
        raise RejectionSpecError("rs_threshold", "must be a number or a string such as "
                                                 "'0.999_1.001' or '0.5_2.0,0.01'")
    specs = ([str(rs_threshold)] if not isinstance(rs_threshold, str)
             else [s.strip() for s in rs_threshold.split(",") if s.strip()])
    if len(specs) not in (1, len(options)):
        raise RejectionSpecError("rs_threshold", f"must hold one entry for all measures or "
                                                 f"one per measure ({len(options)}: {options})")
    if len(specs) == 1:
        specs = specs * len(options)
    criteria = tuple(_criterion(o, s) for o, s in zip(options, specs))
    if rs_target_rate is not None and not (
            len(criteria) == 1 and criteria[0].per_sequence
            and not DIVERGENCES.get(criteria[0].divergence).banded):
        raise RejectionSpecError("rs_target_rate", f"adapts one sequence-level k2/k3 measure "
                                                   f"(e.g. seq_mean_k3), not rs={rs!r}")
    return criteria


def measure_values(log_r_BxT: jax.Array, valid_BxT: jax.Array, criterion: Criterion
                   ) -> jax.Array:
    """The criterion's value: per token ``[B, T]`` or per sequence ``[B]``."""
    values = DIVERGENCES.get(criterion.divergence).estimate(-log_r_BxT)
    per_seq = AGGREGATIONS.get(criterion.aggregation)(values, valid_BxT)
    return values if per_seq is None else per_seq


def adaptive_threshold(values_B: jax.Array, has_tokens_B: jax.Array, floor: float,
                       target_rate: float) -> jax.Array:
    """``max(floor, the (1 - target_rate) quantile of values over has_tokens)``."""
    return jnp.maximum(floor, masked_quantile(values_B, has_tokens_B, 1.0 - target_rate))


def rejections(log_r_BxT: jax.Array, valid_BxT: jax.Array, criteria: tuple[Criterion, ...],
               target_rate: float | None = None
               ) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """``(tokens_BxT, sequences_B, metrics)``: the loss-mask tokens the token measures
    reject, the non-empty sequences the sequence measures reject (either: any measure), and
    ``rs_adaptive_threshold`` (the threshold chosen this batch) with ``target_rate``."""
    has_tokens = jnp.any(valid_BxT, axis=1)
    tokens = jnp.zeros(valid_BxT.shape, jnp.bool_)
    sequences = jnp.zeros(has_tokens.shape, jnp.bool_)
    metrics = {}
    for criterion in criteria:
        values = measure_values(log_r_BxT, valid_BxT, criterion)
        if DIVERGENCES.get(criterion.divergence).banded:
            out = ((values < math.log(criterion.lower))
                   | (values > math.log(criterion.upper)))
        else:
            upper = criterion.upper
            if target_rate is not None:
                upper = adaptive_threshold(values, has_tokens, upper, target_rate)
                metrics["rs_adaptive_threshold"] = upper
            out = values > upper
        if criterion.per_sequence:
            sequences = sequences | (has_tokens & out)
        else:
            tokens = tokens | (valid_BxT & out)
    return tokens, sequences, metrics
