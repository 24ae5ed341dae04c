"""The low-ESS guard (issue 53, item 5): the state machine on its own (fires after exactly
``low_ess_steps`` low steps, once per episode, resets on a good step, off at 0 / null), its
config errors, the config hash it stays out of, and ``run.py`` runs on a tiny model whose
compressed rollouts have ESS < 1: ``on_low_ess=stop`` ends the run cleanly with exit status
3 and the checkpoint of that step, which resumes; ``warn`` prints one line and runs to the
end; async mode stops the same way."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from fault_helpers import RECORDS, run, run_args
from sparse_rl_jax.core.config_io import ConfigError, load_config
from sparse_rl_jax.records.checkpoint import Checkpointer
from sparse_rl_jax.records.metrics_writer import read_metrics
from sparse_rl_jax.rl.correction_presets import PARTS
from sparse_rl_jax.rl.loss_config import CorrectionConfig
from sparse_rl_jax.training.ess_guard import LOW_ESS_EXIT, EssGuard
from sparse_rl_jax.training.run_config import RunConfig
from sparse_rl_jax.training.trainer import config_hash
from tiny_hf import make_tiny_hf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """fault_helpers' tiny qwen2 and data, at one layer of width 32 (faster to compile)."""
    root = tmp_path_factory.mktemp("ess_guard")
    model = make_tiny_hf(root, "qwen2", name="model", num_hidden_layers=1, hidden_size=32,
                         intermediate_size=32)
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return root, model, data


def _feed(guard: EssGuard, values) -> dict[int, object]:
    """``{step: the guard's word}`` for steps fed ``(is_ess, kept_token_fraction)`` pairs."""
    said = {}
    for step, (ess, kept) in enumerate(values, start=1):
        word = guard.observe(step, {"is_ess": ess, "kept_token_fraction": kept})
        if word is not None:
            said[step] = word
    return said


LOW, GOOD = (0.05, 0.9), (0.6, 0.9)


def test_fires_after_exactly_n_low_steps_once_per_episode_and_resets_on_a_good_step():
    guard = EssGuard(CorrectionConfig(min_ess=0.1, low_ess_steps=3))
    lows = [(0.02, 0.95), (0.04, 0.85), (0.09, 0.75)]
    # 2 lows, a good step, then an episode of 3 + 2 lows, a good step, an episode of 3
    said = _feed(guard, [LOW, LOW, GOOD, *lows, LOW, LOW, GOOD, LOW, LOW, LOW])
    assert sorted(said) == [6, 12]
    first = said[6]
    assert (first.step, first.steps, first.stop) == (6, 3, False)
    np.testing.assert_allclose([first.ess, first.kept], [np.mean([e for e, _ in lows]),
                                                         np.mean([k for _, k in lows])])
    assert "mean of steps 4..6" in first.message
    assert "Kish ESS 0.050 and kept tokens 0.850" in first.message


@pytest.mark.parametrize("min_ess", [0, 0.0, None])
def test_min_ess_zero_or_null_turns_the_guard_off(min_ess):
    guard = EssGuard(CorrectionConfig(min_ess=min_ess, low_ess_steps=1, on_low_ess="stop"))
    assert _feed(guard, [(0.0, 0.0)] * 4) == {}


def test_kept_fraction_alone_is_low_and_nan_is_not():
    guard = EssGuard(CorrectionConfig(min_ess=0.3, low_ess_steps=2))
    assert _feed(guard, [(0.5, 0.2), (float("nan"), 0.9), (0.5, 0.2), (0.5, 0.2)]).keys() == {4}


def test_the_line_names_the_correction_numbers_and_what_to_try():
    """Most tokens rejected -> loosen the band; sequence weights concentrated -> token-level
    IS; token weights concentrated -> a lower IS cap."""
    rejecting = EssGuard(CorrectionConfig(kind="decoupled_geo_rs", min_ess=0.1,
                                          low_ess_steps=1, on_low_ess="stop"))
    word = rejecting.observe(7, {"is_ess": 0.004, "kept_token_fraction": 0.006})
    assert word.stop and word.step == 7
    assert word.message.startswith(
        "low ESS: correction.kind=decoupled_geo_rs gave Kish ESS 0.004 and kept tokens 0.006 "
        "(mean of steps 7..7), below correction.min_ess=0.1 for 1 RL steps in a row")
    assert "correction.rs_lower / rs_upper" in word.message and "larger KV budget" in word.message
    spread = EssGuard(CorrectionConfig(kind="decoupled_seq_is", min_ess=0.1, low_ess_steps=1))
    word = spread.observe(1, {"is_ess": 0.023, "kept_token_fraction": 1.0})
    assert "correction.kind=decoupled_seq_is" in word.message
    assert "decoupled_token_is or sparse_rl" in word.message and "rs_lower" not in word.message
    token = EssGuard(CorrectionConfig(kind="decoupled_token_is", min_ess=0.1, low_ess_steps=1))
    word = token.observe(1, {"is_ess": 0.05, "kept_token_fraction": 1.0})
    assert "correction.is_upper" in word.message and "sparse_rl" not in word.message


@pytest.mark.parametrize("override,rule", [
    ("correction.on_low_ess=bogus", r"correction\.on_low_ess='bogus' must be one of"),
    ("correction.min_ess=-1", r"correction\.min_ess=-1(\.0)? must be None or in \[0, 1\]"),
    ("correction.min_ess=1.5", r"correction\.min_ess=1\.5 must be None or in \[0, 1\]"),
    ("correction.low_ess_steps=0", r"correction\.low_ess_steps=0 must be an int >= 1"),
])
def test_bad_guard_settings_name_the_field(override, rule, capsys):
    with pytest.raises(ConfigError, match=rule):
        load_config(RunConfig, None, [override])
    assert run.main(["train", override]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.match("config error: " + rule, err[0]), err


def test_the_guard_is_no_part_and_stays_out_of_the_config_hash():
    """Old run directories (no guard keys in their config) keep their hash, and a stopped
    run resumes with the guard loosened."""
    assert not {"min_ess", "on_low_ess", "low_ess_steps"} & set(PARTS)
    base = config_hash(load_config(RunConfig, None, []))
    for overrides in (["correction.min_ess=0"], ["correction.min_ess=null"],
                      ["correction.on_low_ess=stop", "correction.low_ess_steps=9"]):
        assert config_hash(load_config(RunConfig, None, overrides)) == base


def _args(tiny, run_dir, *overrides):
    """A tiny run whose compressed rollouts have ESS < 1 (16 new tokens into 8 slots) under a
    sequence-level correction (its weights spread most), so ``min_ess=1.0`` makes every step
    low; checkpoints only every 3 steps, so a stop's checkpoint is its own."""
    _, model, data = tiny
    return run_args(model, data, run_dir) + [
        "sampling.max_new_tokens=16", "compression.eviction.budget=8",
        "trainer.checkpoint_every=3", "trainer.plots=false", "logging.backends=[jsonl]",
        "correction.kind=decoupled_seq_is", "correction.min_ess=1.0",
        "correction.low_ess_steps=2", *overrides]


def _main(args) -> tuple[int, str, str]:
    """``run.main(args)`` in this process: ``(exit status, stdout, stderr)``."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = run.main([str(a) for a in args])
    return code, out.getvalue(), err.getvalue()


def _stop(tiny, run_dir, *overrides) -> tuple[Path, int, str]:
    """A 5-step run with ``on_low_ess=stop``: ``(run_dir, exit status, stderr)``."""
    code, _, err = _main(_args(tiny, run_dir, "trainer.steps=5", "correction.on_low_ess=stop",
                               *overrides))
    return run_dir, code, err


def _check_stopped_at_2(run_dir: Path, code: int, err: str) -> None:
    """Exit status 3 after step 2 with one ``stopped:`` line naming the correction and the
    mean ESS / kept fraction of steps 1..2 as logged; the checkpoint of step 2 committed and
    named in the manifest, the lock released, nothing exported."""
    err = err.strip().splitlines()
    assert code == LOW_ESS_EXIT == 3, err
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["is_ess"] < 0.99 for r in records)  # the rollouts really are off-policy
    ess = np.mean([r["is_ess"] for r in records])
    kept = np.mean([r["kept_token_fraction"] for r in records])
    assert len(err) == 1 and err[0].startswith(
        f"stopped: low ESS: correction.kind=decoupled_seq_is gave Kish ESS {ess:.3f} and kept "
        f"tokens {kept:.3f} (mean of steps 1..2), below correction.min_ess=1 for 2 RL steps "
        "in a row"), err
    assert "ended the run after step 2" in err[0]
    with Checkpointer(run_dir / "checkpoints", read_only=True) as ckpt:
        assert ckpt.all_steps() == [2]
        assert ckpt.read_meta(2)["step"] == 2
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["last_good_step"] == 2
    assert not (run_dir / "run.lock").exists() and not (run_dir / "final").exists()


@pytest.fixture(scope="module")
def stopped(tiny, tmp_path_factory) -> tuple[Path, int, str]:
    """A sync run with ``on_low_ess=stop`` (:func:`_stop`)."""
    return _stop(tiny, tmp_path_factory.mktemp("stopped") / "run")


@pytest.mark.slow
def test_stop_ends_the_run_after_n_low_steps_with_that_steps_checkpoint(stopped):
    _check_stopped_at_2(*stopped)


@pytest.mark.slow
def test_warn_resumes_a_stopped_run_prints_one_line_and_runs_to_the_end(stopped, tiny,
                                                                       tmp_path):
    """The stopped run (copied), with ``on_low_ess=warn``: it resumes from step 2; its streak
    restarts, so steps 3..4 are an episode (one line at step 4) and step 5 is silent; the run
    ends and exports."""
    run_dir = tmp_path / "run"
    shutil.copytree(stopped[0], run_dir)
    code, out, err = _main(_args(tiny, run_dir, "trainer.steps=5",
                                 "correction.on_low_ess=warn"))
    assert code == 0, err
    assert "resumed from step 2" in out
    warnings = [line for line in out.splitlines() if "low ESS" in line]
    assert len(warnings) == 1 and warnings[0].startswith(
        "warning: low ESS: correction.kind=decoupled_seq_is"), warnings
    assert "mean of steps 3..4" in warnings[0]
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert all(r["is_ess"] < 0.99 for r in records)  # step 5 was low too: silent by design
    assert (run_dir / "final" / "config.json").is_file()


@pytest.mark.slow
def test_async_mode_stops_the_same_way(tiny, tmp_path):
    _check_stopped_at_2(*_stop(tiny, tmp_path / "run", "trainer.mode=async",
                               "trainer.max_lag=1"))
