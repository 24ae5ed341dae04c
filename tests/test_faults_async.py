"""Fault matrix, async mode (issue 48): a rollout producer that goes quiet without raising
(a wedged device, a deadlock) stops ``run.py train`` at ``trainer.async_timeout_s`` with one
``error:`` line naming the step and the side, leaves the run directory as its last
checkpoint has it, and the same run without the fault resumes from that checkpoint. The
learner's and the weight sync's sides: ``tests/test_async_lag.py``; that the process exits
with the producer asleep: ``tests/test_async_deadline.py``."""

from __future__ import annotations

import json
import threading

from fault_helpers import refused, run, run_args
from sparse_rl_jax.records.metrics_writer import read_metrics
from sparse_rl_jax.training import async_lag

pytest_plugins = ("fault_helpers",)  # the tiny model + data fixture

# An async run of the tiny model, checkpointing every step, light on output.
ASYNC = ["trainer.mode=async", "trainer.max_lag=1", "trainer.checkpoint_every=1",
         "trainer.plots=false", "trainer.export_final=false", "logging.backends=[jsonl]"]


def test_a_producer_that_sleeps_forever_stops_the_run_which_then_resumes(tiny, tmp_path,
                                                                         capsys, monkeypatch):
    """Step 1 runs and is checkpointed; a rerun to 3 steps whose producer sleeps forever
    ends at the 0.5 s deadline naming step 2 and the producer, writes no step and leaves the
    producer's thread asleep as a daemon; the same run without the fault (and with the
    default deadline) resumes from step 1 and finishes."""
    _, model, data = tiny
    run_dir = tmp_path / "run"
    argv = run_args(model, data, run_dir) + ASYNC
    assert run.main(argv) == 0  # trainer.steps=1
    release = threading.Event()

    def sleeps_forever(*args, **kwargs):  # until the test ends: then its thread ends
        release.wait()
        raise RuntimeError("released when the test ended")

    monkeypatch.setattr(async_lag, "collect_rollouts", sleeps_forever)
    try:
        refused(capsys, argv + ["trainer.steps=3", "trainer.async_timeout_s=0.5"],
                "step 2: the rollout producer went quiet: no answer in 0.5 s (deadline 0.5 s, "
                "the larger of trainer.async_timeout_s=0.5 and 10 x the slowest step so far",
                "the same command resumes it from its last checkpoint")
        asleep = [t for t in threading.enumerate() if t.name == "rollout-producer"]
        assert asleep and all(t.daemon for t in asleep)
    finally:
        release.set()
    assert [r["step"] for r in read_metrics(run_dir)] == [1]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["1"]
    assert json.loads((run_dir / "manifest.json").read_text())["last_good_step"] == 1
    assert not (run_dir / "run.lock").exists()

    monkeypatch.undo()
    assert run.main(argv + ["trainer.steps=3"]) == 0
    assert f"resumed from step 1 in {run_dir}" in capsys.readouterr().out
    assert [(r["step"], r["async/lag"]) for r in read_metrics(run_dir)] == [
        (1, 0.0), (2, 1.0), (3, 1.0)]
