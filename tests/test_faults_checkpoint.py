"""Fault matrix, checkpoints (issues 17 and 21): a corrupt newest checkpoint is set aside
(said which and why) and the run resumes from the one before; a disk that fills during a
save stops the run at that save with one ``error:`` line, the committed checkpoints intact,
and the same command resumes from the last of them. Both at the Checkpointer level and
through the trainer / ``run.py``."""

from __future__ import annotations

import gc
import json
import logging
import os
import resource
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fault_helpers import ROOT, run, run_args
from sparse_rl_jax.core.config_io import load_config
from sparse_rl_jax.records.checkpoint import CheckpointError, Checkpointer
from sparse_rl_jax.records.checkpoint_errors import FAILURE_ECHOES, OrbaxErrorLog, save_error
from sparse_rl_jax.records.metrics_writer import read_metrics
from sparse_rl_jax.training.run_config import RunConfig

pytest_plugins = ("fault_helpers",)  # the tiny model + data fixture

# A three-step run of the tiny model, checkpointing every step, light on output.
TRAIN = ["trainer.steps=3", "trainer.checkpoint_every=1", "trainer.plots=false",
         "trainer.export_final=false", "logging.backends=[jsonl]"]


def _state(value):
    return {"w": jnp.full((64, 64), value, jnp.float32), "b": jnp.arange(8, dtype=jnp.int32)}


@pytest.mark.parametrize("corruption", ["garbage_files", "nan_weights"])
def test_corrupt_latest_checkpoint_falls_back_and_says_why(tmp_path, corruption):
    with Checkpointer(tmp_path / "ckpt", keep=5) as ckpt:
        for step in (1, 2, 3):
            value = np.nan if corruption == "nan_weights" and step == 3 else float(step)
            ckpt.save(step, _state(value), {"step": step})
    if corruption == "garbage_files":
        for file in (tmp_path / "ckpt" / "3" / "state").rglob("*"):
            if file.is_file():
                file.write_bytes(b"garbage")
    logs = []
    with Checkpointer(tmp_path / "ckpt", keep=5) as ckpt:
        state, meta = ckpt.restore_newest_good(_state(0.0), log=logs.append)
        assert meta["step"] == 2 and float(state["w"][0, 0]) == 2.0
        assert ckpt.all_steps() == [1, 2]
        ckpt.save(3, _state(30.0), {"step": 3})  # the run can save step 3 again
    aside = tmp_path / "ckpt.corrupt" / "3"
    assert len(logs) == 1 and logs[0].startswith(
        f"warning: skipping checkpoint step 3 (moved to {aside}): "), logs
    if corruption == "nan_weights":
        assert "leaves ['w'] hold NaN or inf" in logs[0]
    assert aside.is_dir()  # kept for inspection
    with Checkpointer(tmp_path / "ckpt", read_only=True) as ckpt:
        assert float(ckpt.restore(_state(0.0))[0]["w"][0, 0]) == 30.0


def test_orbax_error_records_are_held_back_attached_to_the_error_and_never_lost(tmp_path,
                                                                              caplog):
    """While attached, an ERROR record about the checkpoint directory is held back (not
    logged), a WARNING passes; save_error attaches what was held as a note; a record that
    arrives after the error is logged when the log detaches."""
    directory = str(tmp_path / "ckpt")
    absl = logging.getLogger("absl")
    held = OrbaxErrorLog(directory)
    held.attach()
    try:
        absl.error("write of %s/2/state failed: File too large", directory)
        absl.warning("a warning passes")
        absl.error("an unrelated error passes")
        error = save_error(directory, OSError("EFBIG: File too large"), 2, [1], held)
        absl.error("late report about %s/2", directory)
    finally:
        held.detach()
    assert str(error).startswith(f"saving checkpoint step 2 in {directory} failed (disk full?)")
    assert error.__notes__ == [f"orbax's log of the failure:\nERROR:absl:write of {directory}"
                               "/2/state failed: File too large"]
    assert [r.getMessage() for r in caplog.records] == [
        "a warning passes", "an unrelated error passes", f"late report about {directory}/2"]
    assert held not in absl.filters


def test_late_asyncio_reports_of_a_reported_save_failure_are_dropped(tmp_path, caplog):
    """Once a save failure in a directory was reported (save_error), asyncio's later reports
    naming that directory (its futures, collected after the error) are not logged again;
    reports about other directories still are."""
    failed, other = str(tmp_path / "failed"), str(tmp_path / "other")
    save_error(failed, OSError("EFBIG: File too large"), 2, [1], OrbaxErrorLog(failed))
    asyncio_log = logging.getLogger("asyncio")
    asyncio_log.error("Future exception was never retrieved\nfuture: <%s/2 too large>", failed)
    asyncio_log.error("Future exception was never retrieved\nfuture: <%s/2 too large>", other)
    assert [r.getMessage() for r in caplog.records] == [
        f"Future exception was never retrieved\nfuture: <{other}/2 too large>"]


def test_unawaited_write_coroutines_of_a_reported_save_failure_are_not_warned(tmp_path):
    """A failed save's aborted write coroutines, collected at interpreter exit, print
    "coroutine ... was never awaited" (2 stderr lines) unless a save failure was reported."""
    script = ("import gc\nfrom sparse_rl_jax.records.checkpoint_errors import FAILURE_ECHOES\n"
              "if {report}: FAILURE_ECHOES.add('/ckpt')\n"
              "async def write_fragment(): pass\n"
              "pending = write_fragment()\ndel pending\ngc.collect()\n")
    stderr = {report: subprocess.run([sys.executable, "-c", script.format(report=report)],
                                     cwd=ROOT, capture_output=True, text=True,
                                     timeout=120).stderr
              for report in (False, True)}
    assert "coroutine 'write_fragment' was never awaited" in stderr[False]
    assert stderr[True] == ""


class _Pending:
    """An awaitable that never completes: a coroutine awaiting it stays suspended."""

    def __await__(self):
        yield


async def _abandoned_read(path):
    """Like orbax's array read: whatever interrupts it (GeneratorExit when it is collected
    unfinished) is re-raised as an error naming the file it was reading."""
    try:
        await _Pending()
    except BaseException as err:
        raise Exception(f"abandoned read of {path}") from err


def test_a_failed_restores_abandoned_reads_are_dropped_other_errors_still_surface(
        tmp_path, monkeypatch):
    """A restore that fails in orbax (step 2's array metadata is garbage) drops, from then on,
    the errors of that step's reads collected unfinished ("Exception ignored in: <coroutine
    ...>" through ``sys.unraisablehook``); such an error about another step still reaches the
    hook, as does any other unraisable error."""
    with Checkpointer(tmp_path / "ckpt", keep=5) as ckpt:
        for step in (1, 2):
            ckpt.save(step, _state(float(step)), {"step": step})
    for file in (tmp_path / "ckpt" / "2" / "state" / "array_metadatas").iterdir():
        file.write_bytes(b"garbage")
    reached = []
    monkeypatch.setattr(sys, "unraisablehook", reached.append)
    with Checkpointer(tmp_path / "ckpt", keep=5) as ckpt:
        with pytest.raises(CheckpointError, match="checkpoint step 2 in .* could not be restored"):
            ckpt.restore(_state(0.0), step=2)
    assert sys.unraisablehook == FAILURE_ECHOES.unraisablehook
    for step in (2, 1):
        read = _abandoned_read(tmp_path / "ckpt" / str(step) / "state" / "w")
        read.send(None)  # suspended mid-read, then collected
        del read
        gc.collect()
    ours = [str(u.exc_value) for u in reached if str(u.exc_value).startswith("abandoned read")]
    assert ours == [f"abandoned read of {tmp_path / 'ckpt' / '1' / 'state' / 'w'}"]


def test_resuming_past_a_corrupt_checkpoint_prints_no_echoes_of_its_reads(tmp_path):
    """tests/scripts/restore_past_corrupt.py resumes past a corrupt step 2 four times, its
    array reads in flight at the failure (before the fix its stderr held thousands of lines:
    "Exception ignored in: <coroutine object _read_array_index_and_device_put>" tracebacks):
    each resume takes step 1 and stderr holds no traceback."""
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "scripts" /
                                               "restore_past_corrupt.py"), str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.split() == ["1"] * 4, done.stderr[-3000:]
    for noise in ("Exception ignored", "was never awaited", "Traceback"):
        assert noise not in done.stderr, done.stderr[-3000:]


def test_checkpointer_closed_by_an_error_keeps_that_error(tmp_path, caplog):
    """Leaving a ``with Checkpointer`` block by an exception closes it (its log filter is
    detached), the block's exception is the one raised, and orbax error records still held
    back become a note on it instead of log lines."""
    with pytest.raises(KeyError, match="boom") as err:
        with Checkpointer(tmp_path / "ckpt"):
            logging.getLogger("absl").error("late write error in %s/2", tmp_path / "ckpt")
            raise KeyError("boom")
    assert not [f for f in logging.getLogger("absl").filters if isinstance(f, OrbaxErrorLog)]
    assert err.value.__notes__ == [
        f"orbax's log of the failure:\nERROR:absl:late write error in {tmp_path / 'ckpt'}/2"]
    assert not [r for r in caplog.records if "late write error" in r.getMessage()]


def test_disk_full_during_save_is_a_clear_error_and_keeps_earlier_checkpoints(tmp_path):
    """RLIMIT_FSIZE makes every write past 64 KiB fail (EFBIG) like a full disk."""
    big = {"w": jax.random.normal(jax.random.key(0), (256, 256))}  # 256 KiB, incompressible
    with Checkpointer(tmp_path / "ckpt", keep=5) as ckpt:
        ckpt.save(1, big, {"step": 1})
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, limits[1]))
    try:
        with pytest.raises(CheckpointError, match=r"saving checkpoint step 2 in .* failed") as err:
            ckpt = Checkpointer(tmp_path / "ckpt", keep=5)
            try:
                ckpt.save(2, {"w": big["w"] * 2}, {"step": 2})
                ckpt.wait()
            finally:
                resource.setrlimit(resource.RLIMIT_FSIZE, limits)
                try:
                    ckpt.close()
                except CheckpointError:
                    pass
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, previous)
    assert "(disk full?)" in str(err.value) and "committed checkpoints: [1]" in str(err.value)
    assert "resume from step 1" in str(err.value)
    with Checkpointer(tmp_path / "ckpt", keep=5) as ckpt:
        assert ckpt.all_steps() == [1]  # the half-written step 2 is not taken for one
        state, meta = ckpt.restore_newest_good(big, log=lambda _: None)
        assert meta["step"] == 1
        np.testing.assert_array_equal(np.asarray(state["w"]), np.asarray(big["w"]))


def test_trainer_resumes_past_a_corrupt_newest_checkpoint(tiny, tmp_path, caplog):
    """A finished run whose newest checkpoint (step 2) is garbage and whose metrics.jsonl
    holds a line cut short: resuming it says which checkpoint and why, moves it to
    checkpoints.corrupt/ and continues from step 1; the skipped metrics line is one
    ``warning:`` message like the others (no Python logging record)."""
    from sparse_rl_jax.training.trainer import train

    _, model, data = tiny
    run_dir = tmp_path / "run"
    args = run_args(model, data, run_dir)[1:] + TRAIN
    train(load_config(RunConfig, None, args + ["trainer.steps=2"]), log=lambda _: None)
    for file in (run_dir / "checkpoints" / "2" / "state").rglob("*"):
        if file.is_file():
            file.write_bytes(b"garbage")
    metrics = run_dir / "metrics.jsonl"
    first, second = metrics.read_text().splitlines(keepends=True)
    metrics.write_text(first + '{"step": 2, "rew\n' + second)  # a write cut short, then more
    messages = []
    train(load_config(RunConfig, None, args), log=messages.append)
    assert f"warning: {metrics}: skipped 1 malformed line(s) (lines [2]); kept 2 good " \
        "records" in messages
    assert not [r for r in caplog.records if r.name.startswith("sparse_rl_jax")]
    aside = run_dir / "checkpoints.corrupt" / "2"
    skipped = [m for m in messages if m.startswith("warning: skipping checkpoint step 2")]
    assert len(skipped) == 1 and f"(moved to {aside}): checkpoint step 2 in " in skipped[0]
    assert f"resumed from step 1 in {run_dir}" in messages
    assert aside.is_dir() and sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "1", "2", "3"]
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3]


def test_disk_full_during_a_save_stops_run_py_at_that_save_then_resumes(tiny, tmp_path, capsys):
    """The disk fills when step 2 is saved (tests/scripts/disk_full_at_save.py): run.py
    stops there with one short error line (orbax's tracebacks held back), step 3 never runs,
    checkpoint 1 stays the last committed; the same command then resumes from it."""
    _, model, data = tiny
    run_dir = tmp_path / "run"
    argv = run_args(model, data, run_dir) + TRAIN
    full = subprocess.run([sys.executable, str(ROOT / "tests" / "scripts" / "disk_full_at_save.py"),
                           *argv], env=dict(os.environ, DISK_FULL_AT_STEP="2"), cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    err = full.stderr.strip().splitlines()
    assert full.returncode == 2 and len(err) <= 2 and "Traceback" not in full.stderr, err
    assert err[-1].startswith(f"error: saving checkpoint step 2 in {run_dir / 'checkpoints'} "
                              "failed (disk full?): ") and err[-1].endswith(
        "committed checkpoints: [1]; free space and run the same command to resume from "
        "step 1"), err[-1]
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2]  # stopped at the failed save
    assert [p.name for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()] == ["1"]
    assert json.loads((run_dir / "manifest.json").read_text())["last_good_step"] == 1
    assert not (run_dir / "run.lock").exists()

    assert run.main(argv) == 0
    assert f"resumed from step 1 in {run_dir}" in capsys.readouterr().out
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3]
