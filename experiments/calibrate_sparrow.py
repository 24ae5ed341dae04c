#!/usr/bin/env python
"""Calibrate a Sparrow budget schedule for a model and a prompt set.

For each candidate k, sample the prompts with the constant schedule ``[[0, k]]`` (selection
record on), replay it against the dense policy and take alpha's 5th percentile per bin of
response position (``sparse_rl_jax.rollout.acceptance``). Per bin, the cheapest k is the smallest one
whose p5 reaches the threshold (the cost model's step time grows with k, so the smallest
passing k is the cheapest); a bin no candidate passes gets the largest candidate and is
reported. The schedule's bins start at the same offsets as the statistic's bins (as in
Sparrow's presets, where the schedule bins the cached length and the statistic the response
position). Prints the schedule, the cost model's predicted speedup over dense on ``--device``
and, with ``--measure``, the measured speedup of one timed rollout each on this machine.

    python experiments/calibrate_sparrow.py --model PATH --prompts FILE.jsonl \
        [--ks 8 16 32 64] [--max-new-tokens 4096] [--threshold 0.86] [--device h100] [--measure]

``FILE.jsonl`` holds one ``{"prompt": text}`` per line, tokenized verbatim with the model's
tokenizer. Each bin's p5 is measured with that k in every bin (earlier bins' k changes the
sampled context only through the tokens drawn), an approximation the official sweep shares.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import models  # noqa: E402
from sparse_rl_jax.kv.compression_config import CompressionConfig  # noqa: E402
from sparse_rl_jax.kv.compression_sections import SparrowConfig  # noqa: E402
from sparse_rl_jax.kv.sparrow_cost import DEVICES, rollout_seconds  # noqa: E402
from sparse_rl_jax.rollout.acceptance import (acceptance_percentile_per_bin, score_acceptance)  # noqa: E402
from sparse_rl_jax.rollout.sampler import generate  # noqa: E402
from sparse_rl_jax.rollout.sampling_config import SamplingConfig  # noqa: E402


def sparrow_config(schedule, page_size: int, dense_layers: tuple[int, ...]) -> CompressionConfig:
    """The ``sparrow`` compression of ``schedule`` (validated by ``CompressionConfig``)."""
    return CompressionConfig(method="sparrow", page_size=page_size, sparrow=SparrowConfig(
        budget_schedule=tuple(schedule), dense_layers=dense_layers))


def measure_p5(graphdef, params, prompt, mask, key, sampling: SamplingConfig,
               compression: CompressionConfig, bin_tokens: int) -> np.ndarray:
    """Alpha's p5 per ``bin_tokens`` bin of 1-based response position ``[M // bin_tokens + 1]``
    (``acceptance_percentile_per_bin``) of one rollout of ``prompt [B, P]`` under
    ``compression``."""
    r = generate(graphdef, params, prompt, mask, key, sampling, compression)
    alpha = score_acceptance(graphdef, params, r.prompt, r.prompt_mask, r.response,
                             r.record, temperature=sampling.temperature)
    return acceptance_percentile_per_bin(np.asarray(alpha), np.asarray(r.response_mask),
                                         bin_tokens=bin_tokens)


def pick_schedule(p5: dict[int, np.ndarray], threshold: float, bin_tokens: int,
                  ) -> tuple[tuple[tuple[int, int], ...], list[bool]]:
    """``(schedule, met)``: per bin ``i`` (start ``i * bin_tokens``) the smallest candidate k
    with ``p5[k][i] >= threshold``, else the largest candidate (``met[i]`` False). A bin with
    no measured token (NaN for every k) keeps the previous bin's k."""
    ks = sorted(p5)
    schedule, met = [], []
    for i in range(max(len(v) for v in p5.values())):
        values = {k: p5[k][i] if i < len(p5[k]) else np.nan for k in ks}
        if all(np.isnan(v) for v in values.values()) and schedule:
            schedule.append((i * bin_tokens, schedule[-1][1]))
            met.append(met[-1])
            continue
        passing = [k for k in ks if values[k] >= threshold]
        schedule.append((i * bin_tokens, passing[0] if passing else ks[-1]))
        met.append(bool(passing))
    return tuple(schedule), met


def timed_rollout(graphdef, params, prompt, mask, key, sampling, compression) -> float:
    """Seconds of one ``generate`` call after a warm-up call with the same shapes."""
    jax.block_until_ready(generate(graphdef, params, prompt, mask, key, sampling, compression))
    start = time.perf_counter()
    jax.block_until_ready(generate(graphdef, params, prompt, mask, key, sampling, compression))
    return time.perf_counter() - start


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="HF checkpoint directory")
    parser.add_argument("--prompts", required=True, help='JSONL of {"prompt": text}')
    parser.add_argument("--ks", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--max-new-tokens", type=int, default=4096)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--threshold", type=float, default=0.86)
    parser.add_argument("--bin-tokens", type=int, default=2000)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--dense-layers", type=int, nargs="*", default=[0, 1])
    parser.add_argument("--device", choices=sorted(DEVICES), default="h100",
                        help="named device of the cost model's prediction")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--measure", action="store_true",
                        help="also time one dense and one calibrated rollout here")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    """Runs the calibration; prints and returns the schedule and the speedups."""
    args = parse_args(argv)
    dtype = jnp.dtype(args.dtype)
    model = models.load_pretrained(args.model, dtype=dtype)
    texts = [json.loads(line)["prompt"] for line in Path(args.prompts).read_text().splitlines()
             if line.strip()]
    prompt, mask = models.Tokenizer(args.model).encode(texts)
    graphdef, params = nnx.split(model)
    sampling = SamplingConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              eos_ids=model.config.eos_token_ids, record_evictions=True)
    dense_layers, key = tuple(args.dense_layers), jax.random.key(0)
    p5 = {}
    for k in args.ks:
        cfg = sparrow_config(((0, k),), args.page_size, dense_layers)
        p5[k] = measure_p5(graphdef, params, prompt, mask, key, sampling, cfg, args.bin_tokens)
        print(f"k={k:<5} alpha p5 per bin: " + ", ".join(f"{v:.3f}" for v in p5[k]), flush=True)
    schedule, met = pick_schedule(p5, args.threshold, args.bin_tokens)
    chosen = sparrow_config(schedule, args.page_size, dense_layers)
    shape = dict(batch=len(texts) * sampling.num_samples, prompt_len=int(mask.sum(1).mean()),
                 new_tokens=args.max_new_tokens, page_size=args.page_size,
                 dense_layers=dense_layers, itemsize=dtype.itemsize)
    device = DEVICES[args.device]
    predicted = (rollout_seconds(model.config, device, **shape)
                 / rollout_seconds(model.config, device, schedule=schedule, **shape))
    out = dict(schedule=[list(e) for e in schedule], met=met, predicted_speedup=predicted)
    print(f"schedule (threshold {args.threshold}): {out['schedule']}; bins below threshold at "
          f"every candidate: {[i for i, m in enumerate(met) if not m] or 'none'}")
    print(f"predicted decode speedup over dense on {args.device}: {predicted:.2f}x")
    if args.measure:
        dense = timed_rollout(graphdef, params, prompt, mask, key, sampling,
                              CompressionConfig(method="none"))
        sparse = timed_rollout(graphdef, params, prompt, mask, key, sampling, chosen)
        out["measured_speedup"] = dense / sparse
        print(f"measured rollout speedup here ({jax.devices()[0].device_kind}): "
              f"{dense / sparse:.2f}x (dense {dense:.2f} s, sparrow {sparse:.2f} s)")
    return out


if __name__ == "__main__":
    main()
