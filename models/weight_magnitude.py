"""The largest |value| of a checkpoint tensor, read from its bits while it is copied: the
plausibility check :func:`models.loading.load_pretrained` applies to every weight."""

from __future__ import annotations

import math

import numpy as np

_MAGNITUDE_BITS = {2: np.uint16(0x7FFF), 4: np.uint32(0x7FFFFFFF),
                   8: np.uint64(0x7FFFFFFFFFFFFFFF)}
"""Every bit but the sign, per float width (BF16 / F16, F32, F64). With the sign cleared,
the bit patterns of IEEE floats order like their magnitudes, +inf above every finite value
and NaN above +inf, so one integer max gives the largest |value| and finiteness at once."""

MAX_ABS_WEIGHT = 1e4
"""Largest |w| a checkpoint tensor may hold (:func:`load_pretrained` refuses more). Trained
LLM weights stay far below: projections and embeddings are O(0.01..1), and the outliers
(norm gains, attention biases) reach the tens to hundreds. A flipped top exponent bit, which
safetensors (no checksums) cannot detect, makes a weight like 0.02 into ~1e36 (F32 / BF16),
and one such value overflows the activations and turns every rollout NaN. The bound leaves
well over an order of magnitude of headroom above real checkpoints and is still some thirty
orders below what such a flip produces. (An F16 checkpoint's flips stay below its 65504
maximum, so only those above the bound are caught there.)"""


def copy_max_abs(src: np.ndarray, out: np.ndarray | None = None,
                  chunk_bytes: int = 1 << 18) -> float:
    """Copy ``src`` into ``out`` (casting) if given, and return the largest |value| of the
    copy (else of ``src``), ``inf`` when any value is NaN or inf, a cache-sized chunk of rows
    at a time: the max reads the sign-cleared bits (:data:`_MAGNITUDE_BITS`) of a chunk just
    written, so it costs no extra pass over memory."""
    dst = src if out is None else out
    mask = _MAGNITUDE_BITS[dst.dtype.itemsize]
    rows = max(1, chunk_bytes // max(1, dst[:1].nbytes))
    peak = mask.dtype.type(0)
    for start in range(0, dst.shape[0], rows):
        part = slice(start, start + rows)
        if out is not None:
            with np.errstate(over="ignore"):  # an overflow becomes inf, reported as such
                np.copyto(out[part], src[part], casting="unsafe")
        bits = np.ascontiguousarray(dst[part]).view(mask.dtype)
        if bits.size:
            peak = max(peak, np.bitwise_and(bits, mask).max())
    value = float(np.array(peak).view(dst.dtype))
    return math.inf if math.isnan(value) else value
