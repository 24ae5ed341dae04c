"""The diffuse-mismatch walk regime (configs/walk/diffuse.yaml, docs/regimes.md) and the
side-by-side table of experiments/mismatch_regimes.py: the config resolves to the settings the
docs state, on top of an unchanged walk regime; the statistics, band verdicts, tables and
where a batch's mismatch sits against hand-computed values; the stored SmolLM2 reference
sits in every band the issue derived from it; a batch's prompts come from a generated eval
set's held-out problems only."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest

import models
from experiments import mismatch_regimes
from experiments.kit.correction_batch import fitting_prompts
from experiments.kit.results_mismatch_regimes import (BANDED, REFERENCE, STATS, Stat, columns_of,
                                                  diffuseness, format_table, in_band,
                                                  read_stats, shape_table, verdicts)
from sparse_rl_jax.core.config_io import load_config
from sparse_rl_jax.training.evaluation import eval_set
from sparse_rl_jax.training.run_config import RunConfig

ROOT = Path(__file__).resolve().parents[1]
DIFFUSE = next(r for r in mismatch_regimes.REGIMES if r.name == "diffuse")
WALK = next(r for r in mismatch_regimes.REGIMES if r.name == "walk")


def regime_config(regime, *extra):
    """The regime's run config as the table's batches and the study's arms see it."""
    return load_config(RunConfig, str(ROOT / regime.config),
                       [*regime.overrides, f"compression.eviction.budget={regime.budget}",
                        *extra])


def test_diffuse_config_is_the_walk_regime_with_the_documented_changes():
    cfg, walk = regime_config(DIFFUSE), regime_config(WALK)
    assert (cfg.sampling.temperature, cfg.eval.temperature) == (1.6, 1.6)
    assert (cfg.data.walk.c_min, cfg.data.walk.c_max) == (2, 2)
    assert (cfg.data.walk.distractors_min, cfg.data.walk.distractors_max) == (4, 7)
    assert (cfg.compression.method, cfg.compression.eviction.budget,
            cfg.compression.eviction.buffer) == ("rkv", 22, 24)
    # every held-out prompt fits the cache (correction_stats and preflight never truncate)
    assert cfg.data.walk.max_prompt_tokens == 45 <= cfg.compression.capacity == 46
    # everything else is the walk study's setting
    changed = {"sampling": {"temperature"}, "eval": {"temperature"}}
    for section in ("model", "sampling", "trainer", "optim", "eval", "correction", "loss"):
        mine, theirs = dataclasses.asdict(getattr(cfg, section)), dataclasses.asdict(
            getattr(walk, section))
        for key in set(mine) - changed.get(section, set()):
            assert mine[key] == theirs[key], f"{section}.{key}"
    assert cfg.model.path == "data/warm_starts/walk_local2"
    assert (cfg.trainer.steps, cfg.trainer.prompts_per_step, cfg.sampling.num_samples,
            cfg.eval.num_prompts) == (80, 8, 4, 256)


def test_walk_regime_is_unchanged():
    walk = regime_config(WALK)
    assert (walk.sampling.temperature, walk.data.walk.c_min, walk.data.walk.c_max) == (1.0, 1, 2)
    assert (walk.data.walk.distractors_min, walk.data.walk.distractors_max) == (0, 3)
    assert (walk.compression.eviction.budget, walk.compression.eviction.buffer) == (32, 16)
    assert walk.data.walk.echo_every == 2 and walk.sampling.max_new_tokens == 200


def test_docs_state_the_config():
    cfg = regime_config(DIFFUSE)
    doc = (ROOT / "docs" / "regimes.md").read_text()
    header = (ROOT / DIFFUSE.config).read_text()
    for text in (doc, header):
        assert f"temperature {cfg.sampling.temperature:g}" in text
        assert f"R-KV {cfg.compression.eviction.budget}" in text
        assert (f"{cfg.compression.eviction.budget} + {cfg.compression.eviction.buffer}"
                in text)
        assert (f"{cfg.data.walk.distractors_min}-{cfg.data.walk.distractors_max} "
                "distractors") in text
    assert "python experiments/mismatch_regimes.py" in doc


def record(k3, ess, rs, srl, length):
    """A correction_stats budget record holding the table's five values."""
    return {"budget": 64, "config": "x.yaml",
            "batch": {"mismatch_k3": k3, "response_length_mean": length},
            "corrections": {"decoupled_seq_is": {"is_ess": ess, "rejection_rate": 0.0},
                            "decoupled_seq_is_rs": {"is_ess": 0.01, "rejection_rate": rs},
                            "sparse_rl": {"is_ess": 0.7, "rejection_rate": srl}}}


def test_read_stats_picks_each_correction_s_field():
    assert read_stats(record(0.171, 0.023, 0.961, 0.113, 144.9)) == {
        "mismatch_k3": 0.171, "seq_is_ess": 0.023, "seq_is_rs_rejection": 0.961,
        "sparse_rl_rejection": 0.113, "response_length_mean": 144.9}
    partial = record(0.1, 0.1, 0.1, 0.1, 100)
    del partial["corrections"]["decoupled_seq_is_rs"]
    with pytest.raises(KeyError, match="decoupled_seq_is_rs"):
        read_stats(partial)


@pytest.mark.parametrize("key, inside, outside", [
    ("mismatch_k3", [0.086, 0.171, 0.34], [0.0859, 0.3401, 0.0]),
    ("seq_is_ess", [0.0, 0.023, 0.1], [0.1001, 0.77]),
    ("seq_is_rs_rejection", [0.5, 0.961, 1.0], [0.4999, 0.0]),
    ("sparse_rl_rejection", [0.05, 0.113, 0.15], [0.0499, 0.1501, 0.004]),
    ("response_length_mean", [72, 145, 290], [71.9, 290.1]),
])
def test_bands_include_their_ends(key, inside, outside):
    stat = next(s for s in STATS if s.key == key)
    assert all(stat.holds(v) for v in inside) and not any(stat.holds(v) for v in outside)


def test_a_band_needs_an_ordered_end():
    with pytest.raises(ValueError, match="'x'.*low or a high"):
        Stat("x", "x", lambda r: 0.0, None, None)
    with pytest.raises(ValueError, match="'x'.*low 2 > high 1"):
        Stat("x", "x", lambda r: 0.0, 2, 1)


def test_in_band_needs_the_four_issue_bands_not_the_length():
    good = read_stats(record(0.2, 0.05, 0.9, 0.1, 10.0))
    assert verdicts(good) == {"mismatch_k3": True, "seq_is_ess": True,
                              "seq_is_rs_rejection": True, "sparse_rl_rejection": True,
                              "response_length_mean": False}
    assert in_band(good)
    outside = {"mismatch_k3": 0.5, "seq_is_ess": 0.2, "seq_is_rs_rejection": 0.3,
               "sparse_rl_rejection": 0.2}
    assert set(outside) == set(BANDED)
    for key, value in outside.items():
        assert not in_band({**good, key: value}), key


def test_table_against_hand_written_lines():
    columns = {"A": read_stats(record(0.171, 0.023, 0.961, 0.113, 144.9)),
               "B": read_stats(record(0.0069, 0.907, 0.062, 0.004, 75.75))}
    assert format_table(columns).splitlines() == [
        "| statistic | target band | A | B |",
        "|---|---|---|---|",
        "| per-token mismatch k3 | [0.086, 0.34] | 0.171 yes | 0.007 no |",
        "| decoupled_seq_is Kish ESS | <= 0.1 | 0.023 yes | 0.907 no |",
        "| decoupled_seq_is_rs rejection | >= 0.5 | 0.961 yes | 0.062 no |",
        "| sparse_rl rejection | [0.05, 0.15] | 0.113 yes | 0.004 no |",
        "| mean response length (tokens) | [72, 290] | 145 yes | 76 yes |",
    ]


def test_columns_and_summary_of_a_stored_result():
    a, b = read_stats(record(0.2, 0.05, 0.9, 0.1, 100)), read_stats(record(0, 1, 0, 0, 70))
    result = {"reference": {"label": "ref", "stats": a}, "regimes": {
        "diffuse": {"label": "diffuse R-KV 22", "seeds": {
            "0": {"stats": a, "all_in_band": True}, "1": {"stats": b, "all_in_band": False}}},
        "walk": {"label": "walk R-KV 32", "seeds": {"0": {"stats": b, "all_in_band": False}}}}}
    assert list(columns_of(result)) == ["ref", "diffuse R-KV 22 s0", "diffuse R-KV 22 s1",
                                        "walk R-KV 32 s0"]
    lines = mismatch_regimes.summary(result)
    assert lines[0].startswith("diffuse R-KV 22: all of") and lines[0].endswith(
        "in band on 1/2 seeds (0)")
    assert lines[1].endswith("in band on 0/1 seeds")


def test_smollm2_reference_sits_in_every_band():
    ref = mismatch_regimes.reference(REFERENCE)
    assert ref["budget"] == 64 and ref["config"] == "configs/smollm2/smollm2_rkv.yaml"
    assert all(verdicts(ref["stats"]).values()), ref["stats"]
    assert ref["stats"]["mismatch_k3"] == pytest.approx(0.1707, abs=1e-4)


def test_fitting_prompts_reads_a_generated_eval_set_s_held_out_problems():
    cfg = regime_config(DIFFUSE, "eval.num_prompts=40")
    tokenizer = models.Tokenizer(str(ROOT / cfg.model.path))
    prompts, answers, skipped = fitting_prompts(cfg, tokenizer, 32, cfg.compression.capacity)
    texts, truths = eval_set(cfg, tokenizer.hf)
    assert (prompts, answers, skipped) == (texts[:32], truths[:32], [])
    with pytest.raises(ValueError, match="only 40 of the eval set's 40"):
        fitting_prompts(cfg, tokenizer, 41, cfg.compression.capacity)


def test_diffuseness_against_hand_computed_values():
    # log r per token (dense minus sampler); -50 sits on padding and must not count
    log_r = np.array([[0.05, -0.2, 0.3, 0.0],      # clean, sequence ratio e^0.15: inside
                      [-10.0, 0.0, 0.0, -50.0],    # r = e^-10 < 1e-4: vetoed
                      [0.5, 0.5, -50.0, -50.0]])   # clean, sequence ratio e^1: outside
    mask = np.array([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]])
    k3 = {x: math.exp(x) - 1 - x for x in (0.05, -0.2, 0.3, -10.0, 0.5)}
    total = k3[0.05] + k3[-0.2] + k3[0.3] + k3[-10.0] + 2 * k3[0.5]
    got = diffuseness(np.full((3, 4), -1.0), log_r - 1.0, mask)
    assert got["shifted_tokens"] == pytest.approx(5 / 9)
    assert got["k3_share_low_r"] == pytest.approx(k3[-10.0] / total)
    assert got["unvetoed_outside_seq_band"] == pytest.approx(1 / 2)
    assert shape_table({"x": got}).splitlines()[2] == "| x | 0.556 | 0.961 | 0.500 |"
