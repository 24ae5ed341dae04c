"""Predicted time of one decode step, dense or Sparrow page-sparse, from FLOPs and bytes.

A decode step of ``B`` rows whose cached length is ``L`` (current token included) is three
kinds of work, each timed as a roofline ``max(bytes / bandwidth, flops / flops_per_s)`` and
summed (they run one after another):

- **linear**: every weight matrix read once (q/k/v/o, gate/up/down, LM head), ``2 * B`` FLOPs
  per weight.
- **attention**: per layer, ``T`` attended tokens: K and V of ``T`` tokens read per row and KV
  head, ``4 * Hq * D * T`` FLOPs per row (scores and probs @ V). Dense layers (and rows whose
  ``n = ceil(L / page_size)`` pages are ``<= k + 3``) attend to ``T = L`` tokens; sparse layers
  to ``T = (k + 3) * page_size`` (sink + top-k + 2 newest pages).
- **page scoring** (sparse layers of sparse rows): the ``n`` page-mean keys read per row and KV
  head, ``2 * Hkv * D * n`` FLOPs per row (group-mean query dot each page mean).

Norms, RoPE, the top-k and the page-mean refresh are left out (O(hidden) or O(n) per row).
"""

from __future__ import annotations

import dataclasses

from models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class Device:
    """Peak memory bandwidth (bytes/s) and matmul throughput (FLOP/s) of one device."""

    name: str
    bandwidth: float
    flops: float


# Nominal datasheet peaks (dense bf16 tensor-core FLOP/s for the GPUs); "cpu" is a 2-core
# machine of the order this project's CPU benchmarks ran on (measure yours: the benchmark does).
DEVICES = {
    "h100": Device("h100", bandwidth=3.35e12, flops=989e12),
    "h200": Device("h200", bandwidth=4.8e12, flops=989e12),
    "cpu": Device("cpu", bandwidth=30e9, flops=300e9),
}


@dataclasses.dataclass(frozen=True)
class StepCost:
    """Bytes and FLOPs of one decode step, per kind of work (see the module docstring)."""

    linear_bytes: float
    linear_flops: float
    attention_bytes: float
    attention_flops: float
    scoring_bytes: float
    scoring_flops: float

    def seconds(self, device: Device) -> float:
        """Predicted seconds on ``device``: the sum of each kind's roofline time."""
        return sum(max(b / device.bandwidth, f / device.flops) for b, f in (
            (self.linear_bytes, self.linear_flops),
            (self.attention_bytes, self.attention_flops),
            (self.scoring_bytes, self.scoring_flops)))


def linear_params(cfg: ModelConfig) -> int:
    """Weights every decode step multiplies by: attention and MLP matrices and the LM head."""
    h, d = cfg.hidden_size, cfg.head_dim
    attention = h * d * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    mlp = 3 * h * cfg.intermediate_size
    return cfg.num_layers * (attention + mlp) + cfg.vocab_size * h


def decode_step_cost(
    cfg: ModelConfig, *, batch: int, cached_len: int, k: int | None = None,
    page_size: int = 16, dense_layers: tuple[int, ...] = (0, 1), itemsize: int = 2,
) -> StepCost:
    """Bytes and FLOPs of one decode step of ``batch`` rows with ``cached_len`` cached tokens.

    Args:
      cfg: the model's shape.
      batch: rows decoded together (``B``).
      cached_len: ``L``, tokens in each row's cache including the current one.
      k: Sparrow's middle-page budget at this length; ``None`` for a dense step.
      page_size, dense_layers: as ``CompressionConfig`` (``sparrow``).
      itemsize: bytes per weight and per KV element (2 for bf16, 4 for fp32).
    """
    weights = linear_params(cfg)
    pages = -(-cached_len // page_size)
    sparse = k is not None and pages > k + 3
    n_sparse = sum(1 for i in range(cfg.num_layers) if i not in dense_layers) if sparse else 0
    n_dense = cfg.num_layers - n_sparse
    attended = n_dense * cached_len + n_sparse * (k + 3) * page_size if sparse else (
        cfg.num_layers * cached_len)  # tokens summed over layers
    hkv, hq, d = cfg.num_kv_heads, cfg.num_heads, cfg.head_dim
    return StepCost(
        linear_bytes=weights * itemsize,
        linear_flops=2 * batch * weights,
        attention_bytes=batch * attended * hkv * 2 * d * itemsize,
        attention_flops=batch * attended * 4 * hq * d,
        scoring_bytes=batch * n_sparse * pages * hkv * d * itemsize,
        scoring_flops=batch * n_sparse * pages * 2 * hkv * d,
    )


def rollout_seconds(
    cfg: ModelConfig, device: Device, *, batch: int, prompt_len: int, new_tokens: int,
    schedule: tuple[tuple[int, int], ...] | None = None, page_size: int = 16,
    dense_layers: tuple[int, ...] = (0, 1), itemsize: int = 2,
) -> float:
    """Predicted seconds of ``new_tokens - 1`` decode steps after a ``prompt_len`` prompt.

    ``schedule`` is ``CompressionConfig.sparrow.budget_schedule`` (``None``: dense); step ``t`` has
    ``L = prompt_len + t + 1`` cached tokens and k from the schedule's bin of ``L`` (the same
    rule as ``page_sparsity.schedule_budget``).
    """
    total = 0.0
    for t in range(1, new_tokens):
        length = prompt_len + t
        k = None
        if schedule is not None:
            covered = -(-length // page_size) * page_size
            k = [kk for start, kk in schedule if start <= covered][-1]
        total += decode_step_cost(cfg, batch=batch, cached_len=length, k=k,
                                  page_size=page_size, dense_layers=dense_layers,
                                  itemsize=itemsize).seconds(device)
    return total
