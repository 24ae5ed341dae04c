"""TFDS datasets of prompt/answer examples (JSONL sets, the shipped task) for tfds.data_source.

One builder, ``SparseRlExamples``, writes ArrayRecord files with three text features
(``prompt``, ``answer``, ``meta`` as JSON) in generation order (shuffling disabled, so
record ``i`` of a split is the ``i``-th example of its source). Each named dataset is a
builder config, stored under ``data_dir/sparse_rl_examples/<name>/1.0.0/``, and reads back
with ``tfds.data_source("sparse_rl_examples/<name>", data_dir=...)`` or ``load_examples``.

Neither building nor reading needs TensorFlow (tensorflow-datasets serialises the examples
itself and reads ArrayRecord through ``array_record``); only ``tf.data`` pipelines
(``builder.as_dataset``) would.

A prepared dataset is reused when its source fingerprint (the configs plus the JSONL file
contents) matches; a different source under the same name is an error unless
``overwrite=True``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, overload

import tensorflow_datasets as tfds

from sparse_rl_jax.tasks.datasets import (DATASET_NAME_RE, DatasetConfig, Example, TfdsConfig,
                                          load_jsonl)
from sparse_rl_jax.tasks.task import Problem, TaskConfig, TaskDataset

BUILDER_NAME = "sparse_rl_examples"
VERSION = "1.0.0"


@dataclasses.dataclass(eq=False)
class ExamplesSource(tfds.core.BuilderConfig):
    """A builder config: for each split, a function yielding its examples, and a fingerprint."""

    splits: Mapping[str, Callable[[], Iterable[Example]]] = dataclasses.field(
        default_factory=dict, repr=False
    )
    fingerprint: str = ""


class SparseRlExamples(tfds.core.GeneratorBasedBuilder):
    """Writes an ``ExamplesSource``'s splits as ArrayRecord (build it with the functions below)."""

    VERSION = tfds.core.Version(VERSION)
    # Nothing is downloaded, so there is no checksums file beside the code. (tfds 4.9.10's
    # lookup of that file needs the `importlib_resources` backport even on Python >= 3.9.)
    code_path = None

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description="Prompt/answer examples for sparse-rl-jax.",
            features=tfds.features.FeaturesDict(
                {
                    "prompt": tfds.features.Text(),
                    "answer": tfds.features.Text(),
                    "meta": tfds.features.Text(),
                }
            ),
            disable_shuffling=True,
            metadata=tfds.core.MetadataDict(fingerprint=self.builder_config.fingerprint),
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # nothing to download
        return {
            split: self._generate_examples(make)
            for split, make in self.builder_config.splits.items()
        }

    def _generate_examples(self, make: Callable[[], Iterable[Example]]):
        for i, example in enumerate(make()):
            yield i, {
                "prompt": example.prompt,
                "answer": example.answer,
                "meta": json.dumps(example.meta, sort_keys=True),
            }


def dataset_dir(name: str, data_dir: str | Path) -> Path:
    """Where dataset ``name`` lives: ``data_dir/sparse_rl_examples/name/1.0.0``."""
    return Path(data_dir) / BUILDER_NAME / name / VERSION


def _stored_fingerprint(path: Path) -> str | None:
    try:
        return json.loads((path / "metadata.json").read_text())["fingerprint"]
    except (OSError, ValueError, KeyError):
        return None


def prepare_examples(
    name: str,
    splits: Mapping[str, Callable[[], Iterable[Example]]],
    data_dir: str | Path,
    fingerprint: str,
    overwrite: bool = False,
) -> Path:
    """Writes ``splits`` as TFDS dataset ``name`` under ``data_dir`` (or reuses a matching one).

    Args:
      name: dataset (config) name: lower-case letters, digits, underscores.
      splits: split name -> zero-argument function yielding that split's examples.
      data_dir: TFDS data directory.
      fingerprint: identifies the source; a stored dataset with the same one is reused.
      overwrite: replace a stored dataset whose fingerprint differs instead of raising.

    Returns:
      The dataset's directory.

    Raises:
      ValueError: a bad name or split name, no splits, or a stored dataset of a different
        source without ``overwrite``.
    """
    if not DATASET_NAME_RE.fullmatch(name):
        raise ValueError(f"dataset name {name!r} must match {DATASET_NAME_RE.pattern}")
    if not splits or not all(DATASET_NAME_RE.fullmatch(s) for s in splits):
        raise ValueError(
            f"splits {list(splits)} must be non-empty names matching {DATASET_NAME_RE.pattern}"
        )
    path = dataset_dir(name, data_dir)
    if path.exists():
        stored = _stored_fingerprint(path)
        if stored == fingerprint:
            return path
        if not overwrite:
            raise ValueError(
                f"{path} holds dataset {name!r} built from a different source "
                f"(fingerprint {stored} != {fingerprint}); pass overwrite=True or use another name"
            )
        shutil.rmtree(path)
    config = ExamplesSource(
        name=name, version=VERSION, splits=dict(splits), fingerprint=fingerprint
    )
    SparseRlExamples(
        config=config, data_dir=str(data_dir), file_format="array_record"
    ).download_and_prepare()
    return path


def _fingerprint(payload: Any) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[
        :16
    ]


def build_jsonl_tfds(
    name: str,
    splits: Mapping[str, DatasetConfig],
    data_dir: str | Path,
    tokenizer: Any = None,
    overwrite: bool = False,
) -> Path:
    """Loads each split's JSONL file (``load_jsonl``) and writes them as TFDS dataset ``name``.

    All files are read and validated before anything is written; the fingerprint covers the
    configs, the file contents and the tokenizer's chat template (chat template only).

    Returns:
      The dataset's directory.
    """
    loaded = {split: load_jsonl(cfg, tokenizer) for split, cfg in splits.items()}
    uses_chat = any(cfg.template == "chat" for cfg in splits.values())
    payload = {
        "kind": "jsonl",
        "splits": {
            split: {
                "config": dataclasses.asdict(cfg),
                "sha256": hashlib.sha256(Path(cfg.path).read_bytes()).hexdigest(),
            }
            for split, cfg in splits.items()
        },
        "chat_template": tokenizer.chat_template if uses_chat else None,
    }
    return prepare_examples(
        name,
        {split: (lambda data=data: iter(data)) for split, data in loaded.items()},
        data_dir,
        _fingerprint(payload),
        overwrite,
    )


def problem_example(problem: Problem, index: int) -> Example:
    """The shipped task's problem as an ``Example`` (``meta``: ``solution`` and ``index``)."""
    return Example(
        prompt=problem.prompt,
        answer=problem.answer,
        meta={"solution": problem.solution, "index": index},
    )


def build_task_tfds(
    name: str,
    splits: Mapping[str, tuple[TaskConfig, int]],
    data_dir: str | Path,
    overwrite: bool = False,
) -> Path:
    """Writes the first ``size`` problems of each split's ``TaskConfig`` as TFDS dataset ``name``.

    Args:
      splits: split name -> ``(task config, number of problems)``; give splits different
        seeds to keep them disjoint.

    Returns:
      The dataset's directory.
    """
    datasets = {split: TaskDataset(cfg, size) for split, (cfg, size) in splits.items()}
    payload = {
        "kind": "task",
        "splits": {s: [dataclasses.asdict(cfg), size] for s, (cfg, size) in splits.items()},
    }
    return prepare_examples(
        name,
        {
            split: (lambda ds=ds: (problem_example(p, i) for i, p in enumerate(ds)))
            for split, ds in datasets.items()
        },
        data_dir,
        _fingerprint(payload),
        overwrite,
    )


class TfdsExamples(Sequence[Example]):
    """One split of a prepared dataset as a random-access sequence of ``Example``."""

    def __init__(self, name: str, data_dir: str | Path, split: str):
        path = dataset_dir(name, data_dir)
        if not (path / "dataset_info.json").is_file():
            raise FileNotFoundError(
                f"no prepared dataset {name!r} in data_dir={str(data_dir)!r} (expected {path}); "
                "write it with build_jsonl_tfds or build_task_tfds"
            )
        self.source = tfds.data_source(
            f"{BUILDER_NAME}/{name}",
            split=split,
            data_dir=str(data_dir),
            download=False,
            try_gcs=False,
        )

    def __len__(self) -> int:
        return len(self.source)

    def __iter__(self) -> Iterator[Example]:
        return (self[i] for i in range(len(self)))

    @overload
    def __getitem__(self, index: int) -> Example: ...

    @overload
    def __getitem__(self, index: slice) -> list[Example]: ...

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        index = int(index)
        if not -len(self) <= index < len(self):
            raise IndexError(f"example index {index} out of range for {len(self)} examples")
        record = self.source[index % len(self)]
        return Example(
            prompt=record["prompt"].decode("utf-8"),
            answer=record["answer"].decode("utf-8"),
            meta=json.loads(record["meta"].decode("utf-8")),
        )


def load_examples(name: str, data_dir: str | Path, split: str = "train") -> TfdsExamples:
    """Split ``split`` of prepared dataset ``name`` (via ``tfds.data_source``; no TensorFlow)."""
    return TfdsExamples(name, data_dir, split)


def open_examples(cfg: TfdsConfig, jsonl: DatasetConfig | None = None,
                  tokenizer: Any = None) -> TfdsExamples:
    """``cfg``'s split; when ``jsonl`` is given the dataset is first written from that file
    (``build_jsonl_tfds``; reused while the file and configs are unchanged)."""
    if jsonl is not None:
        build_jsonl_tfds(cfg.name, {cfg.split: jsonl}, cfg.data_dir, tokenizer)
    return load_examples(cfg.name, cfg.data_dir, cfg.split)
