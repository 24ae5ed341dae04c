"""MetricsWriter (JSONL + TensorBoard), read_metrics, and the TrainProgress display."""

from __future__ import annotations

import io
import json
import re
import struct
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from sparse_rl_jax.records.metrics_writer import MetricsWriter, read_metrics, tb_tag
from sparse_rl_jax.records.compile_watch import NO_COMPILES, Compiles
from sparse_rl_jax.records.progress import COMPILING, TrainProgress


def _metrics(step: int) -> dict:
    """Deterministic metrics of mixed scalar types for a step."""
    return {
        "reward_mean": jnp.float32(0.1 * step + 0.05),
        "rejection_rate": np.float64(1.0 / (step + 2)),
        "effective_tokens": jnp.asarray(10 * step, jnp.int32),
        "all_rejected": step == 3,
        "lr": 1e-6,
    }


def _expected(step: int) -> dict:
    return {"step": step, **{k: float(np.asarray(v)) for k, v in _metrics(step).items()}}


def _read_events(tb_dir: Path) -> list[event_pb2.Event]:
    """Parse every TFRecord event file under tb_dir (length, crc, payload, crc)."""
    events = []
    for path in sorted(tb_dir.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack_from("<Q", data, offset)
            payload = data[offset + 12 : offset + 12 + length]
            offset += 12 + length + 4
            event = event_pb2.Event()
            event.ParseFromString(payload)
            events.append(event)
    return events


def _scalars(events: list[event_pb2.Event]) -> dict[tuple[str, int], float]:
    return {
        (value.tag, event.step): value.simple_value
        for event in events
        if event.HasField("summary")
        for value in event.summary.value
    }


def test_jsonl_round_trip_and_tensorboard_scalars(tmp_path):
    with MetricsWriter(tmp_path) as writer:
        for step in (1, 2, 3):
            returned = writer.log(step, _metrics(step))
            assert all(type(v) is float for v in returned.values())
            # flushed on every write: readable while the writer is still open
            assert read_metrics(tmp_path)[-1] == _expected(step)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [_expected(s) for s in (1, 2, 3)]
    assert read_metrics(tmp_path / "metrics.jsonl") == [_expected(s) for s in (1, 2, 3)]

    scalars = _scalars(_read_events(tmp_path / "tb"))
    for step in (1, 2, 3):
        for name, value in _expected(step).items():
            if name != "step":
                assert scalars[(tb_tag(name), step)] == np.float32(value), (name, step)
    assert len(scalars) == 3 * 5


def test_nonfinite_values_stay_in_jsonl_but_not_in_tensorboard(tmp_path, capsys):
    """A skipped non-finite update's NaN loss is recorded in metrics.jsonl, while
    TensorBoard gets only the finite values (no NaN chart, no tensorboardX NaN warning)."""
    with MetricsWriter(tmp_path) as writer:
        writer.log(1, {"loss": float("nan"), "grad_norm": float("inf"), "reward_mean": 0.5})
        writer.log(2, {"loss": 0.25, "grad_norm": 1.0, "reward_mean": 0.5})
    record = read_metrics(tmp_path)[0]
    assert np.isnan(record["loss"]) and record["grad_norm"] == float("inf")
    assert _scalars(_read_events(tmp_path / "tb")) == {
        ("rollout/reward_mean", 1): 0.5, ("loss/loss", 2): 0.25, ("loss/grad_norm", 2): 1.0,
        ("rollout/reward_mean", 2): 0.5}
    assert "NaN or Inf" not in capsys.readouterr().out


@pytest.mark.parametrize("name, tag", [
    ("reward_mean", "rollout/reward_mean"), ("response_length_mean", "rollout/response_length_mean"),
    ("loss", "loss/loss"), ("clip_fraction", "loss/clip_fraction"), ("grad_norm", "loss/grad_norm"),
    ("kv_token_savings", "kv/kv_token_savings"), ("dense_kv_peak_tokens", "kv/dense_kv_peak_tokens"),
    ("rejection_rate", "correction/rejection_rate"), ("mismatch_k3", "correction/mismatch_k3"),
    ("eval/dense_pass_at_1", "eval/dense_pass_at_1"), ("eval/sparse_gap", "eval/sparse_gap"),
    ("distill_kl", "loss/distill_kl"), ("rollout_share", "time/rollout_share"),
    ("time_step", "time/time_step"),
])
def test_tensorboard_tags_are_grouped(name, tag):
    assert tb_tag(name) == tag


def test_resume_truncates_to_match_an_uninterrupted_run(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    with MetricsWriter(straight) as writer:
        for step in range(1, 7):
            writer.log(step, _metrics(step))

    with MetricsWriter(resumed) as writer:
        for step in range(1, 6):
            writer.log(step, _metrics(step))
    with open(resumed / "metrics.jsonl", "a") as f:  # killed in the middle of a write
        f.write('{"step": 6, "reward_me')
    torn = (resumed / "metrics.jsonl").read_text()
    torn_then_more = torn + "\n" + json.dumps(_expected(7)) + "\n"
    (tmp_path / "bad.jsonl").write_text(torn_then_more)
    with pytest.raises(ValueError, match=r"bad.jsonl:6: malformed"):
        read_metrics(tmp_path / "bad.jsonl")  # a torn line followed by more lines is corrupt
    assert read_metrics(resumed)[-1]["step"] == 5  # the torn final line is ignored

    with MetricsWriter(resumed, resume_step=3) as writer:  # last checkpoint was step 3
        assert writer.last_step == 3
        assert [r["step"] for r in read_metrics(resumed)] == [1, 2, 3]
        with pytest.raises(ValueError, match="not after the last logged step 3"):
            writer.log(3, _metrics(3))
        for step in range(4, 7):
            writer.log(step, _metrics(step))
    assert (resumed / "metrics.jsonl").read_text() == (straight / "metrics.jsonl").read_text()

    events = _read_events(resumed / "tb")
    purges = [e.step for e in events if e.HasField("session_log") and e.session_log.status == 1]
    assert purges == [4]  # TensorBoard hides the stale steps 4 and 5 of the first attempt
    scalars_after_purge = {}
    seen_purge = False
    for event in events:
        if event.HasField("session_log"):
            seen_purge = True
        elif seen_purge and event.HasField("summary"):
            for value in event.summary.value:
                scalars_after_purge[(value.tag, event.step)] = value.simple_value
    assert sorted({s for _, s in scalars_after_purge}) == [4, 5, 6]


def test_fresh_writer_empties_old_log(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False) as writer:
        writer.log(1, {"a": 1.0})
        writer.log(2, {"a": 2.0})
    with MetricsWriter(tmp_path, tensorboard=False) as writer:
        assert read_metrics(tmp_path) == []
        writer.log(1, {"a": 5.0})
    assert read_metrics(tmp_path) == [{"step": 1, "a": 5.0}]


def test_bad_metrics_fail_before_writing(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False) as writer:
        writer.log(1, {"a": 1.0})
        with pytest.raises(TypeError, match="metric 'vec' must be a scalar, got shape \\(3,\\)"):
            writer.log(2, {"ok": 1.0, "vec": jnp.ones(3)})
        with pytest.raises(TypeError, match="metric 'name' must be a number"):
            writer.log(2, {"name": "dense"})
        with pytest.raises(ValueError, match="other than 'step'"):
            writer.log(2, {"step": 2})
        with pytest.raises(ValueError, match="not after the last logged step 1"):
            writer.log(1, {"a": 1.0})
        writer.log(2, {"a": float("nan"), "b": float("inf")})
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2]
    assert np.isnan(records[1]["a"]) and records[1]["b"] == float("inf")

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "a": 1.0}\nnot json\n{"step": 3, "a": 1.0}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: malformed"):
        read_metrics(path)  # reading is strict
    with pytest.raises(ValueError, match="resume_step"):
        MetricsWriter(tmp_path, resume_step=-2, tensorboard=False)


@pytest.mark.parametrize("middle", [b"not json", b'{"step": 2, "a": 1', b"\xff\xfe bytes",
                                    b'{"step": 1, "a": 9.0}', b"[1, 2]"])
def test_resume_skips_malformed_lines_and_keeps_the_good_ones(tmp_path, middle, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1, "a": 1.0}\n' + middle + b'\n{"step": 2, "a": 2.0}\n'
                     b'{"step": 3, "a": 3.0}\n{"step": 4, "a"')
    messages = []
    with MetricsWriter(tmp_path, resume_step=3, tensorboard=False,
                       log=messages.append) as writer:
        writer.log(4, {"a": 4.0})
    assert read_metrics(path) == [{"step": s, "a": float(s)} for s in (1, 2, 3, 4)]
    assert messages == [f"warning: {path}: skipped 1 malformed line(s) (lines [2]); kept 3 "
                        "good records"]
    assert not caplog.records


def test_torn_line_warning_prints_like_the_cli_s_other_warnings(tmp_path, capsys, caplog):
    """A line cut short mid-file (a killed write, then more records) is reported on resume
    as one ``warning: ...`` line by default (print, as the trainer's other warnings), not in
    Python logging's ``WARNING:sparse_rl_jax...`` format."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "a": 1.0}\n{"step": 2, "a\n'
                                            '{"step": 2, "a": 2.0}\n')
    MetricsWriter(tmp_path, resume_step=2, tensorboard=False).close()
    out, err = capsys.readouterr()
    assert out.startswith("warning: ") and "skipped 1 malformed line(s) (lines [2])" in out
    assert "WARNING:sparse_rl_jax" not in out + err and not caplog.records


def test_progress_plain_lines_when_not_a_tty():
    stream = io.StringIO()
    now = iter([100.0, 106.0, 109.0])
    progress = TrainProgress(10, start_step=2, stream=stream, clock=lambda: next(now))
    assert not progress.live  # StringIO is not a terminal
    progress.update(
        4, {"reward_mean": jnp.float32(0.5), "rejection_rate": 0.07, "kv_token_savings": 0.75}
    )
    progress.message("saved checkpoint 4")
    progress.update(5, {"reward_mean": 0.25, "other": 1.0})
    progress.close()
    assert stream.getvalue().splitlines() == [
        f"step 2/10 | {COMPILING}",
        # 6 s for 2 steps -> 3 s/step, 6 steps left -> 18 s
        "step 4/10 | reward 0.5 | rejected 0.07 | kv saved 0.75 | 3.00 s/step | eta 0:00:18",
        "saved checkpoint 4",
        # 9 s for 3 steps -> 3 s/step, 5 steps left -> 15 s
        "step 5/10 | reward 0.25 | 3.00 s/step | eta 0:00:15",
    ]


def test_progress_reports_the_compile_apart_and_names_a_later_one():
    """Step 1's compile is reported apart and its remainder stands in for s/step; a step that
    compiles later is named on its own line and stays out of the rate (``StepRate``)."""
    stream = io.StringIO()
    now = iter([0.0, 30.0, 31.5, 37.5, 39.0])
    laps = iter([Compiles(5, 27.0, ("jit(prefill)",) * 5), NO_COMPILES,
                 Compiles(2, 4.5, ("jit(prefill)", "jit(score)")), NO_COMPILES])
    progress = TrainProgress(10, stream=stream, clock=lambda: next(now),
                             compiles=lambda: next(laps))
    progress.update(1, {"reward_mean": 0.5})
    progress.update(2, {"reward_mean": 0.5})
    progress.update(3, {})
    progress.update(4, {})
    assert stream.getvalue().splitlines() == [
        f"step 0/10 | {COMPILING}",
        # 30 s, 27 of them compiling: 3 s/step stands in, 9 steps left
        "step 1/10 | reward 0.5 | compiled in 27 s | 3.00 s/step | eta 0:00:27",
        # the first clean step: 1.5 s/step, 8 steps left
        "step 2/10 | reward 0.5 | 1.50 s/step | eta 0:00:12",
        "step 3: compiled 2 programs (jit(prefill), jit(score)) in 4.5 s after the first step",
        "step 3/10 | 1.50 s/step | eta 0:00:10",  # 6 s of step 3 left out: 7 x 1.5 s
        # median of [1.5, 1.5] over 6 steps left
        "step 4/10 | 1.50 s/step | eta 0:00:09",
    ]


def test_progress_times_evaluations_apart_and_counts_those_to_come():
    """An evaluation every 2 steps: its seconds leave the step's time, show on the line (with
    its compile the first time) and join the ETA for each evaluation still to come."""
    stream = io.StringIO()
    # step 1 (1 s, no compile known), step 2: 2 s of step + a 10 s eval (4 s compiling),
    # step 3: 2 s, step 4: 2 s + a 5 s eval
    now = iter([0.0, 1.0, 3.0, 13.0, 13.0, 15.0, 17.0, 22.0, 22.0])
    laps = iter([NO_COMPILES, NO_COMPILES, Compiles(1, 4.0, ("jit(decode)",)), NO_COMPILES,
                 NO_COMPILES, NO_COMPILES, NO_COMPILES, NO_COMPILES])
    progress = TrainProgress(8, stream=stream, clock=lambda: next(now),
                             compiles=lambda: next(laps), eval_every=2)
    progress.update(1, {})
    with progress.evaluating():
        pass
    progress.update(2, {})
    progress.update(3, {})
    with progress.evaluating():
        pass
    progress.update(4, {})
    assert stream.getvalue().splitlines()[1:] == [
        "step 1/8 | 1.00 s/step | eta 0:00:07",  # no eval seen yet: 7 steps x 1 s
        # steps: median [1, 2] = 1.5 s x 6; evals: 10 - 4 = 6 s x 3 to come
        "step 2/8 | eval 10 s (compiled in 4 s) | 1.50 s/step | eta 0:00:27",
        "step 3/8 | 2.00 s/step | eta 0:00:28",  # 2 s x 5 + 6 s x 3
        # steps: 2 s x 4; evals: the first clean one, 5 s, replaces the stand-in: x 2
        "step 4/8 | eval 5 s | 2.00 s/step | eta 0:00:18",
    ]


def test_progress_live_bar_renders_step_and_metrics():
    stream = io.StringIO()
    with TrainProgress(10, stream=stream, live=True) as progress:
        assert progress.live
        for step in range(1, 11):
            progress.update(step, {"reward_mean": 0.5, "kv_token_savings": 0.75})
        progress.message("done training")
    out = stream.getvalue()
    assert "10/10" in out and "reward 0.5" in out and "kv saved 0.75" in out
    assert "done training" in out
    assert "compiling the first step" in out  # before step 1, instead of a bare "eta -:--:--"


def test_progress_live_bar_folds_long_stats_at_80_columns():
    stream = io.StringIO()  # rich renders a non-terminal stream 80 columns wide
    stats = {"reward_mean": 0.412, "rejection_rate": 0.0712, "kv_token_savings": 0.7512,
             "clip_fraction": 0.0046, "mismatch_k3": 0.5771}
    with TrainProgress(100, stream=stream, live=True) as progress:
        progress.update(12, stats)
    final = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", stream.getvalue()).split("12/100")[-1]
    assert max(len(line) for line in final.splitlines()) <= 80
    # every field survives, wrapped onto a second line rather than cut
    words = " ".join(final.split())
    for text in ("reward 0.412", "rejected 0.07", "kv saved 0.75"):
        assert text in words, (text, final)


def _wandb_records(run_file: Path):
    """The protobuf records of a W&B ``.wandb`` transaction log: a 7-byte header (``:W&B``,
    magic, version) then LevelDB-log chunks in 32 KiB blocks (crc32, length, type 1 full /
    2 first / 3 middle / 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    offset, block, pending, records = 7, 32768, b"", []
    while offset + 7 <= len(data):
        if block - offset % block < 7:  # block trailer too short for a header: padding
            offset += block - offset % block
            continue
        length, kind = struct.unpack_from("<HB", data, offset + 4)
        pending += data[offset + 7:offset + 7 + length]
        offset += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def _wandb_history(run_file: Path) -> tuple[list, dict[int, dict]]:
    """The records of a W&B run log and its history by step (a record still being written
    ends the read)."""
    try:
        records = _wandb_records(run_file)
    except Exception:  # a torn trailing record: read again later
        return [], {}
    history = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items = {"/".join(i.nested_key) or i.key: json.loads(i.value_json)
                     for i in record.history.item}
            history[items.pop("_step")] = {k: v for k, v in items.items()
                                           if not k.startswith("_")}
    return records, history


def test_wandb_offline_logs_the_tensorboard_tags_and_the_config_once(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is not installed (pip install -e '.[wandb]')")
    from sparse_rl_jax.records.metrics_writer import WandbRun

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = {"loss": {"group_size": 2}, "run_dir": str(tmp_path)}
    with MetricsWriter(tmp_path, wandb=WandbRun("test", "run0", config)) as writer:
        for step in (1, 2, 3):
            writer.log(step, _metrics(step))
    (run_file,) = tmp_path.glob("wandb/offline-run-*-run0/run-run0.wandb")
    # wandb-core (a separate process) may still be writing the log when finish() returns on
    # a loaded machine: read it until the three steps are there (or give up after 60 s).
    deadline = time.monotonic() + 60
    while True:
        records, history = _wandb_history(run_file)
        if sorted(history) == [1, 2, 3] or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    tb = _scalars(_read_events(tmp_path / "tb"))
    assert sorted(history) == [1, 2, 3]
    for step in (1, 2, 3):
        expected = {tb_tag(k): v for k, v in _expected(step).items() if k != "step"}
        assert history[step] == pytest.approx(expected)
        assert {tag for tag, s in tb if s == step} == set(history[step])
    updates = [{i.key: json.loads(i.value_json) for i in getattr(r, kind).config.update}
               if kind == "run" else
               {i.key: json.loads(i.value_json) for i in r.config.update}
               for r in records if (kind := r.WhichOneof("record_type")) in ("run", "config")]
    logged = [u for u in updates if "loss" in u]
    assert len(logged) == 1 and logged[0]["loss"] == {"group_size": 2}


def test_missing_wandb_is_a_config_error_naming_the_field(monkeypatch):
    from sparse_rl_jax.records.metrics_writer import LoggingConfig

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(ValueError, match=r"LoggingConfig\.backends=.*pip install"):
        LoggingConfig(backends=("jsonl", "wandb"))
    with pytest.raises(ValueError, match=r"LoggingConfig\.backends=\('tensorboard',\) must"):
        LoggingConfig(backends=("tensorboard",))
