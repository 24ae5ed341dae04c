"""Thin wrapper over ``transformers.AutoTokenizer`` for batched, left-padded int32 encoding."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from models.gguf import checkpoint_dir
from models.json_file import read_json


# Checkpoints that declare these classes ship their whole tokenizer in tokenizer.json.
GENERIC_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")
# The JSON files a tokenizer is read from (each checked first, so a broken one is named).
TOKENIZER_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                        "added_tokens.json", "generation_config.json")
# A directory needs one of these file sets to hold a tokenizer.
TOKENIZER_FILES = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"),
                   ("vocab.txt",))


def _check_tokenizer_files(path: Path) -> None:
    """FileNotFoundError naming the files a tokenizer needs when ``path`` has none of them;
    ValueError naming a tokenizer JSON file that is not valid JSON."""
    if not any(all((path / name).is_file() for name in names) for names in TOKENIZER_FILES):
        wanted = " or ".join(" + ".join(names) for names in TOKENIZER_FILES)
        raise FileNotFoundError(f"no tokenizer in {path}: expected {wanted}")
    for name in TOKENIZER_JSON_FILES:
        if (path / name).is_file():
            read_json(path / name)


def _load_hf_tokenizer(path: Path):
    """``AutoTokenizer`` for the directory, except that a checkpoint declaring a generic fast
    tokenizer gets exactly its ``tokenizer.json``: newer transformers (5.2x) otherwise pick
    the class of config.json's ``model_type`` and replace the pre-tokenizer with that
    family's (e.g. Qwen2's byte-level regex, which drops the spaces of a char-level vocab)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    config = path / "tokenizer_config.json"
    declared = read_json(config).get("tokenizer_class") if config.is_file() else None
    if declared in GENERIC_TOKENIZER_CLASSES and (path / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


class Tokenizer:
    """The tokenizer of a local HF checkpoint directory or GGUF file (never downloads).

    Attributes:
      hf: the underlying ``transformers`` tokenizer.
      eos_ids: token ids that end a response (the tokenizer's EOS plus any
        ``generation_config.json`` ``eos_token_id``), in first-seen order.
      pad_id: padding id (the tokenizer's pad token, else the first EOS id, else 0).
    """

    def __init__(self, path: str | Path):
        path = checkpoint_dir(path)
        if not path.is_dir():
            raise FileNotFoundError(f"tokenizer directory not found: {path}")
        _check_tokenizer_files(path)
        self.hf = _load_hf_tokenizer(path)
        eos = [self.hf.eos_token_id]
        generation_config = path / "generation_config.json"
        if generation_config.is_file():
            extra = read_json(generation_config).get("eos_token_id")
            eos += extra if isinstance(extra, list) else [extra]
        self.eos_ids: tuple[int, ...] = tuple(dict.fromkeys(i for i in eos if i is not None))
        pad = self.hf.pad_token_id
        self.pad_id: int = pad if pad is not None else (self.eos_ids[0] if self.eos_ids else 0)

    @property
    def vocab_size(self) -> int:
        """Number of vocabulary entries (added tokens included). The ids need not be
        contiguous, so the largest id can exceed it: see :meth:`largest_id`."""
        return len(self.hf)

    def largest_id(self) -> tuple[int, str]:
        """``(id, name)`` of the largest id this tokenizer can produce: every vocabulary
        entry and added token (``get_vocab``; its ids, not its size, which misses an entry
        mapped past the others), the special tokens and the EOS / pad ids (an id from
        ``generation_config.json`` may have no token: named by the id alone)."""
        names = {i: repr(token) for token, i in self.hf.get_vocab().items()}
        for i in (*self.hf.all_special_ids, *self.eos_ids, self.pad_id):
            if i is not None:
                names.setdefault(i, "special id")
        largest = max(names)
        return largest, names[largest]

    def check_fits(self, vocab_size: int) -> None:
        """ValueError naming the token, its id and ``vocab_size`` when the largest id this
        tokenizer can produce (:meth:`largest_id`) is outside an embedding of ``vocab_size``
        rows, which has no row for it (every rollout would turn NaN)."""
        largest, name = self.largest_id()
        if largest >= vocab_size:
            raise ValueError(
                f"tokenizer {self.hf.name_or_path}: token {name} has id {largest} (vocabulary "
                f"of {self.vocab_size} entries), outside the model's embedding of "
                f"{vocab_size} rows")

    def encode(
        self,
        texts: Sequence[str],
        *,
        max_length: int | None = None,
        add_special_tokens: bool = True,
        pad_to_multiple_of: int = 1,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Encode a batch, left-padded: (ids ``[B, T]`` int32, mask ``[B, T]`` int32 1 = token).

        ``T`` is the longest row rounded up to ``pad_to_multiple_of`` (shape bucketing). A row
        longer than ``max_length`` is an error naming the row, never a silent truncation.
        """
        if isinstance(texts, str):
            raise TypeError("texts: expected a sequence of strings, got a single str")
        rows = self.hf(list(texts), add_special_tokens=add_special_tokens)["input_ids"]
        for i, row in enumerate(rows):
            if max_length is not None and len(row) > max_length:
                raise ValueError(f"texts[{i}]: {len(row)} tokens exceed max_length={max_length}")
        width = max([len(row) for row in rows] + [1])
        width = -(-width // pad_to_multiple_of) * pad_to_multiple_of
        ids = np.full((len(rows), width), self.pad_id, np.int32)
        mask = np.zeros((len(rows), width), np.int32)
        for i, row in enumerate(rows):
            if row:
                ids[i, width - len(row):] = row
                mask[i, width - len(row):] = 1
        return ids, mask

    def decode(self, ids, mask=None, *, skip_special_tokens: bool = True) -> list[str]:
        """Decode ``ids [B, T]``; tokens where ``mask [B, T]`` is 0 are dropped."""
        ids = np.asarray(ids)
        keep = np.ones(ids.shape, bool) if mask is None else np.asarray(mask).astype(bool)
        return [self.hf.decode(row[k].tolist(), skip_special_tokens=skip_special_tokens)
                for row, k in zip(ids, keep)]

    def apply_chat_template(self, messages: list[dict[str, str]], *,
                            add_generation_prompt: bool = True) -> str:
        """Render chat ``messages`` ([{role, content}, ...]) as the prompt string."""
        return self.hf.apply_chat_template(messages, tokenize=False,
                                           add_generation_prompt=add_generation_prompt)
