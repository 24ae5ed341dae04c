"""The shipped data and configs as a user runs them: every file under data/ loads with the
settings data/README.md gives, keeping exactly the rows with a usable answer, and every
config under configs/ validates and finds its training and eval sets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from sparse_rl_jax.core.config_io import load_config
from sparse_rl_jax.tasks.datasets import DatasetConfig, load_jsonl
from sparse_rl_jax.tasks.task_tokenizer import build_task_tokenizer
from sparse_rl_jax.training.run_config import RunConfig

ROOT = Path(__file__).resolve().parents[1]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# (file, loader settings as data/README.md states them, 1-based lines with an empty answer)
SHIPPED = [
    ("train/simplelr_qwen_level3to5/train.jsonl",
     dict(prompt_field="prompt", answer_field="label", template="raw"), (5055, 5159)),
    ("train/simplelr_level3to5/train.jsonl",
     dict(prompt_field="prompt", answer_field="label", template="chat"), (5055, 5159)),
    ("eval/gsm8k/test.jsonl", dict(prompt_field="question", answer_format="gsm8k_hash"), ()),
    ("eval/math500/test.jsonl", dict(prompt_field="problem"), ()),
    ("eval/math500/test.jsonl",
     dict(prompt_field="problem", answer_field="solution", answer_format="boxed_in_solution"), ()),
    ("eval/aime24/test.jsonl", dict(prompt_field="problem"), ()),
    ("eval/amc23/test.jsonl", dict(prompt_field="question"), ()),
    ("eval/gaokao2023en/test.jsonl", dict(prompt_field="question"), (168, 193)),
]


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    tok = AutoTokenizer.from_pretrained(build_task_tokenizer(tmp_path_factory.mktemp("tok")))
    tok.chat_template = CHATML
    return tok


def _raw_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text("utf-8").splitlines() if line.strip()]


def _has_answer(value, fmt: str) -> bool:
    """Whether a record's answer value holds a gold answer (written apart from the loader)."""
    text = str(value)
    if fmt == "gsm8k_hash":
        return "####" in text and bool(text.rsplit("####", 1)[1].strip())
    if fmt == "boxed_in_solution":
        return "\\boxed{" in text
    return bool(text.strip())


@pytest.mark.parametrize("name, settings, empty_lines", SHIPPED,
                         ids=[f"{n}:{s.get('answer_format', 'plain')}" for n, s, _ in SHIPPED])
def test_every_shipped_file_loads_with_its_documented_settings(
        name, settings, empty_lines, chat_tokenizer):
    path = ROOT / "data" / name
    rows = _raw_rows(path)
    field = settings.get("answer_field", "answer")
    fmt = settings.get("answer_format", "plain")
    # Independent count: the rows whose gold answer text is non-empty.
    usable = [i for i, r in enumerate(rows, 1) if _has_answer(r[field], fmt)]
    assert tuple(i for i in range(1, len(rows) + 1) if i not in set(usable)) == empty_lines

    cfg = DatasetConfig(path=str(path), on_error="skip", **settings)
    loaded = load_jsonl(cfg, chat_tokenizer)
    assert len(loaded.examples) == len(usable)
    assert tuple(s.line for s in loaded.skipped) == empty_lines
    assert all("empty" in s.reason for s in loaded.skipped)
    assert all(ex.prompt.strip() and ex.answer for ex in loaded.examples)
    if empty_lines:  # the default refuses the file and names the first bad line
        with pytest.raises(ValueError, match=f":{empty_lines[0]}:"):
            load_jsonl(DatasetConfig(path=str(path), **settings), chat_tokenizer)


CONFIGS = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "configs").rglob("*.yaml"))


@pytest.mark.parametrize("config", CONFIGS)
def test_every_shipped_config_validates_and_finds_its_data(config, chat_tokenizer):
    cfg = load_config(RunConfig, ROOT / config)
    for section in (cfg.data.jsonl, cfg.eval.jsonl):
        if section is None:
            continue
        path = ROOT / section.path
        assert path.is_file(), f"{config}: {section.path} is not shipped"
        loaded = load_jsonl(DatasetConfig(**{**section.__dict__, "path": str(path)}),
                            chat_tokenizer)
        assert len(loaded.examples) >= cfg.trainer.prompts_per_step
