"""The ``corrections`` cell of ``gpu_suite.py`` (issue 53, item 6): GRPO on a real LLM's
compressed rollouts under the shipped default correction against ``sparse_rl`` and
``decoupled_seq_is``, so the walk-regime study's choice meets SmolLM2's diffuse mismatch.

On a GPU: SmolLM2-135M-Instruct (``configs/smollm2/smollm2_rkv.yaml``, float32) on the
arithmetic problems, R-KV at ``eviction.budget`` :data:`KV_BUDGET` (+ the config's buffer of
16 = 80 slots: ``experiments/correction_stats.py``'s smallest budget, where
``decoupled_seq_is``'s Kish ESS was 0.02), temperature 0.7, 256 new tokens,
:data:`GPU_PROMPTS` prompts x :data:`GPU_SAMPLES` samples a step, one update a step,
:data:`GPU_STEPS` steps per arm, then (with at most :data:`EVAL_MAX_ARMS` arms) a greedy and
a sampled pass over the held-out problems.
Prompts are never truncated, so the train and eval files are first cut to the problems whose
prompt fits the cache (16 of 512 and 1 of 64 do not at 80 slots). On the CPU
(``--cpu-scaled``) the same path runs a tiny random model (``gpu_rl_pair.tiny_task_model``) on
the same files with the ``raw`` template, 2 steps per arm and no held-out pass (its four
rollout programs would double the compiles; the trainer's eval is tested on its own).

Rows: one per arm and step (reward, ``is_ess``, ``kept_token_fraction``, ``rejection_rate``,
``mismatch_k3``, mean response length, seconds), then one per arm (first- and last-quarter
reward, mean ESS / kept fraction / rejection / k3, the first step's seconds, compiles
included, the later steps' mean, and held-out pass@1 dense and under the R-KV cache).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

from benchmarks.kit.gpu_cells import ROOT, Context, Skip, print_flush

CONFIG = ROOT / "configs/smollm2/smollm2_rkv.yaml"
KV_BUDGET = 64  # R-KV eviction budget on a GPU (+ buffer 16 = 80 slots)
GPU_STEPS = 32  # per arm: 30+ (issue 53), quarters of 8
GPU_PROMPTS = 8
GPU_SAMPLES = 8  # 64 rollouts of up to 256 tokens a step, one update of all 64
EVAL_MAX_ARMS = 2
"""The held-out pass (greedy and one sample per problem, dense and under R-KV: four rollout
programs to compile, ~70 s estimated) fits the GPU budget beside two arms, not three."""
CPU_STEPS = 2  # the second one's seconds are the steady s/step; no held-out pass
STEP_KEYS = {"reward": "reward_mean", "is_ess": "is_ess", "kept": "kept_token_fraction",
             "rejection": "rejection_rate", "mismatch_k3": "mismatch_k3",
             "length": "response_length_mean", "step_s": "time_step"}
"""Row column -> ``metrics.jsonl`` key of each per-step row."""


def correction_arms() -> list[str]:
    """The arms in run order: the shipped default (``CorrectionConfig().kind``, whatever the
    study made it), then ``sparse_rl`` and ``decoupled_seq_is``, each once."""
    from sparse_rl_jax.rl.loss_config import CorrectionConfig

    return list(dict.fromkeys([CorrectionConfig().kind, "sparse_rl", "decoupled_seq_is"]))


def fitting_jsonl(section, tokenizer, capacity: int, add_special_tokens: bool,
                  out: Path) -> tuple[Path, int, int]:
    """Writes to ``out`` the records of ``section``'s file (a ``DatasetConfig``; a relative
    path is read from the repository root) whose prompt, rendered as ``section`` says, holds
    at most ``capacity`` tokens of ``tokenizer`` (``models.Tokenizer``); ``(out, kept,
    dropped)``. ValueError when none fits."""
    from sparse_rl_jax.tasks.datasets import load_jsonl

    source = Path(section.path) if Path(section.path).is_absolute() else ROOT / section.path
    examples = list(load_jsonl(dataclasses.replace(section, path=str(source)), tokenizer.hf))
    ids = tokenizer.hf([x.prompt for x in examples],
                       add_special_tokens=add_special_tokens)["input_ids"]
    keep = {x.meta["line"] for x, row in zip(examples, ids) if len(row) <= capacity}
    if not keep:
        raise ValueError(f"{source}: no prompt fits the {capacity}-slot cache")
    lines = source.read_bytes().split(b"\n")  # as load_jsonl numbers them
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(b"".join(lines[i - 1] + b"\n" for i in sorted(keep)))
    return out, len(keep), len(examples) - len(keep)


def base_overrides(ctx: Context) -> list[str]:
    """The overrides of :data:`CONFIG` shared by every arm: SmolLM2 at the real sizes on a
    GPU, a tiny random model (written under ``ctx.tmp``) on the CPU. Skip without SmolLM2."""
    common = ["trainer.checkpoint_every=100000", "trainer.export_final=false",
              "trainer.plots=false", "eval.samples=1"]
    if ctx.gpu:
        import models

        try:
            models.smollm2_gguf()
        except FileNotFoundError as e:
            raise Skip(str(e)) from None
        return [
            f"compression.eviction.budget={KV_BUDGET}", f"trainer.steps={GPU_STEPS}",
            f"trainer.prompts_per_step={GPU_PROMPTS}", f"sampling.num_samples={GPU_SAMPLES}",
            f"trainer.minibatch_size={GPU_PROMPTS * GPU_SAMPLES}", "eval.batch_size=64",
            *common]
    from benchmarks.kit.gpu_rl_pair import tiny_task_model

    path = tiny_task_model(ctx.tmp / "tiny_model")
    return [
        f"model.path={path}", "data.jsonl.template=raw", "eval.jsonl.template=raw",
        "compression.eviction.budget=88", "compression.eviction.buffer=8",
        "compression.eviction.window=4", f"trainer.steps={CPU_STEPS}",
        "trainer.prompts_per_step=2", "sampling.num_samples=2", "trainer.minibatch_size=4",
        "trainer.logp_chunk=16", "sampling.max_new_tokens=16", "sampling.prompt_bucket=96",
        *common]


def corrections_configs(ctx: Context) -> tuple[dict, dict]:
    """``({arm: RunConfig}, data)``: every arm's config, its train and eval files cut to the
    prompts that fit the cache (under ``ctx.tmp``), and what the cut kept and dropped. The
    held-out pass ends each arm on a GPU with at most :data:`EVAL_MAX_ARMS` arms."""
    import models
    from sparse_rl_jax.core.config_io import load_config
    from sparse_rl_jax.training.policy import policy_path
    from sparse_rl_jax.training.run_config import RunConfig

    overrides = base_overrides(ctx)
    probe = load_config(RunConfig, CONFIG, overrides)
    tokenizer = models.Tokenizer(policy_path(probe))  # SmolLM2's GGUF converts here, once
    capacity, special = probe.compression.capacity, probe.data.add_special_tokens
    train, train_kept, train_dropped = fitting_jsonl(
        probe.data.jsonl, tokenizer, capacity, special, ctx.tmp / "data/train.jsonl")
    test, test_kept, test_dropped = fitting_jsonl(
        probe.eval.jsonl, tokenizer, capacity, special, ctx.tmp / "data/test.jsonl")
    arms = correction_arms()
    evaluate = ctx.gpu and len(arms) <= EVAL_MAX_ARMS
    overrides += [f"data.jsonl.path={train}", f"eval.jsonl.path={test}",
                  f"eval.num_prompts={test_kept}",
                  f"eval.every_steps={probe.trainer.steps if evaluate else 0}"]
    configs = {arm: load_config(RunConfig, CONFIG, [*overrides, f"run_dir={ctx.tmp / arm}",
                                                    f"correction.kind={arm}"])
               for arm in arms}
    return configs, dict(capacity=capacity, train_kept=train_kept,
                         train_dropped=train_dropped, test_kept=test_kept,
                         test_dropped=test_dropped)


def mean(values: list[float]) -> float | None:
    """The mean of ``values`` (None of none)."""
    return sum(values) / len(values) if values else None


def arm_summary(arm: str, records: list[dict], seconds: float) -> dict:
    """One arm's row from its ``metrics.jsonl`` records (a step's metrics, and the last one's
    ``eval/`` keys): first- and last-quarter mean reward (``ceil(n / 4)`` steps each), the
    correction metrics' means, the first step's seconds (its compiles included), the later
    steps' mean and the held-out pass@1 (None where there is none)."""
    steps = [r for r in records if "reward_mean" in r]
    quarter = max(1, math.ceil(len(steps) / 4))
    evals = [r for r in records if "eval/dense_pass_at_1" in r]
    final = evals[-1] if evals else {}
    return dict(arm=arm, steps=len(steps),
                reward_q1=mean([r["reward_mean"] for r in steps[:quarter]]),
                reward_q4=mean([r["reward_mean"] for r in steps[-quarter:]]),
                ess_mean=mean([r["is_ess"] for r in steps]),
                kept_mean=mean([r["kept_token_fraction"] for r in steps]),
                rejection_mean=mean([r["rejection_rate"] for r in steps]),
                k3_mean=mean([r["mismatch_k3"] for r in steps]),
                first_step_s=steps[0]["time_step"] if steps else None,
                s_per_step=mean([r["time_step"] for r in steps[1:]]),
                eval_sparse_pass1=final.get("eval/sparse_pass_at_1"),
                eval_dense_pass1=final.get("eval/dense_pass_at_1"),
                arm_s=seconds)


def cell_corrections(ctx: Context):
    """Each arm trained in turn; its per-step rows and its summary row as soon as it ends
    (a cell cut at its budget keeps the finished arms)."""
    from sparse_rl_jax.records.metrics_writer import read_metrics
    from sparse_rl_jax.training import trainer

    configs, data = corrections_configs(ctx)
    print_flush(f"corrections: arms {list(configs)}; prompts that fit {data['capacity']} "
                f"slots: train {data['train_kept']} (dropped {data['train_dropped']}), eval "
                f"{data['test_kept']} (dropped {data['test_dropped']})")
    for arm, cfg in configs.items():
        start = time.perf_counter()
        trainer.train(cfg, log=lambda message: None)
        seconds = time.perf_counter() - start
        records = read_metrics(Path(cfg.run_dir) / "metrics.jsonl")
        for r in records:
            if "reward_mean" in r:
                yield dict(table="per step", arm=arm, step=r["step"],
                           **{k: r[m] for k, m in STEP_KEYS.items()})
        summary = arm_summary(arm, records, seconds)
        print_flush("corrections: " + json.dumps(summary))
        yield dict(table="per arm", **summary)
