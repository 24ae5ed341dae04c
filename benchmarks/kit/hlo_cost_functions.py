"""The functions ``hlo_cost.py`` compiles, from abstract inputs only, and their floors.

Each builder returns a :class:`Function`: the lowered (not yet compiled) jit of one library
function at a named model shape, with ``jax.ShapeDtypeStruct`` arguments from
``nnx.eval_shape`` / ``jax.eval_shape`` (no weights are ever materialised), its floors, and
the trip count of the loops XLA cannot count (the page loop of a paged decode step).

Floors per call (``itemsize`` = the dtype's bytes):

- decode step (``B`` rows holding ``context`` tokens; ``rkv``: its ``budget + buffer`` slots;
  ``sparrow``: its pages at that length): ``sparrow_cost.decode_step_cost``'s bytes (every
  weight matrix and the attended KV read once, plus Sparrow's page-mean keys) plus the new
  token's K/V written; FLOPs ``2 x B x weights`` plus attention.
- compression (R-KV, every layer): the ``budget + buffer`` cached K/V and the query ring read
  once, ``budget`` slots written; FLOPs of the window queries' scores against every key.
- score (``N`` x ``(P + M)`` tokens): FLOPs ``2 x N x T x layer weights`` + the LM head over
  the ``M`` response columns + causal attention; bytes: weights, tokens and log-probs once.
- update: 3 x the score's FLOPs (forward + backward); bytes: params and optimizer state read
  and written once, plus the batch.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

from benchmarks.kit import model_setup

SHAPES = {
    "tiny": model_setup.SHAPES["tiny"],
    "qwen2.5-1.5b": model_setup.SHAPES["qwen2.5-1.5b"],
    "qwen2.5-7b": dict(  # Qwen/Qwen2.5-7B config.json
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, head_dim=128,
        max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=0),
    "qwen3-8b": dict(  # Qwen/Qwen3-8B config.json
        model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
        num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rope_theta=1e6, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=0),
}
DECODE_METHODS = ("none", "rkv", "sparrow")
ENGINES = ("static", "continuous")


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The shape of every compiled call (``hlo_cost.py``'s flags)."""

    shape: str
    batch: int
    context: int
    prompt_len: int
    dtype: str
    budget: int
    buffer: int
    window: int
    page_size: int
    score_batch: int
    update_batch: int
    micro_batch: int
    remat: str
    lora_rank: int = 0
    chunk: int = 128
    quant: str = "none"
    unroll_layers: bool = False  # ``Decoder.unroll_layers``


@dataclasses.dataclass
class Function:
    """One function to compile: ``lowered`` (a ``jax.stages.Lowered``), its floors, which of
    them bounds it (``"bytes"`` or ``"flops"``), the trip count of loops without a
    ``known_trip_count`` and, for updates, the memory plan's estimate."""

    name: str
    lower: Callable[[], Any]
    floor_flops: float
    floor_bytes: float
    bound: str
    loop_trips: int | None = None
    plan_bytes: int | None = None
    extra: dict = dataclasses.field(default_factory=dict)


def model_config(shape: str):
    """``models.ModelConfig`` of a named shape; ValueError listing the known names."""
    if shape not in SHAPES:
        raise ValueError(f"--shape: unknown {shape!r}; known: {', '.join(SHAPES)}")
    return model_setup.model_config(SHAPES[shape])


class Abstract:
    """The abstract model of ``sizes`` (``nnx.eval_shape``: shapes and dtypes only)."""

    def __init__(self, sizes: Sizes):
        import jax.numpy as jnp
        from flax import nnx

        import models

        self.sizes, self.cfg = sizes, model_config(sizes.shape)
        self.dtype = jnp.dtype(sizes.dtype)
        self.itemsize = self.dtype.itemsize
        model = nnx.eval_shape(lambda: models.Decoder(self.cfg, dtype=self.dtype,
                                                      param_dtype=self.dtype,
                                                      rngs=nnx.Rngs(0)))
        model.unroll_layers = sizes.unroll_layers
        self.graphdef, self.params = nnx.split(model)

    def compression(self, method: str):
        """``CompressionConfig`` of ``method`` at these sizes."""
        from sparse_rl_jax.kv.compression_config import CompressionConfig
        from sparse_rl_jax.kv.compression_sections import EvictionConfig

        s = self.sizes
        if method == "rkv":
            return CompressionConfig(method="rkv", eviction=EvictionConfig(
                budget=s.budget, buffer=s.buffer, window=s.window), page_size=s.page_size,
                quant=s.quant)
        return CompressionConfig(method=method, page_size=s.page_size, quant=s.quant)

    @property
    def kv_ratio(self) -> float:
        """Stored KV bytes per element over ``itemsize``: 1, or ``quant``'s codes and scale
        per ``head_dim`` values (``models.kv_quant``) over the dtype's."""
        from models.kv_quant import get_quant

        per_vector = get_quant(self.sizes.quant).bytes_per_token(self.cfg.head_dim, self.dtype)
        return per_vector / (self.cfg.head_dim * self.itemsize)

    def kv_bytes(self, tokens: int, rows: int) -> float:
        """K and V bytes of ``tokens`` positions of ``rows`` rows in every layer, as stored
        (``quant``'s codes and scales)."""
        c = self.cfg
        return (2.0 * c.num_layers * rows * c.num_kv_heads * tokens * c.head_dim * self.itemsize
                * self.kv_ratio)


def _sampling(a: Abstract, engine: str, compression):
    from sparse_rl_jax.rollout.engine_state import pooled
    from sparse_rl_jax.rollout.sampling_config import SamplingConfig

    s = a.sizes
    pool = 0
    if engine == "continuous" and pooled(compression):
        pool = s.batch * -(-s.context // s.page_size)  # every slot at max length
    return SamplingConfig(max_new_tokens=s.context - s.prompt_len, temperature=1.0,
                          prompt_bucket=s.prompt_len, engine=engine,
                          **({"slots": s.batch, "pool_pages": pool}
                             if engine == "continuous" else {}))


def _static_step(a: Abstract, sampling, compression):
    """``sampler._step``'s jit and abstract arguments (the loop after prefill)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from sparse_rl_jax.rollout import sampler

    s = a.sizes
    prompt = jax.ShapeDtypeStruct((s.batch, s.prompt_len), jnp.int32)
    key = jax.eval_shape(lambda: jax.random.key(0))
    prefilled = jax.eval_shape(functools.partial(
        sampler.prefill, a.graphdef, sampling=sampling, compression=compression,
        max_len=s.context), a.params, prompt, prompt, key)
    loop = jax.eval_shape(lambda p, k: sampler.start_loop(
        p, k, a.cfg, sampling=sampling, compression=compression), prefilled, key)

    def step(params, loop, lengths):
        return sampler._step(nnx.merge(a.graphdef, params), loop, lengths=lengths,
                             sampling=sampling, compression=compression)

    return jax.jit(step, donate_argnums=1), (a.params, loop, prefilled.lengths)


def _continuous_step(a: Abstract, sampling, compression):
    """``engine._step``'s jit and abstract arguments (the slots of ``init_engine``)."""
    import jax
    from flax import nnx

    from sparse_rl_jax.rollout import engine

    s = a.sizes
    slots, out = jax.eval_shape(functools.partial(
        engine.init_engine, a.graphdef, sampling=sampling, compression=compression,
        max_len=s.context, slots=s.batch, rows=s.batch), a.params)
    key = jax.eval_shape(lambda: jax.random.key(0))

    def step(params, slots, out, key):
        return engine._step(nnx.merge(a.graphdef, params), slots, out, key, sampling=sampling,
                            compression=compression, budget_ks=None)

    return jax.jit(step, donate_argnums=(1, 2)), (a.params, slots, out, key)


def decode_step(a: Abstract, engine: str, method: str) -> Function:
    """One decode step of every row (``engine`` static or continuous) with ``method``'s cache,
    each row holding ``context`` tokens."""
    from models.paged_cache import default_chunk_pages
    from sparse_rl_jax.kv.sparrow_cost import decode_step_cost

    s, cfg = a.sizes, a.cfg
    compression = a.compression(method)
    sampling = _sampling(a, engine, compression)
    build = _static_step if engine == "static" else _continuous_step
    cached, k = s.context, None
    if method == "rkv":
        cached = compression.capacity
    if compression.page_sparse:
        covered = -(-s.context // s.page_size) * s.page_size
        k = [kk for start, kk in compression.sparrow.budget_schedule if start <= covered][-1]
    cost = decode_step_cost(cfg, batch=s.batch, cached_len=cached, k=k, page_size=s.page_size,
                            dense_layers=compression.sparrow.dense_layers,
                            itemsize=a.itemsize)
    chunk = min(default_chunk_pages() * s.page_size, s.context)

    def lower():
        jitted, args = build(a, sampling, compression)
        return jitted.lower(*args)

    return Function(
        f"decode_{engine}_{method}", lower,
        floor_flops=cost.linear_flops + cost.attention_flops + cost.scoring_flops,
        floor_bytes=(cost.linear_bytes + cost.attention_bytes * a.kv_ratio + cost.scoring_bytes
                     + a.kv_bytes(1, s.batch)),
        bound="bytes", loop_trips=-(-s.context // chunk))


def compression_rkv(a: Abstract) -> Function:
    """``kv_state.compress`` of a full R-KV cache (``budget + buffer`` slots, every layer)."""
    import jax

    from sparse_rl_jax.kv import state as kv_state

    s, cfg = a.sizes, a.cfg
    compression = a.compression("rkv")
    capacity = compression.capacity

    def lower():
        state = jax.eval_shape(lambda: kv_state.init_state(
            compression, num_layers=cfg.num_layers, batch=s.batch, num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, max_len=s.context,
            dtype=a.dtype, record=False))
        return jax.jit(kv_state.compress, static_argnums=1, donate_argnums=0).lower(
            state, compression)

    ring = cfg.num_layers * s.batch * cfg.num_heads * s.window * cfg.head_dim * a.itemsize
    scores = 2.0 * cfg.num_layers * s.batch * cfg.num_heads * s.window * capacity * cfg.head_dim
    decode_floor = decode_step(a, "static", "rkv").floor_bytes
    return Function("compress_rkv", lower, floor_flops=scores,
                    floor_bytes=a.kv_bytes(capacity + s.budget, s.batch) + ring, bound="bytes",
                    extra=dict(every_steps=s.buffer, decode_floor_bytes=decode_floor))


def _forward_flops(a: Abstract, n: int) -> float:
    """FLOPs of a teacher-forced forward of ``n`` x ``(prompt_len + context)`` tokens with
    the LM head over the response columns (causal attention)."""
    from sparse_rl_jax.kv.sparrow_cost import linear_params

    s, cfg = a.sizes, a.cfg
    t, m = s.prompt_len + s.context, s.context
    layer_weights = linear_params(cfg) - cfg.vocab_size * cfg.hidden_size
    return 2.0 * n * (t * layer_weights + m * cfg.vocab_size * cfg.hidden_size) + (
        n * cfg.num_layers * 4 * cfg.num_heads * cfg.head_dim * t * (t + 1) / 2)


def _tokens(n: int, width: int):
    import jax
    import jax.numpy as jnp

    return jax.ShapeDtypeStruct((n, width), jnp.int32)


def score(a: Abstract) -> Function:
    """``scoring.score`` (dense log-probs) of ``score_batch`` x ``(prompt_len + context)``."""
    from sparse_rl_jax.rollout import scoring
    from sparse_rl_jax.training.memory_plan import param_count

    s, n = a.sizes, a.sizes.score_batch

    def lower():
        prompt = _tokens(n, s.prompt_len)
        return scoring.score.lower(a.graphdef, a.params, prompt, prompt,
                                   _tokens(n, s.context), chunk_size=s.chunk)

    weights = param_count(a.cfg) * a.itemsize
    return Function("score", lower, floor_flops=_forward_flops(a, n),
                    floor_bytes=weights + n * (s.prompt_len * 8 + s.context * 8), bound="flops")


def update_plan_bytes(cfg, n: int, micro: int, **plan) -> int:
    """The memory plan's bytes for an update of ``n`` sequences in micro-batches of ``micro``:
    ``memory_plan.estimate`` of one micro-batch (``plan``: its other arguments), with the
    gradient accumulator when there is more than one."""
    from sparse_rl_jax.training import memory_plan

    return memory_plan.estimate("update", cfg, batch=micro, accumulate=micro < n, **plan).total


def update(a: Abstract) -> Function:
    """One ``update_step`` (AdamW, remat ``remat``, ``micro_batch`` rows per micro-batch,
    rank-``lora_rank`` adapters on every projection when > 0) of ``update_batch`` x
    ``(prompt_len + context)``; params and optimizer state donated."""
    import jax

    from benchmarks.kit import update_cells
    from sparse_rl_jax.rl.lora_config import LoraConfig

    s, cfg, n = a.sizes, a.cfg, a.sizes.update_batch
    micro = s.micro_batch or n
    kw = dict(dtype=s.dtype, lora_rank=s.lora_rank, remat=s.remat,
              micro=micro if micro < n else 0, chunk_size=s.chunk)
    lowered, params, opt_state, batch = update_cells.lowered_update(cfg, n, s.prompt_len,
                                                                   s.context, **kw)
    nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))  # noqa: E731
    plan = update_plan_bytes(cfg, n, micro, prompt_len=s.prompt_len, new_tokens=s.context,
                             dtype=a.dtype, remat=s.remat, logp_chunk=s.chunk,
                             lora=LoraConfig(rank=s.lora_rank) if s.lora_rank else None)
    return Function("update", lambda: lowered, floor_flops=3 * _forward_flops(a, n),
                    floor_bytes=2 * (nbytes(params) + nbytes(opt_state)) + nbytes(batch),
                    bound="flops", plan_bytes=plan, extra=dict(micro_batch=micro))


BUILDERS = {
    **{f"decode_{e}_{m}": functools.partial(decode_step, engine=e, method=m)
       for e in ENGINES for m in DECODE_METHODS},
    "compress_rkv": compression_rkv,
    "score": score,
    "update": update,
}
