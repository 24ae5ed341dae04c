"""Where the rollout and learner phases run: one host's devices split into two role groups.

``mesh.rollout_devices: n`` (async mode) gives the first ``n`` local devices to the rollouts
and the rest to the learner's ``(data, fsdp, tensor)`` mesh; 0 shares every device. After each
update the weights go from the learner's mesh to the rollout group's as a reshard
(:func:`sync_weights`), timed as ``time/weight_sync``.

A split is refused across hosts: every process of a multi-controller JAX program takes part
in every program it runs, so two disjoint role meshes each need a single controller (Pathways).
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding

import models
from sparse_rl_jax.core.config_checks import ConfigError


def role_devices(cfg) -> tuple[list, list | None]:
    """``(learner devices, rollout devices or None when colocated)`` of the run config ``cfg``;
    a ConfigError naming ``mesh.rollout_devices`` for a split across hosts or one that
    leaves the learner without a device."""
    n = cfg.mesh.rollout_devices
    devices = jax.devices()
    if n == 0:
        return devices, None
    if jax.process_count() > 1:
        raise ConfigError(
            f"mesh.rollout_devices={n}: a rollout/learner split across {jax.process_count()} "
            "processes is not possible with multi-controller JAX (every process takes part in "
            "every program, so disjoint role meshes need a single controller, Pathways); "
            "use mesh.rollout_devices=0 (both roles on every device)")
    if n >= len(devices):
        raise ConfigError(
            f"mesh.rollout_devices={n} leaves the learner no device: this host has "
            f"{len(devices)} device(s); give the rollouts fewer than that")
    return devices[n:], devices[:n]


def rollout_mesh(cfg):
    """The rollout group's mesh (its devices on the fsdp axis), or None when colocated."""
    devices = role_devices(cfg)[1]
    return None if devices is None else models.make_mesh(1, -1, 1, devices=devices)


def sync_weights(params, mesh):
    """A copy of ``params`` for the rollouts: resharded onto ``mesh`` (each leaf keeps its
    partition spec), or on the learner's own devices when ``mesh`` is None. A copy, so the
    learner's next update (which donates its params) leaves it intact."""
    def put(x):
        target = x.sharding if mesh is None else NamedSharding(mesh, x.sharding.spec)
        return jax.device_put(x, target, may_alias=False)
    return jax.tree.map(put, params)
