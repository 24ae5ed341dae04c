"""The RL training loop: load the policy, run RL steps, log, checkpoint, resume, export.

``train(cfg)`` is what ``python run.py train`` calls. A run directory holds the resolved
config, a manifest (config hash, code version, last good step), ``metrics.jsonl`` +
TensorBoard events, orbax checkpoints, plots and (at the end) the policy exported as an HF
checkpoint. Starting ``train`` on a directory that has checkpoints resumes from the newest
one that restores; since every step is a pure function of ``(seed, step)``, a resumed run
continues exactly as an uninterrupted one would have.

Everything that can be checked is checked before the run directory is written: inputs, mesh,
reward, the policy and tokenizer (with an explicit ``model.path``), every prompt's length,
the compression and attention backend against the model and this platform, and whether an
existing directory holds this run (manifest) and is free (lock).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from contextlib import ExitStack
from pathlib import Path
from typing import Callable

import jax
from flax import nnx

import models
from sparse_rl_jax.core.config_io import save_config, to_dict
from sparse_rl_jax.kv.compression_config import CompressionConfig
from sparse_rl_jax.kv.quant_check import QuantErrorWarning
from sparse_rl_jax.records.checkpoint import CheckpointError, Checkpointer
from sparse_rl_jax.records.checkpoint_state import (BASE_KEY, base_record, check_base,
                                                    restore_target, restored_lagged,
                                                    restored_params, train_state)
from sparse_rl_jax.records.compile_watch import CompileWatch
from sparse_rl_jax.records.metrics_writer import MetricsWriter, WandbRun, read_metrics
from sparse_rl_jax.records.plots import plot_metrics
from sparse_rl_jax.records.progress import TrainProgress
from sparse_rl_jax.records.run_dir import check_resumable, open_run_dir
from sparse_rl_jax.rl.kl_reference import kl_reference
from sparse_rl_jax.rl.optim import make_optimizer
from sparse_rl_jax.rl.update_step import init_optimizer, jit_update_step
from sparse_rl_jax.tasks.rewards import get_reward_fn
from sparse_rl_jax.training.budget_control import BudgetLoop
from sparse_rl_jax.training.ess_guard import EssGuard, LowEssStop
from sparse_rl_jax.training.evaluation import eval_metrics
from sparse_rl_jax.training.policy import export_policy, make_run_mesh, policy_path
from sparse_rl_jax.training.preflight import (check_model_fits, checked_eval_set,
                                              checked_prompt_source, default_task_tokenizer,
                                              run_attention)
from sparse_rl_jax.training.rl_step import StepContext, batch_sharding
from sparse_rl_jax.training.role_mesh import rollout_mesh
from sparse_rl_jax.training.run_config import RunConfig
from sparse_rl_jax.training.run_inputs import Prepared, prepare, run_sampling, width_line
from sparse_rl_jax.training.step_modes import STEP_MODES
from sparse_rl_jax.training.warm_start import tiny_model_config


class NonFiniteError(RuntimeError):
    """Too many RL steps in a row had a non-finite loss, gradient or updated params."""


@dataclasses.dataclass
class NonFiniteGuard:
    """Counts RL steps whose update was skipped for a non-finite loss, gradient or updated
    params (``train_step.update_step``).

    Attributes:
      limit: this many such steps in a row raise :class:`NonFiniteError`.
      skipped: such steps so far (the ``skipped_nonfinite_steps`` metric; checkpointed).
      in_a_row: the current streak.
    """

    limit: int
    skipped: int = 0
    in_a_row: int = 0

    def record(self, step: int, nonfinite: bool) -> None:
        """Counts RL step ``step`` (1-based); raises NonFiniteError naming it at the limit."""
        self.in_a_row = self.in_a_row + 1 if nonfinite else 0
        self.skipped += bool(nonfinite)
        if self.in_a_row >= self.limit:
            raise NonFiniteError(
                f"step {step}: the loss, gradients or updated params were not finite in "
                f"{self.in_a_row} RL steps in a row (steps {step - self.in_a_row + 1}..{step}; "
                f"trainer.max_nonfinite_steps={self.limit}); those updates were skipped and no "
                "checkpoint holds them. Lower optim.lr or check the data and model")


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


def config_hash(cfg: RunConfig) -> str:
    """Hash of what determines the run (model, data, method, optimizer, seeds, batch shape),
    which a resumed run must share with the run it continues. Where the run lives
    (``run_dir``), how long it runs, checkpointing, plots, eval, logging and what changes
    only memory or speed (``model.remat`` / ``attention``, ``mesh.rollout_devices``,
    ``trainer.micro_batch_size``,
    ``compression.layout``, ``sampling.engine`` / ``slots`` / ``chunk`` / ``pool_pages`` /
    ``insert_prompts``) are left out, so a moved or copied run directory resumes and a
    finished run can be extended."""
    relevant = {k: v for k, v in to_dict(cfg).items()
                if k not in ("run_dir", "trainer", "eval", "logging")}
    # remat and the attention backend change only speed and memory; where the rollouts run
    # (mesh.rollout_devices) too: runs of older configs (no such fields) still resume
    relevant["model"] = {k: v for k, v in relevant["model"].items()
                         if k not in ("remat", "attention")}
    relevant["mesh"] = {k: v for k, v in relevant["mesh"].items() if k != "rollout_devices"}
    # the rollout engine and its slots change only speed and memory (every row equals static
    # generate's), so they are left out like the layout: runs of older configs still resume
    relevant["sampling"] = {k: v for k, v in relevant["sampling"].items()
                            if k not in ("engine", "slots", "chunk", "pool_pages",
                                         "insert_prompts")}
    # compression.layout changes only speed and memory (every layout a method takes runs the
    # same policy), so it is left out: runs of older configs (no field, or method none's
    # former own layout dense) still resume; the sections are hashed in the flat form of
    # before them (CompressionConfig.MOVED_KEYS), so runs from before the split resume too
    compression = relevant["compression"]
    relevant["compression"] = {"method": compression["method"],
                               "page_size": compression["page_size"]}
    if compression["quant"] != "none":  # another sampler: a quantized run's own hash
        relevant["compression"]["quant"] = compression["quant"]
    for old, new in CompressionConfig.MOVED_KEYS.items():
        section, key = new.split(".")
        relevant["compression"][old] = compression[section][key]
    # the correction in its flat form of before the parts, so those runs resume too
    relevant["correction"] = cfg.correction.hash_form()
    relevant["trainer"] = {k: getattr(cfg.trainer, k)
                           for k in ("seed", "prompts_per_step", "minibatch_size")}
    if cfg.trainer.mode == "async":  # which version draws each rollout (sync runs: as before)
        relevant["trainer"]["max_lag"] = cfg.trainer.max_lag
    return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()[:16]


def wandb_run(cfg: RunConfig) -> WandbRun:
    """The run's W&B run: ``logging.wandb_project``, an id from the run directory and the
    config hash (a resumed run continues it), the resolved config."""
    key = f"{Path(cfg.run_dir).resolve()}:{config_hash(cfg)}"
    return WandbRun(cfg.logging.wandb_project, hashlib.sha256(key.encode()).hexdigest()[:16],
                    to_dict(cfg))


def _checkpoint_hash(ckpt_dir: Path) -> str | None:
    """The config hash stored with the newest readable checkpoint (None without any)."""
    if not ckpt_dir.is_dir():
        return None
    with Checkpointer(ckpt_dir, read_only=True) as ckpt:
        for step in reversed(ckpt.all_steps()):
            try:
                return ckpt.read_meta(step).get("config_hash")
            except CheckpointError:
                continue
    return None


def _in_training_eval(cfg: RunConfig, ctx: StepContext,
                      eval_data: tuple[list[str], list[str]] | None
                      ) -> Callable[..., dict] | None:
    """``params -> eval/ metrics`` on ``eval_data`` (``preflight.checked_eval_set``: the
    eval set, read and checked before the run directory was written), or None when ``eval``
    asks for no evaluation during training."""
    if eval_data is None:
        return None
    prompts, answers = eval_data

    def evaluate_now(params) -> dict:
        return eval_metrics(ctx.graphdef, params, ctx.tokenizer, prompts, answers,
                            ctx.reward_fn, ctx.sampling, cfg.compression,
                            batch_size=cfg.eval.batch_size, samples=cfg.eval.samples,
                            temperature=cfg.eval.temperature,
                            add_special_tokens=cfg.data.add_special_tokens)

    return evaluate_now


def _preflight_default(cfg: RunConfig) -> models.ModelConfig:
    """Checks ``sampling.eos_ids`` / ``pad_id``, the compression, the data, the eval set and
    every prompt against the default model's tokenizer, config and context before the default
    model is built (``model.path`` None); returns that model's config."""
    tokenizer = default_task_tokenizer()
    model_cfg = tiny_model_config(cfg.warm_start, tokenizer.vocab_size, tokenizer.eos_ids[0],
                                  tokenizer.pad_id)
    check_model_fits(cfg, model_cfg)
    checked_prompt_source(cfg, tokenizer, model_cfg.max_position_embeddings)
    checked_eval_set(cfg, tokenizer, model_cfg.max_position_embeddings)
    return model_cfg


def train(cfg: RunConfig, log: Callable[[str], None] = print,
          on_step: Callable[[int, dict], None] | None = None, take_over: bool = False) -> dict:
    """Trains ``cfg``'s policy with GRPO on sparse rollouts; returns the last step's metrics.

    ``on_step(step, metrics)``, when given, is called after each step is logged (1-based
    ``step``; ``metrics`` as written to ``metrics.jsonl``), e.g. to record memory or stop
    criteria in an experiment without patching the loop. ``take_over`` takes over a run
    directory whose lock a run on another host left (``run.py train --take-over``; whether
    that run is alive cannot be told from here, so it is refused by default).

    Resumes from the newest checkpoint in ``cfg.run_dir/checkpoints`` that restores (its
    manifest's config hash must match), otherwise starts fresh. Nothing in the run directory
    is written before every input is checked, the directory is known to hold this run (or
    none) and this process holds its lock.

    Raises:
      ConfigError, ValueError, FileNotFoundError: bad config, model, tokenizer or data.
      RunDirError: unusable run directory, another live run on it (or, without
        ``take_over``, a run on another host), or a different config.
      CheckpointError: no checkpoint restores, or a save failed (e.g. disk full).
      NonFiniteError: ``trainer.max_nonfinite_steps`` non-finite steps in a row.
      LowEssStop: ``correction.on_low_ess: stop`` and a low-ESS episode (``ess_guard``): the
        run ended cleanly at that step (checkpoint committed, metrics and plots written, no
        export).
      AsyncRolloutError: async mode's producer failed, or the producer, the learner or the
        weight sync went quiet past the deadline (``trainer.async_timeout_s``).
    """
    run_dir = Path(cfg.run_dir)
    check_inputs(cfg)  # missing files and mesh errors surface before anything is written
    mesh = make_run_mesh(cfg)
    reward_fn = get_reward_fn(cfg.data.reward)
    chash = config_hash(cfg)
    lead = jax.process_index() == 0
    manifest = check_resumable(run_dir, chash, lambda: _checkpoint_hash(run_dir / "checkpoints"),
                               take_over)
    prepared = prepare(cfg, mesh, log) if cfg.model.path is not None else None
    run_attention(cfg, prepared.model.config if prepared else _preflight_default(cfg))
    owner = open_run_dir(run_dir, chash, manifest, take_over) if lead else None
    try:
        if lead:
            owner.write_manifest(manifest.get("last_good_step") if manifest else None)
            save_config(cfg, run_dir / "config.yaml")
        return _train(cfg, prepared or prepare(cfg, mesh, log), mesh, reward_fn, owner, log,
                      on_step)
    finally:
        if owner is not None:
            owner.close()


def _restore(cfg: RunConfig, ckpt: Checkpointer, params, opt_state, owner, log, base=None):
    """``(params, opt_state, start step, data position, NonFiniteGuard, older versions)``
    from the newest checkpoint of ``ckpt`` that restores (corrupt newer ones are set aside),
    or the initial ones at step 0 when there is none. ``base``: a LoRA run's
    ``base_record``, which the checkpoint's must match (``checkpoint_state.check_base``).
    The older versions are async mode's (``trainer.lagged_versions``, oldest first)."""
    guard = NonFiniteGuard(cfg.trainer.max_nonfinite_steps)
    if ckpt.latest_step() is None:
        return params, opt_state, 0, 0, guard, []
    state, meta = ckpt.restore_newest_good(
        restore_target(params, opt_state, cfg.trainer.lagged_versions), log)
    start = meta["step"]
    if base is not None:
        check_base(meta, base, f"checkpoint step {start} in {ckpt.directory}")
    guard.skipped = meta.get("skipped_nonfinite_steps", 0)
    recorded = owner.manifest.get("last_good_step") if owner and owner.manifest else None
    if recorded is not None and recorded > start:
        log(f"warning: the manifest records step {recorded} as saved; resuming from {start}")
    log(f"resumed from step {start} in {cfg.run_dir}")
    return (restored_params(state, params), state["opt_state"], start,
            meta.get("data_position", start), guard, restored_lagged(state, params))


def build_step_context(cfg: RunConfig, prepared: Prepared, mesh, reward_fn):
    """``(StepContext, params, opt_state)`` of a run from its :class:`Prepared` inputs: the
    model split into graphdef and params, the optimizer's initial state, the jitted update
    on ``mesh`` and the sampling settings at the run's one prompt width
    (:func:`run_sampling`)."""
    tokenizer, model, source = prepared.tokenizer, prepared.model, prepared.source
    model.remat = cfg.model.remat
    model.attention = run_attention(cfg, model.config)  # train checked it before any write
    graphdef, params = nnx.split(model)
    reference = kl_reference(params) if cfg.loss.kl_coef > 0 else None
    optimizer = make_optimizer(cfg.optim)
    opt_state, opt_shardings = init_optimizer(optimizer, params, mesh)
    update = jit_update_step(
        graphdef, loss_cfg=cfg.loss, optimizer=optimizer,
        param_shardings=jax.tree.map(lambda x: x.sharding, params), opt_shardings=opt_shardings,
        batch_sharding=batch_sharding(mesh), chunk_size=cfg.trainer.logp_chunk,
        low_r_share=cfg.trainer.low_r_grad_share, temperature=cfg.sampling.temperature,
    )
    ctx = StepContext(
        cfg=cfg, sampling=run_sampling(cfg, tokenizer, prepared.longest_prompt),
        graphdef=graphdef, tokenizer=tokenizer, source=source, reward_fn=reward_fn,
        update=update, mesh=mesh, reference=reference,
    )
    return ctx, params, opt_state


def _train(cfg: RunConfig, prepared, mesh, reward_fn, owner, log, on_step=None) -> dict:
    """The loop of :func:`train` once the run directory is owned (``owner``: the lead
    process's :class:`RunDir`, None elsewhere): restore, steps, checkpoints, export."""
    run_dir = Path(cfg.run_dir)
    ctx, params, opt_state = build_step_context(cfg, prepared, mesh, reward_fn)
    graphdef, tokenizer, eval_data = ctx.graphdef, ctx.tokenizer, prepared.eval_data
    log(width_line(cfg, ctx.sampling, prepared.longest_prompt))
    del prepared

    chash = config_hash(cfg)
    with ExitStack() as closing:  # closed on error too (orbax threads, log filters, files)
        ckpt = closing.enter_context(Checkpointer(
            run_dir / "checkpoints", keep=cfg.trainer.keep_checkpoints,
            save_every=cfg.trainer.checkpoint_every))
        base = base_record(policy_path(cfg, lambda _: None)) if cfg.model.lora else None
        params, opt_state, start, position, guard, lagged = _restore(
            cfg, ckpt, params, opt_state, owner, log, base)
        resumed = start and cfg.compression.adapt.enabled
        budget = BudgetLoop.start(cfg.compression, ckpt.read_meta(start) if resumed else None)
        writer = closing.enter_context(MetricsWriter(
            run_dir, resume_step=start if start else None,
            tensorboard="tensorboard" in cfg.logging.backends,
            wandb=wandb_run(cfg) if "wandb" in cfg.logging.backends else None, log=log))
        compiles = closing.enter_context(CompileWatch())  # step 1's compile time, and any later
        evaluate_now = _in_training_eval(cfg, ctx, eval_data)
        if evaluate_now is not None and cfg.eval.before_train and start == 0:
            writer.log(0, evaluate_now(params))
        metrics: dict = {}
        pending = None  # the step of the last save started, until it is known to be committed
        quant_warning = QuantErrorWarning(cfg.compression.quant, log)
        low_ess, stop = EssGuard(cfg.correction), None  # correction.min_ess's guard
        compiles.lap()  # the eval before training's: not step 1's
        steps = closing.enter_context(STEP_MODES.get(cfg.trainer.mode)(
            ctx, params, start, position, lagged, rollout_mesh(cfg)))
        with TrainProgress(cfg.trainer.steps, start_step=start, compiles=compiles.lap,
                           eval_every=cfg.eval.every_steps if evaluate_now else 0) as progress:
            for step in range(start, cfg.trainer.steps):
                ckpt.check()  # a save that has already failed stops the run before another step
                params, opt_state, metrics = steps.step(budget.context(ctx), params, opt_state,
                                                        step, position)
                budget.observe(metrics)  # sparrow's closed loop (compression.adapt): log k, move it by p5
                position += int(metrics["collect_rounds"])
                done = step + 1
                if evaluate_now is not None and cfg.eval.every_steps and (
                        done % cfg.eval.every_steps == 0):
                    with progress.evaluating():  # timed apart from the step
                        metrics.update(evaluate_now(params))
                nonfinite = metrics.get("nonfinite_update", 0) > 0
                metrics["skipped_nonfinite_steps"] = guard.skipped + nonfinite
                ckpt.wait()  # nothing after a failed save is recorded: it stops the run here
                if owner is not None and pending is not None:
                    owner.write_manifest(pending)
                pending = None
                writer.log(done, metrics)
                quant_warning.observe(metrics)
                progress.update(done, metrics)
                if on_step is not None:
                    on_step(done, metrics)
                guard.record(done, nonfinite)
                said = low_ess.observe(done, metrics)
                if said is not None and not said.stop:
                    log(f"warning: {said.message}")
                stop = said if said is not None and said.stop else None
                if ckpt.save(done, train_state(params, opt_state, steps.lagged(done)),
                             {"step": done, "config_hash": chash, "data_position": position,
                              "seed": cfg.trainer.seed, "skipped_nonfinite_steps": guard.skipped,
                              **budget.meta(), **({BASE_KEY: base} if base else {})},
                             force=done == cfg.trainer.steps or stop is not None):
                    pending = done
                if stop is not None:  # the checkpoint of this step is saved: end cleanly
                    break
        ckpt.wait()  # the last save is committed before the manifest names it
        if owner is not None and pending is not None:
            owner.write_manifest(pending)
    if cfg.trainer.plots:
        records = read_metrics(run_dir / "metrics.jsonl")
        plot_metrics(records, run_dir / "plots", smooth=max(1, len(records) // 10),
                     title=str(run_dir))
    if stop is not None:
        raise LowEssStop(stop)
    if cfg.trainer.export_final:
        export = export_policy(graphdef, params, tokenizer, run_dir / "final")
        log(f"final policy exported to {export}")
    return metrics
