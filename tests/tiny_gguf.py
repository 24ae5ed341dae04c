"""A tiny random Llama GGUF file (Q4_1 and F32 tensors, GPT-2-style BPE tokenizer) for tests.

Laid out as llama.cpp writes SmolLM2: ``llama.*`` hyperparameters, ``tokenizer.ggml.*``
vocabulary / merges / special ids and a chat template, tied embeddings (no ``output.weight``).
Needs the ``gguf`` package (in the test extra).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TINY = dict(layers=2, hidden=64, ffn=128, heads=4, kv_heads=2, context=256)


def byte_level_alphabet() -> list[str]:
    """The 256 printable stand-ins GPT-2's byte-level BPE uses for the bytes 0..255."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def make_tiny_gguf(path: str | Path, seed: int = 0, quantized: bool = True) -> Path:
    """Writes the tiny model to ``path`` (a ``.gguf`` file) and returns it.

    Vocabulary: 3 specials, the 256 byte symbols and two merges (``Ġ`` + ``t``, ``e`` + ``s``):
    261 ids. Weight matrices are Q4_1 when ``quantized`` (else F32); norms are F32.
    """
    import gguf

    path = Path(path)
    rng = np.random.default_rng(seed)
    alphabet = byte_level_alphabet()
    merges = ["Ġ t", "e s"]
    tokens = SPECIALS + alphabet + [m.replace(" ", "") for m in merges]
    vocab, c = len(tokens), TINY
    head_dim = c["hidden"] // c["heads"]

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_block_count(c["layers"])
    w.add_context_length(c["context"])
    w.add_embedding_length(c["hidden"])
    w.add_feed_forward_length(c["ffn"])
    w.add_head_count(c["heads"])
    w.add_head_count_kv(c["kv_heads"])
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL] * len(SPECIALS)
                      + [gguf.TokenType.NORMAL] * (vocab - len(SPECIALS)))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    def tensor(name, shape, scale=0.1, norm=False):
        # GGUF stores a [out, in] torch weight with shape (in, out) reversed: numpy (out, in).
        data = (1.0 + 0.1 * rng.standard_normal(shape) if norm
                else scale * rng.standard_normal(shape)).astype(np.float32)
        if quantized and not norm:
            q = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q4_1)
            w.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
        else:
            w.add_tensor(name, data)

    h, kv = c["hidden"], c["kv_heads"] * head_dim
    tensor("token_embd.weight", (vocab, h), scale=0.5)
    tensor("output_norm.weight", (h,), norm=True)
    for i in range(c["layers"]):
        tensor(f"blk.{i}.attn_norm.weight", (h,), norm=True)
        tensor(f"blk.{i}.attn_q.weight", (h, h))
        tensor(f"blk.{i}.attn_k.weight", (kv, h))
        tensor(f"blk.{i}.attn_v.weight", (kv, h))
        tensor(f"blk.{i}.attn_output.weight", (h, h))
        tensor(f"blk.{i}.ffn_norm.weight", (h,), norm=True)
        tensor(f"blk.{i}.ffn_gate.weight", (c["ffn"], h))
        tensor(f"blk.{i}.ffn_up.weight", (c["ffn"], h))
        tensor(f"blk.{i}.ffn_down.weight", (h, c["ffn"]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
