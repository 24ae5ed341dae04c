"""The attention backends against the einsum oracle: values and gradients.

Random inputs with GQA, left/right padding, eviction expiry times and an arbitrary mask; the
blockwise backend also with block sizes that do not divide the lengths (padding blocks) and
with blocks that see nothing (skipped). A compiled-memory check shows the blockwise backward
holds no ``[T, S]`` array.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.attention_backends import attention

B, T, HQ, HKV, D = 2, 13, 4, 2, 8


def _inputs(seed, padding="left"):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(B, T, HQ, D)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(B, HKV, T, D)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(B, HKV, T, D)), jnp.float32)
    lengths = [T, T - 4]
    pos = np.full((B, T), -1)
    for row, n in enumerate(lengths):
        if padding == "left":
            pos[row, T - n:] = np.arange(n)
        else:
            pos[row, :n] = np.arange(n)
    pos = jnp.asarray(pos, jnp.int32)
    expiry = jnp.asarray(rng.integers(0, T + 2, size=(B, HKV, T)), jnp.int32)
    mask = jnp.asarray(rng.random((B, 1, T, T)) > 0.3)
    return q, k, v, pos, expiry, mask


def _value_and_grads(backend, q, k, v, q_pos, k_pos, **kw):
    """``attention``'s output and its ``(dq, dk, dv)`` under a fixed random weighting, in one
    compiled program (arrays in ``kw`` traced, the rest static)."""
    weights = jnp.asarray(np.random.default_rng(9).normal(size=q.shape), jnp.float32)
    arrays = {name: x for name, x in kw.items() if isinstance(x, jax.Array)}
    static = tuple(sorted((name, x) for name, x in kw.items() if name not in arrays))
    (_, out), grads = _jit_value_and_grads(q, k, v, q_pos, k_pos, weights, arrays, backend,
                                           static)
    return out, grads


@functools.partial(jax.jit, static_argnames=("backend", "static"))
def _jit_value_and_grads(q, k, v, q_pos, k_pos, weights, arrays, backend, static):
    def loss(q, k, v):
        out = attention(q, k, v, q_pos, k_pos, backend=backend, **arrays, **dict(static))
        return jnp.sum(out * weights), out

    return jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)


def _assert_matches_oracle(backend, q, k, v, q_pos, k_pos, oracle_kw=None, **kw):
    oracle_kw = dict(kw) if oracle_kw is None else oracle_kw
    out, grads = _value_and_grads(backend, q, k, v, q_pos, k_pos, **kw)
    ref_out, ref_grads = _value_and_grads("reference", q, k, v, q_pos, k_pos, **oracle_kw)
    np.testing.assert_allclose(out, ref_out, atol=2e-6, rtol=0)
    for name, got, want in zip("qkv", grads, ref_grads):
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=0, err_msg=f"d{name}")


@pytest.mark.parametrize("block_size", [None, 4, 5])
@pytest.mark.parametrize("extra", ["causal", "expiry", "mask"])
def test_blockwise_equals_oracle(block_size, extra):
    q, k, v, pos, expiry, mask = _inputs(0)
    k_pos = jnp.broadcast_to(pos[:, None], (B, HKV, T))
    kw = {"causal": {}, "expiry": {"k_expiry": expiry}, "mask": {"mask": mask}}[extra]
    _assert_matches_oracle("blockwise", q, k, v, pos, k_pos, dict(kw), block_size=block_size,
                           **kw)


def test_blockwise_cache_layout_fewer_queries_than_keys():
    """Decode-like: 1-3 queries over a cache of slots in arbitrary order with empty slots."""
    rng = np.random.default_rng(3)
    q, k, v, *_ = _inputs(1)
    q = q[:, :3]
    k_pos = jnp.asarray(rng.permutation(np.r_[np.arange(10), -1, -1, -1])[None, None]
                        .repeat(B, 0).repeat(HKV, 1), jnp.int32)
    q_pos = jnp.asarray([[8, 9, 10], [-1, 4, 5]], jnp.int32)
    _assert_matches_oracle("blockwise", q, k, v, q_pos, k_pos, {}, block_size=4)


def test_fused_equals_oracle_on_right_padded_rows():
    q, k, v, pos, *_ = _inputs(2, padding="right")
    k_pos = jnp.broadcast_to(pos[:, None], (B, HKV, T))
    _assert_matches_oracle("fused", q, k, v, pos, k_pos, {})


def test_bad_backend_arguments_are_named():
    q, k, v, pos, expiry, _ = _inputs(0)
    k_pos = jnp.broadcast_to(pos[:, None], (B, HKV, T))
    with pytest.raises(ValueError, match="backend must be one of"):
        attention(q, k, v, pos, k_pos, backend="flash")
    with pytest.raises(ValueError, match="'fused' takes no k_expiry"):
        attention(q, k, v, pos, k_pos, k_expiry=expiry, backend="fused")
    with pytest.raises(ValueError, match="block_size"):
        attention(q, k, v, pos, k_pos, block_size=0)


def test_blockwise_backward_holds_no_query_by_key_array():
    """Compiled temp memory of value+grad stays below one ``[T, S]`` fp32 score array."""
    t, hq, hkv, d = 1024, 2, 1, 16
    q = jax.ShapeDtypeStruct((1, t, hq, d), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, hkv, t, d), jnp.float32)
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    k_pos = pos[:, None]
    expiry = jnp.full((1, hkv, t), 2**30, jnp.int32)

    def temp_bytes(backend, **kw):
        def loss(q, k, v):
            return jnp.sum(attention(q, k, v, pos, k_pos, k_expiry=expiry, backend=backend, **kw))
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    one_score_array = t * t * 4
    assert temp_bytes("reference") >= one_score_array  # the oracle does hold it
    assert temp_bytes("blockwise", block_size=128) < one_score_array / 2
