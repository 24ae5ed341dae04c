"""The walk task, checked against an independent simulation of its rule."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_rl_jax.core.config_io import load_config
from sparse_rl_jax.tasks.prompt_source import PromptSource, eval_examples
from sparse_rl_jax.tasks.rewards import task_exact_reward
from sparse_rl_jax.tasks.task import ALPHABET
from sparse_rl_jax.tasks.walk_task import (WalkDataset, WalkTaskConfig, render_walk, sample_walk,
                                           walk_at)
from sparse_rl_jax.training.run_config import DataSection, RunConfig

CONFIGS = [
    WalkTaskConfig(c_min=1, c_max=2, distractors_min=0, distractors_max=0, seed=0),
    WalkTaskConfig(c_min=3, c_max=9, distractors_min=5, distractors_max=48, seed=7),
    WalkTaskConfig(c_min=1, c_max=5, echo_every=4, seed=3),
    WalkTaskConfig(c_min=2, c_max=6, echo_every=1, seed=11),
    WalkTaskConfig(c_min=1, c_max=3, fact_order="fixed", seed=2),
]


def simulate(prompt: str, echo_every: int) -> tuple[str, str]:
    """Independent solver: read the facts, step x one at a time until c visits to h."""
    assert prompt.endswith(" ?")
    facts = dict(re.fullmatch(r"([A-Za-z])=(\d)", f).groups() for f in prompt[:-2].split(" "))
    k, h, c, x = (int(facts[name]) for name in "khcx")
    trace, visits, steps = [], 0, 0
    while visits != c:
        steps += 1
        x = (x + k) % 10
        if x == h:
            visits += 1
        trace.append("%02d%d%d" % (steps, x, visits))
        if echo_every > 0 and steps % echo_every == 0 and visits != c:
            trace.append("h%dc%d" % (h, c))
        assert steps < 1000, "the walk never halts"
    return " ".join(trace) + " #" + str(steps), str(steps)


@settings(max_examples=80, deadline=None)
@given(cfg=st.sampled_from(CONFIGS), index=st.integers(0, 10**9))
def test_solution_follows_the_rule_and_the_length_formulas(cfg, index):
    p = walk_at(cfg, index)
    solution, answer = simulate(p.prompt, cfg.echo_every)
    assert (p.solution, p.answer) == (solution, answer)
    facts = p.prompt[:-2].split(" ")
    d = len(facts) - 4
    assert cfg.distractors_min <= d <= cfg.distractors_max
    assert len({f[0] for f in facts}) == len(facts)  # labels distinct, k h c x present once
    c = int(dict(f.split("=") for f in facts)["c"])
    assert cfg.c_min <= c <= cfg.c_max
    steps = int(answer)
    assert 10 * c - 9 <= steps <= 10 * c
    echoes = (steps - 1) // cfg.echo_every if cfg.echo_every else 0
    assert len(p.prompt) == 4 * (4 + d) + 1 <= cfg.max_prompt_tokens
    assert len(p.solution) == 5 * (steps + echoes) + 1 + len(answer)
    assert len(p.solution) + 1 <= cfg.max_response_tokens
    assert set(p.prompt + p.solution) <= set(ALPHABET)
    if cfg.fact_order == "fixed":
        assert [f[0] for f in facts[:4]] == list("khcx")
    assert task_exact_reward([p.solution], [p.answer]).tolist() == [1.0]


def test_longest_response_is_reached_and_documented_example():
    cfg = WalkTaskConfig(c_min=3, c_max=3, distractors_min=1, distractors_max=1)
    # k=1, x=h: the first visit is 10 steps away, the longest possible walk (30 steps)
    p = render_walk(1, 4, 3, 4, [("q", 0)], [0, 1, 2, 3, 4])
    assert p.answer == "30" and len(p.solution) + 1 == cfg.max_response_tokens
    p = render_walk(3, 7, 2, 5, [("q", 2), ("B", 9)], [1, 4, 3, 2, 0, 5])
    assert p.prompt == "h=7 q=2 x=5 c=2 k=3 B=9 ?"
    assert p.solution == ("0180 0210 0340 0471 0501 0631 0761 0891 0921 1051 1181 1211 1341 "
                          "1472 #14")


def test_deterministic_per_seed_and_index():
    cfg = CONFIGS[1]
    data = WalkDataset(cfg, 50)
    assert [data[i] for i in range(50)] == [walk_at(cfg, i) for i in range(50)] == list(data)
    assert data[-1] == walk_at(cfg, 49) and data[3:6] == [walk_at(cfg, i) for i in (3, 4, 5)]
    other = WalkTaskConfig(**{**cfg.__dict__, "seed": 8})
    assert [walk_at(other, i) for i in range(20)] != [walk_at(cfg, i) for i in range(20)]
    assert sample_walk(np.random.default_rng([cfg.seed, 7]), cfg) == walk_at(cfg, 7)
    with pytest.raises(IndexError):
        data[50]


def test_reward_rejects_a_miscount_and_a_missing_halt():
    p = render_walk(3, 7, 2, 5, [("q", 2)], [0, 1, 2, 3, 4])
    groups = p.solution.split(" ")[:-1]
    # the counter not incremented at the first visit: the walk halts 10 steps later
    skipped, _ = simulate("k=3 h=7 c=3 x=5 ?", 0)
    miscount = " ".join(g[:3] + str(max(0, int(g[3]) - 1)) if i >= 3 else g
                        for i, g in enumerate(skipped.split(" ")[:-1])) + " " + \
        skipped.split(" ")[-1]
    assert miscount.endswith("#24") and p.answer == "14"
    no_halt = " ".join(groups + ["1500", "1630", "1760", "1890"])  # runs to the length cap
    early = " ".join(groups[:-1]) + " #13"
    rewards = task_exact_reward([p.solution, miscount, no_halt, early], [p.answer] * 4)
    assert rewards.tolist() == [1.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize(
    "kwargs, field",
    [({"c_max": 10}, "c_max"), ({"c_min": 0}, "c_min"), ({"c_min": 4, "c_max": 3}, "c_min"),
     ({"distractors_max": 49}, "distractors_max"), ({"distractors_min": -1}, "distractors_min"),
     ({"distractors_min": 7}, "distractors_min"), ({"echo_every": -1}, "echo_every"),
     ({"seed": -1}, "seed"), ({"c_max": 2.0}, "c_max"), ({"fact_order": "sorted"}, "fact_order")],
)
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"WalkTaskConfig.{field}"):
        WalkTaskConfig(**kwargs)


def test_render_rejects_bad_facts():
    with pytest.raises(ValueError, match="k in"):
        render_walk(2, 1, 1, 1, [], [0, 1, 2, 3])
    with pytest.raises(ValueError, match="distractor labels"):
        render_walk(1, 1, 1, 1, [("k", 1)], [0, 1, 2, 3, 4])
    with pytest.raises(ValueError, match="permutation"):
        render_walk(1, 1, 1, 1, [], [0, 1, 2, 2])


def test_run_config_selects_the_walk_and_keeps_the_default():
    assert RunConfig().data.source == "task" and RunConfig().data.walk is None
    data = DataSection(source="walk", walk=CONFIGS[2])
    assert data.synthetic == CONFIGS[2]
    batch = PromptSource(data, batch_size=3).batch(2)
    assert batch.prompts == [walk_at(CONFIGS[2], i).prompt for i in (6, 7, 8)]
    assert DataSection(source="walk").synthetic == WalkTaskConfig()
    with pytest.raises(ValueError, match="compression.eviction.budget.*data.walk.distractors_max"):
        RunConfig(data=data)  # the default's KV budget is smaller than a walk prompt
    cfg = load_config(RunConfig, None, ["data.source=walk", "compression.method=none",
                                        "data.walk.echo_every=4", "data.walk.seed=3"])
    held_out = eval_examples(cfg)
    assert held_out[0] == walk_at(WalkTaskConfig(**{**CONFIGS[2].__dict__, "seed": 12345}), 0)
    with pytest.raises(ValueError, match="DataSection.control_missed_increment"):
        DataSection(control_missed_increment=0.1)


def test_shipped_walk_configs_load_and_fit():
    for name in ("walk_dense", "walk_rkv"):
        cfg = load_config(RunConfig, f"configs/walk/{name}.yaml")
        walk = cfg.data.synthetic
        assert cfg.data.source == "walk" and isinstance(walk, WalkTaskConfig)
        assert cfg.sampling.max_new_tokens >= 1.4 * walk.max_response_tokens
    with pytest.raises(ValueError, match="sampling.max_new_tokens"):
        load_config(RunConfig, "configs/walk/walk_rkv.yaml", ["sampling.max_new_tokens=100"])
