"""The guard on the published walk results: the regime's first steps still measure what
docs/results.md reports (experiments/fingerprint.py), and the stored fingerprint is the start
of the very runs the page was made from."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from experiments.kit import regime_fingerprint as fingerprint

ROOT = Path(__file__).resolve().parents[1]
STORED = json.loads(fingerprint.STORED.read_text())


@pytest.mark.slow  # two arms, two steps each, of the real regime config
def test_the_regime_still_measures_what_the_results_report(tmp_path):
    measured = fingerprint.fingerprint(tmp_path)
    stale = fingerprint.differences(STORED, measured)
    assert not stale, (
        "the walk regime no longer measures what docs/results.md reports:\n  "
        + "\n  ".join(stale)
        + f"\nif the change is intended, regenerate the results in this commit: "
          f"{fingerprint.REGENERATE}")


def test_the_fingerprint_is_the_start_of_the_published_seed():
    """Its rewards and mismatch are the first steps of seed 0's runs in the regime's results
    (docs/results/regime/*.json): the guard and the page were measured by the same code."""
    runs = [run for part in sorted((ROOT / "docs" / "results" / "regime").glob("*.json"))
            for run in json.loads(part.read_text())["runs"]]
    for arm in fingerprint.ARMS:
        (run,) = [r for r in runs if r["arm"] == arm and r["seed"] == fingerprint.SEED]
        for key in ("reward_mean", "mismatch_k3", "rejection_rate"):
            published = run["steps"][key][:fingerprint.STEPS]
            stored = STORED["arms"][arm][key]
            assert published == pytest.approx(stored, rel=fingerprint.RTOL,
                                              abs=fingerprint.ATOL), (arm, key)


def test_differences_name_every_moved_value():
    assert fingerprint.differences(STORED, STORED["arms"]) == []
    moved = copy.deepcopy(STORED["arms"])
    naive, corrected = fingerprint.ARMS
    moved[naive]["reward_mean"][1] += 1 / 32                 # one more correct sample
    moved[corrected]["loss"][0] *= 1 + 10 * fingerprint.RTOL  # e.g. another normaliser
    moved[corrected]["mismatch_k3"][1] *= 1 + fingerprint.RTOL / 10  # within tolerance
    assert fingerprint.differences(STORED, moved) == [
        f"{naive}, step 2: reward_mean {moved[naive]['reward_mean'][1]:.6g}, stored "
        f"{STORED['arms'][naive]['reward_mean'][1]:.6g}",
        f"{corrected}, step 1: loss {moved[corrected]['loss'][0]:.6g}, stored "
        f"{STORED['arms'][corrected]['loss'][0]:.6g}"]
    moved[naive]["loss"].append(0.0)
    assert (f"{naive}: {fingerprint.STEPS + 1} steps of loss, stored {fingerprint.STEPS}"
            in fingerprint.differences(STORED, moved))
