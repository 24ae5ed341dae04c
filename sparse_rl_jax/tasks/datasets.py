"""Prompt/answer examples from JSONL files, and a resumable shuffled batch order.

One ``DatasetConfig`` describes one file. Settings for the public sets (see the data README):

=======================  ============  ============  =================  ==========
set                      prompt_field  answer_field  answer_format      template
=======================  ============  ============  =================  ==========
SimpleRL-Zoo (Qwen)      prompt        label         plain              raw
SimpleRL-Zoo (msgs)      prompt        label         plain              chat
GSM8K                    question      answer        gsm8k_hash         boxed/chat
MATH500, AIME24          problem       answer        plain              boxed/chat
AMC23 (float answer)     question      answer        plain              boxed/chat
Gaokao2023en             question      answer        plain              boxed/chat
MATH (no answer field)   problem       solution      boxed_in_solution  boxed/chat
OlympiadBench (list)     question      final_answer  plain              boxed/chat
=======================  ============  ============  =================  ==========

Answers are kept as the file states them (``27.0``, ``$\\frac{\\pi}{3}$``); the math reward
parses them. A list answer becomes a tuple of strings, any of which is correct
(``rewards.math_verify`` and ``task_exact`` accept either form). ``boxed_in_solution`` takes
the content of the solution's last ``\\boxed{...}`` (nested braces balanced); it matches
MATH500's ``answer`` field on all 500 rows, but not AIME24's AoPS solutions (use its
``answer`` field). A malformed record raises ``RecordError`` naming the file and line, or, with
``on_error="skip"``, is counted in ``LoadedDataset.skipped`` and logged.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, overload

import numpy as np

from sparse_rl_jax.core.config_checks import check, check_choice, check_int, check_text
from sparse_rl_jax.tasks.prompts import (BOXED_INSTRUCTION, TEMPLATES, check_chat_tokenizer,
                                         render_prompt)
from sparse_rl_jax.tasks.rewards import Answer, last_boxed

log = logging.getLogger(__name__)
T = TypeVar("T")

ANSWER_FORMATS = ("plain", "gsm8k_hash", "boxed_in_solution")
ON_ERROR = ("raise", "skip")
DATASET_NAME_RE = re.compile(r"[a-z][a-z0-9_]*")  # TFDS dataset and split names


@dataclasses.dataclass(frozen=True)
class DatasetConfig:
    """How to read one JSONL file into examples.

    Attributes:
      path: the JSONL file (one JSON object a line; blank lines are ignored).
      prompt_field: the field holding the question / prompt string or chat messages.
      answer_field: the field holding the gold answer (string, number, or a list of them).
      answer_format: "plain" (the value itself), "gsm8k_hash" (the text after the last
        ``####`` of a GSM8K solution) or "boxed_in_solution" (the content of the last
        ``\\boxed{...}`` of a solution text).
      template: "raw", "boxed" or "chat" (see ``sparse_rl_jax.tasks.prompts``).
      instruction: appended to a string question by the boxed and chat templates.
      system_prompt: system message the chat template puts before a string question.
      max_records: keep at most this many examples (None: all).
      on_error: "raise" at the first malformed record, or "skip" it and count it.
      meta_fields: record fields copied into ``Example.meta`` (missing ones are malformed).
    """

    path: str
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    answer_format: Literal["plain", "gsm8k_hash", "boxed_in_solution"] = "plain"
    template: Literal["raw", "boxed", "chat"] = "raw"
    instruction: str = BOXED_INSTRUCTION
    system_prompt: str | None = None
    max_records: int | None = None
    on_error: Literal["raise", "skip"] = "raise"
    meta_fields: tuple[str, ...] = ()

    def __post_init__(self):
        for field in ("path", "prompt_field", "answer_field"):
            check_text(self, field)
        check_choice(self, "answer_format", ANSWER_FORMATS)
        check_choice(self, "template", TEMPLATES)
        check_choice(self, "on_error", ON_ERROR)
        check(isinstance(self.instruction, str), self, "instruction", "must be a string")
        check(self.system_prompt is None or isinstance(self.system_prompt, str), self,
              "system_prompt", "must be None or a string")
        check_int(self, "max_records", 1, optional=True)
        check(isinstance(self.meta_fields, tuple)
              and all(isinstance(f, str) for f in self.meta_fields), self, "meta_fields",
              "must be a tuple of strings")


@dataclasses.dataclass(frozen=True)
class TfdsConfig:
    """One split of a TFDS dataset written by ``tfds_builder`` (builder
    ``sparse_rl_examples``), read with random access through ``tfds.data_source`` (no
    TensorFlow needed).

    Attributes:
      name: the dataset's name: lower-case letters, digits, underscores.
      data_dir: the TFDS data directory holding it.
      split: the split read.
    """

    name: str
    data_dir: str
    split: str = "train"

    def __post_init__(self):
        for field in ("name", "split"):
            value = getattr(self, field)
            check(isinstance(value, str) and bool(DATASET_NAME_RE.fullmatch(value)), self, field,
                  "must be lower-case letters, digits and underscores, starting with a letter")
        check_text(self, "data_dir", "must be a non-empty path")


@dataclasses.dataclass(frozen=True)
class Example:
    """One prompt with its gold answer; ``meta`` holds provenance (path, line) and extras.

    ``answer`` is a string, or a tuple of strings any of which is correct (a list answer).
    """

    prompt: str
    answer: Answer
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)


class RecordError(ValueError):
    """A malformed JSONL record; the message starts with ``path:line:``."""

    def __init__(self, path: str, line: int, reason: str):
        super().__init__(f"{path}:{line}: {reason}")
        self.path, self.line, self.reason = path, line, reason


@dataclasses.dataclass(frozen=True)
class SkippedRecord:
    """A record left out under ``on_error="skip"``: its 1-based line and why."""

    line: int
    reason: str


@dataclasses.dataclass(frozen=True)
class LoadedDataset(Sequence[Example]):
    """The examples of one file (a sequence) plus the records skipped as malformed."""

    path: str
    examples: tuple[Example, ...]
    skipped: tuple[SkippedRecord, ...] = ()

    @property
    def num_skipped(self) -> int:
        """How many malformed records were skipped."""
        return len(self.skipped)

    def __len__(self) -> int:
        return len(self.examples)

    @overload
    def __getitem__(self, index: int) -> Example: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[Example, ...]: ...

    def __getitem__(self, index):
        return self.examples[index]


def extract_answer(value: Any, answer_format: str) -> Answer:
    """The gold answer of a record's answer ``value``: a string, or a tuple for a list.

    "plain": a string as is, a number as ``str(number)`` (AMC's 27.0 stays "27.0"; the
    math reward treats it as 27). "gsm8k_hash": the stripped text after the last ``####``.
    "boxed_in_solution": the content of the last ``\\boxed{...}`` of a solution text. A
    non-empty list gives the tuple of its elements, each read as above (any is correct).

    Raises:
      ValueError: wrong type, no ``####`` / box, an empty answer or an empty list.
    """
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"answer_format={answer_format!r} must be one of {ANSWER_FORMATS}")
    if isinstance(value, list):
        if not value:
            raise ValueError("answer is an empty list")
        try:
            return tuple(_extract_one(v, answer_format) for v in value)
        except ValueError as e:
            raise ValueError(f"list element: {e}") from e
    return _extract_one(value, answer_format)


def _extract_one(value: Any, answer_format: str) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(
            f"answer must be a string, a number or a list of them, got {type(value).__name__}"
        )
    text = value if isinstance(value, str) else str(value)
    if answer_format == "gsm8k_hash":
        if not isinstance(value, str) or "####" not in value:
            raise ValueError("answer has no '####' (answer_format='gsm8k_hash')")
        text = value.rsplit("####", 1)[1]
    elif answer_format == "boxed_in_solution":
        boxed = last_boxed(text) if isinstance(value, str) else None
        if boxed is None:
            raise ValueError(
                "solution has no closed \\boxed{...} (answer_format='boxed_in_solution')"
            )
        text = boxed
    text = text.strip()
    if not text:
        raise ValueError("answer is empty")
    return text


def parse_record(record: Any, cfg: DatasetConfig, tokenizer: Any = None) -> Example:
    """The example for one decoded JSON record (no provenance in ``meta``).

    Raises:
      ValueError: the record is not an object, lacks a configured field, or a field is
        malformed; the message names the field.
    """
    if not isinstance(record, dict):
        raise ValueError(f"record must be a JSON object, got {type(record).__name__}")
    wanted = (cfg.prompt_field, cfg.answer_field, *cfg.meta_fields)
    missing = [f for f in wanted if f not in record]
    if missing:
        raise ValueError(f"missing field(s) {missing}; record has {sorted(record)}")
    try:
        prompt = render_prompt(
            record[cfg.prompt_field],
            cfg.template,
            tokenizer=tokenizer,
            instruction=cfg.instruction,
            system_prompt=cfg.system_prompt,
        )
    except ValueError as e:
        raise ValueError(f"field {cfg.prompt_field!r}: {e}") from e
    try:
        answer = extract_answer(record[cfg.answer_field], cfg.answer_format)
    except ValueError as e:
        raise ValueError(f"field {cfg.answer_field!r}: {e}") from e
    return Example(prompt=prompt, answer=answer, meta={f: record[f] for f in cfg.meta_fields})


def load_jsonl(cfg: DatasetConfig, tokenizer: Any = None) -> LoadedDataset:
    """Reads ``cfg.path`` into examples (``meta`` gets ``path`` and 1-based ``line``).

    Args:
      cfg: the file and its field/format/template settings.
      tokenizer: a ``transformers`` tokenizer; required by ``template="chat"``.

    Raises:
      FileNotFoundError: ``cfg.path`` does not exist.
      ValueError: ``template="chat"`` without a usable tokenizer (before reading).
      RecordError: a malformed record under ``on_error="raise"`` (names path and line).
    """
    path = Path(cfg.path)
    if not path.is_file():
        raise FileNotFoundError(f"DatasetConfig.path={cfg.path!r}: no such file")
    if cfg.template == "chat":
        try:
            check_chat_tokenizer(tokenizer)
        except ValueError as e:
            raise ValueError(f"DatasetConfig.template='chat' for {cfg.path}: {e}") from e
    examples: list[Example] = []
    skipped: list[SkippedRecord] = []
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            if cfg.max_records is not None and len(examples) >= cfg.max_records:
                break
            try:
                text = raw.decode("utf-8")
                if not text.strip():
                    continue
                example = parse_record(json.loads(text), cfg, tokenizer)
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                reason = f"invalid JSON: {e}"
            except ValueError as e:
                reason = str(e)
            else:
                meta = {"path": str(path), "line": line_no, **example.meta}
                examples.append(dataclasses.replace(example, meta=meta))
                continue
            if cfg.on_error == "raise":
                raise RecordError(str(path), line_no, reason)
            skipped.append(SkippedRecord(line=line_no, reason=reason))
    if skipped:
        first = skipped[0]
        log.warning(
            "%s: skipped %d malformed record(s); first at line %d: %s",
            path,
            len(skipped),
            first.line,
            first.reason,
        )
    return LoadedDataset(path=str(path), examples=tuple(examples), skipped=tuple(skipped))


@dataclasses.dataclass(frozen=True)
class EpochShuffle:
    """A deterministic, resumable batch order over ``num_examples`` items.

    Batch ``position`` (0, 1, 2, ... across epochs) is a pure function of
    ``(seed, position)``: epoch ``e = position // batches_per_epoch`` is a fresh permutation
    drawn from ``(seed, e)``, cut into ``batch_size`` slices; the last ``num_examples %
    batch_size`` items of each epoch's order are left out. Resuming from a checkpointed
    position gives exactly the batches an uninterrupted run would have seen.

    Attributes:
      num_examples: dataset size (>= batch_size).
      batch_size: indices per batch (>= 1).
      seed: shuffle seed.
      shuffle: False keeps file order in every epoch.
    """

    num_examples: int
    batch_size: int
    seed: int = 0
    shuffle: bool = True

    def __post_init__(self):
        check_int(self, "batch_size", 1)
        check_int(self, "num_examples", self.batch_size,
                  f"must be an int >= batch_size={self.batch_size}")

    @property
    def batches_per_epoch(self) -> int:
        """Full batches in one epoch."""
        return self.num_examples // self.batch_size

    def batch_indices(self, position: int) -> np.ndarray:
        """Dataset indices of batch ``position`` (>= 0): ``[batch_size]`` int64."""
        if position < 0:
            raise ValueError(f"batch position {position} must be >= 0")
        epoch, k = divmod(position, self.batches_per_epoch)
        order = _epoch_order(self.num_examples, self.seed, epoch, self.shuffle)
        return order[k * self.batch_size : (k + 1) * self.batch_size].copy()

    def batches(self, start: int = 0) -> Iterator[tuple[int, np.ndarray]]:
        """Endless ``(position, indices)`` pairs from batch ``start`` on."""
        position = start
        while True:
            yield position, self.batch_indices(position)
            position += 1


@functools.lru_cache(maxsize=4)
def _epoch_order(num_examples: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    if not shuffle:
        return np.arange(num_examples, dtype=np.int64)
    return np.random.default_rng([seed, epoch]).permutation(num_examples).astype(np.int64)


def gather(dataset: Sequence[T], indices: Sequence[int] | np.ndarray) -> list[T]:
    """``[dataset[i] for i in indices]`` (works for lists, ``LoadedDataset``, ``TaskDataset``)."""
    return [dataset[int(i)] for i in indices]
