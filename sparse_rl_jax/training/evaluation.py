"""Accuracy of a policy under dense inference and under sparse (compressed-KV) inference.

pass@1 is greedy decoding; avg@k is the mean reward of ``k`` samples per prompt at the eval
temperature (the paper's avg@32 on AIME/AMC). Both are measured through the same sampler as
training, once with ``method='none'`` (dense) and once with the training compression.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sparse_rl_jax.kv.compression_config import CompressionConfig
from sparse_rl_jax.rl.rollout_metrics import kv_token_savings
from sparse_rl_jax.rollout.sampling_config import SamplingConfig
from sparse_rl_jax.tasks.prompt_source import eval_examples
from sparse_rl_jax.training.collect import RolloutPolicy, collect_prompts
from sparse_rl_jax.training.policy import load_policy, resolve_sampling


@dataclasses.dataclass(frozen=True)
class EvalRow:
    """One line of the results table."""

    mode: str  # "dense" or "sparse (<method> budget B)"
    pass_at_1: float
    avg_at_k: float
    k: int
    mean_length: float
    kv_savings: float

    def format(self) -> str:
        """A fixed-width table line."""
        return (f"{self.mode:<28} {self.pass_at_1:>8.3f} {self.avg_at_k:>9.3f} {self.k:>3d} "
                f"{self.mean_length:>9.1f} {self.kv_savings:>9.3f}")


HEADER = f"{'mode':<28} {'pass@1':>8} {'avg@k':>9} {'k':>3} {'length':>9} {'kv saved':>9}"


def mode_name(compression: CompressionConfig) -> str:
    """The eval-table name of an inference setting: ``dense`` or ``sparse (<method>
    <budget>)``, with `` <quant>`` (``compression.quant``) added inside the brackets of a
    quantized one (``dense`` quantized: ``quantized (<quant>)``)."""
    quant = "" if compression.quant == "none" else f" {compression.quant}"
    if not compression.compresses:
        return f"quantized ({compression.quant})" if quant else "dense"
    return f"sparse ({compression.method} {compression.eviction.budget}{quant})"


def _mean_reward(policy: RolloutPolicy, params, prompts, answers, sampling, compression, key,
                 batch_size):
    """Mean reward, mean response length and KV savings over all prompts and samples."""
    # Accuracy needs no replay record (shadow-mask training turns it on): one less
    # compiled sampler variant and no per-step record traffic.
    sampling = dataclasses.replace(sampling, record_evictions=False)
    rewards, lengths, sparse_kv, dense_kv = [], [], [], []
    for start in range(0, len(prompts), batch_size):
        chunk = slice(start, start + batch_size)
        out = collect_prompts(policy, params, prompts[chunk], answers[chunk],
                              jax.random.fold_in(key, start), compression=compression,
                              sampling=sampling, score=False)
        rewards.append(out.rewards)
        lengths.append(np.asarray(out.rollout.response_mask).sum(1))
        sparse_kv.append(np.asarray(out.rollout.kv_mean))
        dense_kv.append(np.asarray(out.rollout.dense_kv_mean))
    savings = kv_token_savings(jnp.concatenate(sparse_kv), jnp.concatenate(dense_kv))
    return (float(np.concatenate(rewards).mean()), float(np.concatenate(lengths).mean()),
            float(savings))


def _modes(compression: CompressionConfig | Sequence[CompressionConfig]
           ) -> list[CompressionConfig]:
    """Dense first, then each setting of ``compression`` that compresses or quantizes (the
    dense cache at a ``compression.quant`` level), in order."""
    sparse = [compression] if isinstance(compression, CompressionConfig) else list(compression)
    return [CompressionConfig(method="none")] + [c for c in sparse
                                                  if c.compresses or c.quant != "none"]


def _greedy(sampling: SamplingConfig) -> SamplingConfig:
    return dataclasses.replace(sampling, greedy=True, num_samples=1)


def eval_metrics(graphdef, params, tokenizer, prompts: Sequence[str], answers: Sequence[str],
                 reward_fn: Callable, sampling: SamplingConfig, compression: CompressionConfig,
                 *, batch_size: int, samples: int, temperature: float,
                 add_special_tokens: bool = False) -> dict[str, float]:
    """Greedy pass@1 and sampled avg@k of the current policy, dense and (if ``compression``
    compresses or quantizes) under the rollouts' own cache, named ``sparse``: the evaluation run during training (``eval.every_steps``), through the
    same sampler (:func:`evaluate` with seed 0). Greedy pass@1 moves only when an argmax
    flips; avg@k (``samples`` draws per prompt at ``temperature``, one fixed key so successive
    evals share their noise) is the accuracy of the sampling policy that RL optimises.

    Returns ``eval/dense_pass_at_1``, ``eval/dense_avg_at_k`` and ``eval/dense_length`` (mean
    greedy response tokens), and when compressing also ``eval/sparse_pass_at_1``,
    ``eval/sparse_avg_at_k``, ``eval/sparse_length`` and ``eval/sparse_gap`` = dense minus
    sparse pass@1 (what compression costs the policy).
    """
    rows = evaluate(graphdef, params, tokenizer, prompts, answers, reward_fn, sampling,
                    compression, samples=samples, temperature=temperature,
                    batch_size=batch_size, add_special_tokens=add_special_tokens)
    out = {}
    for row in rows:
        name = "dense" if row.mode == "dense" else "sparse"
        out[f"eval/{name}_pass_at_1"], out[f"eval/{name}_length"] = row.pass_at_1, row.mean_length
        out[f"eval/{name}_avg_at_k"] = row.avg_at_k
    if "eval/sparse_pass_at_1" in out:
        out["eval/sparse_gap"] = out["eval/dense_pass_at_1"] - out["eval/sparse_pass_at_1"]
    return out


def evaluate(
    graphdef,
    params,
    tokenizer,
    prompts: Sequence[str],
    answers: Sequence[str],
    reward_fn: Callable,
    sampling: SamplingConfig,
    compression: CompressionConfig | Sequence[CompressionConfig],
    *,
    samples: int,
    temperature: float,
    batch_size: int,
    seed: int = 0,
    add_special_tokens: bool = False,
) -> list[EvalRow]:
    """Dense and sparse pass@1 / avg@k of one policy.

    Args:
      graphdef, params: ``nnx.split`` of the policy.
      tokenizer: ``models.Tokenizer``.
      prompts, answers: the eval set.
      reward_fn: ``(completions, answers) -> [N]`` (1.0 = correct).
      sampling: base sampling config (EOS ids, max_new_tokens, prompt bucket); every batch
        pads to the longest prompt's bucket (``SamplingConfig.one_width``), so only the
        first batch of each mode compiles.
      compression: the sparse-inference setting (usually the training one), or several;
        each compressing or quantizing one adds a row after the dense one, in the given
        order.
      samples: ``k`` of avg@k; temperature: its sampling temperature.
      batch_size: prompts per generation call.
      seed: sampling seed.
      add_special_tokens: whether prompts get the tokenizer's special tokens (BOS), as in
        training (``data.add_special_tokens``).
    """
    prompts, answers = list(prompts), list(answers)
    if prompts:  # one prompt width for every batch: no compile after the first one's
        mask = tokenizer.encode(prompts, add_special_tokens=add_special_tokens)[1]
        sampling = sampling.one_width(int(mask.sum(axis=1).max()))
    modes = _modes(compression)
    greedy = _greedy(sampling)
    sampled = dataclasses.replace(sampling, greedy=False, num_samples=samples,
                                  temperature=temperature, top_p=1.0, top_k=0)
    key = jax.random.key(seed)
    policy = RolloutPolicy(graphdef, tokenizer, sampling, reward_fn,
                           add_special_tokens=add_special_tokens)
    rows = []
    for comp in modes:
        p1, length, savings = _mean_reward(policy, params, prompts, answers, greedy, comp, key,
                                           batch_size)
        avg, _, _ = _mean_reward(policy, params, prompts, answers, sampled, comp, key,
                                 batch_size)
        rows.append(EvalRow(mode_name(comp), p1, avg, samples, length, savings))
    return rows


def write_table(rows: list[EvalRow], path: str | Path) -> str:
    """Writes the table as text (``path``) and JSON (``path`` with ``.json``); returns it."""
    text = "\n".join([HEADER] + [row.format() for row in rows])
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")
    path.with_suffix(".json").write_text(json.dumps([dataclasses.asdict(r) for r in rows],
                                                    indent=1))
    return text


def eval_set(cfg, tokenizer=None) -> tuple[list[str], list[str]]:
    """The eval prompts and answers of a ``RunConfig`` (``prompt_source.eval_examples``;
    ``tokenizer``, a ``transformers`` tokenizer, renders a chat template)."""
    items = eval_examples(cfg, tokenizer)
    return [x.prompt for x in items], [x.answer for x in items]


def evaluate_checkpoint(cfg, checkpoint: str | None = None,
                        log: Callable[[str], None] = print) -> tuple[list[EvalRow], int]:
    """The eval table's rows for ``cfg``'s policy (``checkpoint``: an HF dir or a run dir;
    None = ``cfg.run_dir``) on ``cfg``'s eval set, dense then under ``cfg.compression``, and
    the number of prompts."""
    from sparse_rl_jax.tasks.rewards import get_reward_fn

    graphdef, params, tokenizer = load_policy(cfg, checkpoint, log)
    prompts, answers = eval_set(cfg, tokenizer.hf)
    rows = evaluate(
        graphdef, params, tokenizer, prompts, answers, get_reward_fn(cfg.data.reward),
        resolve_sampling(cfg, tokenizer), cfg.compression, samples=cfg.eval.samples,
        temperature=cfg.eval.temperature, batch_size=cfg.eval.batch_size, seed=cfg.trainer.seed,
        add_special_tokens=cfg.data.add_special_tokens,
    )
    return rows, len(prompts)


def run_eval(cfg, checkpoint: str | None = None, log: Callable[[str], None] = print) -> str:
    """``run.py eval``: loads the policy, evaluates dense and sparse, prints and saves the
    table to ``<run_dir>/eval.txt`` (+ ``.json``); returns the table text."""
    rows, num_prompts = evaluate_checkpoint(cfg, checkpoint, log)
    out = Path(checkpoint or cfg.run_dir)
    out = out if out.is_dir() else Path(cfg.run_dir)
    text = write_table(rows, out / "eval.txt")
    log(f"{num_prompts} prompts, checkpoint {checkpoint or cfg.run_dir}\n{text}")
    return text
