"""The positive control: exactly the requested fraction of rollout rows carries a missed-count
walk trace, the rest is untouched; the injected trace follows the rule with one visit lost."""

from __future__ import annotations

import re

import numpy as np
import pytest

from sparse_rl_jax.tasks.anomaly_control import control_rows, missed_increment_trace
from sparse_rl_jax.tasks.rewards import task_exact_reward
from sparse_rl_jax.tasks.walk_task import WalkTaskConfig, walk_at
from sparse_rl_jax.training.collect_rounds import collect_rollouts
from tiny_rl import G, PROMPTS, step_context, tiny_task_policy


def lost_visit_walk(prompt: str, echo_every: int) -> str:
    """Independent reference: simulate the walk with the first visit not counted."""
    facts = dict(re.findall(r"([A-Za-z])=(\d)", prompt))
    k, h, c, x = (int(facts[n]) for n in "khcx")
    out, counted, seen, step = [], 0, 0, 0
    while True:
        step += 1
        x = (x + k) % 10
        if x == h:
            seen += 1
            counted += seen > 1
        out.append("%02d%d%d" % (step, x, counted))
        if counted == c:
            return " ".join(out) + " #%d" % step
        if echo_every and step % echo_every == 0:
            out.append("h%dc%d" % (h, c))


@pytest.mark.parametrize("rate, n", [(0.03, 100), (0.1, 100), (0.25, 8), (0.1, 37), (0.0, 10),
                                     (1.0, 6)])
def test_exactly_the_requested_fraction_per_prng(rate, n):
    rows = control_rows(3, 7, n, rate)
    assert rows.shape == (n,) and rows.sum() == round(rate * n)
    np.testing.assert_array_equal(rows, control_rows(3, 7, n, rate))  # pure in (seed, position)
    if 0 < rows.sum() < n:
        others = [control_rows(3, p, n, rate) for p in range(8, 14)]
        assert any((o != rows).any() for o in others)
        assert all(o.sum() == rows.sum() for o in others)
    with pytest.raises(ValueError, match="rate"):
        control_rows(0, 0, n, 1.5)


@pytest.mark.parametrize("echo_every", [0, 1, 4])
def test_missed_increment_trace_follows_the_rule_with_a_lost_visit(echo_every):
    cfg = WalkTaskConfig(c_min=1, c_max=9, echo_every=echo_every, seed=5)
    for i in range(60):
        p = walk_at(cfg, i)
        trace = missed_increment_trace(p.prompt, echo_every)
        assert trace == lost_visit_walk(p.prompt, echo_every)
        assert int(trace.rsplit("#", 1)[1]) == int(p.answer) + 10  # one visit (10 steps) late
        assert task_exact_reward([trace], [p.answer]).tolist() == [0.0]
    with pytest.raises(ValueError, match="walk-task prompt"):
        missed_increment_trace("A=1 B=2 ?")


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return tiny_task_policy(tmp_path_factory.mktemp("control"))


def test_collect_injects_into_exactly_the_chosen_rows(policy):
    walk = ["data.source=walk", "data.walk.c_max=1", "data.walk.distractors_min=0",
            "data.walk.distractors_max=0", "compression.method=none"]
    plain, _, _ = collect_rollouts(step_context(policy, *walk), policy[3], position=2)
    ctx = step_context(policy, *walk, "data.control_missed_increment=0.25")
    batch, _, _ = collect_rollouts(ctx, policy[3], position=2)
    rows = control_rows(ctx.cfg.trainer.seed, 2, PROMPTS * G, 0.25)
    assert rows.sum() == 2
    same = np.all(np.asarray(batch.response) == np.asarray(plain.response), axis=1)
    np.testing.assert_array_equal(same, ~rows)
    prompts = [walk_at(ctx.cfg.data.synthetic, 2 * PROMPTS + i // G).prompt
               for i in range(PROMPTS * G)]
    texts = ctx.tokenizer.decode(batch.response, batch.loss_mask)
    width = batch.response.shape[1]
    for i in np.flatnonzero(rows):
        assert texts[i] == missed_increment_trace(prompts[i])[:width]  # cut: never halts here
        assert batch.rewards[i] == 0.0
        assert not np.asarray(batch.logp_sparse)[i].any()
    with pytest.raises(ValueError, match="data.control_missed_increment"):
        step_context(policy, *walk, "data.control_missed_increment=0.25",
                     "correction.kind=shadow_mask")
