"""Flax NNX decoder for the Llama 3.x / Qwen2 / Qwen3 families.

Parameter paths mirror HF names: ``embed_tokens/embedding``, ``layers/self_attn/q_proj/
kernel``, ``layers/mlp/gate_proj/kernel``, ``layers/input_layernorm/weight``, ``norm/weight``,
``lm_head/kernel`` (kernels are HF ``weight`` transposed, ``[in, out]``). Layer parameters are
stacked along a leading layer axis (``layers/mlp/up_proj/kernel`` is ``[L, H, F]``; slice ``i``
is HF's ``model.layers.{i}.mlp.up_proj.weight`` transposed) and the layers run under
``lax.scan``, so compile time does not grow with depth.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from models.attention import attention
from models.cache import KVCache
from models.config import ModelConfig
from models.page_sparse import PageReplay, PageSparsity, page_sparse_attention
from models.rope import apply_rope, inv_frequencies
from models.shapes import check_shape

_INIT = nnx.initializers.normal(0.02)
REMAT_POLICIES = ("none", "full", "dots_saveable")
"""Activation rematerialisation of the scanned layer body (``Decoder.remat``): ``none``
keeps every layer's activations for the backward pass; ``full`` keeps only each layer's
input and recomputes the rest (``jax.checkpoint_policies.nothing_saveable``);
``dots_saveable`` keeps the matmul outputs and recomputes the elementwise ops."""


def _remat(body, policy: str):
    """``body`` under ``jax.checkpoint`` with the named :data:`REMAT_POLICIES` policy."""
    if policy not in REMAT_POLICIES:
        raise ValueError(f"remat: must be one of {REMAT_POLICIES}, got {policy!r}")
    if policy == "none":
        return body
    saveable = {"full": jax.checkpoint_policies.nothing_saveable,
                "dots_saveable": jax.checkpoint_policies.dots_saveable}[policy]
    return jax.checkpoint(body, policy=saveable, prevent_cse=False)


class DecoderOutput(NamedTuple):
    """Forward results.

    logits: ``[B, T, V]`` float32, or None when ``return_logits=False``.
    hidden: ``[B, T, H]`` final-normed hidden states (input of the LM head).
    cache: the updated :class:`KVCache` (``index += T``), or None without a cache.
    queries: ``[L, B, Hq, W, D]`` last ``W`` queries of every layer (after qk-norm and RoPE),
      or None when ``return_queries == 0``.
    pages: ``[L, B, Hkv, K]`` int32 pages each layer attended to (page-sparse decode; ``-1``
      everywhere for dense layers), or None.
    """

    logits: jax.Array | None
    hidden: jax.Array
    cache: KVCache | None
    queries: jax.Array | None
    pages: jax.Array | None = None


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis; normalises in float32 like HF, then scales by ``weight``."""

    def __init__(self, dim: int, eps: float, *, dtype, param_dtype):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight[...].astype(self.dtype) * xf.astype(self.dtype)


class Linear(nnx.Linear):
    """``nnx.Linear`` plus an optional low-rank adapter's output: ``lora`` is None (a plain
    linear) or a :class:`models.lora.LoRA` set by :func:`models.lora.add_lora`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.lora = nnx.data(None)

    def __call__(self, x: jax.Array) -> jax.Array:
        y = super().__call__(x)
        return y if self.lora is None else y + self.lora(x)


def _dense(dtype, param_dtype, rngs: nnx.Rngs) -> partial:
    """:class:`Linear` factory with the model's dtypes and HF's N(0, 0.02) initialisation."""
    return partial(Linear, dtype=dtype, param_dtype=param_dtype, kernel_init=_INIT, rngs=rngs)


class Attention(nnx.Module):
    """Self-attention block: q/k/v/o projections, optional q/k RMSNorm, RoPE, GQA."""

    def __init__(self, cfg: ModelConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        dense = _dense(dtype, param_dtype, rngs)
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = dense(h, cfg.num_heads * d, use_bias=cfg.attention_bias)
        self.k_proj = dense(h, cfg.num_kv_heads * d, use_bias=cfg.attention_bias)
        self.v_proj = dense(h, cfg.num_kv_heads * d, use_bias=cfg.attention_bias)
        self.o_proj = dense(cfg.num_heads * d, h, use_bias=cfg.o_proj_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)
        self.cfg = cfg

    def __call__(self, x, positions, layer, cache, key_expiry, mask, backend, pages=None,
                 replay=None):
        """x ``[B, T, H]`` -> (out ``[B, T, H]``, queries ``[B, T, Hq, D]``, cache, selected
        pages ``[B, Hkv, K]`` or None). ``pages``: this layer's :class:`PageSparsity`;
        ``replay``: this layer's :class:`PageReplay` (``pages [B, Hkv, T, K]``)."""
        cfg = self.cfg
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, cfg.num_heads, cfg.head_dim)
        k = self.k_proj(x).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        v = self.v_proj(x).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        inv_freq = inv_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, Hkv, T, D]
        k_pos = jnp.broadcast_to(positions[:, None, :], (b, cfg.num_kv_heads, t))
        if cache is not None:
            cache = _write_layer(cache, layer, k, v, k_pos)
            k, v, k_pos = cache.k[layer], cache.v[layer], cache.pos[layer]
        if pages is None:
            out = attention(q, k, v, positions, k_pos, k_expiry=key_expiry, mask=mask,
                            q_pages=None if replay is None else replay.pages,
                            page_size=16 if replay is None else replay.page_size,
                            backend=backend)
            selected = None
        else:
            out, selected = _page_sparse_or_dense(q, k, v, positions, k_pos, layer, pages)
        return self.o_proj(out.reshape(b, t, -1)), q, cache, selected


def _page_sparse_or_dense(q, k, v, positions, k_pos, layer, pages: PageSparsity):
    """Page-sparse attention, or dense attention on ``pages.dense_layers`` (``-1`` pages)."""
    def sparse(_):
        return page_sparse_attention(q, k, v, positions, k_pos, pages.page_keys, pages.budget,
                                     pages.slot_offset, page_size=pages.page_size,
                                     max_k=pages.max_k)

    def dense(_):
        shape = (k.shape[0], k.shape[1], pages.num_selected)
        return attention(q, k, v, positions, k_pos), jnp.full(shape, -1, jnp.int32)

    if not pages.dense_layers:
        return sparse(None)
    is_dense = jnp.any(layer == jnp.asarray(pages.dense_layers, jnp.int32))
    return jax.lax.cond(is_dense, dense, sparse, None)


def _write_layer(cache: KVCache, layer: int, k, v, pos) -> KVCache:
    """Write ``k, v [B, Hkv, T, D]`` and ``pos [B, Hkv, T]`` at slots ``[index, index + T)``."""
    at = (layer, 0, 0, cache.index)
    return cache.replace(
        k=jax.lax.dynamic_update_slice(cache.k, k[None].astype(cache.k.dtype), at + (0,)),
        v=jax.lax.dynamic_update_slice(cache.v, v[None].astype(cache.v.dtype), at + (0,)),
        pos=jax.lax.dynamic_update_slice(cache.pos, pos[None].astype(jnp.int32), at),
    )


class MLP(nnx.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: ModelConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        dense = _dense(dtype, param_dtype, rngs)
        h, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = dense(h, f, use_bias=cfg.mlp_bias)
        self.up_proj = dense(h, f, use_bias=cfg.mlp_bias)
        self.down_proj = dense(f, h, use_bias=cfg.mlp_bias)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    """Pre-norm transformer layer: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: ModelConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.self_attn = Attention(cfg, rngs=rngs, **kw)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.mlp = MLP(cfg, rngs=rngs, **kw)

    def __call__(self, x, positions, layer, cache, key_expiry, mask, backend, pages=None,
                 replay=None):
        attn, q, cache, selected = self.self_attn(self.input_layernorm(x), positions, layer,
                                                  cache, key_expiry, mask, backend, pages,
                                                  replay)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), q, cache, selected


def stack_layers(layers: list[DecoderLayer]) -> DecoderLayer:
    """One :class:`DecoderLayer` whose every parameter has a leading layer axis ``[L, ...]``.

    The decoder runs it under ``lax.scan`` (one layer traced and compiled, whatever the
    depth). Built from separately initialised layers, so random init equals per-layer init.
    """
    graphdef = nnx.graphdef(layers[0])
    states = [nnx.state(layer) for layer in layers]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *states)
    return nnx.merge(graphdef, stacked)


class Decoder(nnx.Module):
    """Decoder-only LM. ``dtype`` is the compute dtype, ``param_dtype`` the storage dtype.

    ``layers`` is one :class:`DecoderLayer` with stacked parameters (``layers/self_attn/
    q_proj/kernel`` is ``[L, H, Hq * D]``), scanned over in :meth:`__call__`. ``remat`` (one
    of :data:`REMAT_POLICIES`, default ``none``; a static attribute, set it before
    ``nnx.split``) is the activation rematerialisation of the scanned layer body under
    differentiation; it changes no value.
    """

    def __init__(self, config: ModelConfig, *, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                 rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        self.config = config
        self.dtype = dtype
        self.remat = "none"
        self.embed_tokens = nnx.Embed(config.vocab_size, config.hidden_size, embedding_init=_INIT,
                                      rngs=rngs, **kw)
        self.layers = stack_layers([DecoderLayer(config, rngs=rngs, **kw)
                                    for _ in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)
        if not config.tie_word_embeddings:
            self.lm_head = _dense(dtype, param_dtype, rngs)(config.hidden_size, config.vocab_size,
                                                            use_bias=False)

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array | None = None,
        attention_mask: jax.Array | None = None,
        *,
        cache: KVCache | None = None,
        key_expiry: jax.Array | None = None,
        mask: jax.Array | None = None,
        return_queries: int = 0,
        return_logits: bool = True,
        attention_backend: str = "blockwise",
        pages: PageSparsity | None = None,
        page_replay: PageReplay | None = None,
    ) -> DecoderOutput:
        """Forward ``tokens [B, T]``.

        Args:
          tokens: ``[B, T]`` int token ids.
          positions: ``[B, T]`` int positions, ``-1`` marks padding. Default: from
            ``attention_mask`` (``cumsum - 1``, pads ``-1``), else ``arange(T)`` (offset by
            ``cache.index`` when a cache is given; pass positions explicitly once rows are
            padded or the cache has been compressed).
          attention_mask: ``[B, T]`` HF-style 1/0 padding mask; zeros force position ``-1``.
          cache: if given, the ``T`` new keys/values are written at slots
            ``[cache.index, cache.index + T)`` of every layer (the caller keeps
            ``index + T <= C``), queries attend over all ``C`` slots, and the returned cache
            has ``index += T``. Without a cache the keys are the ``T`` tokens themselves.
          key_expiry: ``[L, B, Hkv, S]`` int; key ``s`` is hidden from queries at position
            ``>= key_expiry[..., s]``. ``S = T`` without a cache, ``C`` with one.
          mask: ``[L|1, B, Hkv|1, T, S]`` bool visibility ANDed into the causal rule.
          return_queries: ``W > 0`` returns the last ``W`` queries of every layer.
          return_logits: compute ``[B, T, V]`` float32 logits (else use :meth:`unembed`).
          attention_backend: ``"blockwise"`` (any positions, expiry, mask), ``"fused"`` (no
            cache, no expiry/mask, rows right-padded: positions ``0..n-1`` then ``-1``) or
            ``"reference"`` (the einsum oracle); see :mod:`models.attention`.
          pages: page-sparse decode (:mod:`models.page_sparse`): needs a cache and ``T == 1``;
            the output's ``pages`` holds what each layer attended to.
          page_replay: a page-sparse rollout's selection (:class:`PageReplay`, ``pages
            [L, B, Hkv, T, K]``) replayed on a full forward (no cache): each query sees only
            the keys of its pages, expanded one query block at a time (never ``[T, S]`` per
            layer beyond one block).
        """
        cfg = self.config
        check_shape("tokens", tokens, dtype=int, B=None, T=None)
        t = tokens.shape[1]
        positions = _resolve_positions(tokens, positions, attention_mask, cache)
        _check_call(cfg, tokens, cache, key_expiry, mask, return_queries, attention_backend,
                    pages, page_replay)

        layer_graph, layer_params = nnx.split(self.layers)
        shared_mask = mask[0] if mask is not None and mask.shape[0] == 1 else None
        per_layer = (jnp.arange(cfg.num_layers), layer_params, key_expiry,
                     None if shared_mask is not None else mask,
                     None if pages is None else pages.page_keys,
                     None if page_replay is None else page_replay.pages)

        def one_layer(carry, xs):
            x, cache = carry
            layer, params, layer_expiry, layer_mask, page_keys, replay_pages = xs
            block = nnx.merge(layer_graph, params)
            layer_mask = shared_mask if shared_mask is not None else layer_mask
            layer_pages = None if pages is None else pages.replace(page_keys=page_keys)
            replay = None if page_replay is None else page_replay.replace(pages=replay_pages)
            x, q, cache, selected = block(x, positions, layer, cache, layer_expiry, layer_mask,
                                          attention_backend, layer_pages, replay)
            q = q[:, t - return_queries:].transpose(0, 2, 1, 3) if return_queries else None
            return (x, cache), (q, selected)

        (x, cache), (queries, selected) = jax.lax.scan(
            _remat(one_layer, self.remat), (self.embed_tokens(tokens), cache), per_layer)
        hidden = self.norm(x)
        if cache is not None:
            cache = cache.replace(index=cache.index + t)
        return DecoderOutput(
            logits=self.unembed(hidden) if return_logits else None,
            hidden=hidden,
            cache=cache,
            queries=queries,
            pages=selected,
        )

    def unembed(self, hidden: jax.Array) -> jax.Array:
        """LM head: ``hidden [..., H]`` -> float32 logits ``[..., V]`` (tied or untied)."""
        hidden = hidden.astype(self.dtype)
        if self.config.tie_word_embeddings:
            table = self.embed_tokens.embedding[...].astype(self.dtype)  # [V, H]
            return jnp.einsum("...h,vh->...v", hidden, table, preferred_element_type=jnp.float32)
        kernel = self.lm_head.kernel[...].astype(self.dtype)  # [H, V]
        return jnp.einsum("...h,hv->...v", hidden, kernel, preferred_element_type=jnp.float32)


def _resolve_positions(tokens, positions, attention_mask, cache) -> jax.Array:
    """``[B, T]`` int32 positions with ``-1`` on padding."""
    if positions is None:
        if attention_mask is not None:
            check_shape("attention_mask", attention_mask, B=tokens.shape[0], T=tokens.shape[1])
            positions = jnp.cumsum(attention_mask.astype(jnp.int32), axis=-1) - 1
        else:
            offset = 0 if cache is None else cache.index
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]) + offset, tokens.shape)
    check_shape("positions", positions, B=tokens.shape[0], T=tokens.shape[1])
    positions = positions.astype(jnp.int32)
    if attention_mask is not None:
        check_shape("attention_mask", attention_mask, B=tokens.shape[0], T=tokens.shape[1])
        positions = jnp.where(attention_mask.astype(bool), positions, -1)
    return positions


def _check_call(cfg: ModelConfig, tokens, cache, key_expiry, mask, return_queries: int,
                attention_backend: str, pages, page_replay=None) -> None:
    """Reject :meth:`Decoder.__call__` arguments that do not fit ``tokens [B, T]`` (ValueError
    naming the argument) before any compute."""
    b, t = tokens.shape
    num_keys = t if cache is None else cache.capacity
    check_shape("key_expiry", key_expiry, L=cfg.num_layers, B=b, Hkv=cfg.num_kv_heads,
                S=num_keys)
    check_shape("mask", mask, L={1, cfg.num_layers}, B=b,
                Hkv={1, cfg.num_kv_heads}, T=t, S=num_keys)
    if not 0 <= return_queries <= t:
        raise ValueError(f"return_queries: must be in [0, T={t}], got {return_queries}")
    _check_cache_room(cache, t)
    if attention_backend == "fused" and cache is not None:
        raise ValueError("attention_backend: 'fused' needs a full forward (no cache)")
    if pages is not None and (cache is None or t != 1):
        raise ValueError(f"pages: page-sparse attention needs a cache and one token per row "
                         f"(T=1), got T={t}, cache={'set' if cache is not None else None}")
    if page_replay is not None:
        check_shape("page_replay.pages", page_replay.pages, dtype=int, L=cfg.num_layers, B=b,
                    Hkv=cfg.num_kv_heads, T=t, K=None)
        if cache is not None or attention_backend == "fused":
            raise ValueError("page_replay: replays on a full forward (no cache) with the "
                             f"blockwise or reference backend, got cache="
                             f"{'set' if cache is not None else None}, "
                             f"attention_backend={attention_backend!r}")


def _check_cache_room(cache: KVCache | None, t: int) -> None:
    """Reject a write past the cache's capacity when the index is known (not under jit)."""
    if cache is None or isinstance(cache.index, jax.core.Tracer):
        return
    if int(cache.index) + t > cache.capacity:
        raise ValueError(f"cache: writing {t} tokens at index {int(cache.index)} exceeds "
                         f"capacity {cache.capacity}")
