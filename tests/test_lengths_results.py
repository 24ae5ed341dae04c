"""The corrections study at real lengths (issue 53) as docs/results.md lays it out, on made-up
evidence, and the shipped default tied to the stored evidence."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from experiments.kit import lengths_rule, results_data, results_lengths  # noqa: E402
from results_helpers import run  # noqa: E402

GOOD = {"is_ess": 0.8, "kept_token_fraction": 0.9}
BATCH = {"rows": 256, "mismatch_k3": 0.1, "response_length_mean": 140.0}


def _regime(scores, seeds=5, dense=0.95):
    runs = [run("dense", s, dense) for s in range(seeds)]
    runs += [run(f"{p} rkv 22", s, scores.get(p, 0.5)) for p in lengths_rule.LENGTHS_ARMS
             for s in range(seeds)]
    return results_data.Experiment(lengths_rule.LENGTHS_REGIME, tuple(runs),
                                   ({"commit": "abc1234", "date": "d", "machine": "m",
                                     "command": "c", "wall_s": 1},))


def _walk(presets, dense=0.99):
    runs = [run("dense", s, dense) for s in range(5)]
    runs += [run(f"{p} rkv 32", s, 0.97) for p in presets for s in range(5)]
    return results_data.Experiment(lengths_rule.LENGTHS_WALK, tuple(runs),
                                   ({"commit": "abc1234", "date": "d", "machine": "m",
                                     "command": "c", "wall_s": 1},))


def _stats(passing, budgets=lengths_rule.SMOL_BUDGETS):
    bad = {"is_ess": 0.05, "kept_token_fraction": 0.9}
    return {b: {"batch": BATCH, "corrections": {
        p: dict(GOOD if p in passing else bad) for p in lengths_rule.LENGTHS_ARMS}}
        for b in budgets}


def test_the_complete_evidence_decides_and_the_default_follows():
    scores = {"decoupled_token_is": 0.93, "sparse_rl": 0.90}
    settings = {lengths_rule.LENGTHS_REGIME: _regime(scores),
                lengths_rule.LENGTHS_WALK: _walk(["decoupled_token_is", "sparse_rl"])}
    stats = _stats({"decoupled_token_is", "sparse_rl"})
    out = results_lengths.outcome(settings, stats)
    assert out["missing"] == [] and out["recommended"] == "decoupled_token_is"
    assert results_lengths.shipped_default(settings, stats, "before") == "decoupled_token_is"
    block = results_lengths.lengths_block(settings, stats)
    assert "Provisional" not in block
    assert "- Eligible (the regime, the walk and SmolLM2's screen): `sparse_rl`, " \
           "`decoupled_token_is`." in block
    assert "**By the rule: `decoupled_token_is`**" in block
    assert "| `decoupled_token_is` | 0.80 / 0.90 | 0.80 / 0.90 | 0.80 / 0.90 | pass |" in block
    assert "| `decoupled_seq_is` | not run | – | – |" in block


def test_readme_table_sums_up_each_arm_and_ends_with_the_verdict():
    """README's short form: per arm its parts, regime pass@1 (mean ± SE) and degraded seeds
    against the regime's dense arm, the walk's degraded seeds, SmolLM2's lowest ESS / kept
    fraction over the budgets, the criteria passed; then the rule's verdict."""
    scores = {"decoupled_token_is": 0.93}
    settings = {lengths_rule.LENGTHS_REGIME: _regime(scores),
                lengths_rule.LENGTHS_WALK: _walk(["decoupled_token_is"])}
    stats = _stats({"decoupled_token_is"})
    stats[96]["corrections"]["decoupled_token_is"]["is_ess"] = 0.6  # the lowest budget wins
    table = results_lengths.readme_table(settings, stats)
    assert "held-out pass@1 (dense-trained 0.950 ± 0.000)" in table.splitlines()[0]
    assert "| `decoupled_token_is` | 1 | 0.930 ± 0.000 | 0/5 | 0/5 | 0.60 / 0.90 | " \
           "regime, walk, SmolLM2 |" in table
    assert "| `decoupled_seq_is` | 1 | 0.500 ± 0.000 | 5/5 | not run | 0.05 / 0.90 | none |" \
        in table
    assert table.endswith(results_lengths.verdict(settings, stats))
    assert "**By the rule: `decoupled_token_is`**" in table


def test_missing_evidence_keeps_the_default_and_says_what_is_missing():
    scores = {"decoupled_token_is": 0.93}
    settings = {lengths_rule.LENGTHS_REGIME: _regime(scores, seeds=3),
                lengths_rule.LENGTHS_WALK: None}
    stats = _stats({"decoupled_token_is"}, budgets=(64, 96))
    out = results_lengths.outcome(settings, stats)
    assert out["missing"] == [
        "lengths_regime: 14 of 14 arms have fewer than 5 seeds",
        "SmolLM2 statistics missing at 128 slots"]
    assert results_lengths.shipped_default(settings, stats, "before") == "before"
    block = results_lengths.lengths_block(settings, stats)
    assert block.count("**Provisional**") == 1 and "(3 seeds)" in block
    assert "| `decoupled_token_is` | 0.80 / 0.90 | 0.80 / 0.90 | pending (128 not measured) |" \
        in block
    assert "| `sparse_rl` | 0.05 / 0.90 | 0.05 / 0.90 | fail |" in block
    # the SmolLM2 screen passes at the stored budgets, so the walk is what it lacks once the
    # last budget is in
    full = _stats({"decoupled_token_is"})
    assert "walk runs missing for `decoupled_token_is`" in \
        results_lengths.outcome(settings, full)["missing"]


def test_a_walk_preset_without_runs_of_its_own_reads_the_issue_47_runs_of_its_parts():
    stored = results_data.Experiment(lengths_rule.WALK_STORED, tuple(
        [run("dense", s, 0.99) for s in range(5)]
        + [run("icepop rkv 32", s, 0.80 if s == 0 else 0.97) for s in range(5)]), ())
    settings = {lengths_rule.LENGTHS_REGIME: _regime({}), lengths_rule.LENGTHS_WALK: None,
                lengths_rule.WALK_STORED: stored}
    table = results_lengths.walk_table(settings)
    assert "| `decoupled_token_icepop` | corrections_regime as icepop | 0/5 | 1/5 |" in table


def test_the_shipped_default_follows_the_stored_evidence():
    """``CorrectionConfig()``'s preset is the lengths study's winner once its stored evidence
    is complete, and the issue-47 study's outcome until then."""
    from experiments.kit import results_corrections
    from sparse_rl_jax.core.config_io import load_config
    from sparse_rl_jax.rl.loss_config import CorrectionConfig
    from sparse_rl_jax.training.run_config import RunConfig
    _, before = results_corrections.study_outcome(results_corrections.load_study())
    settings, stats = results_lengths.load_lengths()
    expected = results_lengths.shipped_default(settings, stats, before["default"])
    assert CorrectionConfig().kind == expected
    assert load_config(RunConfig, None, []).correction.kind == expected
