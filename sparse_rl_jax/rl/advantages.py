"""Per-sequence advantages from outcome rewards: GRPO, Dr.GRPO, RLOO and REINFORCE++.

The rollout batch is laid out as ``N / group_size`` consecutive groups of ``group_size``
samples of the same prompt. Every estimator returns one advantage per sequence, which the loss
broadcasts to the sequence's tokens.

REINFORCE++ (verl ``reinforce_plus_plus``, OpenRLHF ``reinforce``) is defined per token: the
discounted return of each token, whitened over the batch's valid tokens. With an outcome
reward (given at the last token) and gamma = 1, every token of sequence ``i`` has return
``R_i``, so the per-token advantage is one value per sequence; whitening over *tokens* then
means sequence ``i`` weighs ``L_i`` (its number of response tokens) in the batch mean and
variance. That is what :func:`compute_advantages` does, so its per-sequence output broadcast to
the tokens equals the per-token definition exactly.

Each estimator is an :class:`Estimator` registered in :data:`ESTIMATORS` next to its function;
``AdvantageConfig`` takes its allowed values from there, so a new estimator is one function
plus its registration (:func:`register_estimator`).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Callable

import jax
import jax.numpy as jnp

from models.registry import Registry
from models.shapes import check_shape
from sparse_rl_jax.core.config_checks import check, check_choice, check_number

SCALES = ("group", "batch", "none")


@dataclasses.dataclass(frozen=True)
class Estimator:
    """One advantage estimator and the config rules it implies.

    Attributes:
      fn: ``fn(rewards, group_size, cfg, response_mask, valid) -> [N]`` float32: rewards
        ``[N]`` float32, ``group_size`` > 1 when ``uses_group``, the ``AdvantageConfig``,
        ``response_mask`` ``[N, T]`` or None, ``valid`` ``[N]`` bool (0 on invalid rows).
      default_scale: the ``scale`` it uses when ``scale`` is left unset.
      scales: the scales it defines; ``scale_rule`` says why when it is not all of ``SCALES``.
      scale_rule: the words of the error for a scale outside ``scales``.
      uses_group: it needs a group baseline (groups of one give 0, with a warning).
    """

    fn: Callable[..., jax.Array]
    default_scale: str
    scales: tuple[str, ...] = SCALES
    scale_rule: str = ""
    uses_group: bool = True


ESTIMATORS: Registry[Estimator] = Registry("advantage estimator")


def register_estimator(name: str, *, default_scale: str, scales: tuple[str, ...] = SCALES,
                       scale_rule: str = "", uses_group: bool = True):
    """Decorator: registers its function as the advantage estimator ``name`` (selectable as
    ``advantage.estimator``; the keywords are :class:`Estimator`'s)."""
    def register(fn):
        ESTIMATORS.register(name, Estimator(fn, default_scale, scales, scale_rule, uses_group))
        return fn
    return register


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
    """Which advantage estimator the RL step uses (the ``advantage`` section of a run).

    Attributes:
      estimator: a registered estimator (:data:`ESTIMATORS`): ``grpo`` (``R - mean_G``, verl/TRL ``grpo``), ``rloo`` (leave-one-out
        baseline ``R_i - mean_{j != i} R_j = n/(n-1) (R_i - mean_G)``, verl ``rloo``),
        ``reinforce_pp`` (returns whitened over the batch's valid tokens, verl
        ``reinforce_plus_plus``), ``reinforce_pp_baseline`` (group mean subtracted first,
        then whitened; verl ``reinforce_plus_plus_baseline``).
      scale: what the centred reward is divided by. ``group``: the group's reward std (ddof
        1); ``batch``: the batch's reward std (ddof 1; TRL ``scale_rewards="batch"``);
        ``none``: nothing (Dr.GRPO is ``estimator: grpo, scale: none``; TRL
        ``scale_rewards="none"``). For ``reinforce_pp*`` only ``batch`` (token-weighted
        whitening, mean shifted too) is defined. None (default) picks the estimator's own:
        grpo -> group, rloo -> none, reinforce_pp* -> batch.
      eps: added to the std in every denominator, ``/ (std + eps)`` (verl/slime 1e-6; TRL uses
        1e-4; verl's whitening uses ``rsqrt(var + 1e-8)``, a negligible difference).
    """

    estimator: str = "grpo"
    scale: str | None = None
    eps: float = 1e-6

    def __post_init__(self):
        check_choice(self, "estimator", ESTIMATORS.names())
        check_choice(self, "scale", SCALES, optional=True)
        estimator = ESTIMATORS.get(self.estimator)
        if self.scale is None:
            object.__setattr__(self, "scale", estimator.default_scale)
        check(self.scale in estimator.scales, self, "scale",
              f"is not defined for estimator={self.estimator!r}: {estimator.scale_rule}")
        check_number(self, "eps", gt=0)


def _check_inputs(rewards: jax.Array, group_size: int) -> int:
    check_shape("rewards", rewards, N=None)
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
    n = rewards.shape[0]
    if n % group_size != 0:
        raise ValueError(
            f"rewards length {n} is not a multiple of group_size {group_size} "
            "(expected N/G consecutive groups of G samples)"
        )
    return n


def _group_centered(rewards: jax.Array, group_size: int) -> jax.Array:
    """``R - mean_G R`` as ``[N / G, G]``; exactly 0 for an all-equal group."""
    groups = rewards.reshape(-1, group_size)
    # Shift by each group's first reward first: a float mean of equal values can be off by an
    # ulp, which a tiny std would then blow up; after the shift the mean is exactly 0.
    groups = groups - groups[:, :1]
    return groups - jnp.mean(groups, axis=1, keepdims=True)


def group_advantages(rewards: jax.Array, group_size: int, eps: float = 1e-6) -> jax.Array:
    """GRPO: ``A_i = (R_i - mean_G R) / (std_G R + eps)``; rewards ``[N]`` -> ``[N]`` float32.

    ``std_G`` is the *unbiased* sample standard deviation (ddof=1), as ``torch.Tensor.std`` in
    the official slime / verl GRPO code. A group whose rewards are all equal gets advantage
    exactly 0 (numerator 0, denominator eps), never NaN. Groups of one get 0 (with a warning).
    """
    return compute_advantages(rewards, group_size, AdvantageConfig(eps=eps))


def _weighted_centre(x: jax.Array, weight: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(x - mu, sigma)``: mean and unbiased std of ``x`` `[N]` weighted by ``weight`` `[N]`
    (how many tokens or sequences each value stands for); ``x - mu`` is exactly 0 when every
    weighted value is equal."""
    x = x - x[jnp.argmax(weight > 0)]  # shift by a weighted value first: exact zeros
    total = jnp.sum(weight)
    centred = x - jnp.sum(weight * x) / jnp.maximum(total, 1.0)
    var = jnp.sum(weight * centred**2) / jnp.maximum(total - 1.0, 1.0)
    return centred, jnp.sqrt(var)


def _scaled(out: jax.Array, centered: jax.Array, rewards: jax.Array, group_size: int,
            cfg: AdvantageConfig, valid: jax.Array) -> jax.Array:
    """``out`` ``[N / G, G]`` divided by ``cfg.scale``'s std (of the ``centered`` group rewards,
    or of the valid batch ``rewards``), as ``[N]``, 0 on invalid rows."""
    if cfg.scale == "group":
        std = jnp.sqrt(jnp.sum(centered * centered, axis=1, keepdims=True) / (group_size - 1))
        out = out / (std + cfg.eps)
    elif cfg.scale == "batch":
        out = out / (_weighted_centre(rewards, valid.astype(jnp.float32))[1] + cfg.eps)
    return jnp.where(valid, out.reshape(rewards.shape[0]), 0.0)


@register_estimator("grpo", default_scale="group")
def grpo(rewards, group_size, cfg, response_mask, valid) -> jax.Array:
    """GRPO: ``(R_i - mean_G R) / s``."""
    del response_mask
    centered = _group_centered(rewards, group_size)
    return _scaled(centered, centered, rewards, group_size, cfg, valid)


@register_estimator("rloo", default_scale="none")
def rloo(rewards, group_size, cfg, response_mask, valid) -> jax.Array:
    """RLOO: the leave-one-out baseline, ``n/(n-1) (R_i - mean_G R) / s``."""
    del response_mask
    centered = _group_centered(rewards, group_size)
    return _scaled(centered * (group_size / (group_size - 1)), centered, rewards, group_size,
                   cfg, valid)


def _token_whitened(x: jax.Array, cfg: AdvantageConfig, response_mask: jax.Array | None,
                    valid: jax.Array) -> jax.Array:
    """``x`` ``[N]`` whitened over the batch's valid tokens (each row weighs its response
    length), 0 on invalid rows; ValueError without ``response_mask``."""
    n = x.shape[0]
    if response_mask is None:
        raise ValueError(f"advantage.estimator={cfg.estimator!r} needs response_mask "
                         f"[{n}, T] (whitening over valid tokens)")
    check_shape("response_mask", response_mask, N=n, T=None)
    lengths = jnp.sum(jnp.asarray(response_mask) != 0, axis=1).astype(jnp.float32)
    centred, std = _weighted_centre(x, jnp.where(valid, lengths, 0.0))
    return jnp.where(valid, centred / (std + cfg.eps), 0.0)


_WHITENS = "REINFORCE++ whitens over the batch's tokens (scale 'batch' or unset)"


@register_estimator("reinforce_pp", default_scale="batch", scales=("batch",),
                    scale_rule=_WHITENS, uses_group=False)
def reinforce_pp(rewards, group_size, cfg, response_mask, valid) -> jax.Array:
    """REINFORCE++: the rewards whitened over the batch's valid tokens."""
    del group_size
    return _token_whitened(rewards, cfg, response_mask, valid)


@register_estimator("reinforce_pp_baseline", default_scale="batch", scales=("batch",),
                    scale_rule=_WHITENS)
def reinforce_pp_baseline(rewards, group_size, cfg, response_mask, valid) -> jax.Array:
    """REINFORCE++ with a baseline: the group-centred rewards whitened over the batch's valid
    tokens."""
    centered = _group_centered(rewards, group_size).reshape(rewards.shape[0])
    return _token_whitened(centered, cfg, response_mask, valid)


def compute_advantages(
    rewards: jax.Array,
    group_size: int,
    cfg: AdvantageConfig = AdvantageConfig(),
    response_mask: jax.Array | None = None,
    valid: jax.Array | None = None,
) -> jax.Array:
    """Per-sequence advantages ``[N]`` (float32) of ``cfg.estimator`` / ``cfg.scale``.

    Args:
      rewards: ``[N]`` outcome rewards, ``N / group_size`` consecutive groups.
      group_size: samples per prompt (static). Groups of one have no baseline: every
        estimator that uses a group gives them 0, with a warning.
      cfg: the estimator (static; one registered in :data:`ESTIMATORS`).
      response_mask: ``[N, T]`` response tokens; needed by ``reinforce_pp*``, whose
        whitening weighs each sequence by its token count (see the module docstring).
      valid: ``[N]`` bool, False for rows that are only padding (dynamic sampling): they get
        0 and stay out of every batch statistic. Padding must come in whole groups.

    Returns:
      ``grpo``: ``c_i / s``; ``rloo``: ``n/(n-1) c_i / s``; with ``c_i = R_i - mean_G R`` and
      ``s`` the group std, the batch reward std, or 1 (``scale``). ``reinforce_pp``:
      token-weighted whitening of ``R``; ``reinforce_pp_baseline``: of ``c``. An all-equal
      group gives exactly 0 under ``grpo`` / ``rloo``; under ``reinforce_pp*`` the batch
      whitening shifts by the batch mean, so only an all-equal *batch* gives exactly 0.
    """
    rewards = jnp.asarray(rewards)
    n = _check_inputs(rewards, group_size)
    rewards = rewards.astype(jnp.float32)
    valid = jnp.ones((n,), jnp.bool_) if valid is None else jnp.asarray(valid, jnp.bool_)
    check_shape("valid", valid, N=n)
    estimator = ESTIMATORS.get(cfg.estimator)
    if estimator.uses_group and group_size == 1:
        warnings.warn(f"advantage.estimator={cfg.estimator!r} with groups of one sample: no "
                      "baseline exists, every advantage is 0", stacklevel=2)
        return jnp.zeros((n,), jnp.float32)
    return estimator.fn(rewards, group_size, cfg, response_mask, valid)
