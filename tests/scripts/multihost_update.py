"""One GRPO update as two JAX processes on loopback (gloo collectives, 2 x 2 CPU devices, an
explicit coordinator), or on one device with ``--single``; writes the loss and the updated
params to ``--out`` (an .npz, process 0 only).

Run by tests/test_multihost.py: the multi-host path (``run.py --distributed``) tested for real.
"""

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
args = argparse.ArgumentParser()
args.add_argument("--single", action="store_true")
args.add_argument("--process-id", type=int, default=0)
args.add_argument("--port", type=int, default=0)
args.add_argument("--out", required=True)
args = args.parse_args()
# appended: the suite's XLA flags (tests/conftest.py: fast compiles) stay in force
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=2").strip()
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
if not args.single:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{args.port}", num_processes=2,
                               process_id=args.process_id)

import models  # noqa: E402
from sparse_rl_jax.rl.corrections import compute_corrections  # noqa: E402
from sparse_rl_jax.rl.grpo_loss import LossBatch  # noqa: E402
from sparse_rl_jax.rl.loss_config import CorrectionConfig  # noqa: E402
from sparse_rl_jax.rl.update_step import Minibatch  # noqa: E402
from sparse_rl_jax.training.rl_step import batch_sharding  # noqa: E402
from update_problem import sharded_update, update_problem  # noqa: E402  (this script's folder)

config, arrays = update_problem()  # every process draws the same global batch
prompt, prompt_mask, response = arrays["prompt"], arrays["prompt_mask"], arrays["response"]
loss_mask, logp_old, logp_sparse = arrays["loss_mask"], arrays["logp_old"], arrays["logp_sparse"]
adv = arrays["adv"]
corr = jax.tree.map(np.asarray, compute_corrections(
    jnp.asarray(logp_old), jnp.asarray(logp_sparse), jnp.asarray(loss_mask),
    CorrectionConfig(kind="sparse_rl")))
host_batch = Minibatch(prompt, prompt_mask, response,
                       LossBatch.from_corrections(logp_old, adv, loss_mask, corr))

mesh = (models.make_mesh(1, 1, 1, devices=jax.devices()[:1]) if args.single
        else models.make_mesh(2, 1, 2))  # data over the two processes, tensor within each
sharding = batch_sharding(mesh)
batch = jax.tree.map(  # a global array: each process fills the shards of its own devices
    lambda x: jax.make_array_from_callback(x.shape, sharding if x.ndim else
                                           jax.sharding.NamedSharding(mesh, jax.P()),
                                           lambda idx, x=x: x[idx]), host_batch)
new_params, metrics = sharded_update(config, batch, mesh)
replicated = jax.sharding.NamedSharding(mesh, jax.P())
gather = jax.jit(lambda t: t, out_shardings=replicated)  # every process gets every value
leaves = [np.asarray(gather(x).addressable_data(0)) for x in jax.tree.leaves(new_params)]
loss = float(np.asarray(metrics["loss"].addressable_data(0)))  # replicated: every process has it
if jax.process_index() == 0:
    np.savez(args.out, loss=loss, devices=jax.device_count(), processes=jax.process_count(),
             **{f"param_{i}": leaf for i, leaf in enumerate(leaves)})
