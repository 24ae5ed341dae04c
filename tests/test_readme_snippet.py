"""The README's Functional API block runs as written (a tiny model in place of the path)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from sparse_rl_jax.tasks.rewards import math_verify_score
from tiny_hf import make_tiny_hf

README = Path(__file__).resolve().parents[1] / "README.md"


def functional_api_block() -> str:
    """The first ```python block after the '## Functional API' heading."""
    text = README.read_text()
    section = text[text.index("## Functional API"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_functional_api_snippet_runs_as_written(tmp_path):
    code = functional_api_block()
    placeholder = '"path/to/Qwen2.5-1.5B-Instruct"'
    assert code.count(placeholder) == 1
    path = make_tiny_hf(tmp_path, "qwen2")  # char tokenizer with a chat template
    namespace: dict = {}
    exec(compile(code.replace(placeholder, repr(path)), str(README), "exec"), namespace)

    G, texts, rollout = namespace["G"], namespace["texts"], namespace["rollout"]
    answers = namespace["answers"]
    assert len(texts) == rollout.response.shape[0] == G * len(answers)
    # the rewards are math-verify's verdicts on the decoded texts, prompt-major
    expected = [math_verify_score(t, answers[i // G]) for i, t in enumerate(texts)]
    assert namespace["rewards"].tolist() == expected
    assert np.isfinite(float(namespace["loss"]))
    assert float(np.max(rollout.kv_peak)) <= 64 + 16  # R-KV kept the cache at budget + buffer
