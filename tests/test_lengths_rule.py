"""The corrections study at real lengths (issue 53): its pre-registered rule on made-up
settings, checked against the rule's words and plain NumPy."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from experiments.kit import lengths_rule, results_data  # noqa: E402
from results_helpers import run  # noqa: E402

OK = (False,) * 5
GOOD_STATS = {"is_ess": 0.8, "kept_token_fraction": 0.9}


def _setting(name, per_preset, dense=0.99, label="rkv 32"):
    runs = [run("dense", s, dense) for s in range(5)]
    for preset, (scores, collapsed) in per_preset.items():
        runs += [run(f"{preset} {label}", s, scores[s], collapsed=collapsed[s])
                 for s in range(5)]
    return results_data.Experiment(name, tuple(runs), ({"commit": "abc1234"},))


def _stats(per_preset, budgets=lengths_rule.SMOL_BUDGETS):
    return {b: {"corrections": {p: dict(per_preset[p]) for p in per_preset}} for b in budgets}


def _study(regime, walk, stored=None):
    settings = {lengths_rule.LENGTHS_REGIME: _setting(lengths_rule.LENGTHS_REGIME, regime),
                lengths_rule.LENGTHS_WALK: _setting(lengths_rule.LENGTHS_WALK, walk)}
    if stored is not None:
        settings[lengths_rule.WALK_STORED] = _setting(lengths_rule.WALK_STORED, stored)
    dense = {name: exp.arm("dense") for name, exp in settings.items()}
    return settings, dense


def test_the_leader_ties_within_two_se_and_the_fewest_parts_win():
    regime = {"sparse_rl": ((0.90, 0.91, 0.92, 0.90, 0.91), OK),
              "decoupled_token_is": ((0.91, 0.90, 0.92, 0.91, 0.90), OK),
              "decoupled_k3_rs_token_tis": ((0.93, 0.92, 0.94, 0.92, 0.93), OK)}
    settings, dense = _study(regime, regime)
    parts = {"sparse_rl": 4, "decoupled_token_is": 1, "decoupled_k3_rs_token_tis": 2}
    out = lengths_rule.lengths_recommend(settings, dense, _stats({p: GOOD_STATS for p in parts}),
                                         list(parts), parts)
    assert out["eligible_any"] and out["leader"] == "decoupled_k3_rs_token_tis"
    for other in ("sparse_rl", "decoupled_token_is"):
        gap = np.array(regime["decoupled_k3_rs_token_tis"][0]) - np.array(regime[other][0])
        tie = not (gap.mean() > 0 and gap.mean() > 2 * gap.std(ddof=1) / np.sqrt(5))
        assert (other in out["tied"]) == tie
    expected = "decoupled_token_is" if "decoupled_token_is" in out["tied"] else (
        "decoupled_k3_rs_token_tis")
    assert out["recommended"] == expected
    assert out["means"]["sparse_rl"] == np.mean(regime["sparse_rl"][0])


def test_smollm2_screen_needs_every_budget_above_both_floors():
    assert lengths_rule.smol_screen(_stats({"a": GOOD_STATS}), "a")[0]
    low_ess = _stats({"a": GOOD_STATS})
    low_ess[96]["corrections"]["a"]["is_ess"] = 0.29
    ok, words = lengths_rule.smol_screen(low_ess, "a")
    assert not ok and "96: ESS 0.29" in words
    low_kept = _stats({"a": GOOD_STATS})
    low_kept[128]["corrections"]["a"]["kept_token_fraction"] = 0.49
    assert not lengths_rule.smol_screen(low_kept, "a")[0]
    missing = _stats({"a": GOOD_STATS}, budgets=(64, 96))
    ok, words = lengths_rule.smol_screen(missing, "a")
    assert not ok and "128: not measured" in words
    edge = _stats({"a": {"is_ess": lengths_rule.SMOL_MIN_ESS,
                         "kept_token_fraction": lengths_rule.SMOL_MIN_KEPT}})
    assert lengths_rule.smol_screen(edge, "a")[0]  # the floors are inclusive


def test_walk_evidence_comes_from_stored_runs_with_the_same_parts_whatever_their_name():
    """``icepop`` ran the parts of ``decoupled_token_icepop``; the issue-47 ``decoupled_geo_rs``
    ran the pre-0.9 numbers (``decoupled_geo_rs_veto``), not verl 0.9's."""
    stored = {"icepop": ((0.95,) * 5, OK), "decoupled_geo_rs": ((0.97,) * 5, OK)}
    settings, _ = _study({}, {}, stored)
    runs, where = lengths_rule.walk_runs(settings, "decoupled_token_icepop")
    assert where == f"{lengths_rule.WALK_STORED} as icepop" and len(runs) == 5
    assert lengths_rule.walk_runs(settings, "decoupled_geo_rs") == ([], "not run")
    runs, where = lengths_rule.walk_runs(settings, "decoupled_geo_rs_veto")
    assert where.endswith("as decoupled_geo_rs") and runs[0]["arm"] == "decoupled_geo_rs rkv 32"
    own = {"decoupled_token_icepop": ((0.5,) * 5, OK)}
    settings, _ = _study({}, own, stored)
    runs, where = lengths_rule.walk_runs(settings, "decoupled_token_icepop")
    assert where == lengths_rule.LENGTHS_WALK and runs[0]["eval"][0]["pass_at_1"] == 0.5


def test_a_collapse_or_degrade_anywhere_makes_a_preset_ineligible():
    collapse = (True,) + (False,) * 4
    regime = {"a_p": ((0.95,) * 5, OK), "b_p": ((0.97,) * 5, collapse)}
    walk = {"a_p": ((0.95, 0.95, 0.80, 0.95, 0.95), OK), "b_p": ((0.97,) * 5, OK)}
    settings, dense = _study(regime, walk)
    table = {p: lengths_rule.trained(settings[lengths_rule.LENGTHS_WALK].arm(f"{p} rkv 32"),
                                     dense[lengths_rule.LENGTHS_WALK], "walk") for p in walk}
    assert table["a_p"] == (False, "walk: 0/5 collapse, 1/5 degrade")  # 0.80 < 0.99 - 0.1
    assert table["b_p"][0]
    ok, words = lengths_rule.trained(settings[lengths_rule.LENGTHS_REGIME].arm("b_p rkv 32"),
                                     dense[lengths_rule.LENGTHS_REGIME], "regime")
    assert not ok and words == "regime: 1/5 collapse, 0/5 degrade"


def test_with_nothing_eligible_the_rule_orders_the_criteria_regime_walk_smollm2():
    """``hi`` passes the walk and SmolLM2 but not the regime; ``lo`` passes the regime and the
    walk: ``lo`` wins despite ``hi``'s higher regime mean."""
    regime = {"hi": ((0.99, 0.99, 0.70, 0.99, 0.99), OK), "lo": ((0.90,) * 5, OK)}
    walk = {"hi": ((0.95,) * 5, OK), "lo": ((0.95,) * 5, OK)}
    settings, dense = _study(regime, walk)
    stats = _stats({"hi": GOOD_STATS, "lo": {"is_ess": 0.1, "kept_token_fraction": 0.9}})
    out = lengths_rule.lengths_recommend(settings, dense, stats, ["hi", "lo"],
                                         {"hi": 1, "lo": 1})
    assert not out["eligible_any"]
    assert out["criteria"]["hi"][0] == (False, True, True)
    assert out["criteria"]["lo"][0] == (True, True, False)
    assert out["recommended"] == "lo"
    assert "no correction is eligible" in out["why"] and "regime, walk" in out["why"]


def test_with_nothing_eligible_more_criteria_passed_beat_the_order():
    """``one`` passes only the regime; ``two`` passes the walk and SmolLM2 (two criteria), so
    ``two`` wins although the regime comes first in the order and ``one``'s mean is higher."""
    regime = {"one": ((0.99,) * 5, OK), "two": ((0.99, 0.99, 0.60, 0.99, 0.99), OK)}
    walk = {"one": ((0.70,) * 5, OK), "two": ((0.95,) * 5, OK)}
    settings, dense = _study(regime, walk)
    stats = _stats({"one": {"is_ess": 0.1, "kept_token_fraction": 0.9}, "two": GOOD_STATS})
    out = lengths_rule.lengths_recommend(settings, dense, stats, ["one", "two"],
                                         {"one": 1, "two": 1})
    assert out["criteria"]["one"][0] == (True, False, False)
    assert out["criteria"]["two"][0] == (False, True, True)
    assert out["recommended"] == "two" and "passes walk, SmolLM2" in out["why"]
