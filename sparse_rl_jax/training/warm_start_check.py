"""The warm start's held-out check: teacher-forced accuracy of a policy on problems it never
trained on, cheap enough to run every few dozen steps (one forward over a fixed batch).

``solutions`` is the share of problems whose every solution token (and the EOS) is the
policy's argmax given the true prefix: greedy decoding then writes that solution, so greedy
pass@1 on the same problems is at least this share. ``lookups`` is the accuracy on the
solution characters that copy a prompt fact by its label (``task.lookup_columns``: the shipped
task's digits; chance is 0.1), the skill a policy that ignores its prompt lacks.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import nnx

import models
from sparse_rl_jax.tasks.task import TaskConfig
from sparse_rl_jax.tasks.walk_task import WalkTaskConfig, synthetic_dataset
from sparse_rl_jax.training.supervised import supervised_batch


@dataclasses.dataclass(frozen=True)
class HeldOutScore:
    """Teacher-forced accuracies on the held-out problems (fractions in [0, 1]).

    Attributes:
      solutions: problems whose whole solution (+ EOS) is argmax under teacher forcing.
      tokens: solution tokens (+ EOS) that are the argmax.
      lookups: looked-up characters that are the argmax (None: the task has none).
    """

    solutions: float
    tokens: float
    lookups: float | None

    def summary(self) -> str:
        """``solutions S, tokens T, looked-up digits L`` on one line."""
        lookups = "" if self.lookups is None else f", looked-up digits {self.lookups:.3f}"
        return f"solutions {self.solutions:.3f}, tokens {self.tokens:.3f}{lookups}"


@nnx.jit
def _argmax_next(model, tokens_BxT, attention_BxT):
    """The policy's argmax next token at every position: ``[B, T-1]``."""
    return jnp.argmax(model(tokens_BxT, attention_mask=attention_BxT).logits[:, :-1], -1)


class HeldOutCheck:
    """A fixed held-out batch of task problems; calling it on a model scores the model.

    Args:
      tokenizer: the task's ``models.Tokenizer`` (one token per character).
      held_out: the task config the problems are drawn from (the training task with its own
        seed); its ``lookup_columns`` marks the looked-up characters.
      size: number of problems (the first ``size`` of ``held_out``'s stream).
      width: pad every row to this many tokens (one compiled forward for the whole run).
    """

    def __init__(self, tokenizer: models.Tokenizer, held_out: TaskConfig | WalkTaskConfig,
                 size: int, width: int):
        problems = synthetic_dataset(held_out, size)[:]
        tokens, attention, loss_mask = supervised_batch(tokenizer, problems,
                                                        tokenizer.eos_ids[0])
        pad = ((0, 0), (0, max(0, width - tokens.shape[1])))
        self.tokens, self.attention = np.pad(tokens, pad), np.pad(attention, pad)
        self.targets_BxT = self.tokens[:, 1:]
        self.scored_BxT = np.pad(loss_mask, pad)[:, :-1] > 0
        self.lookup_BxT = np.zeros_like(self.scored_BxT)
        for i, problem in enumerate(problems):
            first = int(np.argmax(self.scored_BxT[i]))  # predicts the solution's first token
            self.lookup_BxT[i, [first + c for c in held_out.lookup_columns(problem)]] = True

    def __call__(self, model) -> HeldOutScore:
        """Scores ``model`` (a ``models.Decoder``) on the held-out batch."""
        right_BxT = np.asarray(_argmax_next(model, self.tokens, self.attention)) == \
            self.targets_BxT
        solved_B = (right_BxT | ~self.scored_BxT).all(axis=1)
        lookups = float(right_BxT[self.lookup_BxT].mean()) if self.lookup_BxT.any() else None
        return HeldOutScore(solutions=float(solved_B.mean()),
                            tokens=float(right_BxT[self.scored_BxT].mean()), lookups=lookups)
