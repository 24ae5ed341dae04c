"""Async mode through ``train``: ``max_lag: 0`` is the sync run bit for bit (rows, losses,
params), a lag-1 run stopped after a step and resumed equals the uninterrupted one (the
in-flight rollout is drawn again from the checkpointed older version), and the device split
is refused before anything is written when it leaves a role without devices or spans hosts."""

from __future__ import annotations

import jax
import pytest
from safetensors.numpy import load_file

from sparse_rl_jax.core.config_io import ConfigError, load_config
from sparse_rl_jax.records.metrics_writer import read_metrics
from sparse_rl_jax.tasks.rewards import available_reward_fns, register_reward_fn
from sparse_rl_jax.tasks.task import TaskConfig
from sparse_rl_jax.training.run_config import RunConfig, WarmStartConfig
from sparse_rl_jax.training.trainer import train
from sparse_rl_jax.training.warm_start import build_default_model
from tiny_rl import hash_reward

STEPS = 3
TIMING = ("time", "rollout_share", "score_share", "update_share", "tokens_per_second")


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory):
    return build_default_model(
        tmp_path_factory.mktemp("async_trainer") / "policy",
        WarmStartConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                        intermediate_size=64, steps=3, batch_size=4),
        TaskConfig(n_min=2, n_max=4), log=lambda _: None)


def _run(policy, run_dir, *overrides):
    """Trains the tiny config in ``run_dir`` (one prompt length: one compiled shape; a reward
    that differs between samples, the tiny policy's task reward being 0 everywhere); returns
    ``(metrics records, final params)``."""
    if "crc_parity" not in available_reward_fns():
        register_reward_fn("crc_parity", lambda: hash_reward)
    cfg = load_config(RunConfig, None, [
        f"run_dir={run_dir}", f"model.path={policy}", "data.task.n_min=4", "data.task.n_max=4",
        "data.reward=crc_parity",
        "sampling.max_new_tokens=16", "sampling.num_samples=2", "sampling.prompt_bucket=8",
        "compression.method=rkv", "compression.eviction.budget=16",
        "compression.eviction.buffer=4", "compression.eviction.window=2", "optim.lr=1e-3",
        f"trainer.steps={STEPS}", "trainer.prompts_per_step=4", "trainer.minibatch_size=4",
        "trainer.logp_chunk=8", "trainer.checkpoint_every=1", "trainer.plots=false",
        *overrides])
    train(cfg, log=lambda _: None)
    records = [{k: v for k, v in r.items() if not k.startswith(TIMING)}
               for r in read_metrics(run_dir / "metrics.jsonl")]
    return records, load_file(str(next((run_dir / "final").glob("*.safetensors"))))


def _assert_same(a, b):
    (records_a, params_a), (records_b, params_b) = a, b
    shared = [{k: r[k] for k in r if k in s} for r, s in zip(records_a, records_b)]
    assert shared == [{k: s[k] for k in r} for r, s in zip(shared, records_b)]
    assert len(records_a) == len(records_b) == STEPS
    assert params_a.keys() == params_b.keys()
    for name in params_a:
        assert (params_a[name] == params_b[name]).all(), name


def test_async_lag_zero_equals_sync_bit_for_bit(tiny_policy, tmp_path):
    sync = _run(tiny_policy, tmp_path / "sync")
    lag0 = _run(tiny_policy, tmp_path / "lag0", "trainer.mode=async", "trainer.max_lag=0")
    _assert_same(sync, lag0)
    assert {r["async/lag"] for r in lag0[0]} == {0.0}
    assert sync[0][0]["loss"] != sync[0][-1]["loss"]  # it trained: the params moved


def test_lag_one_resumed_after_a_step_equals_the_uninterrupted_run(tiny_policy, tmp_path):
    lag1 = ("trainer.mode=async", "trainer.max_lag=1")
    whole = _run(tiny_policy, tmp_path / "whole", *lag1)
    _run(tiny_policy, tmp_path / "cut", *lag1, "trainer.steps=2")
    resumed = _run(tiny_policy, tmp_path / "cut", *lag1)  # step 2's rows: version 1, restored
    _assert_same(whole, resumed)
    assert [r["async/lag"] for r in whole[0]] == [0.0, 1.0, 1.0]


@pytest.mark.parametrize("processes, rule", [
    (1, "leaves the learner no device"),
    (2, "multi-controller JAX"),
])
def test_a_device_split_that_cannot_run_fails_before_any_file_is_written(
        tmp_path, monkeypatch, processes, rule):
    monkeypatch.setattr(jax, "process_count", lambda: processes)
    cfg = load_config(RunConfig, None, [
        f"run_dir={tmp_path / 'x'}", "trainer.mode=async",
        f"mesh.rollout_devices={jax.device_count()}"])
    with pytest.raises(ConfigError, match=rf"mesh\.rollout_devices=\d+.*{rule}"):
        train(cfg, log=lambda _: None)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("overrides, field", [
    (["trainer.mode=async", "trainer.max_lag=-1"], "trainer.max_lag"),
    (["trainer.mode=async", "data.dynamic_sampling=true"], "data.dynamic_sampling"),
    (["trainer.mode=async", "correction.kind=shadow_mask"], "correction.replay"),
    (["trainer.mode=async", "compression.method=sparrow", "compression.adapt.enabled=true"],
     "compression.adapt.enabled"),
    (["mesh.rollout_devices=1"], "mesh.rollout_devices"),
    (["trainer.mode=fast"], "trainer.mode"),
])
def test_what_async_mode_cannot_serve_is_a_config_error_naming_the_key(overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(RunConfig, None, overrides)
