"""One optimizer update at a given shape: the model and a random minibatch, the jitted AdamW
``update_step`` lowered from abstract inputs or compiled, XLA's peak bytes of a compiled
program, and a timed cell. Used by ``bench_rl_step.py --update-grid``, the HLO functions
(``hlo_cost_functions.update``), the memory plan's grid and the GPU suite's ``update`` cell."""

from __future__ import annotations

import statistics
import time
from pathlib import Path


def update_model(config, *, dtype="float32", lora_rank: int = 0):
    """A ``config`` decoder with random ``dtype`` weights, rank-``lora_rank`` adapters
    (alpha ``2R``) on every projection when > 0 (under ``nnx.eval_shape``: its shapes)."""
    import jax.numpy as jnp
    from flax import nnx

    import models

    model = models.Decoder(config, dtype=jnp.dtype(dtype), param_dtype=jnp.dtype(dtype),
                           rngs=nnx.Rngs(0))
    if lora_rank:
        models.add_lora(model, lora_rank, 2.0 * lora_rank, models.LORA_TARGETS,
                        rngs=nnx.Rngs(1))
    return model


def update_batch(n: int, prompt_len: int, new_tokens: int, vocab: int):
    """A ``Minibatch`` of ``n`` random sequences of ``prompt_len`` prompt + ``new_tokens``
    response tokens below ``vocab`` (under ``jax.eval_shape``: its shapes)."""
    import jax.numpy as jnp
    import numpy as np

    from sparse_rl_jax.rl.grpo_loss import LossBatch
    from sparse_rl_jax.rl.update_step import Minibatch

    p, m = prompt_len, new_tokens
    rng = np.random.default_rng(0)
    mask = jnp.ones((n, m), jnp.int32)
    return Minibatch(
        jnp.asarray(rng.integers(1, vocab, (n, p)), jnp.int32), jnp.ones((n, p), jnp.int32),
        jnp.asarray(rng.integers(1, vocab, (n, m)), jnp.int32),
        LossBatch(logp_old_dense=jnp.full((n, m), -9.0), loss_mask=mask, token_mask=mask,
                  advantages=jnp.asarray(rng.normal(size=n), jnp.float32),
                  is_weights=jnp.ones((n, m)), seq_mask=jnp.ones((n,), bool)))


def update_model_and_batch(config, n: int, prompt_len: int, new_tokens: int, *,
                           dtype="float32", lora_rank: int = 0):
    """``(model, minibatch)`` of one update: :func:`update_model` and :func:`update_batch`."""
    return (update_model(config, dtype=dtype, lora_rank=lora_rank),
            update_batch(n, prompt_len, new_tokens, config.vocab_size))


def _update_fn(graphdef, micro: int, chunk_size: int, donate: bool):
    """The jitted AdamW update (``update_step``, ``micro`` rows per micro-batch, 0 = all);
    ``donate``: params and optimizer state donated, as the trainer's ``jit_update_step``."""
    import jax

    from sparse_rl_jax.rl.loss_config import GRPOLossConfig
    from sparse_rl_jax.rl.optim import OptimConfig, make_optimizer
    from sparse_rl_jax.rl.update_step import update_step

    optimizer = make_optimizer(OptimConfig(lr=1e-5))
    step = jax.jit(lambda pr, s, b: update_step(
        graphdef, pr, s, b, loss_cfg=GRPOLossConfig(), optimizer=optimizer, chunk_size=chunk_size,
        micro_batch_size=micro or None), donate_argnums=(0, 1) if donate else ())
    return step, optimizer


def xla_peak_bytes(stats) -> int:
    """Peak bytes of a compiled program from its ``memory_analysis()``: arguments + outputs +
    temporaries - the outputs aliased to donated arguments."""
    return (stats.argument_size_in_bytes + stats.output_size_in_bytes
            + stats.temp_size_in_bytes - stats.alias_size_in_bytes)


def lowered_update(config, n: int, prompt_len: int, new_tokens: int, *, dtype="float32",
                   lora_rank: int = 0, remat: str = "none", micro: int = 0,
                   chunk_size: int = 64):
    """One update of ``n`` x (``prompt_len`` + ``new_tokens``) of a ``config`` decoder
    (:func:`update_model`, ``model.remat`` ``remat``) lowered from abstract inputs (no
    weights are made), params and optimizer state donated as in training; ``micro`` rows
    per micro-batch (0 = all). Returns ``(lowered, params, opt_state, batch)``: the
    ``jax.stages.Lowered`` and its abstract arguments."""
    import jax
    from flax import nnx

    import models

    model = nnx.eval_shape(lambda: update_model(config, dtype=dtype, lora_rank=lora_rank))
    model.remat = remat
    graphdef, params = nnx.split(model)
    step, optimizer = _update_fn(graphdef, micro, chunk_size, donate=True)
    opt_state = jax.eval_shape(optimizer.init, models.split_trainable(params)[0])
    batch = jax.eval_shape(lambda: update_batch(n, prompt_len, new_tokens, config.vocab_size))
    return step.lower(params, opt_state, batch), params, opt_state, batch


def compiled_update(config, n: int, prompt_len: int, new_tokens: int, **kw):
    """:func:`lowered_update` (same arguments), compiled: the ``jax.stages.Compiled``."""
    return lowered_update(config, n, prompt_len, new_tokens, **kw)[0].compile()


def update_cell(graphdef, params, batch, micro: int, chunk_size: int = 64, repeats: int = 3,
                dump: Path | None = None) -> dict:
    """Compile and time one update (``micro`` rows per micro-batch, 0 = all): its compile
    seconds, median step seconds of ``repeats`` after a warm-up, and XLA's temp / peak MiB
    (None where the backend reports no memory analysis; params and optimizer state are not
    donated, so the peak holds both twice); ``dump``: write the compiled HLO text there."""
    import jax

    import models
    from benchmarks.kit.timing import time_calls

    step, optimizer = _update_fn(graphdef, micro, chunk_size, donate=False)
    opt_state = optimizer.init(models.split_trainable(params)[0])
    start = time.perf_counter()
    compiled = step.lower(params, opt_state, batch).compile()
    compile_s = time.perf_counter() - start
    if dump is not None:
        Path(dump).write_text(compiled.as_text())
    stats = compiled.memory_analysis()
    times = time_calls(lambda: jax.block_until_ready(compiled(params, opt_state, batch)),
                       repeats)
    temp = peak = None
    if stats is not None:
        temp = stats.temp_size_in_bytes / 2**20
        peak = xla_peak_bytes(stats) / 2**20
    return dict(temp=temp, peak=peak, step=statistics.median(times), compile=compile_s)
