"""The RL training loop: load the policy, run RL steps, log, checkpoint, resume, export.

``train(cfg)`` is what ``python run.py train`` calls. A run directory holds the resolved
config, ``metrics.jsonl`` + TensorBoard events, orbax checkpoints, plots and (at the end) the
policy exported as an HF checkpoint. Starting ``train`` on a directory that has checkpoints
resumes from the latest one; since every step is a pure function of ``(seed, step)``, a
resumed run continues exactly as an uninterrupted one would have.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

import models
from sparse_rl_jax.checkpoint import Checkpointer
from sparse_rl_jax.config_io import save_config, to_dict
from sparse_rl_jax.metrics_writer import MetricsWriter, read_metrics
from sparse_rl_jax.optim import make_optimizer
from sparse_rl_jax.plots import plot_metrics
from sparse_rl_jax.progress import TrainProgress
from sparse_rl_jax.prompt_source import PromptSource
from sparse_rl_jax.rewards import get_reward_fn
from sparse_rl_jax.rl_step import StepContext, batch_sharding, rl_step
from sparse_rl_jax.run_config import RunConfig
from sparse_rl_jax.train_step import init_optimizer, jit_update_step
from sparse_rl_jax.warm_start import build_default_model

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def make_run_mesh(cfg: RunConfig):
    """The run's device mesh; a size that does not fit the devices names the field."""
    mesh = models.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
    batch_devices = mesh.shape["data"] * mesh.shape["fsdp"]
    if cfg.trainer.minibatch_size % batch_devices:
        raise ValueError(
            f"trainer.minibatch_size={cfg.trainer.minibatch_size} must be divisible by the "
            f"mesh's data x fsdp = {batch_devices} devices"
        )
    return mesh


def check_inputs(cfg: RunConfig) -> None:
    """Fails (naming the field) if a file the run reads is missing, before anything is written."""
    if (cfg.model.path is not None and not (Path(cfg.model.path) / "config.json").is_file()
            and models.find_gguf(cfg.model.path) is None):
        raise FileNotFoundError(
            f"model.path={cfg.model.path!r} is not an HF checkpoint directory (no config.json) "
            "nor a GGUF file; nothing is downloaded: point it at a local copy")
    for field, dataset in (("data.jsonl", cfg.data.jsonl), ("eval.jsonl", cfg.eval.jsonl)):
        if dataset is not None and not Path(dataset.path).is_file():
            raise FileNotFoundError(f"{field}.path={dataset.path!r} does not exist")


def policy_path(cfg: RunConfig, log: Callable[[str], None] = print) -> str:
    """The HF checkpoint directory of the initial policy (building the default if needed)."""
    if cfg.model.path is not None:
        return str(models.checkpoint_dir(cfg.model.path))  # a GGUF file is converted once
    return build_default_model(Path(cfg.run_dir) / "warm_start", cfg.warm_start, cfg.data.task,
                               log=log)


def resolve_sampling(cfg: RunConfig, tokenizer: models.Tokenizer):
    """``cfg.sampling`` with the tokenizer's EOS and pad ids when the config names none."""
    sampling = cfg.sampling
    if not sampling.eos_ids:
        sampling = dataclasses.replace(sampling, eos_ids=tuple(tokenizer.eos_ids),
                                       pad_id=tokenizer.pad_id)
    return sampling


def _config_hash(cfg: RunConfig) -> str:
    """Hash of the settings a resumed run must share with the run it continues."""
    relevant = {k: v for k, v in to_dict(cfg).items() if k not in ("trainer", "eval")}
    relevant["seed"] = cfg.trainer.seed
    return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()[:16]


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def train(cfg: RunConfig, log: Callable[[str], None] = print) -> dict:
    """Trains ``cfg``'s policy with GRPO on sparse rollouts; returns the last step's metrics.

    Resumes from the latest checkpoint in ``cfg.run_dir/checkpoints`` if there is one (its
    config hash must match), otherwise starts fresh.
    """
    run_dir = Path(cfg.run_dir)
    check_inputs(cfg)  # missing files and mesh errors surface before anything is written
    mesh = make_run_mesh(cfg)
    reward_fn = get_reward_fn(cfg.data.reward)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")

    path = policy_path(cfg, log)
    tokenizer = models.Tokenizer(path)
    model = models.load_pretrained(path, dtype=DTYPES[cfg.model.dtype], mesh=mesh)
    graphdef, params = nnx.split(model)
    del model
    ref_params = jax.tree.map(jnp.copy, params) if cfg.loss.kl_coef > 0 else None
    optimizer = make_optimizer(cfg.optim)
    opt_state, opt_shardings = init_optimizer(optimizer, params, mesh)
    update = jit_update_step(
        graphdef, loss_cfg=cfg.loss, optimizer=optimizer,
        param_shardings=jax.tree.map(lambda x: x.sharding, params), opt_shardings=opt_shardings,
        batch_sharding=batch_sharding(mesh), chunk_size=cfg.trainer.logp_chunk,
    )
    ctx = StepContext(
        cfg=cfg, sampling=resolve_sampling(cfg, tokenizer), graphdef=graphdef,
        tokenizer=tokenizer, source=PromptSource(cfg.data, cfg.trainer.prompts_per_step,
                                                 tokenizer.hf),
        reward_fn=reward_fn, update=update, mesh=mesh, ref_params=ref_params,
    )

    config_hash = _config_hash(cfg)
    ckpt = Checkpointer(run_dir / "checkpoints", keep=cfg.trainer.keep_checkpoints,
                        save_every=cfg.trainer.checkpoint_every)
    start = 0
    if ckpt.latest_step() is not None:
        meta = ckpt.read_meta()
        if meta.get("config_hash") != config_hash:
            raise ValueError(
                f"{run_dir}: its checkpoints come from a different config (hash "
                f"{meta.get('config_hash')} != {config_hash}); use a new run_dir"
            )
        state, meta = ckpt.restore(_abstract({"params": params, "opt_state": opt_state}))
        params, opt_state, start = state["params"], state["opt_state"], meta["step"]
        log(f"resumed from step {start} in {run_dir}")
    writer = MetricsWriter(run_dir, resume_step=start if start else None)
    metrics: dict = {}
    with TrainProgress(cfg.trainer.steps, start_step=start) as progress:
        for step in range(start, cfg.trainer.steps):
            params, opt_state, metrics = rl_step(ctx, params, opt_state, step)
            done = step + 1
            writer.log(done, metrics)
            progress.update(done, metrics)
            ckpt.save(done, {"params": params, "opt_state": opt_state},
                      {"step": done, "config_hash": config_hash,
                       "data_position": done, "seed": cfg.trainer.seed},
                      force=done == cfg.trainer.steps)
    ckpt.close()
    writer.close()
    if cfg.trainer.plots:
        records = read_metrics(run_dir / "metrics.jsonl")
        plot_metrics(records, run_dir / "plots", smooth=max(1, len(records) // 10),
                     title=str(run_dir))
    if cfg.trainer.export_final:
        export = export_policy(graphdef, params, tokenizer, run_dir / "final")
        log(f"final policy exported to {export}")
    return metrics


def export_policy(graphdef, params, tokenizer: models.Tokenizer, out: str | Path) -> Path:
    """Writes the policy and its tokenizer as an HF checkpoint directory that
    ``transformers.AutoModelForCausalLM`` / ``AutoTokenizer`` load (torch needed); returns it."""
    out = Path(out)
    models.save_pretrained(nnx.merge(graphdef, params), out)
    tokenizer.hf.save_pretrained(out)
    return out


def load_policy(cfg: RunConfig, checkpoint: str | None = None, log: Callable[[str], None] = print):
    """``(graphdef, params, tokenizer)`` of a policy to evaluate.

    Args:
      cfg: the run config (its ``run_dir``, model and warm-start sections).
      checkpoint: an HF checkpoint directory (has ``config.json``), or a run directory whose
        latest orbax checkpoint is restored; None means ``cfg.run_dir``.
    """
    target = Path(checkpoint or cfg.run_dir)
    if (target / "config.json").is_file():
        path = target
    else:
        path = Path(policy_path(cfg, log))
    tokenizer = models.Tokenizer(path)
    mesh = make_run_mesh(cfg)
    model = models.load_pretrained(path, dtype=DTYPES[cfg.model.dtype], mesh=mesh)
    graphdef, params = nnx.split(model)
    if path != target:
        ckpt_dir = target / "checkpoints"
        if not ckpt_dir.is_dir():
            raise FileNotFoundError(
                f"{target} is neither an HF checkpoint (no config.json) nor a run directory "
                "with checkpoints/")
        opt_state = jax.eval_shape(make_optimizer(cfg.optim).init, params)
        abstract = {"params": _abstract(params),
                    "opt_state": jax.tree.map(
                        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), opt_state)}
        with Checkpointer(ckpt_dir, read_only=True) as ckpt:
            state, meta = ckpt.restore(abstract)
        params = state["params"]
        log(f"loaded step {meta['step']} from {ckpt_dir}")
    return graphdef, params, tokenizer
