"""The share of a batch's gradient that its low-r sequences carry, by row subsets.

The definition is ``update_step.low_r_grad_metrics``'s: ``g_low`` is the gradient of the loss
restricted to the sequences holding a token with ``r_t < 1e-4`` (``loss.low_r``), under the
whole batch's denominators, and the share is ``<g_low, g> / |g|^2``
(``update_step.grad_share``). The trainer gets ``g_low`` from a second backward of the whole
minibatch with the other rows masked; here ``g = g_low + g_rest`` comes from one backward of
each disjoint row subset instead (``update_step.loss_grads`` on micro-batches), which costs
one backward of the batch, and less:

- a row whose loss terms are all zero (no kept token; or an advantage of 0 and no term but
  the policy's) adds nothing to the gradient and is left out;
- rows go to micro-batches in order of response length, and each micro-batch's response
  columns are cut after its longest response (rounded up to ``bucket`` columns, so few
  shapes compile): the policy is causal and the cut columns lie outside every mask, so the
  kept columns' log-probs and the loss are unchanged. Rows replaying a record (its arrays
  span every column) and the ``seq_mean_token_sum_norm`` aggregation (it divides by the
  width) keep every column.

A micro-batch short of rows is filled with copies of its first row with ``seq_mask`` False,
which add nothing.
"""

from __future__ import annotations

import functools
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax

from models.lora import split_trainable
from sparse_rl_jax.rl.grpo_loss import LossBatch, grpo_loss, loss_norm
from sparse_rl_jax.rl.loss_config import GRPOLossConfig
from sparse_rl_jax.rl.update_step import Minibatch, grad_share, loss_grads


def contributing_rows(loss: LossBatch, loss_cfg: GRPOLossConfig) -> np.ndarray:
    """``[N]`` bool: rows whose loss terms can have a nonzero gradient: a kept token (loss
    mask, token mask, sequence mask) and, unless a KL, distillation or entropy term is on, a
    nonzero advantage (the policy term of every loss is ``A`` times something)."""
    kept = (np.asarray(loss.loss_mask).astype(bool) & np.asarray(loss.token_mask).astype(bool)
            & np.asarray(loss.seq_mask).astype(bool)[:, None]).any(axis=1)
    penalties = (loss_cfg.entropy_coef > 0 or loss_cfg.distill_coef > 0
                 or (loss.logp_ref is not None and loss_cfg.kl_coef > 0))
    return kept if penalties else kept & (np.asarray(loss.advantages) != 0)


def response_lengths(loss_mask) -> np.ndarray:
    """``[N]`` int: one past each row's last loss-mask column (0 for an empty row)."""
    mask = np.asarray(loss_mask).astype(bool)
    return np.where(mask.any(axis=1), mask.shape[1] - np.argmax(mask[:, ::-1], axis=1), 0)


def micro_batches(full: Minibatch, rows: np.ndarray, size: int, bucket: int | None
                  ) -> Iterator[Minibatch]:
    """``full``'s ``rows`` (indices) as micro-batches of ``size`` rows in order of response
    length, the last filled with masked-out copies; with ``bucket``, each cut to its longest
    response rounded up to a multiple of ``bucket`` columns (see the module docstring)."""
    full = jax.device_get(full)  # sliced on the host: no small programs to compile
    lengths = response_lengths(full.loss.loss_mask)
    order = np.asarray(rows)[np.argsort(lengths[rows], kind="stable")]
    width = full.response.shape[1]
    for start in range(0, len(order), size):
        chunk = order[start:start + size]
        idx = np.concatenate([chunk, np.repeat(chunk[:1], size - len(chunk))])
        piece = jax.tree.map(lambda x: x[idx], full)
        filler = np.arange(size) >= len(chunk)
        piece = piece._replace(loss=piece.loss.replace(seq_mask=piece.loss.seq_mask & ~filler))
        if bucket:
            cut = min(width, -(-int(lengths[chunk].max()) // bucket) * bucket)
            piece = piece._replace(
                response=piece.response[:, :cut],
                loss=jax.tree.map(lambda x: x[:, :cut] if x.ndim == 2 else x, piece.loss))
        yield piece


@functools.partial(jax.jit, static_argnames=("graphdef", "loss_cfg", "chunk_size",
                                             "temperature"), donate_argnums=(0,))
def _add_grads(acc, graphdef, trainable, frozen, piece: Minibatch, norm, *,
               loss_cfg: GRPOLossConfig, chunk_size: int, temperature: float):
    """``acc`` plus the float32 gradient of ``piece``'s loss under ``norm``."""
    _, _, grads = loss_grads(graphdef, trainable, frozen, piece, loss_cfg=loss_cfg,
                             chunk_size=chunk_size, norm=norm, temperature=temperature)
    return jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads)


def rows_grad(graphdef, params, full: Minibatch, rows: np.ndarray, *, loss_cfg: GRPOLossConfig,
              micro: int, chunk_size: int, temperature: float, bucket: int | None = 64):
    """The float32 gradient (a pytree like the trainable params) of the loss of ``full``'s
    ``rows`` alone under ``full``'s whole-batch denominators, summed over micro-batches of
    ``micro`` rows (zeros when ``rows`` is empty)."""
    trainable, frozen = split_trainable(params)
    acc = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), trainable)
    norm = loss_norm(full.loss, loss_cfg)
    cut = (bucket if full.record is None and loss_cfg.aggregation != "seq_mean_token_sum_norm"
           else None)
    for piece in micro_batches(full, np.flatnonzero(rows), micro, cut):
        acc = _add_grads(acc, graphdef, trainable, frozen, piece, norm, loss_cfg=loss_cfg,
                         chunk_size=chunk_size, temperature=temperature)
    return acc


def low_r_grad_share(graphdef, params, full: Minibatch, *, loss_cfg: GRPOLossConfig,
                     micro: int, chunk_size: int, temperature: float,
                     bucket: int | None = 64) -> dict[str, float]:
    """``low_r_grad_share`` and ``low_r_grad_norm_ratio`` (``update_step.grad_share``) of the
    low-r rows of ``full`` (``full.loss.low_r``) with the whole of ``full`` as one minibatch,
    ``grad_norm`` (``|g|``), and the rows that entered each backward (``grad_rows_low``,
    ``grad_rows_rest``: :func:`contributing_rows`). Without a contributing low-r row the share
    is 0 and nothing is computed (``grad_norm`` None). Arguments as in :func:`rows_grad`."""
    active = contributing_rows(full.loss, loss_cfg)
    low = np.asarray(full.loss.low_r).astype(bool)
    rows = {"grad_rows_low": int(np.sum(active & low)),
            "grad_rows_rest": int(np.sum(active & ~low))}
    if not rows["grad_rows_low"]:  # g_low = 0: the share is 0 whatever g is
        return {"low_r_grad_share": 0.0, "low_r_grad_norm_ratio": 0.0, "grad_norm": None, **rows}
    kw = dict(loss_cfg=loss_cfg, micro=micro, chunk_size=chunk_size, temperature=temperature,
              bucket=bucket)
    g_low = rows_grad(graphdef, params, full, active & low, **kw)
    shares = _shares(g_low, rows_grad(graphdef, params, full, active & ~low, **kw))
    return {**{k: float(v) for k, v in shares.items()}, **rows}


@jax.jit
def _shares(g_low, g_rest) -> dict[str, jax.Array]:
    """``update_step.grad_share`` of ``g_low`` in ``g = g_low + g_rest``, and ``grad_norm``."""
    g = jax.tree.map(jnp.add, g_low, g_rest)
    return {**grad_share(g_low, g), "grad_norm": optax.tree.norm(g)}


def loss_cotangent(full: Minibatch, loss_cfg: GRPOLossConfig, logp) -> np.ndarray:
    """``[N, M]``: the gradient of ``full``'s loss with respect to the learner's log-probs at
    ``logp`` (dense scoring; its parameter gradient is this cotangent pulled back through the
    policy). Two corrections with equal cotangents at the learner's own log-probs have the
    same first-update gradient (e.g. ``pg_is`` and ``decoupled_seq_is``: plain policy
    gradient and PPO at ratio 1)."""
    return np.asarray(jax.grad(lambda lp: grpo_loss(lp, full.loss, loss_cfg)[0])(logp))
