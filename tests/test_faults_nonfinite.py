"""Fault matrix, non-finite updates (issue 17): an update whose loss, gradient or updated
params / optimizer state is not finite is skipped inside the jitted step (params and
optimizer state bit-identical) and counted; ``trainer.max_nonfinite_steps`` such RL steps in
a row stop the run with ``NonFiniteError`` naming the step, no checkpoint holding a NaN."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from fault_helpers import run_args
from sparse_rl_jax.core.config_io import load_config
from sparse_rl_jax.records.checkpoint import Checkpointer
from sparse_rl_jax.records.checkpoint_errors import OrbaxErrorLog
from sparse_rl_jax.records.metrics_writer import read_metrics
from sparse_rl_jax.training.run_config import RunConfig
from sparse_rl_jax.training.trainer import NonFiniteError, NonFiniteGuard, train
from tiny_hf import make_tiny_hf

pytest_plugins = ("fault_helpers",)  # the tiny model + data fixture


@pytest.mark.parametrize("lr,advantage,skipped", [
    (1e-2, np.nan, True),   # NaN advantage: the loss is NaN
    (1e39, 1.0, True),      # lr beyond float32: the updated params would be inf / NaN
    (1e-2, -1.0, False),    # a finite update goes through
])
def test_nonfinite_update_is_skipped(tmp_path, lr, advantage, skipped):
    """Params and optimizer state stay bit-identical when the update is skipped."""
    from flax import nnx

    from sparse_rl_jax.rl.grpo_loss import LossBatch
    from sparse_rl_jax.rl.loss_config import GRPOLossConfig
    from sparse_rl_jax.rl.optim import OptimConfig, make_optimizer
    from sparse_rl_jax.rl.update_step import Minibatch, update_step

    model_dir = make_tiny_hf(tmp_path, "qwen2", tokenizer=False, num_hidden_layers=1,
                             hidden_size=32, intermediate_size=32)
    graphdef, params = nnx.split(models.load_pretrained(model_dir, dtype=jnp.float32))
    optimizer = make_optimizer(OptimConfig(lr=lr))
    opt_state = optimizer.init(params)
    n, p, m = 2, 3, 4
    mask = jnp.ones((n, m), bool)
    batch = Minibatch(jnp.full((n, p), 7, jnp.int32), jnp.ones((n, p), jnp.int32),
                      jnp.full((n, m), 9, jnp.int32),
                      LossBatch(logp_old_dense=jnp.full((n, m), -1.0),
                                advantages=jnp.array([1.0, advantage]), loss_mask=mask,
                                is_weights=jnp.ones((n, m)), token_mask=mask,
                                seq_mask=jnp.ones((n,), bool)))
    new_params, new_state, metrics = jax.jit(lambda pr, s, b: update_step(
        graphdef, pr, s, b, loss_cfg=GRPOLossConfig(), optimizer=optimizer,
        chunk_size=4))(params, opt_state, batch)
    assert float(metrics["nonfinite_update"]) == float(skipped)
    same = [np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(
        jax.tree.leaves((params, opt_state)), jax.tree.leaves((new_params, new_state)))]
    assert all(same) if skipped else not all(same)


def test_nonfinite_streak_stops_the_run_naming_the_step():
    guard = NonFiniteGuard(limit=3)
    for step, nonfinite in enumerate([True, False, True, True], start=1):
        guard.record(step, nonfinite)
    assert (guard.skipped, guard.in_a_row) == (3, 2)
    with pytest.raises(NonFiniteError, match=r"step 5: .* 3 RL steps in a row \(steps 3..5"):
        guard.record(5, True)


def test_trainer_skips_nonfinite_steps_and_stops_naming_the_step(tiny, tmp_path):
    """optim.lr=1e39 (finite in the config, inf in float32): every update would make the
    params non-finite, so each is skipped and counted, the second in a row stops the run,
    and the one checkpoint written (step 1) holds the initial, finite params."""
    _, model, data = tiny
    run_dir = tmp_path / "run"
    cfg = load_config(RunConfig, None, run_args(model, data, run_dir)[1:] + [
        "optim.lr=1e39", "trainer.steps=3", "trainer.max_nonfinite_steps=2",
        "trainer.checkpoint_every=1", "trainer.plots=false", "trainer.export_final=false",
        "logging.backends=[jsonl]"])
    with pytest.raises(NonFiniteError, match=r"^step 2: the loss, gradients or updated params "
                                             r"were not finite in 2 RL steps in a row"):
        train(cfg, log=lambda _: None)
    # the run's Checkpointer was closed on the error: none of its log filters is left behind
    assert not [f for f in logging.getLogger("absl").filters if isinstance(f, OrbaxErrorLog)]
    records = read_metrics(run_dir)
    assert [(r["step"], r["nonfinite_update"], r["skipped_nonfinite_steps"])
            for r in records] == [(1, 1.0, 1), (2, 1.0, 2)]
    from flax import nnx

    from sparse_rl_jax.rl.optim import make_optimizer
    from sparse_rl_jax.records.checkpoint_state import abstract_like
    from sparse_rl_jax.rl.update_step import init_optimizer

    initial = nnx.split(models.load_pretrained(model, dtype=jnp.float32))[1]
    opt_state, _ = init_optimizer(make_optimizer(cfg.optim), initial, models.make_mesh())
    with Checkpointer(run_dir / "checkpoints", read_only=True) as ckpt:
        assert ckpt.all_steps() == [1]
        saved, _ = ckpt.restore(abstract_like({"params": initial, "opt_state": opt_state}))
    for a, b in zip(jax.tree.leaves((initial, opt_state)), jax.tree.leaves(
            (saved["params"], saved["opt_state"]))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
