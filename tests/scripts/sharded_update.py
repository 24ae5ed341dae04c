"""Runs one GRPO update on a (data=2, fsdp=2, tensor=2) mesh of 8 fake CPU devices and on one
device, and prints the max differences of the loss and the updated params as JSON.

Run by tests/test_trainer.py in a subprocess (the fake devices must exist before jax starts).
"""

import json
import os
import sys
from pathlib import Path

# Import this checkout's packages even where another copy is installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import models  # noqa: E402
from sparse_rl_jax.corrections import compute_corrections  # noqa: E402
from sparse_rl_jax.grpo_loss import LossBatch  # noqa: E402
from sparse_rl_jax.loss_config import CorrectionConfig, GRPOLossConfig  # noqa: E402
from sparse_rl_jax.optim import OptimConfig, make_optimizer  # noqa: E402
from sparse_rl_jax.rl_step import batch_sharding  # noqa: E402
from sparse_rl_jax.train_step import Minibatch, init_optimizer, jit_update_step  # noqa: E402

config = models.ModelConfig(model_type="qwen2", vocab_size=64, hidden_size=32,
                            intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                            head_dim=8, attention_bias=True)
rng = np.random.default_rng(0)
n, p, m = 8, 6, 10
prompt = rng.integers(1, 64, (n, p)).astype(np.int32)
prompt_mask = np.ones((n, p), np.int32)
prompt_mask[:3, :2] = 0
response = rng.integers(1, 64, (n, m)).astype(np.int32)
loss_mask = (np.arange(m)[None] < rng.integers(3, m + 1, n)[:, None]).astype(np.int32)
logp_old = -rng.uniform(0.5, 4.0, (n, m)).astype(np.float32)
logp_sparse = logp_old + rng.normal(0, 0.3, (n, m)).astype(np.float32)
corr = compute_corrections(jnp.asarray(logp_old), jnp.asarray(logp_sparse),
                           jnp.asarray(loss_mask), CorrectionConfig(kind="sparse_rl"))
adv = jnp.asarray(rng.normal(size=n).astype(np.float32))
batch = Minibatch(jnp.asarray(prompt), jnp.asarray(prompt_mask), jnp.asarray(response),
                  LossBatch.from_corrections(jnp.asarray(logp_old), adv,
                                             jnp.asarray(loss_mask), corr))
optimizer = make_optimizer(OptimConfig(lr=1e-2, weight_decay=0.1))
loss_cfg = GRPOLossConfig(group_size=2)


def run(mesh):
    model = nnx.eval_shape(lambda: models.Decoder(config, dtype=jnp.float32,
                                                  param_dtype=jnp.float32, rngs=nnx.Rngs(0)))
    graphdef, abstract = nnx.split(model)
    shardings = models.param_shardings(abstract, mesh)
    params = jax.jit(lambda: nnx.split(models.Decoder(
        config, dtype=jnp.float32, param_dtype=jnp.float32, rngs=nnx.Rngs(0)))[1],
        out_shardings=shardings)()
    opt_state, opt_shardings = init_optimizer(optimizer, params, mesh)
    step = jit_update_step(graphdef, loss_cfg=loss_cfg, optimizer=optimizer,
                           param_shardings=shardings, opt_shardings=opt_shardings,
                           batch_sharding=batch_sharding(mesh), chunk_size=4)
    new_params, _, metrics = step(params, opt_state, jax.device_put(batch, batch_sharding(mesh)))
    spread = {str(x.sharding.spec) for x in jax.tree.leaves(new_params)}
    return jax.device_get(new_params), float(metrics["loss"]), spread


single, loss_1, _ = run(models.make_mesh(1, 1, 1, devices=jax.devices()[:1]))
sharded, loss_8, specs = run(models.make_mesh(2, 2, 2))
diff = max(float(np.max(np.abs(a - b))) for a, b in
           zip(jax.tree.leaves(single), jax.tree.leaves(sharded)))
moved = max(float(np.max(np.abs(a))) for a in jax.tree.leaves(single))
print(json.dumps({"loss_single": loss_1, "loss_sharded": loss_8, "param_diff": diff,
                  "devices": jax.device_count(), "specs": sorted(specs), "max_param": moved}))
