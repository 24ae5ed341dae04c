"""The whole experiment as one frozen config tree (what ``run.py`` reads from YAML).

Every section is a frozen dataclass validated on construction; :class:`RunConfig` adds the
checks that span sections (group size, minibatch divisibility), so a bad config fails before
any model is loaded or any file is written.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from models.partitioning import mesh_size_error
from sparse_rl_jax.core.config_checks import (check, check_bool, check_choice,
                                              check_int, check_number, check_text, reject)
from sparse_rl_jax.kv.compression_config import CompressionConfig
from sparse_rl_jax.kv.compression_sections import EvictionConfig
from sparse_rl_jax.records.metrics_writer import LoggingConfig
from sparse_rl_jax.rl.advantages import AdvantageConfig
from sparse_rl_jax.rl.loss_config import CorrectionConfig, GRPOLossConfig
from sparse_rl_jax.rl.optim import OptimConfig
from sparse_rl_jax.rl.overlong import OverlongConfig
from sparse_rl_jax.rollout.sampling_config import SamplingConfig
from sparse_rl_jax.tasks.datasets import DatasetConfig, TfdsConfig
from sparse_rl_jax.tasks.task import TaskConfig
from sparse_rl_jax.tasks.walk_task import WalkTaskConfig
from sparse_rl_jax.training.model_section import ModelSection
from sparse_rl_jax.training.warm_start_config import WarmStartConfig


@dataclasses.dataclass(frozen=True)
class DataSection:
    """Where prompts and answers come from, and how responses are rewarded.

    Attributes:
      source: ``task`` (the shipped synthetic task), ``walk`` (the long-trace walk task,
        ``walk_task``), ``jsonl`` (a file in a real format) or ``tfds`` (a dataset of
        ``tfds_builder``, read through ``tfds.data_source``).
      task: the shipped task's distribution (``source: task``).
      walk: the walk task's distribution (``source: walk``; its defaults when unset).
      control_missed_increment: positive control (``source: walk`` only; 0 = off): this
        fraction of every rollout's sequences is rewritten as if a bad eviction had happened,
        without any eviction (``anomaly_control``).
      jsonl: the file and its field names / template (``source: jsonl``; with ``source:
        tfds``, the file the TFDS dataset is written from, reused while unchanged).
      tfds: the TFDS dataset's name, data_dir and split (``source: tfds``).
      reward: a registered reward function (``task_exact``, ``math_verify``, ``final_number``, or your own).
      shuffle_seed: seed of the deterministic, resumable prompt order.
      add_special_tokens: let the tokenizer add BOS etc. when encoding prompts (off for
        prompts already in chat format).
      dynamic_sampling: DAPO's dynamic sampling (verl ``algorithm.filter_groups``): drop
        groups whose (task) rewards are all equal, and groups left with fewer than 2
        sequences in the loss (correction rejection, ``overlong.mask_truncated``); roll out
        further batches of ``trainer.prompts_per_step`` prompts until the update batch holds
        ``prompts_per_step`` groups or ``max_collect_rounds`` rounds were used.
      max_collect_rounds: rollout rounds per RL step at most under dynamic sampling (verl
        ``max_num_gen_batches``); an update batch still short then is padded with groups
        masked out of the loss.
    """

    source: Literal["task", "walk", "jsonl", "tfds"] = "task"
    task: TaskConfig = dataclasses.field(default_factory=TaskConfig)
    walk: WalkTaskConfig | None = None
    jsonl: DatasetConfig | None = None
    tfds: TfdsConfig | None = None
    reward: str = "task_exact"
    shuffle_seed: int = 0
    add_special_tokens: bool = False
    dynamic_sampling: bool = False
    max_collect_rounds: int = 4
    control_missed_increment: float = 0.0

    def __post_init__(self):
        check_int(self, "max_collect_rounds", 1)
        check_choice(self, "source", ("task", "walk", "jsonl", "tfds"))
        check_number(self, "control_missed_increment", ge=0, le=1)
        check(self.control_missed_increment == 0 or self.source == "walk", self,
              "control_missed_increment", f"needs source 'walk' (got {self.source!r})",
              self.control_missed_increment)
        check(self.source != "jsonl" or self.jsonl is not None, self, "jsonl",
              "must be set (path, fields) when source is 'jsonl'")
        check(self.source != "tfds" or self.tfds is not None, self, "tfds",
              "must be set (name, data_dir) when source is 'tfds'")
        check_int(self, "shuffle_seed", 0)
        check_text(self, "reward", "must name a registered reward fn")

    @property
    def synthetic(self) -> TaskConfig | WalkTaskConfig:
        """The synthetic task the run draws from (``source: walk``: ``walk``, else ``task``;
        also the default eval set and the warm start's training data)."""
        if self.source == "walk":
            return self.walk or WalkTaskConfig()
        return self.task



@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh sizes over the axes (data, fsdp, tensor); one may be -1 (the rest).

    Attributes:
      rollout_devices: with ``trainer.mode: async``, the first this many local devices run
        the rollouts and the rest form the learner's (data, fsdp, tensor) mesh; the weights
        are resharded onto them after each update (``time/weight_sync``). 0 (default): both
        roles share every device.
    """

    data: int = 1
    fsdp: int = -1
    tensor: int = 1
    rollout_devices: int = 0

    def __post_init__(self):
        bad = mesh_size_error({"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor})
        if bad:
            reject(self, *bad)
        check_int(self, "rollout_devices", 0, "must be an int >= 0 (0 = colocated)")


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    """The RL loop.

    Attributes:
      steps: RL steps (one rollout each).
      prompts_per_step: prompts per rollout; ``x sampling.num_samples`` sequences.
      minibatch_size: sequences per optimizer update (the global batch); it must divide the
        rollout's sequences, giving ``N / minibatch_size`` updates per rollout.
      micro_batch_size: sequences per forward/backward inside one update (gradient
        accumulation; the update equals the unsplit one); it must divide ``minibatch_size``.
        0 = the whole minibatch, lowered to the largest divisor that fits where the device
        reports a memory limit (``memory_plan.micro_batch_size``).
      seed: seed of every random choice of the run (rollouts, minibatch order).
      score_batch: sequences per scoring call (bounds scoring memory); 0 = the minibatch size,
        lowered to what fits where the device reports a memory limit (``memory_plan``).
      logp_chunk: response columns per LM-head chunk when computing log-probs.
      checkpoint_every: save every this many RL steps (and at the end).
      keep_checkpoints: how many checkpoints to keep.
      export_final: write the final policy as an HF checkpoint to ``run_dir/final``.
      plots: write PNG plots of the metrics to ``run_dir/plots`` at the end.
      max_nonfinite_steps: an RL step whose loss or gradient is not finite skips that update
        (params and optimizer state unchanged; counted in ``skipped_nonfinite_steps``); this
        many such steps in a row stop the run with an error naming the step.
      low_r_grad_share: also log, per update, how much of the gradient comes from the
        sequences holding a token with ``r_t < 1e-4`` (those a Sparse-RL veto drops), in any
        correction kind without dropping them: ``low_r_grad_norm_ratio`` and
        ``low_r_grad_share`` (``train_step.low_r_grad_metrics``). Costs a second backward.
      mode: ``sync`` (step t's rollout is drawn from the params update t-1 left) or
        ``async`` (rollouts run ahead of the learner on a fixed schedule, ``async_lag``;
        logs ``async/lag``, ``time/wait_rollout``, ``time/wait_learner``,
        ``time/weight_sync``). Async cannot serve ``data.dynamic_sampling``,
        ``compression.adapt`` or ``correction.replay`` (``shadow_mask``).
      max_lag: in async mode, step t's rollout is drawn from exactly the params after update
        ``t - max_lag`` (the initial params for the first steps); the learner's PPO ratio is
        taken around its own params at the update (the decoupled objective,
        ``rl.decoupled``). 0 is the sync run, bit for bit.
      split_mismatch: in async mode, the producer also scores its lagged rows densely under
        their own version, and the logs split the mismatch the correction sees into
        compression (``async/compression_mismatch_k3``: the sampler against dense at the
        rollout's version) and lag (``async/lag_mismatch_k3``: that against the learner's
        params). Costs one more dense scoring pass per step, on the rollout devices. Off,
        the rows of a lagged version are scored once, by the learner.
      async_timeout_s: in async mode, the floor of the deadline (seconds) on every wait of
        the learner on the other side: a step's rows from the producer, its own scoring and
        update, the weight sync, the producer's stop. Past it the run stops with
        ``AsyncRolloutError`` naming the step and the side that went quiet, and the same
        command resumes it from the last checkpoint. The deadline is the larger of this and
        10 x the slowest step so far (the first step a process runs left out), so the floor
        must hold what the pace of steps does not: the first step (its compiles and its
        rollout) and a compile for a new shape mid-run. null: no deadline (``async_deadline``).
    """

    steps: int = 100
    prompts_per_step: int = 128
    minibatch_size: int = 256
    micro_batch_size: int = 0
    seed: int = 0
    score_batch: int = 0
    logp_chunk: int = 128
    checkpoint_every: int = 10
    keep_checkpoints: int = 3
    export_final: bool = True
    plots: bool = True
    max_nonfinite_steps: int = 3
    low_r_grad_share: bool = False
    mode: Literal["sync", "async"] = "sync"
    max_lag: int = 1
    split_mismatch: bool = False
    async_timeout_s: float | None = 1800.0

    def __post_init__(self):
        for field in ("steps", "prompts_per_step", "minibatch_size", "logp_chunk",
                      "checkpoint_every", "keep_checkpoints", "max_nonfinite_steps"):
            check_int(self, field, 1)
        check_int(self, "seed", 0)
        check_int(self, "score_batch", 0, "must be an int >= 0 (0 = planned)")
        rule = (f"must be 0 (planned) or an int dividing minibatch_size={self.minibatch_size}")
        check_int(self, "micro_batch_size", 0, rule)
        check(self.micro_batch_size == 0 or self.minibatch_size % self.micro_batch_size == 0,
              self, "micro_batch_size", rule)
        for field in ("export_final", "plots", "low_r_grad_share", "split_mismatch"):
            check_bool(self, field)
        check_choice(self, "mode", ("sync", "async"))
        check_int(self, "max_lag", 0)
        check_number(self, "async_timeout_s", gt=0, optional=True)

    @property
    def lagged_versions(self) -> int:
        """Older param versions a checkpoint holds besides the current one: ``max_lag`` in
        async mode (its in-flight rollouts are drawn from them), else 0."""
        return self.max_lag if self.mode == "async" else 0


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Evaluation of a policy under dense and under sparse (training-compression) inference.

    Attributes:
      num_prompts: prompts evaluated (the first of the eval set).
      samples: samples per prompt (avg@k); pass@1 uses greedy decoding.
      temperature: sampling temperature for avg@k.
      task_seed: seed of the held-out task problems (differs from training's).
      jsonl: evaluate on this file instead of the shipped task.
      tfds: evaluate on this TFDS dataset (``tfds_builder``) instead; written from ``jsonl``
        first when both are set.
      batch_size: prompts per generation call.
      every_steps: during training, greedy pass@1 and avg@k (dense, and sparse when the
        run compresses) on this eval set every this many RL steps, logged under ``eval/``;
        0 (default) = never.
      before_train: also evaluate once before the first RL step (logged at step 0).
    """

    num_prompts: int = 64
    samples: int = 4
    temperature: float = 1.0
    task_seed: int = 12345
    jsonl: DatasetConfig | None = None
    tfds: TfdsConfig | None = None
    batch_size: int = 64
    every_steps: int = 0
    before_train: bool = False

    def __post_init__(self):
        for field in ("num_prompts", "samples", "batch_size"):
            check_int(self, field, 1)
        check_int(self, "every_steps", 0, "must be an int >= 0 (0 = never)")
        check_number(self, "temperature", gt=0)
        check_int(self, "task_seed", 0)


# The embedded default: a CPU-sized run on the shipped task. Sections not listed keep their
# own defaults (the official Sparse-RL settings); configs/ holds the paper setups.
# Runs keep the rollout's record only where something reads it (policy.record_needed):
# record_evictions None = auto (memory).
DEFAULT_SAMPLING = SamplingConfig(max_new_tokens=40, num_samples=8, prompt_bucket=16,
                                  record_evictions=None)
DEFAULT_COMPRESSION = CompressionConfig(method="rkv",
                                        eviction=EvictionConfig(budget=32, buffer=8, window=4))
DEFAULT_LOSS = GRPOLossConfig()
DEFAULT_OPTIM = OptimConfig(lr=5e-5, weight_decay=0.0)
DEFAULT_TRAINER = TrainerConfig(steps=100, prompts_per_step=32, minibatch_size=128,
                                checkpoint_every=10, logp_chunk=64)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """One experiment: model, data, rollout, corrections, loss, optimizer, loop, mesh, eval.

    ``RunConfig()`` is the embedded default (a tiny model on the shipped task that trains on
    a CPU in minutes); a YAML file overrides any subset of sections and keys.
    """

    run_dir: str = "runs/default"
    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    warm_start: WarmStartConfig = dataclasses.field(default_factory=WarmStartConfig)
    data: DataSection = dataclasses.field(default_factory=DataSection)
    sampling: SamplingConfig = DEFAULT_SAMPLING
    compression: CompressionConfig = DEFAULT_COMPRESSION
    correction: CorrectionConfig = dataclasses.field(default_factory=CorrectionConfig)
    advantage: AdvantageConfig = dataclasses.field(default_factory=AdvantageConfig)
    overlong: OverlongConfig = dataclasses.field(default_factory=OverlongConfig)
    loss: GRPOLossConfig = DEFAULT_LOSS
    optim: OptimConfig = DEFAULT_OPTIM
    trainer: TrainerConfig = DEFAULT_TRAINER
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)

    def __post_init__(self):
        check_text(self, "run_dir", "must be a directory path (empty would train into the "
                                    "current directory)")
        sampling, trainer, correction = self.sampling, self.trainer, self.correction
        check(sampling.num_samples >= 2, self, "sampling.num_samples", "must be >= 2 (the GRPO "
              "group: advantages compare samples of one prompt)", sampling.num_samples)
        check(not (self.compression.adapt.enabled and sampling.record_evictions is False), self,
              "sampling.record_evictions", "cannot be false with compression.adapt.enabled (the "
              "closed loop reads alpha from the rollout's record); leave it unset (auto) or true",
              sampling.record_evictions)
        check(self.overlong.buffer_len < sampling.max_new_tokens, self, "overlong.buffer_len",
              f"must be < sampling.max_new_tokens={sampling.max_new_tokens}",
              self.overlong.buffer_len)
        sequences = self.sequences_per_step
        check(sequences % trainer.minibatch_size == 0, self, "trainer.minibatch_size",
              f"must divide the rollout's {sequences} sequences (trainer.prompts_per_step x "
              "sampling.num_samples)", trainer.minibatch_size)
        check(sequences % (trainer.score_batch or trainer.minibatch_size) == 0, self,
              "trainer.score_batch", f"must divide the rollout's {sequences} sequences",
              trainer.score_batch)
        self._check_shadow_mask()
        self._check_async()
        check(not (self.data.control_missed_increment and correction.replay),
              self, "data.control_missed_increment", "cannot be used with correction.replay "
              "(shadow_mask: the injected rows have no record to replay)",
              self.data.control_missed_increment)
        self._resolve_correction_loss()
        synthetic = self.data.source in ("task", "walk")
        if synthetic and self.model.path is None and self.compression.compresses:
            self._check_task_fits()

    def _check_shadow_mask(self) -> None:
        """The learner replays the rollout's record, and the distillation term exists, only
        under ``correction.replay`` (shadow_mask)."""
        shadow = self.correction.replay
        check(self.sampling.record_evictions is not False or not shadow, self,
              "sampling.record_evictions", "cannot be false with correction.replay "
              "(shadow_mask: the learner replays the rollout's record); leave it unset (auto) "
              "or true", self.sampling.record_evictions)
        check(shadow or self.loss.distill_coef == 0, self, "loss.distill_coef",
              f"needs correction.replay (shadow_mask; got correction.kind="
              f"{self.correction.kind!r}): the distillation term compares the replayed sparse "
              "policy with the dense one", self.loss.distill_coef)
        check(shadow or self.loss.distill_kind == "k3", self, "loss.distill_kind",
              f"needs correction.replay (shadow_mask; got correction.kind="
              f"{self.correction.kind!r})", self.loss.distill_kind)

    def _resolve_correction_loss(self) -> None:
        """``correction.loss: pg`` makes the policy term plain policy gradient
        (``loss.policy_loss: pg``); ``pg`` is reached only that way, so a saved config
        reloads as it ran."""
        policy_loss = self.loss.policy_loss
        if self.correction.loss == "pg":
            check(policy_loss in ("ppo_clip", "pg"), self, "correction.loss",
                  f"=pg replaces loss.policy_loss, which is {policy_loss!r}; leave that at its "
                  "default", self.correction.loss)
            check(self.loss.clip_c is None, self, "loss.clip_c", "(dual-clip) cannot be used "
                  "with correction.loss=pg (plain policy gradient clips nothing)",
                  self.loss.clip_c)
            object.__setattr__(self, "loss", dataclasses.replace(self.loss, policy_loss="pg"))
        else:
            check(policy_loss != "pg", self, "loss.policy_loss",
                  "pg is set by correction.loss=pg (with the correction it belongs to); set "
                  "that instead", policy_loss)

    def _check_async(self) -> None:
        """What async mode (``trainer.mode``) cannot serve, and the device split it needs."""
        if self.trainer.mode == "sync":
            check(self.mesh.rollout_devices == 0, self, "mesh.rollout_devices",
                  "needs trainer.mode=async (a sync rollout waits for the learner: a split "
                  "would leave one group idle)", self.mesh.rollout_devices)
            return
        unserved = (("data.dynamic_sampling", self.data.dynamic_sampling,
                     self.data.dynamic_sampling,
                     "it discards groups, and the paced producer keeps every group"),
                    ("compression.adapt.enabled", self.compression.adapt.enabled,
                     self.compression.adapt.enabled,
                     "its closed loop sets a rollout's budget from the step before it, which "
                     "a rollout running ahead has not seen"),
                    ("correction.replay", self.correction.replay, self.correction.replay,
                     "shadow_mask's learner replays the record under the rollout's own "
                     "params, which async mode no longer holds at the update"))
        for field, value, bad, why in unserved:
            check(not bad, self, field, f"cannot be used with trainer.mode=async: {why}", value)

    def _check_task_fits(self) -> None:
        """The default model's tokenizer has one token per character: the shipped task's
        lengths are known, so the cache and the response limit must hold them."""
        task, compression, sampling = self.data.synthetic, self.compression, self.sampling
        knob = (f"data.task.n_max={task.n_max}" if self.data.source == "task" else
                f"data.walk.distractors_max={task.distractors_max}")
        check(compression.capacity >= task.max_prompt_tokens, self,
              "compression.eviction.budget",
              f"+ buffer ({compression.capacity}) must hold the task's longest prompt "
              f"({task.max_prompt_tokens} tokens, {knob})",
              compression.eviction.budget)
        needed = task.max_response_tokens
        check(sampling.max_new_tokens >= needed, self, "sampling.max_new_tokens",
              f"must fit the task's longest solution + EOS ({needed} tokens)",
              sampling.max_new_tokens)

    @property
    def sequences_per_step(self) -> int:
        """Sequences in one rollout: prompts per step x samples per prompt."""
        return self.trainer.prompts_per_step * self.sampling.num_samples
