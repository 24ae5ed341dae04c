"""The seam between the decoder and whatever holds or filters its keys: a *KV view*.

Every attention block hands its layer's new queries, keys and values to the view,
``out, view = view.attend(layer, q, k, v, q_pos, backend)``, and the view decides which keys
those queries see (writing them into a cache first, if it is one). The decoder knows no cache
layout, no eviction record and no page selection; it only scans the layers and carries the view.

Protocol (:class:`KVView`; every view is a ``flax.struct`` pytree):

- ``attend(layer, q, k, v, q_pos, backend) -> (out, view)``: ``q [B, T, Hq, D]`` (after
  qk-norm and RoPE), ``k, v [B, Hkv, T, D]`` (after RoPE), ``q_pos [B, T]`` int32 positions
  (``-1`` padding), ``layer`` the traced layer index, ``backend`` the name of a registered
  ``models.attention_backends.AttentionBackend``; ``out [B, T, Hq, D]``.
- ``check(config, batch, t, backend)``: ValueError naming the field that does not fit a
  forward of ``[batch, t]`` tokens, or the backend when it is unknown or cannot attend through
  this view (called before any compute).
- ``position_offset``: position of the first token when the caller passes none (a cache's
  write index; 0 for a full forward).
- ``begin_forward(positions)``: the view before the first layer of a forward of positions
  ``[B, T]`` (the decoder calls it once, before the layer scan: a cache writes the new tokens'
  positions here, once for all layers; a full forward returns itself).
- ``end_forward(t)``: the view after all layers saw ``t`` tokens (a cache advances its index;
  the page-sparse cache also refreshes the mean keys of the pages the forward wrote).

Fields declared with :func:`layer_field` hold ``[L, ...]`` read-only per-layer arrays: the
decoder scans them with the layers (``attend`` sees one layer's slice, so no layer's data is
carried through the scan or saved per layer for the backward); every other field is carried
through the scan and may be updated in place at ``layer``.

Views of a full forward (no cache; keys are the ``T`` tokens themselves), in this module:
:class:`Causal` (the default), :class:`ExpiryRecord` (an eviction record replayed as key
expiry times) and :class:`MaskRecord` (an explicit boolean mask, the general case); in
``models.page_sparse``, ``PageReplay`` (a page-sparse selection replayed); :class:`QuantProbe`
measures what KV quantization would do to the keys. Views of a rollout
cache: ``models.cache.KVCache`` (the slot cache; dense and budget layouts are capacities of
it; optionally holding the ring of the last ``W`` queries an eviction policy scores with),
``models.paged_cache.PagedKVCache`` (the paged layout of dense and Sparrow rollouts: one
position array for all layers, decode reads only the filled pages) and
``models.page_sparse.PageSparseCache`` (Sparrow: a paged cache and its page-mean keys) and
``models.page_pool.PagePoolCache`` (the paged layout's pages drawn from one pool shared by
the rows, through per-row page tables: a continuous-batching engine's rows;
``PageSparseCache`` may wrap it).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import struct

from models.attention_backends import attention, get_backend, visibility_backend
from models.kv_quant import fake_quant
from models.shapes import check_shape


class KVView(Protocol):
    """What the decoder's attention blocks call (see the module docstring)."""

    @property
    def position_offset(self) -> jax.Array | int:
        """Position of the first token of a forward whose caller passes no positions."""

    def check(self, config, batch: int, t: int, backend: str) -> None:
        """Reject a view that does not fit a forward of ``[batch, t]`` tokens (ValueError)."""

    def attend(self, layer: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array,
               q_pos: jax.Array, backend: str) -> tuple[jax.Array, KVView]:
        """One layer's attention output ``[B, T, Hq, D]`` and the updated view."""

    def begin_forward(self, positions: jax.Array) -> KVView:
        """The view before the first layer of a forward of positions ``[B, T]``."""

    def end_forward(self, t: int) -> KVView:
        """The view after every layer saw the forward's ``t`` tokens."""


def layer_field(**kwargs) -> Any:
    """A view field holding ``[L, ...]`` per-layer read-only data, scanned with the layers."""
    return struct.field(pytree_node=True, metadata={"per_layer": True}, **kwargs)


def split_layers(view: KVView) -> tuple[KVView, dict[str, Any]]:
    """``(carried, per_layer)``: the view with its :func:`layer_field` fields set to None,
    and those fields by name (each ``[L, ...]``, scanned by the decoder)."""
    names = [f.name for f in dataclasses.fields(view) if f.metadata.get("per_layer")]
    per_layer = {name: getattr(view, name) for name in names}
    return view.replace(**{name: None for name in names}), per_layer


def join_layers(carried: KVView, per_layer: dict[str, Any]) -> KVView:
    """Inverse of :func:`split_layers` (``per_layer`` may hold one layer's slices)."""
    return carried.replace(**per_layer)


def self_keys(q_pos: jax.Array, k: jax.Array) -> jax.Array:
    """Key positions ``[B, Hkv, T]`` of a full forward's own keys ``k [B, Hkv, T, D]``."""
    return jnp.broadcast_to(q_pos[:, None, :], k.shape[:3])


class FullForward:
    """Shared parts of the full-forward views (keys are the forward's own tokens). Each has a
    static ``quant`` field (a ``models.kv_quant`` format, ``"none"`` by default): a view
    replaying a quantized rollout attends over its keys and values quantized and decoded, as
    the rollout's cache returned them."""

    position_offset = 0

    def own_kv(self, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The forward's keys and values as this view's rollout cache held them."""
        return fake_quant(self.quant, k, v)

    def begin_forward(self, positions: jax.Array):
        """Nothing to write before the layers: a full forward keeps no state."""
        del positions
        return self

    def end_forward(self, t: int):
        """Nothing to advance: a full forward keeps no state."""
        del t
        return self


@struct.dataclass
class Causal(FullForward):
    """Plain causal (+ padding) attention over the forward's own tokens; the only view a
    backend without per-key visibility (``"fused"``) takes. With ``quant`` it replays a
    quantized rollout that evicted nothing."""

    quant: str = struct.field(pytree_node=False, default="none")

    def check(self, config, batch: int, t: int, backend: str) -> None:
        """Any registered backend fits a full causal forward."""
        get_backend(backend, "Causal")

    def attend(self, layer, q, k, v, q_pos, backend):
        """Causal attention of ``q [B, T, Hq, D]`` over ``k, v [B, Hkv, T, D]``."""
        del layer
        return attention(q, *self.own_kv(k, v), q_pos, self_keys(q_pos, k),
                         backend=backend), self


@struct.dataclass
class ExpiryRecord(FullForward):
    """An eviction record replayed by a full forward: key ``s`` is hidden from queries at
    positions ``>= expiry[..., s]``.

    Attributes:
      expiry: ``[L, B, Hkv, T]`` int32 per-key expiry position (``2**30``-ish = never).
    """

    expiry: jax.Array = layer_field()
    quant: str = struct.field(pytree_node=False, default="none")

    def check(self, config, batch: int, t: int, backend: str) -> None:
        """``expiry`` must be ``[L, B, Hkv, T]``; the backend must take per-key visibility."""
        check_shape("ExpiryRecord.expiry", self.expiry, L=config.num_layers, B=batch,
                    Hkv=config.num_kv_heads, S=t)
        visibility_backend(backend, "ExpiryRecord")

    def attend(self, layer, q, k, v, q_pos, backend):
        """Causal attention with this layer's expiry ``[B, Hkv, T]``."""
        del layer
        return attention(q, *self.own_kv(k, v), q_pos, self_keys(q_pos, k),
                         k_expiry=self.expiry, backend=backend), self


@struct.dataclass
class MaskRecord(FullForward):
    """An arbitrary visibility replayed by a full forward: ``mask`` ANDed into the causal rule.
    Holds ``[T, T]`` per layer, row and head: for small cases and as the tests' oracle; the
    compact records (:class:`ExpiryRecord`, ``PageReplay``) are what scales.

    Attributes:
      mask: ``[L, B, Hkv|1, T, T]`` bool.
    """

    mask: jax.Array = layer_field()
    quant: str = struct.field(pytree_node=False, default="none")

    def check(self, config, batch: int, t: int, backend: str) -> None:
        """``mask`` must be ``[L, B, Hkv|1, T, T]``; the backend must take a mask."""
        check_shape("MaskRecord.mask", self.mask, L=config.num_layers, B=batch,
                    Hkv={1, config.num_kv_heads}, T=t, S=t)
        visibility_backend(backend, "MaskRecord")

    def attend(self, layer, q, k, v, q_pos, backend):
        """Causal attention ANDed with this layer's mask ``[B, Hkv|1, T, T]``."""
        del layer
        return attention(q, *self.own_kv(k, v), q_pos, self_keys(q_pos, k), mask=self.mask,
                         backend=backend), self


@struct.dataclass
class QuantProbe(FullForward):
    """A full-precision causal forward that measures how far ``quant`` would move its keys:
    ``key_error [L]``, per layer the largest relative error ``|fake(k) - k| / |k|`` of any real
    token and KV head (``models.kv_quant``), with each channel measured in units of its RMS
    over the forward's real tokens. Channel-normalised, a few outlier channels that swamp a
    per-token scale (keys without QK-norm) count for what they destroy: every other channel,
    which the queries read, rounds to zero.

    Attributes:
      key_error: ``[L]`` float32, zeros before the forward.
      quant: the format to measure (static).
    """

    key_error: jax.Array
    quant: str = struct.field(pytree_node=False, default="none")

    def check(self, config, batch: int, t: int, backend: str) -> None:
        """``key_error`` must be ``[L]``; any registered backend fits a causal forward."""
        check_shape("QuantProbe.key_error", self.key_error, L=config.num_layers)
        get_backend(backend, "QuantProbe")

    def attend(self, layer, q, k, v, q_pos, backend):
        """Causal attention at full precision; this layer's key error into ``key_error``."""
        real = (q_pos >= 0)[:, None, :, None]  # [B, 1, T, 1]
        kf = jnp.where(real, k.astype(jnp.float32), 0.0)  # [B, Hkv, T, D]
        count = jnp.maximum(jnp.sum(real), 1)
        rms = jnp.sqrt(jnp.sum(kf * kf, axis=(0, 2), keepdims=True) / count)  # [1, Hkv, 1, D]
        rms = jnp.where(rms > 0, rms, 1.0)
        err = jnp.linalg.norm((fake_quant(self.quant, kf, kf)[0] - kf) / rms, axis=-1)
        norm = jnp.linalg.norm(kf / rms, axis=-1)
        rel = jnp.where(norm > 0, err / jnp.where(norm > 0, norm, 1.0), 0.0)  # [B, Hkv, T]
        out = attention(q, k, v, q_pos, self_keys(q_pos, k), backend=backend)
        return out, self.replace(key_error=self.key_error.at[layer].set(jnp.max(rel)))
