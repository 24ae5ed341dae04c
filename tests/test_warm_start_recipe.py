"""The embedded default's warm-start recipe: it learns the task's lookup (in a shortened run;
the full recipe's seeds 0-4 are measured by ``experiments/default_table.py``), its held-out check against a string-level oracle, its batches, and the one
warning line of a warm start that never learned the task."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from sparse_rl_jax.core.config_io import load_config
from sparse_rl_jax.records.metrics_writer import read_metrics
from sparse_rl_jax.tasks.task import LABELS, TaskConfig, num_items
from sparse_rl_jax.tasks.task_tokenizer import build_task_tokenizer
from sparse_rl_jax.tasks.walk_task import WalkTaskConfig, synthetic_dataset
from sparse_rl_jax.training.run_config import RunConfig
from sparse_rl_jax.training.trainer import train
from sparse_rl_jax.training.warm_start import MARKER, build_default_model, warm_start_problems
from sparse_rl_jax.training.warm_start_check import HeldOutCheck
from sparse_rl_jax.training.warm_start_config import WarmStartConfig

# The default recipe cut to 200 steps (curriculum 100) with one check at the end, on a smaller
# task (4-5 labelled digits) so that it fits a unit test. The recipe before it (4 heads, no
# curriculum, no shuffled rows, cosine decay) ends this run with the looked-up digits at 0.08
# (seed 0) and 0.58 (seed 1); this one at 1.00 on both (2-core CPU). The test runs seed 0 (the
# one the old recipe failed hardest), which the short RL run below starts from too: one build.
# (Re-measured on 2026-12-03: the old recipe 0.83 at seed 0, still under the floor. Shorter
# runs lose the contrast: 150 steps end at 0.75; batch 16 or 2-3 digits teach the old recipe
# the lookup as well.)
SHORT = dict(steps=200, curriculum_steps=100, check_every=200, check_problems=64,
             target_accuracy=None)
SHORT_TASK = TaskConfig(n_min=4, n_max=5)
LOOKUP_FLOOR = 0.9
SCRIPT = Path(__file__).resolve().parent / "scripts" / "warm_start.py"


@pytest.fixture(scope="module")
def short_warm_start(tmp_path_factory, optimized_env):
    """``seed -> warm-start directory`` of the shortened recipe, each built once per module,
    in a child process whose XLA:CPU optimises the 200 steps' programs (``optimized_env``)."""
    built = {}

    def build(seed: int) -> Path:
        if seed not in built:
            out = tmp_path_factory.mktemp(f"warm{seed}")
            proc = subprocess.run(
                [sys.executable, str(SCRIPT), str(out), json.dumps({**SHORT, "seed": seed}),
                 json.dumps(dataclasses.asdict(SHORT_TASK))], env=optimized_env,
                capture_output=True, text=True, timeout=300)
            assert proc.returncode == 0, proc.stderr[-3000:]
            built[seed] = out
        return built[seed]

    return build


def test_shortened_recipe_learns_the_lookup(short_warm_start):
    result = json.loads((short_warm_start(0) / MARKER).read_text())["result"]
    assert result["steps"] == SHORT["steps"]
    assert result["lookups"] >= LOOKUP_FLOOR, result  # chance is 0.1


@pytest.mark.slow  # 10 GRPO steps, evaluated before and after
def test_short_rl_run_raises_the_reward_over_the_warm_start(short_warm_start, tmp_path):
    """From the shortened recipe's seed-0 warm start, 10 GRPO steps (lr 1e-3, dense rollouts,
    8 fixed prompts x 8 samples, so every step revisits the prompts the eval measures) raise
    the training reward and the sampled reward. (The default run's R-KV rollouts need ~100
    steps for a visible gain: experiments/default_table.py measures that.)"""
    problems = synthetic_dataset(dataclasses.replace(SHORT_TASK, seed=777), 8)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p.prompt, "answer": p.answer}) + "\n"
                            for p in problems))
    cfg = load_config(RunConfig, None, [
        f"run_dir={tmp_path / 'run'}", f"model.path={short_warm_start(0)}",
        "data.source=jsonl", f"data.jsonl.path={data}", f"eval.jsonl.path={data}",
        "compression.method=none", "sampling.max_new_tokens=24", "optim.lr=1e-3",
        "trainer.steps=10", "trainer.prompts_per_step=8", "trainer.minibatch_size=64",
        "trainer.checkpoint_every=10", "eval.before_train=true", "eval.every_steps=10",
        "eval.num_prompts=8", "eval.samples=8", "eval.batch_size=8"])
    train(cfg, log=lambda _: None)
    metrics = read_metrics(cfg.run_dir)
    rewards = [m["reward_mean"] for m in metrics if "reward_mean" in m]
    before, after = (next(m for m in metrics if m["step"] == step) for step in (0, 10))
    assert len(rewards) == 10
    assert np.mean(rewards[-3:]) > np.mean(rewards[:3]) + 0.05, rewards
    assert after["eval/dense_avg_at_k"] > before["eval/dense_avg_at_k"], (before, after)


def test_unlearned_warm_start_says_so_in_one_line(tmp_path):
    lines = []
    warm = WarmStartConfig(hidden_size=16, num_heads=2, num_kv_heads=1, intermediate_size=32,
                           steps=3, check_problems=8, seed=0)
    path = build_default_model(tmp_path, warm, TaskConfig(n_min=2, n_max=3), log=lines.append)
    warnings = [line for line in lines if line.startswith("warning:")]
    assert len(warnings) == 1
    assert "did not learn the task in 3 steps" in warnings[0]
    assert "looked-up digits" in warnings[0] and "warm_start.steps=6" in warnings[0]
    assert "\n" not in warnings[0]
    # a reused warm start repeats its held-out result instead of retraining
    again = []
    assert build_default_model(tmp_path, warm, TaskConfig(n_min=2, n_max=3),
                               log=again.append) == path
    assert again == [f"warm start: reusing {tmp_path} "
                     f"({json.loads((tmp_path / MARKER).read_text())['result']['summary']})"]


def test_batches_follow_the_curriculum_and_mask_shuffled_labels():
    task, warm = TaskConfig(), WarmStartConfig(batch_size=8, curriculum_steps=10,
                                               shuffled_fraction=0.5)
    first, _ = warm_start_problems(warm, task, 0)
    assert {num_items(p) for p in first} == {1}
    middle, _ = warm_start_problems(warm, task, 5)
    assert max(num_items(p) for p in middle) <= 1 + round(0.5 * 7)
    problems, masked = warm_start_problems(warm, task, 10)
    assert all(task.n_min <= num_items(p) <= task.n_max for p in problems)
    for j, (problem, columns) in enumerate(zip(problems, masked)):
        labels = problem.prompt.split(" ")[:-1]
        if j < 4:  # shuffled rows: every next label but the first is masked
            assert columns == [4 * i for i in range(1, num_items(problem))]
            assert [problem.solution[c] for c in columns] == [lab[0] for lab in labels[1:]]
        else:
            assert columns == []
            assert [lab[0] for lab in labels] == list(LABELS[:num_items(problem)])
    assert any([lab[0] for lab in p.prompt.split(" ")[:-1]] != sorted(
        lab[0] for lab in p.prompt.split(" ")[:-1]) for p in problems[:4])
    # pure in (warm, task, step); the walk has no labels to shuffle
    assert warm_start_problems(warm, task, 10) == (problems, masked)
    walk, walk_masked = warm_start_problems(warm, WalkTaskConfig(), 0)
    assert walk == synthetic_dataset(dataclasses.replace(
        WalkTaskConfig(), seed=WalkTaskConfig().seed + 1_000_003), 8)[:]
    assert walk_masked == [[]] * 8


class _TableModel(nnx.Module):
    """A 'model' whose logits are a fixed table (the held-out batch's true next tokens, with
    chosen positions wrong): the check must count exactly the positions the test broke."""

    def __init__(self, logits_BxTxV):
        self.table = nnx.Variable(jnp.asarray(logits_BxTxV))

    def __call__(self, tokens, attention_mask=None):
        return models.DecoderOutput(logits=self.table.get_value(), hidden=None, kv=None)


def test_held_out_check_against_a_string_oracle(tmp_path):
    build_task_tokenizer(tmp_path)
    tokenizer = models.Tokenizer(tmp_path)
    task = TaskConfig(n_min=2, n_max=4)
    problems = synthetic_dataset(dataclasses.replace(task, seed=99), 6)[:]
    width = task.max_prompt_tokens + task.max_response_tokens
    check = HeldOutCheck(tokenizer, dataclasses.replace(task, seed=99), 6, width)
    vocab = tokenizer.vocab_size
    eos = tokenizer.eos_ids[0]
    # The oracle works on strings: the text each row should continue with, character by
    # character, and a prediction per character that the test corrupts on purpose.
    predicted = [list(p.solution) + ["<eos>"] for p in problems]
    predicted[0][1] = "X"                          # row 0: the first looked-up digit
    predicted[2][-1] = "#"                         # row 2: the EOS
    predicted[3][2] = "Y"                          # row 3: a running sum (not a lookup)
    predicted[5][4 * (num_items(problems[5]) - 1) + 1] = "Z"  # row 5: the last lookup
    logits = np.zeros((6, width, vocab), np.float32)
    vocab_of = tokenizer.hf.get_vocab()
    for r, problem in enumerate(problems):
        start = len(problem.prompt)
        for c, ch in enumerate(predicted[r]):
            logits[r, start - 1 + c, eos if ch == "<eos>" else vocab_of[ch]] = 1.0
    score = check(_TableModel(logits))
    total = sum(len(p.solution) + 1 for p in problems)
    lookups = sum(num_items(p) for p in problems)
    assert score.solutions == pytest.approx(2 / 6)  # rows 1 and 4 untouched
    assert score.tokens == pytest.approx((total - 4) / total)
    assert score.lookups == pytest.approx((lookups - 2) / lookups)
