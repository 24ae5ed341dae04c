"""The committed SmolLM2 length record (``benchmarks/smollm2_lengths.py``) is a consistent
sample, and ``bench_engine.py``'s caps (``benchmarks/kit/length_caps.py``) replay exactly its
first rows, or say why not."""

from __future__ import annotations

import json

import numpy as np

from benchmarks.kit import length_caps


def _record() -> dict:
    return json.loads(length_caps.SMOLLM2_LENGTHS.read_text())


def test_the_record_is_a_prompt_major_sample_of_the_configured_shape():
    rec = _record()
    lengths, finished = np.asarray(rec["lengths"]), np.asarray(rec["finished"])
    assert lengths.shape == finished.shape == (rec["prompts"] * rec["samples"],)
    cap = rec["max_new_tokens"]
    assert ((lengths >= 1) & (lengths <= cap)).all()
    # a row without EOS ran to the cap; one with EOS counts it, so it ended at the cap or before
    assert (lengths[~finished] == cap).all()
    assert rec["temperature"] == 0.7 and cap == 256 and rec["command"].startswith("python ")


def test_bench_engine_replays_the_first_rows_as_caps():
    rec = _record()
    caps, max_new = length_caps.smollm2_caps(64)
    np.testing.assert_array_equal(caps, rec["lengths"][:64])
    assert caps.dtype == np.int32 and max_new == rec["max_new_tokens"]
    too_many = len(rec["lengths"]) + 4
    reason = length_caps.smollm2_caps(too_many)
    assert isinstance(reason, str) and f"--rows {too_many}" in reason


def test_without_the_record_the_distribution_is_left_out_with_the_command(tmp_path,
                                                                         monkeypatch):
    monkeypatch.setattr(length_caps, "SMOLLM2_LENGTHS", tmp_path / "smollm2_lengths.json")
    reason = length_caps.smollm2_caps(8)
    assert isinstance(reason, str) and "benchmarks/smollm2_lengths.py" in reason
