"""Device memory planned before compiling: bytes of a rollout, a score or an update call.

The estimates are analytic: exact for the resident buffers (weights, KV cache of the slot or
paged layout, query ring, eviction or page-selection record, sparrow's page keys, optimizer
state) and an upper-leaning model of the transients (one layer's activations under the layer
scan, one attention block, one LM-head chunk; for an update, the larger of its backward and
its optimizer step: ``update_memory``). Every estimate grows with the batch (rollouts and
scores affinely; an update's optimizer step is the same for every batch), which gives the
largest batch that fits a limit. The limit is the device's ``bytes_limit`` from
``memory_stats()`` where JAX reports one (GPU, TPU), else a configured number of bytes.

Activations take the compute dtype of the platform: the parameter dtype, except on XLA:CPU
before jaxlib 0.11, which computes bfloat16 work in float32 (an update there also holds a
float32 copy of the weights: ``update_memory``), so a CPU compile's ``memory_analysis()`` can
check the plan in either dtype.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from models.config import ModelConfig
from models.decoder import REMAT_POLICIES
from models.kv_quant import get_quant
from models.page_sparse import selected_slots
from models.paged_cache import default_chunk_pages
from sparse_rl_jax.kv.compression_config import CompressionConfig
from sparse_rl_jax.kv.page_sparsity import num_pages
from sparse_rl_jax.rl.lora_config import LoraConfig
from sparse_rl_jax.rollout.engine_state import pooled
from sparse_rl_jax.training.update_memory import compute_itemsize, update_parts

KINDS = ("rollout", "score", "update")
_ONE_BLOCK_PAIRS = 2**20  # mirrors models.attention: T * S up to this is one block
_BLOCK = 512
_F32 = 4


class MemoryPlanError(ValueError):
    """A request whose estimated bytes exceed the device memory limit."""


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Estimated peak bytes of one call.

    Attributes:
      kind: ``rollout``, ``score`` or ``update``.
      batch: sequences ``N`` of the call.
      parts: name -> bytes of each term (``weights``, ``kv_cache``, ``activations``, ...).
    """

    kind: str
    batch: int
    parts: dict[str, int]

    @property
    def total(self) -> int:
        """The sum of the parts, in bytes."""
        return sum(self.parts.values())


def param_count(cfg: ModelConfig) -> int:
    """Number of parameters of a ``models.Decoder`` with this config."""
    h, f, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    attn = h * q + 2 * h * kv + q * h
    attn += (q + 2 * kv) * cfg.attention_bias + h * cfg.o_proj_bias + 2 * d * cfg.qk_norm
    mlp = 3 * h * f + (2 * f + h) * cfg.mlp_bias
    per_layer = attn + mlp + 2 * h
    head = 0 if cfg.tie_word_embeddings else h * cfg.vocab_size
    return cfg.vocab_size * h + cfg.num_layers * per_layer + h + head


def kv_cache_bytes(cfg: ModelConfig, rows: int, slots: int, dtype, *,
                   paged: bool = False, quant: str = "none") -> int:
    """Bytes of a ``models.KVCache``: keys + values in ``dtype`` (or ``quant``'s codes and
    scales, ``models.kv_quant``) and int32 slot positions per layer and KV head; ``paged``: of
    a ``models.PagedKVCache``, whose positions are one ``[rows, slots]`` array."""
    positions = rows * slots * (1 if paged else cfg.num_layers * cfg.num_kv_heads)
    return rows * slots * kv_bytes_per_token(cfg, quant, dtype) + 4 * positions


def kv_bytes_per_token(cfg: ModelConfig, quant: str, dtype) -> int:
    """K + V bytes of a token in a ``quant`` cache of ``dtype``: every layer and KV head."""
    per_head = get_quant(quant).bytes_per_token(cfg.head_dim, dtype)  # its scale included
    return 2 * cfg.num_layers * cfg.num_kv_heads * per_head


def _blocks(t: int, s: int) -> tuple[int, int]:
    """``(bq, bk)``: the query and key block of a ``T x S`` blockwise attention."""
    return (t, s) if t * s <= _ONE_BLOCK_PAIRS else (min(_BLOCK, t), min(_BLOCK, s))


def _attention_block(cfg: ModelConfig, rows: int, t: int, s: int) -> int:
    """fp32 logits + probabilities of one blockwise-attention block (``models.attention``)."""
    bq, bk = _blocks(t, s)
    return 2 * rows * cfg.num_heads * bq * bk * _F32


def _visibility_residual(cfg: ModelConfig, rows: int, t: int) -> int:
    """Bytes an update's forward keeps of its causal ``T x T`` blockwise attention: under the
    layer scan's autodiff the parts of each block's step that depend on positions alone
    (the same in every layer) are hoisted out of the scan and kept for the backward, stacked
    over query x key blocks: per row and query head a bool visibility and a float32 fill of
    every padded ``T' x T'`` pair, and a float32 value per query and key block."""
    bq, bk = _blocks(t, t)
    tq, sk = -(-t // bq), -(-t // bk)  # query and key blocks
    per_head = tq * bq * sk * bk * (1 + _F32) + tq * bq * sk * _F32
    return rows * cfg.num_heads * per_head


def _layer_activations(cfg: ModelConfig, rows: int, t: int, itemsize: int) -> int:
    """One layer's forward transients: hidden states, q/k/v/out projections, SwiGLU."""
    width = 4 * cfg.hidden_size + 2 * cfg.num_heads * cfg.head_dim
    width += 2 * cfg.num_kv_heads * cfg.head_dim + 3 * cfg.intermediate_size
    return rows * t * width * itemsize


def _lm_head_chunk(cfg: ModelConfig, rows: int, chunk: int) -> int:
    """fp32 logits, log-softmax and probabilities of one LM-head chunk."""
    return 3 * rows * chunk * cfg.vocab_size * _F32


def _check_args(kind: str, remat: str, **sizes) -> None:
    """ValueError naming the first bad argument of :func:`estimate` (``batch`` may be 0)."""
    if kind not in KINDS:
        raise ValueError(f"kind: must be one of {KINDS}, got {kind!r}")
    if remat not in REMAT_POLICIES:
        raise ValueError(f"remat: must be one of {REMAT_POLICIES}, got {remat!r}")
    for name, value in sizes.items():
        smallest = 0 if name in ("batch", "pool_pages") else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < smallest:
            raise ValueError(f"{name}: must be an int >= {smallest}, got {value!r}")


def page_bytes(cfg: ModelConfig, page_size: int, dtype, quant: str = "none") -> int:
    """Bytes of one page of a ``models.page_pool.PagePoolCache``: keys + values of
    ``page_size`` positions in every layer and KV head (``quant``'s codes and scales)."""
    return page_size * kv_bytes_per_token(cfg, quant, dtype)


def _rollout_parts(cfg: ModelConfig, batch: int, prompt_len: int, new_tokens: int,
                   compression: CompressionConfig | None, dtype, num_samples: int,
                   record_evictions: bool, pool_pages: int = 0) -> dict[str, int]:
    """The parts of a rollout's peak (:func:`estimate` ``kind="rollout"``), in bytes; with
    ``pool_pages`` (paged rows of the continuous engine), ``kv_pool`` is the pool and
    ``kv_cache`` the prefill's rows plus each slot's positions and page table."""
    itemsize = np.dtype(dtype).itemsize
    total_len = prompt_len + new_tokens
    compression = compression or CompressionConfig(method="none")
    slots = compression.cache_capacity(total_len)
    paged = compression.cache_layout == "paged"
    # the attention block of a decode step: every slot, or one chunk of the paged loop
    read = min(slots, default_chunk_pages() * compression.page_size) if paged else slots
    prompts = -(-batch // num_samples)
    kv, heads = cfg.num_kv_heads, cfg.num_heads
    ring = (cfg.num_layers * batch * heads * compression.eviction.window * cfg.head_dim * itemsize
            if compression.compresses else 0)  # the cache's query ring: evicting methods only
    similarity = 2 * batch * kv * slots * slots * _F32 if compression.compresses else 0
    pages = num_pages(total_len, compression.page_size) if compression.page_sparse else 0
    # the record (Rollout.record): each key's eviction time, or (sparrow, beside its page-mean
    # keys) the pages each decode step attended to
    selected = selected_slots(compression.max_pages_k, pages) if pages else 0
    per_row = total_len if compression.compresses else new_tokens * selected
    record = cfg.num_layers * batch * kv * per_row * 4 if record_evictions else 0
    pool = pool_pages if pooled(compression) else 0
    kv_rows = prompts if pool else batch + prompts
    return {
        "weights": param_count(cfg) * itemsize,
        "kv_cache": kv_cache_bytes(cfg, kv_rows, slots, dtype, paged=paged,
                                   quant=compression.quant)
        + (batch * (slots + slots // compression.page_size) * 4 if pool else 0),
        "kv_pool": pool * page_bytes(cfg, compression.page_size, dtype, compression.quant),
        "page_keys": cfg.num_layers * (batch + prompts) * kv * pages * cfg.head_dim * itemsize,
        "query_ring": ring,
        "record": record,
        "prefill": _layer_activations(cfg, prompts, prompt_len, itemsize)
        + _attention_block(cfg, prompts, prompt_len, read),
        "decode_step": 2 * batch * cfg.vocab_size * _F32
        + _attention_block(cfg, batch, 1, read) + batch * new_tokens * 8,
        "compression": similarity,
    }


def _scoring_parts(cfg: ModelConfig, batch: int, total_len: int, chunk: int,
                   itemsize: int, compute_itemsize: int,
                   replay: CompressionConfig | None = None) -> dict[str, int]:
    """The parts of a teacher-forced forward's peak (``kind="score"``), in bytes: weights of
    ``itemsize``, activations of ``compute_itemsize``; ``replay``: the ``sparrow`` config
    whose page-selection record the forward replays."""
    return {
        "weights": param_count(cfg) * itemsize,
        "activations": _layer_activations(cfg, batch, total_len, compute_itemsize)
        + _attention_block(cfg, batch, total_len, total_len),
        "lm_head_chunk": _lm_head_chunk(cfg, batch, chunk),
        "hidden": batch * total_len * cfg.hidden_size * compute_itemsize,
        "page_replay": _page_replay(cfg, batch, total_len, replay),
    }


def _page_replay(cfg: ModelConfig, batch: int, total_len: int,
                 replay: CompressionConfig | None) -> int:
    """Bytes of a page-selection replay (``scoring`` with a ``sparrow`` record): the selection of
    every query ``[L, N, Hkv, S, K]`` int32 and, for one query block, the page flags and
    visibility rows ``[N, Hkv, bq, ceil(S / page_size) + S]`` bool plus the flags' scatter
    indices ``[N, Hkv, bq, K, 4]`` int32 (``models.attention.page_visibility``)."""
    if replay is None or not replay.page_sparse:
        return 0
    pages = num_pages(total_len, replay.page_size)
    selected = selected_slots(replay.max_pages_k, pages)
    rows = total_len if total_len * total_len <= _ONE_BLOCK_PAIRS else min(_BLOCK, total_len)
    return (cfg.num_layers * batch * cfg.num_kv_heads * total_len * selected * 4
            + batch * cfg.num_kv_heads * rows * (pages + total_len + selected * 16))


def estimate(
    kind: str,
    cfg: ModelConfig,
    *,
    batch: int,
    prompt_len: int,
    new_tokens: int,
    compression: CompressionConfig | None = None,
    dtype=np.float32,
    num_samples: int = 1,
    logp_chunk: int = 128,
    record_evictions: bool = True,
    remat: str = "none",
    pool_pages: int = 0,
    lora: LoraConfig | None = None,
    accumulate: bool = False,
    platform: str | None = None,
) -> MemoryEstimate:
    """Estimated peak bytes of one call of ``kind`` over ``batch`` sequences.

    Args:
      kind: ``rollout`` (``sampler.generate``), ``score`` (``scoring.score``) or ``update``
        (``update_step.update_step`` with donated params and optimizer state: the
        backward or, when larger, the optimizer step; ``update_memory``).
      cfg: the model's architecture.
      batch: sequences ``N`` (for a rollout, prompts x ``num_samples``).
      prompt_len, new_tokens: ``P`` (bucketed prompt width) and ``M`` (max new tokens).
      compression: the rollout's KV policy (``None`` = dense); for score/update, a
        ``sparrow`` config with ``record_evictions`` counts the replay of its record.
      dtype: parameter / compute / KV dtype.
      num_samples: samples per prompt (a rollout prefills ``N / num_samples`` prompts).
      logp_chunk: response columns per LM-head chunk (score/update).
      record_evictions: the rollout keeps its record (``Rollout.record``): the
        ``[N, L, Hkv, P + M]`` eviction times of an evicting method, or for ``sparrow`` the
        ``[N, L, Hkv, M, K]`` selected pages.
      remat: the update's ``model.remat`` policy: what each layer keeps for its backward
        (``none``: its activations; ``full``: its input only; ``dots_saveable``: its matmul
        outputs, the attention scores included).
      pool_pages: a rollout through the continuous engine whose paged rows share a
        pool of this many pages (``sampling.pool_pages``; ``batch`` is then its slots ``S``):
        the pool is the ``kv_pool`` part (:func:`engine_sizes` sizes both).
      lora: an update that trains these adapters alone (``model.lora``): gradients and
        optimizer state for the adapters only; None: every weight trains.
      accumulate: an update of a minibatch larger than ``batch``, run in micro-batches of
        ``batch`` that sum their gradients in a float32 accumulator.
      platform: the JAX platform whose compute dtype the score's and update's activations
        take (None: ``jax.default_backend()``): ``update_memory.compute_itemsize``.
    """
    _check_args(kind, remat, batch=batch, prompt_len=prompt_len, new_tokens=new_tokens,
                num_samples=num_samples, logp_chunk=logp_chunk, pool_pages=pool_pages)
    itemsize = np.dtype(dtype).itemsize
    if kind == "rollout":
        parts = _rollout_parts(cfg, batch, prompt_len, new_tokens, compression, dtype,
                               num_samples, record_evictions, pool_pages)
        return MemoryEstimate(kind, batch, parts)
    compute = compute_itemsize(itemsize, platform or jax.default_backend())
    total_len = prompt_len + new_tokens
    parts = _scoring_parts(cfg, batch, total_len, min(logp_chunk, new_tokens), itemsize,
                           compute, compression if record_evictions else None)
    if kind == "update":
        parts = update_parts(parts, cfg, batch=batch, total_len=total_len, dtype=dtype,
                             compute_itemsize=compute, remat=remat, params=param_count(cfg),
                             lora=lora, accumulate=accumulate,
                             visibility=_visibility_residual(cfg, batch, total_len))
    return MemoryEstimate(kind, batch, parts)


def device_memory_limit(device: jax.Device | None = None) -> int | None:
    """``bytes_limit`` from the device's ``memory_stats()``, or None where JAX reports none
    (XLA:CPU)."""
    device = device or jax.local_devices()[0]
    try:
        stats = device.memory_stats()
    except (NotImplementedError, RuntimeError):
        return None
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def largest_batch(kind: str, cfg: ModelConfig, limit: int, *, step: int = 1, **kw) -> int:
    """The largest batch (a multiple of ``step``) whose :func:`estimate` fits ``limit`` bytes;
    0 if none. ``kw`` are :func:`estimate`'s other arguments.

    An estimate never shrinks as the batch grows (it is affine, or for an update the larger
    of an affine backward and a fixed optimizer step), so doubling then bisecting the
    multiples of ``step`` finds it."""
    fits = lambda n: estimate(kind, cfg, batch=n * step, **kw).total <= limit  # noqa: E731
    if not fits(0):
        return 0
    low, high = 0, 1  # fits(low); find a high that does not
    while fits(high):
        low, high = high, 2 * high
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low * step


def engine_sizes(cfg: ModelConfig, limit: int, *, rows: int, prompt_len: int,
                 new_tokens: int, compression: CompressionConfig | None = None,
                 **kw) -> tuple[int, int]:
    """``(slots, pool_pages)`` of a continuous-engine rollout of ``rows`` rows in ``limit``
    bytes (``sampling.slots`` / ``sampling.pool_pages`` when unset).

    Without a pool (evicting methods, the dense layout: ``engine_state.pooled``) the slots
    are the largest :func:`largest_batch` (at most ``rows``), pool 0. Paged rows (``none``,
    ``sparrow``) hold only the pages they fill, so the engine gets twice the slots whose
    max-length KV would fit (at most ``rows``; a row's mean length is at most its max) and
    the pool the memory left (at most every slot at max length); where that pool cannot
    hold one max-length row, the slots fall back to those that fit at max length.

    Raises:
      MemoryPlanError: not one row fits (:func:`check_fits`'s message).
    """
    kw = dict(prompt_len=prompt_len, new_tokens=new_tokens, compression=compression, **kw)
    dense = largest_batch("rollout", cfg, limit, **kw)
    if dense == 0:
        check_fits("rollout", cfg, batch=1, limit=limit, **kw)
    compression = compression or CompressionConfig(method="none")
    if not pooled(compression):
        return min(rows, dense), 0
    row_pages = -(-(prompt_len + new_tokens) // compression.page_size)
    page = page_bytes(cfg, compression.page_size, kw.get("dtype", np.float32),
                      compression.quant)
    slots = min(rows, 2 * dense)
    rest = limit - estimate("rollout", cfg, batch=slots, **kw, pool_pages=1).total + page
    pool = min(rest // page, slots * row_pages)
    if pool < row_pages:  # the doubled slots leave no pool: the slots that fit at max length
        slots = min(rows, dense)
        pool = slots * row_pages
    return slots, pool


def check_fits(kind: str, cfg: ModelConfig, *, batch: int, limit: int | None = None,
               step: int = 1, **kw) -> MemoryEstimate:
    """:func:`estimate`, raising :class:`MemoryPlanError` (the estimate, the limit and the
    largest batch that fits) when it exceeds ``limit`` bytes (default: the device's limit;
    no check when neither is known). Call it before compiling the request."""
    est = estimate(kind, cfg, batch=batch, **kw)
    limit = device_memory_limit() if limit is None else limit
    if limit is not None and est.total > limit:
        fits = largest_batch(kind, cfg, limit, step=step, **kw)
        largest = (f"the largest batch that fits is {fits}" if fits else
                   "no batch fits (the fixed part alone exceeds it)")
        detail = ", ".join(f"{name} {size / 2**30:.2f}" for name, size in est.parts.items())
        raise MemoryPlanError(
            f"{kind} of batch {batch} x {kw.get('prompt_len')}+{kw.get('new_tokens')} tokens "
            f"needs an estimated {est.total / 2**30:.2f} GiB ({detail} GiB), over the memory "
            f"limit of {limit / 2**30:.2f} GiB; {largest}")
    return est


def micro_batch_size(cfg: ModelConfig, minibatch: int, *, limit: int | None = None,
                     step: int = 1, **kw) -> int:
    """The micro-batch an update of ``minibatch`` sequences runs with when
    ``trainer.micro_batch_size`` is 0: the whole minibatch when its :func:`estimate` fits
    ``limit`` bytes (default: the device's; always where none is known), else the largest
    divisor of ``minibatch`` (a multiple of ``step``, the batch devices) whose estimate with
    the float32 gradient accumulator (``accumulate``) fits. ``kw``: :func:`estimate`'s other
    arguments.

    Raises:
      MemoryPlanError: naming the estimate of the smallest micro-batch and the largest
        micro-batch that fits, when no divisor fits.
    """
    limit = device_memory_limit() if limit is None else limit
    if limit is None or estimate("update", cfg, batch=minibatch, **kw).total <= limit:
        return minibatch
    # any size that fits, not just multiples of ``step``: the error names it
    fits = largest_batch("update", cfg, limit, accumulate=True, **kw)
    divisors = [d for d in range(step, min(fits, minibatch) + 1, step) if minibatch % d == 0]
    if divisors:
        return divisors[-1]
    smallest = estimate("update", cfg, batch=step, accumulate=True, **kw).total
    raise MemoryPlanError(
        f"update of micro-batch {step} x {kw.get('prompt_len')}+{kw.get('new_tokens')} tokens "
        f"needs an estimated {smallest / 2**30:.2f} GiB (with the float32 gradient "
        f"accumulator), over the memory limit of {limit / 2**30:.2f} GiB; the largest "
        f"micro-batch that fits is {fits} (none dividing trainer.minibatch_size={minibatch} "
        "in multiples of the batch devices): lower the sequence lengths or use remat")
