"""The experiment scripts' command line: overrides anywhere, also after a multi-value option."""

from __future__ import annotations

import argparse

import pytest

from experiments.kit.overrides_cli import parse_with_overrides


def _parser():
    parser = argparse.ArgumentParser(prog="exp")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--budgets", nargs="*", type=int, default=[32])
    parser.add_argument("--out", default="runs/x")
    return parser


def test_overrides_after_a_multi_value_option_are_overrides():
    args = parse_with_overrides(_parser(), [
        "--seeds", "0", "1", "2", "model.path=data/w=1", "--budgets", "trainer.steps=80",
        "--out", "o", "optim.lr=2e-4"])
    assert args.seeds == [0, 1, 2] and args.budgets == [] and args.out == "o"
    assert args.overrides == ["model.path=data/w=1", "trainer.steps=80", "optim.lr=2e-4"]


def test_usage_names_the_overrides_and_bad_values_still_fail(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_with_overrides(_parser(), ["--seeds", "x"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "[key=value ...]" in err.splitlines()[0] + err
    assert "argument --seeds: invalid int value: 'x'" in err
