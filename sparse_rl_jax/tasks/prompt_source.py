"""Prompts and gold answers for RL step ``s`` (a pure function of the config and ``s``), and
the eval set.

Because batch ``s`` depends only on the data seed and ``s``, a resumed run sees exactly the
prompts an uninterrupted run would have seen, with no iterator state to checkpoint.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

from sparse_rl_jax.tasks.datasets import EpochShuffle, gather, load_jsonl
from sparse_rl_jax.tasks.rewards import Answer
from sparse_rl_jax.tasks.walk_task import synthetic_dataset


class PromptBatch(NamedTuple):
    """``prompts`` (strings, fed to the tokenizer as is) and their gold ``answers``."""

    prompts: list[str]
    answers: list[Answer]


class PromptSource:
    """Deterministic, resumable prompt batches from the shipped task, a JSONL file or a TFDS
    dataset (``data.source``).

    Args:
      data: the run's ``DataSection``.
      batch_size: prompts per batch.
      tokenizer: a ``transformers`` tokenizer (needed by the ``chat`` template only).
    """

    def __init__(self, data: Any, batch_size: int, tokenizer: Any = None):
        self.batch_size = batch_size
        self.order = None
        if data.source in ("task", "walk"):  # endless: batch s holds problems [sB, (s+1)B)
            self.dataset = synthetic_dataset(data.synthetic, size=2**40)
            return
        if data.source == "tfds":
            from sparse_rl_jax.tasks.tfds_builder import open_examples  # imports tensorflow_datasets

            self.dataset = open_examples(data.tfds, data.jsonl, tokenizer)
            where = f"data.tfds: {data.tfds.name}/{data.tfds.split} in {data.tfds.data_dir}"
        else:
            self.dataset = load_jsonl(data.jsonl, tokenizer)
            where = f"data.jsonl: {data.jsonl.path}"
        if len(self.dataset) < batch_size:
            raise ValueError(f"{where} holds {len(self.dataset)} usable records, "
                             f"fewer than trainer.prompts_per_step={batch_size}")
        self.order = EpochShuffle(len(self.dataset), batch_size, seed=data.shuffle_seed)

    def batch(self, position: int) -> PromptBatch:
        """The prompts of batch ``position`` (>= 0)."""
        if self.order is None:
            start = position * self.batch_size
            items = self.dataset[start : start + self.batch_size]
        else:
            items = gather(self.dataset, self.order.batch_indices(position))
        return PromptBatch([item.prompt for item in items], [item.answer for item in items])


def eval_examples(cfg: Any, tokenizer: Any = None) -> list:
    """The eval set of a ``RunConfig``: the first ``eval.num_prompts`` examples of
    ``eval.tfds`` (written from ``eval.jsonl`` first when both are set) or ``eval.jsonl``
    (``path:line`` in each ``meta``; a malformed record raises ``RecordError`` naming them),
    else held-out problems of the synthetic task (``data.synthetic``, ``eval.task_seed``).
    Each item has ``prompt`` and ``answer``; ``tokenizer`` (``transformers``) renders a chat
    template."""
    if cfg.eval.tfds is not None:
        from sparse_rl_jax.tasks.tfds_builder import open_examples  # imports tensorflow_datasets

        return list(open_examples(cfg.eval.tfds, cfg.eval.jsonl, tokenizer)[: cfg.eval.num_prompts])
    if cfg.eval.jsonl is not None:
        return list(load_jsonl(cfg.eval.jsonl, tokenizer))[: cfg.eval.num_prompts]
    task = dataclasses.replace(cfg.data.synthetic, seed=cfg.eval.task_seed)
    return list(synthetic_dataset(task, cfg.eval.num_prompts)[:])
