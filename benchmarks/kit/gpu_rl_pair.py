"""The last cell of ``gpu_suite.py``: SmolLM2-135M dense vs Sparse-RL on R-KV, a few RL steps
each (on the CPU a tiny random model on the shipped task), reward and KV saved per step."""

from __future__ import annotations

from pathlib import Path

from benchmarks.kit.gpu_cells import ROOT, Context, Skip

RL_STEPS = 5  # per arm on a GPU: the pair comes last and must fit what is left


def rl_configs(ctx: Context):
    """``{arm: RunConfig}`` of the RL pair: SmolLM2 from ``configs/smollm2`` on a GPU; on the
    CPU a tiny random Qwen2 with the task tokenizer on the shipped task."""
    from sparse_rl_jax.core.config_io import load_config
    from sparse_rl_jax.training.run_config import RunConfig

    common = ["trainer.checkpoint_every=100000", "trainer.export_final=false",
              "trainer.plots=false"]
    if ctx.gpu:
        import models

        try:
            models.smollm2_gguf()
        except FileNotFoundError as e:
            raise Skip(str(e)) from None
        return {arm: load_config(RunConfig, ROOT / f"configs/smollm2/smollm2_{arm}.yaml", [
            f"run_dir={ctx.tmp / arm}", f"trainer.steps={RL_STEPS}",
            *common]) for arm in ("dense", "rkv")}
    path = tiny_task_model(ctx.tmp / "tiny_model")
    tiny = [f"model.path={path}", "trainer.steps=1", "trainer.prompts_per_step=2",
            "trainer.minibatch_size=4", "trainer.logp_chunk=16", "sampling.num_samples=2",
            "sampling.max_new_tokens=24", "sampling.prompt_bucket=48", *common]
    rkv = ["compression.method=rkv", "compression.eviction.budget=48", "compression.eviction.buffer=8",
           "compression.eviction.window=4"]
    return {arm: load_config(RunConfig, None, [f"run_dir={ctx.tmp / arm}", *tiny, *extra])
            for arm, extra in (("dense", ["compression.method=none"]), ("rkv", rkv))}



def tiny_task_model(path: Path) -> Path:
    """A random 1-layer Qwen2 (hidden 32) with the shipped task's tokenizer, saved to
    ``path``: the CPU stand-in for SmolLM2."""
    import jax.numpy as jnp
    from flax import nnx

    import models
    from sparse_rl_jax.tasks.task_tokenizer import build_task_tokenizer

    cfg = models.ModelConfig(model_type="qwen2", vocab_size=128, hidden_size=32,
                             intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                             head_dim=16, attention_bias=True, tie_word_embeddings=True)
    models.save_pretrained(models.Decoder(cfg, dtype=jnp.float32, param_dtype=jnp.float32,
                                          rngs=nnx.Rngs(0)), path)
    build_task_tokenizer(path)
    return path



def cell_rl_pair(ctx: Context):
    """Dense vs Sparse-RL on R-KV, reward and KV saved per step."""
    from sparse_rl_jax.training import trainer
    from sparse_rl_jax.records.metrics_writer import read_metrics

    for arm, cfg in rl_configs(ctx).items():
        trainer.train(cfg, log=lambda message: None)
        for r in read_metrics(Path(cfg.run_dir) / "metrics.jsonl"):
            yield dict(arm=arm, model=Path(cfg.model.path).name, step=r["step"],
                       reward=r["reward_mean"], kv_saved=r.get("kv_token_savings", 0.0),
                       rejection=r.get("rejection_rate", 0.0), step_s=r["time_step"])




def cell_rl_async(ctx: Context):
    """The R-KV arm of the RL pair, sync vs async (``trainer.max_lag: 1``, colocated: host
    work under the device's): steps/s (after the first step when there are several), the
    largest lag and the mean waits and weight-sync seconds."""
    import dataclasses
    import time

    from sparse_rl_jax.training import trainer

    cfg = rl_configs(ctx)["rkv"]
    for mode in ("sync", "async"):
        run = dataclasses.replace(cfg, run_dir=str(ctx.tmp / f"async_{mode}"),
                                  trainer=dataclasses.replace(cfg.trainer, mode=mode))
        ends, records = [], []
        start = time.perf_counter()
        trainer.train(run, log=lambda message: None, on_step=lambda step, metrics: (
            ends.append(time.perf_counter()), records.append(metrics)))
        steady = (len(ends) - 1) / (ends[-1] - ends[0]) if len(ends) > 2 else (
            len(ends) / (ends[-1] - start))

        def mean(key):
            return sum(r.get(key, 0.0) for r in records) / len(records)

        yield dict(mode=mode, steps=len(ends), steps_per_s=steady,
                   lag_max=max(r.get("async/lag", 0.0) for r in records),
                   wait_rollout_s=mean("time/wait_rollout"),
                   wait_learner_s=mean("time/wait_learner"),
                   weight_sync_s=mean("time/weight_sync"))
