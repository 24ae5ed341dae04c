"""models.Tokenizer against the underlying `transformers` tokenizer it wraps."""

from __future__ import annotations

import json

import numpy as np
import pytest
import transformers

import models
from tiny_hf import make_tiny_tokenizer


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    make_tiny_tokenizer(path)
    return path


def test_encode_left_pads_hf_ids(tok_dir):
    tok = models.Tokenizer(tok_dir)
    hf = transformers.AutoTokenizer.from_pretrained(tok_dir)
    texts = ["hi", "hello world", "7 + 5 = 12"]
    ids, mask = tok.encode(texts, pad_to_multiple_of=8)
    assert ids.dtype == np.int32 and mask.dtype == np.int32 and ids.shape == (3, 16)
    for row, m, text in zip(ids, mask, texts):
        expected = hf(text)["input_ids"]
        assert m.sum() == len(expected) and (m[-len(expected):] == 1).all()
        assert row[m == 1].tolist() == expected and (row[m == 0] == tok.pad_id).all()
    assert tok.decode(ids, mask) == texts
    with pytest.raises(ValueError, match=r"texts\[1\]: 11 tokens exceed max_length=5"):
        tok.encode(texts, max_length=5)


def test_special_ids_and_chat_template(tok_dir):
    (tok_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    tok = models.Tokenizer(tok_dir)
    hf = transformers.AutoTokenizer.from_pretrained(tok_dir)
    assert tok.pad_id == hf.pad_token_id == 0
    assert tok.eos_ids == (2, 5) and tok.vocab_size == len(hf) <= 128
    prompt = tok.apply_chat_template([{"role": "user", "content": "2+2?"}])
    assert prompt == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(FileNotFoundError, match="tokenizer directory not found"):
        models.Tokenizer(tok_dir / "missing")
