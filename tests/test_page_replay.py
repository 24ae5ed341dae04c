"""The blockwise replay of a page-selection record against the dense visibility mask.

The oracle is a NumPy mask ``[L, B, Hkv, S, S]`` built straight from the record's definition
(a response query sees the keys of its recorded pages; prompt queries and all-``-1`` rows see
every key), fed to the einsum reference attention (values and gradients) and to the decoder's
``mask`` argument (the dense path scoring used before the replay went blockwise).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import models
from models.attention import page_visibility
from models.attention_backends import attention
from models.page_sparse import PageReplay
from sparse_rl_jax.kv.page_sparsity import replay_from_page_record
from sparse_rl_jax.rollout.scoring import sequence_positions
from test_models_attention import _value_and_grads
from tiny_hf import left_padded_batch, make_tiny_hf

PS = 4  # tokens per page


def np_replay_mask(record, positions, prompt_lengths, page_size):
    """``[L, B, Hkv, S, S]`` bool: which key column each query column may see (before the
    causal rule), straight from the record, loop by loop."""
    n_layers, b, h, m, _ = record.shape
    s = positions.shape[1]
    mask = np.ones((n_layers, b, h, s, s), bool)
    for layer in range(n_layers):
        for row in range(b):
            for head in range(h):
                for col in range(s):
                    r = positions[row, col] - prompt_lengths[row]
                    if positions[row, col] < 0 or not 0 <= r < m:
                        continue
                    pages = record[layer, row, head, r]
                    if np.all(pages < 0):
                        continue
                    for key in range(s):
                        page = positions[row, key] // page_size
                        mask[layer, row, head, col, key] = page in set(pages[pages >= 0])
    return mask


def _random_record(rng, n_layers, b, h, m, k, num_pages):
    """Random page sets with unused slots, duplicates and all-``-1`` (dense) rows."""
    record = rng.integers(-1, num_pages, size=(n_layers, b, h, m, k)).astype(np.int32)
    record[rng.random((n_layers, b, h, m)) < 0.15] = -1
    return record


def _case(seed, prompt_lengths, width, m, k, n_layers=1, h=2):
    rng = np.random.default_rng(seed)
    _, prompt_mask = left_padded_batch(rng, prompt_lengths, width=width)
    positions = np.asarray(sequence_positions(jnp.asarray(prompt_mask), m))
    s = width + m
    record = _random_record(rng, n_layers, len(prompt_lengths), h, m, k, -(-s // PS))
    plen = prompt_mask.sum(axis=1)
    return rng, record, positions, plen


def test_page_visibility_equals_numpy_mask():
    _, record, positions, plen = _case(0, [7, 3, 5], width=7, m=12, k=3, n_layers=2)
    replay = replay_from_page_record(jnp.asarray(record), jnp.asarray(positions),
                                     jnp.asarray(plen), PS)
    want = np_replay_mask(record, positions, plen, PS)
    k_pos = np.broadcast_to(positions[:, None], (positions.shape[0], 2, positions.shape[1]))
    real_keys = (positions >= 0)[:, None, None, :]  # padding keys are hidden by the causal rule
    for layer in range(2):
        got = np.asarray(page_visibility(replay.pages[layer], jnp.asarray(k_pos), PS))
        np.testing.assert_array_equal(got & real_keys, want[layer] & real_keys)


@pytest.mark.parametrize("block_size", [None, 3, 5, 8, 19])
def test_blockwise_page_replay_equals_dense_mask_values_and_grads(block_size):
    """S = 19 columns; blocks of 3, 5, 8 do not divide it (padding blocks)."""
    rng, record, positions, plen = _case(1, [7, 4], width=7, m=12, k=3)
    b, hq, hkv, d, s = 2, 4, 2, 8, positions.shape[1]
    q = jnp.asarray(rng.normal(size=(b, s, hq, d)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(b, hkv, s, d)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(b, hkv, s, d)), jnp.float32)
    pos = jnp.asarray(positions)
    k_pos = jnp.broadcast_to(pos[:, None], (b, hkv, s))
    q_pages = replay_from_page_record(jnp.asarray(record), pos, jnp.asarray(plen), PS).pages[0]
    mask = jnp.asarray(np_replay_mask(record, positions, plen, PS)[0])
    out, grads = _value_and_grads("blockwise", q, k, v, pos, k_pos, q_pages=q_pages,
                                  page_size=PS, block_size=block_size)
    ref, ref_grads = _value_and_grads("reference", q, k, v, pos, k_pos, mask=mask)
    np.testing.assert_allclose(out, ref, atol=2e-6, rtol=0)
    for name, got, want in zip("qkv", grads, ref_grads):
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=0, err_msg=f"d{name}")
    # the selection really hides keys: dense attention differs
    dense = attention(q, k, v, pos, k_pos, backend="reference")
    assert float(jnp.max(jnp.abs(dense - ref))) > 1e-2


def test_decoder_page_replay_equals_dense_mask_forward(tmp_path):
    """The model's forward with a ``PageReplay`` == with the dense ``[L, B, Hkv, S, S]`` mask,
    layer by layer (each layer its own selection)."""
    path = make_tiny_hf(tmp_path, "qwen2", tokenizer=False, std=0.2, hidden_size=32,
                        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=64)
    model = models.load_pretrained(path, dtype=jnp.float32)
    rng, record, positions, plen = _case(2, [9, 5, 2], width=9, m=14, k=4, n_layers=3)
    tokens = jnp.asarray(rng.integers(6, 128, size=positions.shape), jnp.int32)
    pos = jnp.asarray(positions)
    replay = replay_from_page_record(jnp.asarray(record), pos, jnp.asarray(plen), PS)
    got = model(tokens, pos, kv=replay).logits
    mask = models.MaskRecord(jnp.asarray(np_replay_mask(record, positions, plen, PS)))
    want = model(tokens, pos, kv=mask).logits
    real = positions >= 0
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=2e-5, rtol=0)
    dense = model(tokens, pos).logits
    assert float(jnp.max(jnp.abs(dense - want)[real])) > 1e-3


def test_page_replay_errors_name_the_argument(tmp_path):
    path = make_tiny_hf(tmp_path, "qwen2", tokenizer=False, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, intermediate_size=64)
    model = models.load_pretrained(path, dtype=jnp.float32)
    tokens = jnp.ones((1, 5), jnp.int32)
    with pytest.raises(ValueError, match="PageReplay.pages"):
        model(tokens, kv=PageReplay(jnp.zeros((2, 1, 1, 5, 3), jnp.int32), 4))
    with pytest.raises(ValueError, match="PageReplay: .*attention_backend='fused'"):
        model(tokens, kv=PageReplay(jnp.zeros((2, 1, 2, 5, 3), jnp.int32), 4),
              attention_backend="fused")
