"""The RL trainer end to end: run.py in a subprocess, SIGKILL (during training, sync and
async, or during a checkpoint save, then a moved run directory) + resume equals an
uninterrupted run, a sharded update equals a single-device one, config errors.

Runs that must die (SIGKILL) are ``python run.py`` child processes; the reference run, the
resumes, the eval and the config error call ``run.py``'s ``main`` in this process (the same
code path without an interpreter start per run), with one compilation cache shared by both."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

import models
from benchmarks.kit.compile_count import count_compiles
from sparse_rl_jax.core.config_io import ConfigError, load_config
from sparse_rl_jax.records.metrics_writer import read_metrics
from sparse_rl_jax.rollout.sampler import bucket_prompts
from sparse_rl_jax.tasks.prompt_source import PromptSource
from sparse_rl_jax.tasks.rewards import available_reward_fns, register_reward_fn
from sparse_rl_jax.tasks.task import TaskConfig
from sparse_rl_jax.training.run_config import RunConfig, WarmStartConfig
from sparse_rl_jax.training.trainer import train
from sparse_rl_jax.training.warm_start import build_default_model

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import run  # noqa: E402  (run.py at the repository root)

TINY_TASK = TaskConfig(n_min=2, n_max=4)
STEPS = 6


@pytest.fixture(scope="module")
def run_env(tmp_path_factory):
    """A tiny warm-started policy, a run config for it, and the environment of its child
    processes (this session's compilation cache, set by conftest.py, so child processes and
    in-process runs load each other's compiled programs)."""
    root = tmp_path_factory.mktemp("trainer")
    policy = build_default_model(
        root / "policy",
        WarmStartConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                        intermediate_size=64, steps=3, batch_size=4),
        TINY_TASK, log=lambda _: None)
    config = root / "tiny.yaml"
    config.write_text(f"""
model: {{path: {policy}}}
data: {{task: {{n_min: 2, n_max: 4}}}}
sampling: {{max_new_tokens: 20, num_samples: 2, prompt_bucket: 8}}
compression: {{method: rkv, eviction: {{budget: 16, buffer: 4, window: 2}}}}
optim: {{lr: 1.0e-3}}
trainer: {{steps: {STEPS}, prompts_per_step: 4, minibatch_size: 4, micro_batch_size: 2,
          checkpoint_every: 1,
          logp_chunk: 8}}
eval: {{num_prompts: 4, samples: 2, batch_size: 4}}
""")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    return root, config, env


def _main(args) -> str:
    """``run.main(args)`` in this process; asserts exit code 0 and returns its stdout."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = run.main([str(a) for a in args])
    assert code == 0, err.getvalue()[-3000:]
    return out.getvalue()


@pytest.fixture(scope="module")
def uninterrupted(run_env):
    root, config, _ = run_env
    return root / "a", _main(["train", "--config", config, f"run_dir={root / 'a'}"])


def _comparable(records):
    return [{k: v for k, v in r.items() if not k.startswith(("time_", "time/"))
             and not k.endswith("_share") and k != "tokens_per_second"} for r in records]


@pytest.mark.slow
def test_run_py_train_writes_metrics_plots_checkpoint_and_export(uninterrupted):
    run_dir, out = uninterrupted
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for key in ("reward_mean", "rejection_rate", "kv_token_savings", "clip_fraction",
                "mismatch_k3", "loss", "rollout_share"):
        assert all(np.isfinite(r[key]) for r in records), key
    assert all(r["skipped_nonfinite_steps"] == 0 for r in records)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["last_good_step"] == STEPS and not (run_dir / "run.lock").exists()
    assert (run_dir / "plots" / "summary.png").stat().st_size > 10_000
    assert (run_dir / "config.yaml").is_file()
    assert (run_dir / "final" / "config.json").is_file()
    assert sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir()
                  if p.name.isdigit())[-1] == STEPS
    assert list((run_dir / "tb").iterdir())


ASYNC = ("trainer.mode=async", "trainer.max_lag=1", "trainer.steps=4")


@pytest.fixture(scope="module")
def uninterrupted_async(run_env):
    """The async run (lag 1, 4 steps) that the killed async run must end equal to."""
    root, config, _ = run_env
    _main(["train", "--config", config, f"run_dir={root / 'a_async'}", *ASYNC])
    return root / "a_async"


def _kill_after_step_2_and_resume(run_env, reference, run_dir, *overrides):
    """``run.py`` SIGKILLed once checkpoint 2 is written (mid-step 3), then resumed with the
    same command: its metrics and final weights equal the uninterrupted run's."""
    root, config, env = run_env
    args = [sys.executable, str(ROOT / "run.py"), "train", "--config", str(config),
            f"run_dir={run_dir}", *overrides]
    proc = subprocess.Popen(args, env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while not (run_dir / "checkpoints" / "2").is_dir():
        assert proc.poll() is None and time.monotonic() < deadline, "run ended before step 2"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (run_dir / "final").exists()  # it really died mid-training

    assert "resumed from step" in _main(["train", "--config", config, f"run_dir={run_dir}",
                                         *overrides])
    assert _comparable(read_metrics(run_dir / "metrics.jsonl")) == _comparable(
        read_metrics(reference / "metrics.jsonl"))
    resumed = load_file(run_dir / "final" / "model.safetensors")
    expected = load_file(reference / "final" / "model.safetensors")
    assert resumed.keys() == expected.keys()
    for name in expected:
        np.testing.assert_array_equal(resumed[name], expected[name], err_msg=name)


@pytest.mark.slow
def test_sigkill_then_resume_matches_uninterrupted_run(run_env, uninterrupted):
    _kill_after_step_2_and_resume(run_env, uninterrupted[0], run_env[0] / "b")


@pytest.mark.slow
def test_async_sigkill_then_resume_matches_uninterrupted_run(run_env, uninterrupted_async):
    """Killed with the producer a step ahead (its rows for step 3 in flight or queued): the
    resumed run draws them again from version 1, restored from checkpoint 2."""
    _kill_after_step_2_and_resume(run_env, uninterrupted_async, run_env[0] / "b_async", *ASYNC)
    records = read_metrics(uninterrupted_async / "metrics.jsonl")
    assert [r["async/lag"] for r in records] == [0.0, 1.0, 1.0, 1.0]


@pytest.mark.slow
def test_sigkill_during_checkpoint_save_then_resume_after_a_move(run_env, uninterrupted):
    """Killed while committing checkpoint 3 (its files written, not renamed); the run
    directory is then moved: the same command on the new path resumes from step 2 (the
    torn step 3 is not taken for a checkpoint, the dead run's lock is taken over) and ends
    with the metrics and weights of the uninterrupted run."""
    root, config, env = run_env
    reference, _ = uninterrupted
    first, moved = root / "c", root / "c_moved"
    killed = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "scripts" / "kill_during_save.py"), "train",
         "--config", str(config), f"run_dir={first}"],
        env=dict(env, KILL_AT_STEP="3"), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    steps = sorted(p.name for p in (first / "checkpoints").iterdir())
    assert "3" not in steps and any(name.startswith("3.orbax-checkpoint-tmp") for name in steps)
    assert json.loads((first / "run.lock").read_text())["pid"] > 0  # left by the dead run
    assert json.loads((first / "manifest.json").read_text())["last_good_step"] in (1, 2)
    first.rename(moved)

    out = _main(["train", "--config", config, f"run_dir={moved}"])
    assert f"resumed from step 2 in {moved}" in out
    assert not (moved / "run.lock").exists()
    assert json.loads((moved / "manifest.json").read_text())["last_good_step"] == STEPS
    assert _comparable(read_metrics(moved / "metrics.jsonl")) == _comparable(
        read_metrics(reference / "metrics.jsonl"))
    resumed = load_file(moved / "final" / "model.safetensors")
    expected = load_file(reference / "final" / "model.safetensors")
    for name in expected:
        np.testing.assert_array_equal(resumed[name], expected[name], err_msg=name)


@pytest.mark.slow
def test_resume_with_other_micro_batch_and_remat_continues_the_run(run_env, uninterrupted):
    """Micro-batch size and remat change only memory: a copy of the finished run rolled back
    to checkpoint 4 and resumed with the whole minibatch in one micro-batch and full remat
    ends where the uninterrupted run (micro-batches of 2, no remat) did, up to float
    reassociation of the gradient sum."""
    root, config, _ = run_env
    reference, _ = uninterrupted
    run_dir = root / "micro"
    shutil.copytree(reference, run_dir)
    for name in ("5", "6"):
        shutil.rmtree(run_dir / "checkpoints" / name)
    shutil.rmtree(run_dir / "final")
    out = _main(["train", "--config", config, f"run_dir={run_dir}",
                 "trainer.micro_batch_size=4", "model.remat=full"])
    assert "resumed from step 4" in out
    got, want = (_comparable(read_metrics(d / "metrics.jsonl")) for d in (run_dir, reference))
    assert [r["step"] for r in got] == [r["step"] for r in want]
    assert got[:4] == want[:4]  # the steps before the resume are kept as written
    for g, w in zip(got[4:], want[4:]):
        assert g.keys() == w.keys()
        for key in w:
            np.testing.assert_allclose(g[key], w[key], rtol=1e-4, atol=1e-5, err_msg=key)
    resumed = load_file(run_dir / "final" / "model.safetensors")
    expected = load_file(reference / "final" / "model.safetensors")
    for name in expected:
        np.testing.assert_allclose(resumed[name], expected[name], rtol=1e-4, atol=1e-6,
                                   err_msg=name)


def test_eval_prints_dense_and_sparse_pass_at_1(uninterrupted):
    run_dir, _ = uninterrupted
    out = _main(["eval", "--checkpoint", run_dir])
    assert "pass@1" in out and "dense" in out and "sparse (rkv 16)" in out
    rows = json.loads((run_dir / "eval.json").read_text())
    assert [r["mode"] for r in rows] == ["dense", "sparse (rkv 16)"]
    assert all(0.0 <= r["pass_at_1"] <= 1.0 for r in rows)


DAPO_STEPS = 3


@pytest.mark.parametrize("mode", [(), ASYNC[:2]], ids=["sync", "async"])
def test_nothing_compiles_after_step_1_over_prompts_in_two_buckets(run_env, uninterrupted,
                                                                   capsys, mode):
    """The tiny run's prompts (9, 13 or 17 tokens, sampling.prompt_bucket 8) reach two
    widths alone: 20 (24 capped at the KV cache's 16 + 4) at positions 0 and 1, 16 at 2.
    Every batch pads to the run's one width, so steps 2 and 3 (sync, or async's producer
    one step ahead) compile nothing; the progress lines say so. (The uninterrupted run
    compiled the same programs first: step 1 loads them from the session's cache.)"""
    root, config, _ = run_env
    cfg = load_config(RunConfig, config, [
        f"run_dir={root / ('widths_' + '_'.join(mode))}", "trainer.steps=3",
        "trainer.plots=false", "trainer.export_final=false", "logging.backends=[jsonl]", *mode])
    tokenizer = models.Tokenizer(root / "policy")
    source = PromptSource(cfg.data, cfg.trainer.prompts_per_step)
    widths = [min(bucket_prompts(*tokenizer.encode(source.batch(position).prompts,
                                                    add_special_tokens=False),
                                 cfg.sampling.prompt_bucket)[0].shape[1],
                  cfg.compression.capacity) for position in range(3)]
    assert widths == [20, 20, 16]  # the third batch alone would compile a new program set
    jax.clear_caches()  # compiled before (by other tests) would hide a compile in step 3
    totals = []
    with count_compiles() as compiles:
        train(cfg, on_step=lambda step, _: totals.append(sum(compiles.values())))
    assert totals[0] > 0 and totals[1:] == [totals[0]] * 2, (totals, dict(compiles))
    out = capsys.readouterr().out
    assert "prompt width 20 for every batch: the longest prompt (17 tokens)" in out
    assert "step 1/3 |" in out and "compiled in" in out.split("step 1/3 |")[1].split("\n")[0]
    assert "after the first step" not in out


def crc_parity(completions, answers):
    """A deterministic reward that differs between samples (the tiny policy's task reward
    is 0 everywhere): dynamic sampling then has groups to keep and to drop."""
    return np.array([float(zlib.crc32(c.encode()) % 2) for c in completions], np.float32)


def _dapo_config(config, run_dir, *overrides):
    """The shipped DAPO example on the tiny policy (one prompt length: one compiled shape),
    with a reward that varies per sample."""
    if "crc_parity" not in available_reward_fns():
        register_reward_fn("crc_parity", lambda: crc_parity)
    return load_config(RunConfig, [ROOT / "configs" / "family" / "dapo.yaml", config], [
        "data.reward=crc_parity", "data.task.n_min=4", "eval.every_steps=2",
        f"trainer.steps={DAPO_STEPS}", "trainer.plots=false", f"run_dir={run_dir}",
        *overrides])


@pytest.mark.slow
def test_dapo_example_resumes_identically_and_logs_eval(run_env):
    """Dynamic sampling + overlong + eval during training; a run stopped after 1 step and
    restarted continues to the same metrics and weights (the data cursor is checkpointed:
    with dynamic sampling step s no longer reads prompt batch s)."""
    from sparse_rl_jax.training.trainer import train

    root, config, _ = run_env
    reference = root / "dapo_a"
    train(_dapo_config(config, reference), log=lambda _: None)
    records = read_metrics(reference / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(DAPO_STEPS + 1))  # step 0: before_train
    assert [r["step"] for r in records if "eval/sparse_gap" in r] == [0, 2]
    for r in records:
        if "eval/sparse_gap" in r:
            assert 0 <= r["eval/dense_pass_at_1"] <= 1 and 0 <= r["eval/sparse_pass_at_1"] <= 1
            assert 0 <= r["eval/dense_avg_at_k"] <= 1 and 0 <= r["eval/sparse_avg_at_k"] <= 1
            assert r["eval/sparse_gap"] == r["eval/dense_pass_at_1"] - r["eval/sparse_pass_at_1"]
    steps = records[1:]
    rounds = [r["collect_rounds"] for r in steps]
    assert all(1 <= n <= 3 for n in rounds) and max(rounds) > 1  # it did sample more prompts
    assert [r["prompts_consumed"] for r in steps] == [4 * n for n in rounds]
    assert all(r["groups_kept"] <= 4 and r["overlong_penalty_mean"] <= 0 for r in steps)

    run_dir = root / "dapo_b"
    train(_dapo_config(config, run_dir, "trainer.steps=1", "trainer.export_final=false"),
          log=lambda _: None)
    messages = []
    train(_dapo_config(config, run_dir), log=messages.append)
    assert any("resumed from step 1" in m for m in messages)
    assert _comparable(read_metrics(run_dir / "metrics.jsonl")) == _comparable(records)
    resumed = load_file(run_dir / "final" / "model.safetensors")
    expected = load_file(reference / "final" / "model.safetensors")
    for name in expected:
        np.testing.assert_array_equal(resumed[name], expected[name], err_msg=name)


@pytest.mark.parametrize("name, expected", [
    ("dr_grpo", {"advantage.scale": "none", "loss.aggregation": "seq_mean_token_sum_norm"}),
    ("dapo", {"data.dynamic_sampling": True, "loss.eps_high": 0.28,
              "loss.aggregation": "token_mean", "overlong.buffer_len": 4}),
    ("gspo", {"loss.ratio_level": "sequence", "loss.eps_low": 3.0e-4, "loss.eps_high": 4.0e-4}),
    ("cispo", {"loss.policy_loss": "cispo", "loss.eps_high": 0.2}),
])
def test_family_examples_load_and_validate(name, expected):
    cfg = load_config(RunConfig, ROOT / "configs" / "family" / f"{name}.yaml")
    for key, value in expected.items():
        section, field = key.split(".")
        assert getattr(getattr(cfg, section), field) == value, key
    assert cfg.model.path is None  # the embedded default


@pytest.mark.slow
def test_sharded_update_equals_single_device():
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "scripts" / "sharded_update.py")],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["devices"] == 8
    assert "P('fsdp', 'tensor')" in result["specs"]  # params really are split
    assert result["loss_sharded"] == pytest.approx(result["loss_single"], abs=1e-6)
    # Adam's normalised step (lr 1e-2) amplifies reduction-order noise in tiny gradients.
    assert result["param_diff"] <= 1e-4


@pytest.mark.parametrize("override,field", [
    ("correction.kind=foo", "correction"),
    ("loss.eps_low=0", "eps_low"),
    ("sampling.num_samples=1", "sampling.num_samples"),
    ("trainer.minibatch_size=48", "trainer.minibatch_size"),
    ("compression.eviction.budget=2", "budget"),
    ("mesh.tensor=0", "mesh.tensor"),
    ("advantage.estimator=ppo", "advantage.estimator"),
    ("advantage.scale=token", "advantage.scale"),
    ("advantage.eps=0", "advantage.eps"),
    ("data.max_collect_rounds=0", "data.max_collect_rounds"),
    ("overlong.buffer_len=40", "overlong.buffer_len"),
    ("overlong.buffer_len=-1", "overlong.buffer_len"),
    ("overlong.penalty=-1", "overlong.penalty"),
    ("eval.every_steps=-1", "eval.every_steps"),
    ("loss.adv_eps=1e-4", "loss.adv_eps"),
    ("loss.group_size=8", "loss.group_size"),
])
def test_bad_config_names_the_field(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(RunConfig, None, override.split())


def test_mesh_not_dividing_devices_fails_before_any_file_is_written(tmp_path):
    from sparse_rl_jax.training.trainer import train

    cfg = load_config(RunConfig, None, [f"run_dir={tmp_path / 'x'}", "mesh.fsdp=3"])
    with pytest.raises(ValueError, match="fsdp"):
        train(cfg, log=lambda _: None)
    assert not (tmp_path / "x").exists()


def test_run_py_reports_config_errors_without_traceback(capsys):
    assert run.main(["train", "sampling.topp=0.5"]) == 2
    err = capsys.readouterr().err
    assert "unknown key(s) ['sampling.topp']" in err and "Traceback" not in err
