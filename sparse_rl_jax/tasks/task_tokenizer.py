"""A character-level HF fast tokenizer for the shipped task, built locally with ``tokenizers``.

One token per character of ``task.ALPHABET`` plus ``<pad>`` (id 0), ``<eos>`` (id 1) and
``<unk>`` (id 2). Like Qwen2's tokenizer it adds no special tokens when encoding, so
``decode(encode(s)) == s`` for every task string; the pipeline appends ``<eos>`` itself.
The directory it writes loads with ``transformers.AutoTokenizer.from_pretrained``.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from sparse_rl_jax.tasks.task import ALPHABET

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, EOS, UNK)


def task_vocab(alphabet: str = ALPHABET) -> dict[str, int]:
    """Token -> id: the special tokens first, then each character of ``alphabet`` in order.

    Raises:
      ValueError: ``alphabet`` is empty or repeats a character.
    """
    if not alphabet or len(set(alphabet)) != len(alphabet):
        raise ValueError(f"alphabet {alphabet!r} must be non-empty with distinct characters")
    return {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *alphabet))}


def build_task_tokenizer(out_dir: str | Path, alphabet: str = ALPHABET) -> str:
    """Builds the task tokenizer and ``save_pretrained``-s it into ``out_dir``.

    Args:
      out_dir: directory to write (created if missing; existing tokenizer files replaced).
      alphabet: the characters that get their own token (default: the task's alphabet).

    Returns:
      ``str(out_dir)``, ready for ``AutoTokenizer.from_pretrained``.
    """
    core = Tokenizer(models.WordLevel(task_vocab(alphabet), unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.FixedLength(length=1)
    core.decoder = decoders.Fuse()
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        eos_token=EOS,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    wrapped.save_pretrained(str(out))
    return str(out)
