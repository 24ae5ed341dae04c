"""What a run checks before its run directory is touched: policy, tokenizer, prompts and the
attention backend.

Each check raises a ``ValueError`` / ``FileNotFoundError`` naming the tensor, the file (and
line) or the config field, so ``run.py`` prints one ``error:`` line and nothing is written.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterable, Iterator

import jax
import jax.numpy as jnp
from flax import nnx

import models
from sparse_rl_jax.tasks.prompt_source import PromptSource, eval_examples
from sparse_rl_jax.tasks.task_tokenizer import build_task_tokenizer

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
_ENCODE_CHUNK = 1024


def load_checked_policy(path: str, cfg, mesh) -> tuple[models.Tokenizer, models.Decoder]:
    """``(tokenizer, model)`` of the HF checkpoint at ``path``, validated together, with
    ``cfg.model.lora``'s adapters added (``models.add_lora``, A drawn from
    ``trainer.seed``) when set.

    The tokenizer's files are named when missing; every id it can produce (vocabulary,
    special ids) and the configured ``sampling.eos_ids`` / ``pad_id`` must fit the model's
    embedding (the largest id, not the vocabulary's size); ``load_pretrained`` validates
    config, tensor names, shapes, dtypes, finiteness and magnitudes.
    """
    tokenizer = models.Tokenizer(path)
    model = models.load_pretrained(path, dtype=DTYPES[cfg.model.dtype], mesh=mesh)
    lora = cfg.model.lora
    if lora is not None:
        models.add_lora(model, lora.rank, lora.alpha, lora.targets,
                        rngs=nnx.Rngs(cfg.trainer.seed), mesh=mesh, dropout=lora.dropout)
    tokenizer.check_fits(model.config.vocab_size)
    check_model_fits(cfg, model.config)
    return tokenizer, model


def check_model_fits(cfg, model_config: models.ModelConfig) -> None:
    """ValueError naming the field when the model cannot serve the run's settings: the ids of
    :func:`check_sampling_ids`, or a compression it cannot run
    (``CompressionConfig.check_fits``: ``sparrow.dense_layers``, ``quant``)."""
    check_sampling_ids(cfg, model_config.vocab_size)
    cfg.compression.check_fits(model_config)


def run_attention(cfg, model_config: models.ModelConfig) -> str:
    """The attention backend ``model.attention`` selects on this JAX platform for a model of
    ``model_config`` paged and stored as ``compression`` says (``ModelSection.backend``); a
    FieldError naming ``model.attention`` when its kernel cannot run here or take those
    shapes. Reads the JAX platform: call it after ``jax.distributed.initialize``."""
    return cfg.model.backend(jax.default_backend(), model_config, cfg.compression.page_size,
                             cfg.compression.quant)


def check_sampling_ids(cfg, vocab_size: int) -> None:
    """ValueError naming the field when ``sampling.eos_ids`` or ``sampling.pad_id`` is not
    an id of the model's embedding of ``vocab_size`` rows."""
    for field, ids in (("eos_ids", cfg.sampling.eos_ids), ("pad_id", (cfg.sampling.pad_id,))):
        if any(i >= vocab_size for i in ids):
            raise ValueError(f"sampling.{field}={getattr(cfg.sampling, field)!r}: ids must be "
                             f"below the model's vocab_size={vocab_size}")


def default_task_tokenizer() -> models.Tokenizer:
    """The embedded default model's tokenizer, built in a temporary directory (so prompts can
    be checked before the default model is built inside the run directory)."""
    with tempfile.TemporaryDirectory() as tmp:
        return models.Tokenizer(build_task_tokenizer(tmp))


def _where(example, fallback: str) -> str:
    """``path:line`` of an example read from a JSONL file (also through TFDS), else
    ``fallback``."""
    meta = getattr(example, "meta", None) or {}
    return f"{meta['path']}:{meta['line']}" if "path" in meta and "line" in meta else fallback


def _prompts(source: PromptSource, batches: int) -> Iterator[tuple[str, str]]:
    """``(where, prompt)`` for every prompt the run can see: each record of a data file
    (``path:line``), or the task prompts of the ``batches`` batches the run can read."""
    if source.order is not None:
        for index, example in enumerate(source.dataset):
            yield _where(example, f"data example {index}"), example.prompt
        return
    for position in range(batches):
        for row, prompt in enumerate(source.batch(position).prompts):
            yield f"task batch {position} row {row}", prompt


def check_prompt_lengths(prompts: Iterable[tuple[str, str]], tokenizer: models.Tokenizer, cfg,
                         context: int) -> int:
    """Tokenizes every ``(where, prompt)`` and refuses (naming ``where``) an empty prompt or
    one longer than the compressed KV cache (``compression.eviction.budget + buffer``; prompts are
    never truncated) or the model's context (``context`` positions). Returns the longest
    prompt's length."""
    limits = [(context, "the model context (max_position_embeddings)")]
    if cfg.compression.compresses:
        limits.append((cfg.compression.capacity,
                       f"the KV cache (compression.eviction.budget + buffer = {cfg.compression.capacity})"))
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

    for item in prompts:
        batch.append(item)
        if len(batch) == _ENCODE_CHUNK:
            flush()
    if batch:
        flush()
    return longest


def checked_prompt_source(cfg, tokenizer: models.Tokenizer,
                          context: int) -> tuple[PromptSource, int]:
    """The run's :class:`PromptSource` with its data read (``file:line`` errors) and every
    prompt's length checked by :func:`check_prompt_lengths`, and the longest prompt's
    length: of the data file, or of the task batches the run can read (``trainer.steps``
    of them, ``data.max_collect_rounds`` times as many with ``data.dynamic_sampling``)."""
    source = PromptSource(cfg.data, cfg.trainer.prompts_per_step, tokenizer.hf)
    batches = cfg.trainer.steps * (cfg.data.max_collect_rounds if cfg.data.dynamic_sampling
                                   else 1)
    return source, check_prompt_lengths(_prompts(source, batches), tokenizer, cfg, context)


def checked_eval_set(cfg, tokenizer: models.Tokenizer,
                     context: int) -> tuple[tuple[list[str], list[str]] | None, int]:
    """The ``(prompts, answers)`` evaluated during training (``eval.every_steps`` /
    ``eval.before_train``; None when neither asks for it), read now (``eval.jsonl`` /
    ``eval.tfds`` errors name file and line) and every prompt's length checked like the
    training prompts, so a bad eval file fails before the run directory is written; and the
    longest prompt's length (0 without an eval set)."""
    if not (cfg.eval.every_steps or cfg.eval.before_train):
        return None, 0
    examples = eval_examples(cfg, tokenizer.hf)
    if not examples:
        source = cfg.eval.tfds.name if cfg.eval.tfds is not None else cfg.eval.jsonl.path
        raise ValueError(f"the eval set ({source}) holds no usable records; eval.every_steps="
                         f"{cfg.eval.every_steps} and eval.before_train="
                         f"{cfg.eval.before_train} need at least one")
    longest = check_prompt_lengths(((_where(x, f"eval prompt {i}"), x.prompt)
                                    for i, x in enumerate(examples)), tokenizer, cfg, context)
    return ([x.prompt for x in examples], [x.answer for x in examples]), longest
