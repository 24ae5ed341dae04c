"""Flax NNX decoder for the Llama 3.x / Qwen2 / Qwen3 families.

Parameter paths mirror HF names: ``embed_tokens/embedding``, ``layers/self_attn/q_proj/
kernel``, ``layers/mlp/gate_proj/kernel``, ``layers/input_layernorm/weight``, ``norm/weight``,
``lm_head/kernel`` (kernels are HF ``weight`` transposed, ``[in, out]``). Layer parameters are
stacked along a leading layer axis (``layers/mlp/up_proj/kernel`` is ``[L, H, F]``; slice ``i``
is HF's ``model.layers.{i}.mlp.up_proj.weight`` transposed) and the layers run under
``lax.scan``, so compile time does not grow with depth.

Attention goes through a KV view (:mod:`models.kv_view`): each layer hands its queries, keys
and values to ``kv.attend(layer, ...)``, which decides what they see (a rollout cache, an
eviction or page-selection record replayed, or plain causal attention); the decoder knows no
cache layout.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig
from models.kv_view import Causal, KVView, join_layers, split_layers
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
    kv: the updated KV view (a cache has ``index += T``, its query ring and, page-sparse,
      its ``selected`` pages updated), or None when the forward got none.
    """

    logits: jax.Array | None
    hidden: jax.Array
    kv: KVView | None


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

    def __call__(self, x, positions, layer, kv: KVView, backend):
        """x ``[B, T, H]`` -> (out ``[B, T, H]``, the KV view after ``kv.attend``)."""
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
        out, kv = kv.attend(layer, q, k, v, positions, backend)
        return self.o_proj(out.reshape(b, t, -1)), kv


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

    def __call__(self, x, positions, layer, kv: KVView, backend):
        attn, kv = self.self_attn(self.input_layernorm(x), positions, layer, kv, backend)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), kv


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
    differentiation; it changes no value. ``unroll_layers`` (static, default False) unrolls
    that scan: one program per layer, each reading its slice of the stacked weights at a
    constant offset (compile time grows with depth; the same values). On the H200, XLA:GPU
    copied each layer's weight slice out of the stack in the scanned decode step
    (benchmarks/README.md, "One H200"). Unrolled, that copy is gone (the step's bytes fall
    from 2.6x to 1.3x the floor) but a b32 decode step is at most 1.2x faster and a b256 one
    unchanged, for 9x the compile (``gpu_suite.py --cells decode_unrolled``), so it stays off.
    """

    def __init__(self, config: ModelConfig, *, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                 rngs: nnx.Rngs):
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        self.config = config
        self.dtype = dtype
        self.remat = "none"
        self.unroll_layers = False
        self.attention = "blockwise"  # the backend of a forward given none (static)
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
        kv: KVView | None = None,
        return_logits: bool = True,
        attention_backend: str | None = None,
    ) -> DecoderOutput:
        """Forward ``tokens [B, T]``.

        Args:
          tokens: ``[B, T]`` int token ids.
          positions: ``[B, T]`` int positions, ``-1`` marks padding. Default: from
            ``attention_mask`` (``cumsum - 1``, pads ``-1``), else ``arange(T)`` offset by
            ``kv.position_offset`` (a cache's write index; pass positions explicitly once rows
            are padded or the cache has been compressed).
          attention_mask: ``[B, T]`` HF-style 1/0 padding mask; zeros force position ``-1``.
          kv: the KV view every layer attends through (:mod:`models.kv_view`): None is plain
            causal attention over the ``T`` tokens; a ``models.KVCache`` (or
            ``models.page_sparse.PageSparseCache``) stores the new keys/values and attends
            over its slots (the caller keeps ``index + T <= C``); a record
            (``models.kv_view.ExpiryRecord`` / ``MaskRecord``,
            ``models.page_sparse.PageReplay``) limits what each query of a full forward sees.
          return_logits: compute ``[B, T, V]`` float32 logits (else use :meth:`unembed`).
          attention_backend: a registered backend (:mod:`models.attention_backends`):
            ``"blockwise"`` (any view), ``"fused"`` (no view or ``Causal``, rows
            right-padded: positions ``0..n-1`` then ``-1``) or ``"reference"`` (the einsum
            oracle), ``"pallas_gpu"`` / ``"pallas_tpu"`` (``"blockwise"`` with a paged
            cache's decode steps read by a Pallas kernel); None: ``self.attention``
            (``"blockwise"`` unless set, e.g. from ``models.resolve_attention``). An unknown
            one, or one the view cannot attend through, is a ValueError naming it.
        """
        cfg = self.config
        attention_backend = attention_backend or self.attention
        check_shape("tokens", tokens, dtype=int, B=None, T=None)
        b, t = tokens.shape
        positions = resolve_positions(tokens, positions, attention_mask, kv)
        view = Causal() if kv is None else kv
        view.check(cfg, b, t, attention_backend)
        view = view.begin_forward(positions)

        layer_graph, layer_params = nnx.split(self.layers)
        carried, per_layer = split_layers(view)

        def one_layer(carry, xs):
            x, carried = carry
            layer, params, layer_data = xs
            block = nnx.merge(layer_graph, params)
            x, view = block(x, positions, layer, join_layers(carried, layer_data),
                            attention_backend)
            return (x, split_layers(view)[0]), None

        (x, carried), _ = jax.lax.scan(
            _remat(one_layer, self.remat), (self.embed_tokens(tokens), carried),
            (jnp.arange(cfg.num_layers), layer_params, per_layer),
            unroll=bool(self.unroll_layers))
        hidden = self.norm(x)
        return DecoderOutput(
            logits=self.unembed(hidden) if return_logits else None,
            hidden=hidden,
            kv=None if kv is None else join_layers(carried, per_layer).end_forward(t),
        )

    def unembed(self, hidden: jax.Array) -> jax.Array:
        """LM head: ``hidden [..., H]`` -> float32 logits ``[..., V]`` (tied or untied)."""
        hidden = hidden.astype(self.dtype)
        if self.config.tie_word_embeddings:
            table = self.embed_tokens.embedding[...].astype(self.dtype)  # [V, H]
            return jnp.einsum("...h,vh->...v", hidden, table, preferred_element_type=jnp.float32)
        kernel = self.lm_head.kernel[...].astype(self.dtype)  # [H, V]
        return jnp.einsum("...h,hv->...v", hidden, kernel, preferred_element_type=jnp.float32)


def resolve_positions(tokens, positions, attention_mask, kv) -> jax.Array:
    """``[B, T]`` int32 positions with ``-1`` on padding."""
    if positions is None:
        if attention_mask is not None:
            check_shape("attention_mask", attention_mask, B=tokens.shape[0], T=tokens.shape[1])
            positions = jnp.cumsum(attention_mask.astype(jnp.int32), axis=-1) - 1
        else:
            offset = 0 if kv is None else kv.position_offset
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]) + offset, tokens.shape)
    check_shape("positions", positions, B=tokens.shape[0], T=tokens.shape[1])
    positions = positions.astype(jnp.int32)
    if attention_mask is not None:
        check_shape("attention_mask", attention_mask, B=tokens.shape[0], T=tokens.shape[1])
        positions = jnp.where(attention_mask.astype(bool), positions, -1)
    return positions
