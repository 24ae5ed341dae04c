"""Positive control for collapse experiments: the anomaly of a bad eviction, without eviction.

With ``data.control_missed_increment: q`` (walk task only) exactly ``round(q N)`` of every
rollout round's ``N`` sampled sequences are replaced, after sampling and before rewards and
dense scoring, by the walk's trace with the visit counter silently not incremented at the
first visit, which is what a policy that lost ``c`` or ``h`` from its KV cache at that point
would write: the walk then halts one visit (10 steps) late with a wrong step count, or runs
to ``sampling.max_new_tokens`` without halting. The rows are drawn by a PRNG of
``(trainer.seed, prompt batch position)``, so a resumed run injects into the same rows.

The replaced tokens get sampler log-prob 0 (the corrupted sampler was certain of them) and
are then scored by the dense policy like every other row, so the learner sees confident
off-policy tokens with a reward of 0, as after a bad eviction; the rollout's record and
KV statistics of those rows are left as they were (``shadow_mask`` cannot replay them, and a run
rejects that combination). If naive training survives this control, collapse from bad
evictions is not observable at that scale.
"""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np

from sparse_rl_jax.tasks.walk_task import FACTS, render_walk

_CONTROL_STREAM = 0x5EED_C0DE  # keeps the control's draws apart from every other PRNG use


def control_rows(seed: int, position: int, num_rows: int, rate: float) -> np.ndarray:
    """Which of a round's ``num_rows`` sequences get the anomaly: ``[num_rows]`` bool with
    exactly ``round(rate * num_rows)`` True, drawn from ``(seed, position)`` alone."""
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"control rate {rate} must lie in [0, 1]")
    chosen = np.random.default_rng([seed, position, _CONTROL_STREAM]).permutation(num_rows)
    rows = np.zeros(num_rows, bool)
    rows[chosen[: int(round(rate * num_rows))]] = True
    return rows


def missed_increment_trace(prompt: str, echo_every: int = 0) -> str:
    """The walk's solution for ``prompt`` (a walk-task prompt, ``echo_every`` its task's
    knob) when the first visit to ``h`` is not counted: every count from the first visit on
    is one lower, so the walk goes on to the next visit (10 steps) and answers that step.

    Raises:
      ValueError: ``prompt`` is not a walk-task prompt (facts ``L=d``, then `` ?``).
    """
    values = {label: int(digit) for label, digit in re.findall(r"([A-Za-z])=(\d)", prompt)}
    if not prompt.endswith(" ?") or any(name not in values for name in FACTS):
        raise ValueError(f"not a walk-task prompt (facts {FACTS} then ' ?'): {prompt!r}")
    k, h, c, x = (values[name] for name in FACTS)
    correct = render_walk(k, h, c, x, [], list(range(len(FACTS))), echo_every)
    groups = [g if g[0] == "h" else g[:3] + str(max(0, int(g[3]) - 1))
              for g in correct.solution.split(" ")[:-1]]
    step, x = int(correct.answer), int(groups[-1][2])
    while True:  # the walk from its (missed) halt to the next visit, where the count hits c
        if echo_every and step % echo_every == 0:
            groups.append(f"h{h}c{c}")
        step, x = step + 1, (x + k) % 10
        groups.append(f"{step:02d}{x}{c - 1 + (x == h)}")
        if x == h:
            return " ".join(groups) + f" #{step}"


def inject_missed_increment(rollout, rows: np.ndarray, prompts: list[str], tokenizer,
                            eos_id: int, pad_id: int, echo_every: int = 0):
    """``rollout`` (a ``sampler.Rollout``, ``N`` rows, ``M`` response slots) with the rows
    where ``rows`` ``[N]`` is True replaced by ``missed_increment_trace`` of their prompt
    (``prompts[i]`` the text of row ``i``), + EOS, cut at ``M`` tokens (then unfinished):
    new ``response``, ``response_mask``, ``logp`` (0 on the new tokens) and ``finished``."""
    response = np.array(rollout.response)
    mask = np.array(rollout.response_mask)
    logp = np.array(rollout.logp)
    finished = np.array(rollout.finished)
    width = response.shape[1]
    for i in np.flatnonzero(rows):
        ids = tokenizer.hf(missed_increment_trace(prompts[i], echo_every),
                           add_special_tokens=False)["input_ids"] + [eos_id]
        ids = ids[:width]
        response[i], mask[i], logp[i] = pad_id, 0, 0.0
        response[i, : len(ids)], mask[i, : len(ids)] = ids, 1
        finished[i] = ids[-1] == eos_id
    return rollout._replace(response=jnp.asarray(response), response_mask=jnp.asarray(mask),
                            logp=jnp.asarray(logp), finished=jnp.asarray(finished))
