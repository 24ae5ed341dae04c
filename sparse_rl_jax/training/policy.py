"""The policy outside the training loop: where its weights come from, loading it (from an
HF checkpoint or a run directory's newest orbax checkpoint) onto the run's mesh, the sampling
settings it rolls out with, and exporting it as an HF checkpoint.

The trainer, evaluation and the experiments share these, so evaluating a policy does not
import the training loop.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

import jax
from flax import nnx

import models
from sparse_rl_jax.core.config_io import ConfigError
from sparse_rl_jax.records.checkpoint import Checkpointer
from sparse_rl_jax.records.checkpoint_state import (base_record, check_base, restore_target,
                                                    restored_params)
from sparse_rl_jax.rl.optim import make_optimizer
from sparse_rl_jax.training.preflight import load_checked_policy
from sparse_rl_jax.training.role_mesh import role_devices
from sparse_rl_jax.training.run_config import RunConfig
from sparse_rl_jax.training.warm_start import build_default_model


def make_run_mesh(cfg: RunConfig):
    """The run's (learner's) device mesh, over the devices ``mesh.rollout_devices`` leaves
    it (``role_mesh.role_devices``); sizes that do not fit them are a ConfigError naming the
    mesh fields and the device count."""
    devices = role_devices(cfg)[0]  # the learner's (all of them unless mesh.rollout_devices)
    try:
        mesh = models.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, devices=devices)
    except ValueError as e:
        split = cfg.mesh.rollout_devices
        where = (f"the learner's {len(devices)} of {jax.device_count()} device(s) "
                 f"(rollout_devices={split})" if split else f"the {len(devices)} device(s)")
        raise ConfigError(f"mesh (data={cfg.mesh.data}, fsdp={cfg.mesh.fsdp}, "
                          f"tensor={cfg.mesh.tensor}) does not fit {where}: {e}") from e
    batch_devices = mesh.shape["data"] * mesh.shape["fsdp"]
    if cfg.trainer.minibatch_size % batch_devices:
        raise ValueError(
            f"trainer.minibatch_size={cfg.trainer.minibatch_size} must be divisible by the "
            f"mesh's data x fsdp = {batch_devices} devices"
        )
    return mesh


def policy_path(cfg: RunConfig, log: Callable[[str], None] = print) -> str:
    """The HF checkpoint directory of the initial policy (building the default if needed)."""
    if cfg.model.path is not None:
        return str(models.checkpoint_dir(cfg.model.path))  # a GGUF file is converted once
    return build_default_model(Path(cfg.run_dir) / "warm_start", cfg.warm_start, cfg.data.synthetic,
                               log=log)


def record_needed(cfg: RunConfig) -> bool:
    """Whether the run reads the rollout's record (``Rollout.record``): a replaying
    (``correction.replay``, ``shadow_mask``) learner replays it; ``sparrow`` logs its acceptance alpha from it (unless
    ``compression.alpha.metric: off``). Nothing else does: a dense or evicting cache under
    the dense-scoring corrections never needs one."""
    return cfg.correction.replay or (cfg.compression.page_sparse
                                                    and cfg.compression.alpha.metric != "off")


def resolve_sampling(cfg: RunConfig, tokenizer: models.Tokenizer):
    """``cfg.sampling`` with the tokenizer's EOS and pad ids when the config names none, and
    ``record_evictions`` resolved when unset (:func:`record_needed`)."""
    sampling = cfg.sampling
    if sampling.record_evictions is None:
        sampling = dataclasses.replace(sampling, record_evictions=record_needed(cfg))
    if not sampling.eos_ids:
        sampling = dataclasses.replace(sampling, eos_ids=tuple(tokenizer.eos_ids),
                                       pad_id=tokenizer.pad_id)
    return sampling


LORA_ADAPTER_DIR = "lora_adapter"
"""Where :func:`export_policy` writes a LoRA policy's adapter alone (PEFT format)."""


def export_policy(graphdef, params, tokenizer: models.Tokenizer, out: str | Path) -> Path:
    """Writes the policy and its tokenizer as an HF checkpoint directory that
    ``transformers.AutoModelForCausalLM`` / ``AutoTokenizer`` load (torch needed); returns it.

    A policy with LoRA adapters is written merged, and its adapter alone goes to
    ``out/lora_adapter`` (``models.save_adapter``: PEFT's ``adapter_model.safetensors`` +
    ``adapter_config.json``, applied to the base checkpoint by ``peft.PeftModel``).
    """
    out = Path(out)
    model = nnx.merge(graphdef, params)
    models.save_pretrained(model, out)
    if models.has_lora(model):
        models.save_adapter(model, out / LORA_ADAPTER_DIR)
    tokenizer.hf.save_pretrained(out)
    return out


def load_policy(cfg: RunConfig, checkpoint: str | None = None, log: Callable[[str], None] = print):
    """``(graphdef, params, tokenizer)`` of a policy to evaluate.

    Args:
      cfg: the run config (its ``run_dir``, model and warm-start sections).
      checkpoint: an HF checkpoint directory (has ``config.json``), or a run directory whose
        latest orbax checkpoint is restored (a LoRA checkpoint's adapters onto the base
        ``cfg.model`` names, which must be the one they were trained on:
        ``checkpoint_state.check_base``); None means ``cfg.run_dir``.
    """
    target = Path(checkpoint or cfg.run_dir)
    if (target / "config.json").is_file():
        path = target
    elif not (target / "checkpoints").is_dir():  # before building a default warm start
        raise FileNotFoundError(
            f"{target} is neither an HF checkpoint (no config.json) nor a run directory "
            "with checkpoints/")
    else:
        path = Path(policy_path(cfg, log))
    mesh = make_run_mesh(cfg)
    tokenizer, model = load_checked_policy(str(path), cfg, mesh)
    graphdef, params = nnx.split(model)
    if path != target:
        ckpt_dir = target / "checkpoints"
        opt_state = jax.eval_shape(make_optimizer(cfg.optim).init,
                                   models.split_trainable(params)[0])
        with Checkpointer(ckpt_dir, read_only=True) as ckpt:
            state, meta = ckpt.restore(restore_target(params, opt_state,
                                                        cfg.trainer.lagged_versions))
        check_base(meta, base_record(path), f"checkpoint step {meta['step']} in {ckpt_dir}")
        params = restored_params(state, params)
        log(f"loaded step {meta['step']} from {ckpt_dir}")
    return graphdef, params, tokenizer
