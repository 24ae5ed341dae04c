"""R-KV's redundancy computed over key blocks: the score of its definition (a NumPy reference
that forms the whole similarity matrix) at every block size, including capacities that are not
a multiple of the block, the same bits whatever the block, and no ``[C, C]`` array per head in
its jaxpr."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_rl_jax.kv.scores import KEY_BLOCK, redundancy


def numpy_redundancy(k, pos, index, threshold):
    """The definition, in float64 with the whole ``[C, C]`` similarity: cosine similarity of
    the valid keys (``k / (|k| + 1e-8)``), diagonal and invalid pairs 0; per row ``i`` the
    newest valid ``j != i`` with ``S_ij > threshold`` zeroed; ``softmax_j`` over the valid
    slots of ``mean_i S_ij`` (the mean over the valid rows); 0 on invalid slots."""
    b_, h_, c, _ = k.shape
    out = np.zeros((b_, h_, c))
    for b in range(b_):
        for h in range(h_):
            valid = (pos[b, h] >= 0) & (np.arange(c) < index)
            kn = k[b, h].astype(np.float64)
            kn = kn / (np.linalg.norm(kn, axis=-1, keepdims=True) + 1e-8)
            sim = np.where(valid[:, None] & valid[None, :], kn @ kn.T, 0.0)
            np.fill_diagonal(sim, 0.0)
            for i in np.flatnonzero(valid):
                dups = np.flatnonzero((sim[i] > threshold) & valid & (np.arange(c) != i))
                if dups.size:
                    sim[i, dups.max()] = 0.0
            mean = sim.sum(axis=0) / max(valid.sum(), 1)
            e = np.exp(mean[valid] - mean[valid].max())
            out[b, h, valid] = e / e.sum()
    return out


def _case(c, d, seed, empty_tail=3):
    """Random keys with near-duplicate pairs far apart (so pairs straddle key blocks), random
    holes and ``empty_tail`` empty slots at the end (``index = c - empty_tail``)."""
    rng = np.random.default_rng(seed)
    b, h = 2, 2
    k = rng.normal(size=(b, h, c, d)).astype(np.float32)
    src = rng.integers(0, c, size=c // 3)
    dst = (src + rng.integers(1, c, size=src.size)) % c
    k[:, :, dst] = k[:, :, src] + 0.3 * rng.normal(size=(b, h, src.size, d))
    index = c - empty_tail
    valid = (np.arange(c) < index) & (rng.random((b, h, c)) > 0.1)
    pos = np.where(valid, np.cumsum(valid, axis=-1) - 1, -1).astype(np.int32)
    return k, pos, index


RED = jax.jit(redundancy, static_argnums=(3, 4))


@pytest.mark.parametrize("c,block", [(24, 8), (29, 8), (64, 7), (300, 128),
                                     (700, KEY_BLOCK)])
@pytest.mark.parametrize("threshold", [0.3, 0.5])
def test_blockwise_redundancy_matches_numpy_definition(c, block, threshold):
    k, pos, index = _case(c, d=8, seed=c)
    ref = numpy_redundancy(k, pos, index, threshold)
    got = np.asarray(RED(k, pos, jnp.int32(index), threshold, block))
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=1e-7)
    valid = (pos >= 0) & (np.arange(c) < index)
    assert np.all(got[~valid] == 0.0) and np.all(got[valid] > 0.0)


@pytest.mark.parametrize("c", [29, 300])
def test_the_block_size_does_not_change_a_bit(c):
    """Every block size gives the bits of one block over all slots (``block = C``: the whole
    ``[C, C]`` similarity at once)."""
    k, pos, index = _case(c, d=16, seed=1)
    whole = np.asarray(RED(k, pos, jnp.int32(index), 0.5, c))
    for block in (5, 8, 64, KEY_BLOCK):
        got = np.asarray(RED(k, pos, jnp.int32(index), 0.5, block))
        np.testing.assert_array_equal(got.view(np.uint32), whole.view(np.uint32))


def _shapes(jaxpr):
    """The shape of every intermediate of ``jaxpr`` and of the jaxprs nested in its equations
    (``scan``/``map`` bodies, ``pjit``, ``cond`` branches)."""
    for eqn in jaxpr.eqns:
        yield from (v.aval.shape for v in eqn.outvars)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _shapes(inner)


def _square_intermediates(c, block):
    k = jax.ShapeDtypeStruct((1, 2, c, 64), jnp.float32)
    pos = jax.ShapeDtypeStruct((1, 2, c), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda k, p: redundancy(k, p, jnp.int32(c), 0.5, block))(k, pos)
    shapes = list(_shapes(jaxpr.jaxpr))
    assert any(len(s) >= 2 and s[-2:] == (c, block) for s in shapes)  # the walk sees the body
    return [s for s in shapes if len(s) >= 2 and s[-2:] == (c, c)]


def test_no_intermediate_is_a_capacity_by_capacity_array():
    """At C = 4 x KEY_BLOCK in blocks of KEY_BLOCK, no intermediate ends in ``[C, C]``; one
    block of all C slots (the control) does form it."""
    assert _square_intermediates(4 * KEY_BLOCK, KEY_BLOCK) == []
    assert _square_intermediates(4 * KEY_BLOCK, 4 * KEY_BLOCK)
