"""``scoring.score`` against an independent oracle: the log-softmax of the full-vocabulary
logits `transformers` (PyTorch) computes for the same tiny checkpoint and tokens, on a
left-padded batch, with the LM head in one chunk or in chunks that do not divide the
response."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import models
from sparse_rl_jax.rollout.scoring import score
from tiny_hf import hf_logits, left_padded_batch, load_hf, make_tiny_hf

PROMPT_LENGTHS, P, M = [9, 4, 1], 9, 7


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random Qwen2 (two layers, GQA) as ``(path, graphdef, params)``, fp32."""
    path = make_tiny_hf(tmp_path_factory.mktemp("scoring"), "qwen2", tokenizer=False)
    graphdef, params = nnx.split(models.load_pretrained(path, dtype=jnp.float32))
    return path, graphdef, params


@pytest.fixture(scope="module")
def tokens():
    """A left-padded prompt batch (lengths 9, 4, 1) and random responses ``[3, M]``."""
    rng = np.random.default_rng(0)
    prompt, prompt_mask = left_padded_batch(rng, PROMPT_LENGTHS, P)
    response = rng.integers(6, 128, size=(len(PROMPT_LENGTHS), M)).astype(np.int32)
    return prompt, prompt_mask, response


def oracle(path, prompt, prompt_mask, response, temperature=1.0):
    """``(logp [N, M], entropy [N, M])`` of each response token from HF's logits divided by
    ``temperature``: column ``P - 1 + j`` of the prompt+response sequence predicts response
    token ``j``."""
    tokens = np.concatenate([prompt, response], axis=1)
    mask = np.concatenate([prompt_mask, np.ones_like(response)], axis=1)
    logits = torch.as_tensor(hf_logits(load_hf(path), tokens, mask), dtype=torch.float64)
    logprobs = torch.log_softmax(logits[:, P - 1:P - 1 + M] / temperature, dim=-1)
    picked = torch.gather(logprobs, -1, torch.as_tensor(response, dtype=torch.long)[..., None])
    entropy = -(logprobs.exp() * logprobs).sum(-1)
    return picked[..., 0].numpy(), entropy.numpy()


@pytest.mark.parametrize("chunk_size,temperature", [(128, 1.0), (3, 1.0), (3, 0.6)],
                         ids=["one_chunk", "chunks_of_3", "chunks_of_3_at_0.6"])
def test_score_matches_transformers_log_softmax(checkpoint, tokens, chunk_size, temperature):
    path, graphdef, params = checkpoint
    want_logp, want_entropy = oracle(path, *tokens, temperature=temperature)
    got = score(graphdef, params, *(jnp.asarray(x) for x in tokens), chunk_size=chunk_size,
                with_entropy=True, temperature=temperature)
    assert got.logp.shape == got.entropy.shape == (len(PROMPT_LENGTHS), M)
    np.testing.assert_allclose(np.asarray(got.logp), want_logp, rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(got.entropy), want_entropy, rtol=1e-5, atol=2e-5)


def test_left_padding_does_not_change_a_rows_scores(checkpoint, tokens):
    """Each row scored alone without padding gives its scores in the padded batch."""
    _, graphdef, params = checkpoint
    prompt, prompt_mask, response = tokens
    batched = np.asarray(score(graphdef, params, prompt, prompt_mask, response).logp)
    for i, n in enumerate(PROMPT_LENGTHS):
        alone = score(graphdef, params, prompt[i:i + 1, P - n:], prompt_mask[i:i + 1, P - n:],
                      response[i:i + 1]).logp
        np.testing.assert_allclose(np.asarray(alone)[0], batched[i], rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("temperature", [0.0, -1.0, float("inf"), True])
def test_score_rejects_a_temperature_that_is_not_a_positive_number(checkpoint, tokens,
                                                                   temperature):
    _, graphdef, params = checkpoint
    with pytest.raises(ValueError, match="temperature"):
        score(graphdef, params, *(jnp.asarray(x) for x in tokens), temperature=temperature)
