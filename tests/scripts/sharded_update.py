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
# appended: the suite's XLA flags (tests/conftest.py: fast compiles) stay in force
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import models  # noqa: E402
from sparse_rl_jax.rl.corrections import compute_corrections  # noqa: E402
from sparse_rl_jax.rl.grpo_loss import LossBatch  # noqa: E402
from sparse_rl_jax.rl.loss_config import CorrectionConfig  # noqa: E402
from sparse_rl_jax.rl.update_step import Minibatch  # noqa: E402
from sparse_rl_jax.training.rl_step import batch_sharding  # noqa: E402
from update_problem import sharded_update, update_problem  # noqa: E402  (this script's folder)

config, arrays = update_problem()
prompt, prompt_mask, response = arrays["prompt"], arrays["prompt_mask"], arrays["response"]
loss_mask, logp_old, logp_sparse = arrays["loss_mask"], arrays["logp_old"], arrays["logp_sparse"]
corr = compute_corrections(jnp.asarray(logp_old), jnp.asarray(logp_sparse),
                           jnp.asarray(loss_mask), CorrectionConfig(kind="sparse_rl"))
adv = jnp.asarray(arrays["adv"])
batch = Minibatch(jnp.asarray(prompt), jnp.asarray(prompt_mask), jnp.asarray(response),
                  LossBatch.from_corrections(jnp.asarray(logp_old), adv,
                                             jnp.asarray(loss_mask), corr))


def run(mesh):
    new_params, metrics = sharded_update(config, jax.device_put(batch, batch_sharding(mesh)), mesh)
    spread = {str(x.sharding.spec) for x in jax.tree.leaves(new_params)}
    return jax.device_get(new_params), float(metrics["loss"]), spread


single, loss_1, _ = run(models.make_mesh(1, 1, 1, devices=jax.devices()[:1]))
sharded, loss_8, specs = run(models.make_mesh(2, 2, 2))
diff = max(float(np.max(np.abs(a - b))) for a, b in
           zip(jax.tree.leaves(single), jax.tree.leaves(sharded)))
moved = max(float(np.max(np.abs(a))) for a in jax.tree.leaves(single))
print(json.dumps({"loss_single": loss_1, "loss_sharded": loss_8, "param_diff": diff,
                  "devices": jax.device_count(), "specs": sorted(specs), "max_param": moved}))
