"""What a run checks before its run directory is touched: policy, tokenizer and prompts.

Each check raises a ``ValueError`` / ``FileNotFoundError`` naming the tensor, the file (and
line) or the config field, so ``run.py`` prints one ``error:`` line and nothing is written.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator

import jax.numpy as jnp
from flax import nnx

import models
from sparse_rl_jax.prompt_source import PromptSource
from sparse_rl_jax.task_tokenizer import build_task_tokenizer

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
_ENCODE_CHUNK = 1024


def load_checked_policy(path: str, cfg, mesh) -> tuple[models.Tokenizer, models.Decoder]:
    """``(tokenizer, model)`` of the HF checkpoint at ``path``, validated together, with
    ``cfg.model.lora``'s adapters added (``models.add_lora``, A drawn from
    ``trainer.seed``) when set.

    The tokenizer's files are named when missing; every id it can produce (vocabulary,
    special ids) and the configured ``sampling.eos_ids`` / ``pad_id`` must fit the model's
    embedding; ``load_pretrained`` validates config,
    tensor names, shapes, dtypes and finiteness.
    """
    tokenizer = models.Tokenizer(path)
    model = models.load_pretrained(path, dtype=DTYPES[cfg.model.dtype], mesh=mesh)
    lora = cfg.model.lora
    if lora is not None:
        models.add_lora(model, lora.rank, lora.alpha, lora.targets,
                        rngs=nnx.Rngs(cfg.trainer.seed), mesh=mesh)
    vocab = model.config.vocab_size
    tokenizer.check_fits(vocab)
    for field, ids in (("eos_ids", cfg.sampling.eos_ids), ("pad_id", (cfg.sampling.pad_id,))):
        if any(i >= vocab for i in ids):
            raise ValueError(f"sampling.{field}={getattr(cfg.sampling, field)!r}: ids must be "
                             f"below the model's vocab_size={vocab}")
    return tokenizer, model


def default_task_tokenizer() -> models.Tokenizer:
    """The embedded default model's tokenizer, built in a temporary directory (so prompts can
    be checked before the default model is built inside the run directory)."""
    with tempfile.TemporaryDirectory() as tmp:
        return models.Tokenizer(build_task_tokenizer(tmp))


def _prompts(source: PromptSource, steps: int) -> Iterator[tuple[str, str]]:
    """``(where, prompt)`` for every prompt the run can see: each record of a JSONL file
    (``path:line``), or the task prompts of the run's ``steps`` batches."""
    if source.order is not None:
        for example in source.dataset:
            yield f"{example.meta['path']}:{example.meta['line']}", example.prompt
        return
    for position in range(steps):
        for row, prompt in enumerate(source.batch(position).prompts):
            yield f"task batch {position} row {row}", prompt


def check_prompt_lengths(source: PromptSource, tokenizer: models.Tokenizer, cfg,
                         context: int) -> int:
    """Tokenizes every prompt the run can see and refuses an empty one or one longer than
    the compressed KV cache (``compression.budget + buffer``; prompts are never truncated) or
    the model's context (``context`` positions). Returns the longest prompt's length."""
    limits = [(context, "the model context (max_position_embeddings)")]
    if cfg.compression.compresses:
        limits.append((cfg.compression.capacity,
                       f"the KV cache (compression.budget + buffer = {cfg.compression.capacity})"))
    longest, batch = 0, []

    def flush():
        nonlocal longest
        texts = [prompt for _, prompt in batch]
        rows = tokenizer.hf(texts, add_special_tokens=cfg.data.add_special_tokens)["input_ids"]
        for (where, _), row in zip(batch, rows):
            if not row:
                raise ValueError(f"{where}: the prompt encodes to no tokens")
            for limit, what in limits:
                if len(row) > limit:
                    raise ValueError(f"{where}: the prompt has {len(row)} tokens, more than "
                                     f"{what} holds ({limit})")
            longest = max(longest, len(row))
        batch.clear()

    for item in _prompts(source, cfg.trainer.steps):
        batch.append(item)
        if len(batch) == _ENCODE_CHUNK:
            flush()
    if batch:
        flush()
    return longest


def checked_prompt_source(cfg, tokenizer: models.Tokenizer, context: int) -> PromptSource:
    """The run's :class:`PromptSource` with its data read (``file:line`` errors) and every
    prompt's length checked by :func:`check_prompt_lengths`."""
    source = PromptSource(cfg.data, cfg.trainer.prompts_per_step, tokenizer.hf)
    check_prompt_lengths(source, tokenizer, cfg, context)
    return source
