"""Quantized keys and values: the codes a cache stores and the scale of each token.

A KV cache may hold its keys and values as low-precision *codes* with one scale per token
and KV head (per vector of ``D`` values), computed when the token is written (absmax:
``scale = max |x| / qmax``, ``code = x / scale`` rounded into the format). Attention reads
``code * scale``. A format is a :class:`KVQuant` registered in :data:`KV_QUANTS` by the name
``compression.quant`` takes:

- ``"none"``: no codes, the cache's own dtype (bf16 / f32); no scales.
- ``"int8"``: int8 codes in ``[-127, 127]``, rounded to nearest.
- ``"fp8"``: ``float8_e4m3fn`` codes in ``[-448, 448]`` (round to nearest even).
- ``"int4"``: codes in ``[-7, 7]``, two per byte (``uint8``: value ``+ 8`` in each nibble,
  even index low), so the stored last axis is ``D / 2`` and ``D`` must be even.

Scales are bfloat16 (:data:`SCALE_DTYPE`): float32's exponent range in 2 bytes, so no
finite vector gets a subnormal or a capped scale (float16 scales, before, were subnormal
for int8 vectors below ``max |x|`` ~ 7.8e-3, losing precision, and capped above ~8e6; fp8
codes then overflowed to NaN). The scale is ``max |x| / qmax`` floored at ``2**-126`` (the
smallest normal float32) and rounded to bfloat16; the codes are computed against that
rounded scale, so its rounding (at most ``2**-8`` of it) moves only the clipped largest
element. Per element, for every finite ``x`` with ``max |x| <= 1e38``::

    |decode(encode(x)) - x| <= b * max|x| + 2**-126,
    b = (1 + 2**-8) / 254 (int8, 0.396%), (1 + 2**-8) / 14 (int4, 7.17%), 2**-4 (fp8, 6.25%)

(half a code step, or fp8's 3 mantissa bits; the ``2**-126`` matters only for vectors below
``qmax * 2**-126``, ~1.5e-36 at int8, whose scale is the floor, and for float32 subnormal
elements, which XLA may read as zero). No encode or decode of a finite vector gives NaN or
inf. Per token and KV head at ``D = 128``: int8 stores 128 + 2 bytes where bf16 stores 256
(1.97x the tokens in the same bytes), int4 64 + 2 (3.88x).

:func:`fake_quant` (``decode(encode(x))``) is what a full forward replaying a quantized
rollout applies to its own keys and values, so the learner's replay quantizes the way the
sampler's cache did: the same function of the same inputs gives the same codes. The
rounding is written as arithmetic (:func:`round_to_e4m3fn`, ``lax.reduce_precision``), not
as a float cast read back, because XLA may drop a ``float32 -> narrow -> float32`` round trip
inside one program (XLA:GPU does under its default ``xla_allow_excess_precision``), which
would leave the replay unrounded where the sampler's stored codes are rounded. The inputs
themselves differ: the sampler's decode steps and the learner's full forward compute the
keys and values in different programs, whose float32 results can differ in the last ulp,
so an element within that of a rounding boundary gets the neighbouring code on one side
(one code step; tests/test_kv_quant_replay.py bounds what that does to the log-probs).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from models.registry import Registry

SCALE_DTYPE = jnp.bfloat16
"""The dtype of the per-token, per-KV-head scales a quantized cache stores."""

SCALE_FLOOR = float(jnp.finfo(jnp.float32).tiny)
"""The smallest scale (``2**-126``): an all-zero or tiny vector's, never a subnormal one."""


def round_to_e4m3fn(y: jax.Array) -> jax.Array:
    """float32 ``y`` in ``[-448, 448]`` rounded to the nearest ``float8_e4m3fn`` value (ties to
    even), in float32: 3 mantissa bits, spacing ``2**-9`` below the smallest normal ``2**-6``.
    Exact integer and power-of-two arithmetic, with no float8 round trip for XLA to drop
    (see the module docstring); ``.astype(float8_e4m3fn)`` of the result is exact."""
    exponent = ((jax.lax.bitcast_convert_type(y, jnp.int32) >> 23) & 0xFF) - 127
    spacing = jnp.maximum(exponent - 3, -9)  # log2 of the e4m3fn spacing at |y|
    return jnp.round(y * _power_of_two(-spacing)) * _power_of_two(spacing)


def _power_of_two(e: jax.Array) -> jax.Array:
    """float32 ``2**e`` of int32 ``e`` in ``[-126, 127]``, built from its exponent bits."""
    return jax.lax.bitcast_convert_type((e + 127) << 23, jnp.float32)


@dataclasses.dataclass(frozen=True)
class KVQuant:
    """One code format.

    Attributes:
      name: the ``compression.quant`` value.
      code_dtype: the stored dtype (None: no codes, the cache keeps its own dtype).
      qmax: the largest code magnitude (the absmax maps to it).
      per_byte: values per stored element along ``D`` (2: int4 packs two per byte).
    """

    name: str
    code_dtype: object | None
    qmax: float = 0.0
    per_byte: int = 1

    @property
    def quantizes(self) -> bool:
        """False for ``none`` (full precision, no scales)."""
        return self.code_dtype is not None

    def stored_dim(self, head_dim: int) -> int:
        """The stored last axis for ``head_dim`` values (``head_dim / per_byte``)."""
        return head_dim // self.per_byte

    def bytes_per_token(self, head_dim: int, dtype) -> int:
        """Bytes of one token's key (or value) vector of one KV head, its scale included;
        ``dtype`` is the cache's own dtype (what ``none`` stores)."""
        if not self.quantizes:
            return head_dim * jnp.dtype(dtype).itemsize
        return (self.stored_dim(head_dim) * jnp.dtype(self.code_dtype).itemsize
                + jnp.dtype(SCALE_DTYPE).itemsize)

    def check_head_dim(self, head_dim: int, who: str) -> None:
        """ValueError naming ``who`` when ``head_dim`` cannot be packed (odd for int4)."""
        if head_dim % self.per_byte:
            raise ValueError(f"{who}: quant {self.name!r} packs {self.per_byte} values per "
                             f"byte and needs head_dim divisible by {self.per_byte}, got "
                             f"{head_dim}; use one of {fitting_quants(head_dim)}")

    def encode(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``(codes [..., D / per_byte], scale [...] SCALE_DTYPE)`` of ``x [..., D]`` (finite);
        ValueError naming head_dim when ``D`` cannot be packed (odd for int4)."""
        self.check_head_dim(x.shape[-1], f"KVQuant.encode of x {tuple(x.shape)}")
        x = x.astype(jnp.float32)
        wide = jnp.maximum(jnp.max(jnp.abs(x), axis=-1) / self.qmax, SCALE_FLOOR)
        scale = jax.lax.reduce_precision(wide, exponent_bits=8, mantissa_bits=7)  # bfloat16's
        y = jnp.clip(x / scale[..., None], -self.qmax, self.qmax)
        if self.code_dtype == jnp.float8_e4m3fn:
            return round_to_e4m3fn(y).astype(jnp.float8_e4m3fn), scale.astype(SCALE_DTYPE)
        codes = jnp.round(y).astype(jnp.int8)
        if self.per_byte == 2:
            nibbles = (codes + 8).astype(jnp.uint8)
            codes = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
        return codes, scale.astype(SCALE_DTYPE)

    def decode(self, codes: jax.Array, scale: jax.Array, dtype) -> jax.Array:
        """``x [..., D]`` in ``dtype`` from ``codes [..., D / per_byte]`` and ``scale [...]``."""
        if self.per_byte == 2:
            low = (codes & 15).astype(jnp.int8) - 8
            high = (codes >> 4).astype(jnp.int8) - 8
            codes = jnp.stack([low, high], axis=-1).reshape(*codes.shape[:-1], -1)
        return (codes.astype(jnp.float32) * scale.astype(jnp.float32)[..., None]).astype(dtype)

    def fake(self, x: jax.Array) -> jax.Array:
        """``decode(encode(x))`` in ``x``'s dtype; ``x`` itself for ``none``."""
        if not self.quantizes:
            return x
        return self.decode(*self.encode(x), x.dtype)


KV_QUANTS: Registry[KVQuant] = Registry("KV quant level")
for _quant in (KVQuant("none", None), KVQuant("int8", jnp.int8, 127.0),
               KVQuant("fp8", jnp.float8_e4m3fn, 448.0), KVQuant("int4", jnp.uint8, 7.0, 2)):
    KV_QUANTS.register(_quant.name, _quant)


def get_quant(name: str) -> KVQuant:
    """The format registered as ``name`` (ValueError listing the registered ones)."""
    return KV_QUANTS.get(name)


def fitting_quants(head_dim: int) -> tuple[str, ...]:
    """The registered formats that can store vectors of ``head_dim`` values."""
    return tuple(n for n in KV_QUANTS.names() if head_dim % KV_QUANTS.get(n).per_byte == 0)


def fake_quant(name: str, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Keys and values ``[..., D]`` as a ``name``-quantized cache would return them."""
    quant = get_quant(name)
    return quant.fake(k), quant.fake(v)
