"""Overlong handling (DAPO): a soft length penalty on the reward, and masking truncated
responses out of the loss."""

from __future__ import annotations

import dataclasses

import numpy as np

from sparse_rl_jax.core.config_checks import check_bool, check_int, check_number


@dataclasses.dataclass(frozen=True)
class OverlongConfig:
    """The ``overlong`` section of a run.

    Attributes:
      buffer_len: DAPO's soft overlong punishment (verl ``overlong_buffer.len``): a response
        longer than ``max_new_tokens - buffer_len`` tokens loses reward linearly, reaching
        ``-penalty`` at ``max_new_tokens``; 0 (default) disables it. Must be below
        ``sampling.max_new_tokens`` (checked by the run config).
      penalty: the penalty at the length cap (verl ``overlong_buffer.penalty_factor``, 1.0).
      mask_truncated: responses that hit ``max_new_tokens`` without EOS are excluded from the
        loss (their loss mask is zeroed; DAPO's "overlong filtering"); their rewards still
        enter the group statistics of the advantages.
    """

    buffer_len: int = 0
    penalty: float = 1.0
    mask_truncated: bool = False

    def __post_init__(self):
        check_int(self, "buffer_len", 0, "must be an int >= 0 (0 = off)")
        check_number(self, "penalty", ge=0)
        check_bool(self, "mask_truncated")


def overlong_penalty(lengths: np.ndarray, max_len: int, cfg: OverlongConfig) -> np.ndarray:
    """DAPO's soft overlong punishment per response, ``[N]`` lengths -> ``[N]`` float32 (<= 0).

    ``min(-(L - (max_len - buffer_len)) / buffer_len * penalty, 0)``: 0 up to
    ``max_len - buffer_len`` tokens, then linear down to ``-penalty`` at ``max_len``. It is
    added to the sequence's reward (DAPO adds it at the last token; with outcome rewards and
    per-sequence advantages that is the same). All zeros when ``buffer_len`` is 0.
    """
    lengths = np.asarray(lengths, np.float64)
    if cfg.buffer_len == 0:
        return np.zeros(lengths.shape, np.float32)
    if cfg.buffer_len >= max_len:
        raise ValueError(f"overlong.buffer_len={cfg.buffer_len} must be < max_new_tokens "
                         f"({max_len})")
    excess = lengths - (max_len - cfg.buffer_len)
    return np.minimum(-excess / cfg.buffer_len * cfg.penalty, 0.0).astype(np.float32)
