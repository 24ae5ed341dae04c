"""The low-ESS guard: says when a correction leaves too few effective samples to learn from.

Each RL step logs ``is_ess`` (Kish's effective sample fraction of the final correction
weights, rejected tokens at 0) and ``kept_token_fraction`` (``rl.corrections``). A step is
*low* when either is below ``correction.min_ess``. After ``correction.low_ess_steps`` low
steps in a row the guard speaks once: one line naming the correction, the window's mean ESS
and kept fraction, and what to try. It stays silent for the rest of that episode; a step that
is not low ends the episode, and the next one may speak again. ``correction.on_low_ess: stop``
makes its word a stop: the trainer commits that step's checkpoint, closes the run and raises
:class:`LowEssStop`, which ``python run.py`` turns into exit status :data:`LOW_ESS_EXIT`.

The guard's settings are not in the config hash and its streak is not checkpointed: a stopped
run resumes (with ``on_low_ess: warn`` or ``min_ess: 0`` to go past the stop), and a resumed
run counts its streak afresh.
"""

from __future__ import annotations

import dataclasses

from sparse_rl_jax.rl.loss_config import CorrectionConfig

LOW_ESS_EXIT = 3
"""``python run.py``'s exit status when the guard stopped the run (``on_low_ess: stop``);
bad input is 2, a finished run 0."""


@dataclasses.dataclass(frozen=True)
class LowEss:
    """What the guard says at the step an episode of low ESS reaches its length.

    Attributes:
      step: that RL step (1-based); the window is ``step - steps + 1 .. step``.
      steps: the window's length (``correction.low_ess_steps``).
      ess, kept: the window's mean ``is_ess`` and ``kept_token_fraction``.
      stop: whether the run stops (``correction.on_low_ess: stop``).
      message: the line to print.
    """

    step: int
    steps: int
    ess: float
    kept: float
    stop: bool
    message: str


class LowEssStop(RuntimeError):
    """The guard stopped the run (``correction.on_low_ess: stop``) after ``said.step``, whose
    checkpoint is committed: the run resumes from it. The message is the guard's line and
    how to go on.

    Attributes:
      said: the guard's word (:class:`LowEss`).
    """

    def __init__(self, said: LowEss):
        super().__init__(
            f"{said.message}. correction.on_low_ess=stop ended the run after step "
            f"{said.step}, its checkpoint saved; to go on, run the same command with "
            "correction.on_low_ess=warn (or correction.min_ess=0): it resumes from there")
        self.said = said


def low_ess_message(cfg: CorrectionConfig, step: int, ess: float, kept: float) -> str:
    """The guard's one line for the window ending at ``step`` (``ess``, ``kept``: its means):
    the correction, the numbers and what to try: a looser rejection band when most tokens
    are rejected, a token-level correction when a sequence-level weight leaves a few
    sequences to carry the update, a lower IS cap when token weights do so."""
    first = step - cfg.low_ess_steps + 1
    if kept < cfg.min_ess:
        cause = ("most tokens are rejected: loosen the rejection band "
                 "(correction.rs_lower / rs_upper)")
    elif cfg.is_level in ("sequence", "geometric"):
        cause = ("a few sequences carry the update: use a token-level correction "
                 "(correction.kind=decoupled_token_is or sparse_rl)")
    else:
        cause = "a few tokens carry the update: lower the IS cap (correction.is_upper)"
    return (f"low ESS: correction.kind={cfg.kind} gave Kish ESS {ess:.3f} and kept tokens "
            f"{kept:.3f} (mean of steps {first}..{step}), below correction.min_ess="
            f"{cfg.min_ess:g} for {cfg.low_ess_steps} RL steps in a row; {cause}, or give "
            "the sampler a larger KV budget")


@dataclasses.dataclass
class EssGuard:
    """The guard's state machine over one run's steps (see the module docstring).

    Attributes:
      cfg: the run's correction (``min_ess``, ``on_low_ess``, ``low_ess_steps``, ``kind``).
      window: ``(is_ess, kept_token_fraction)`` of the current streak's last steps (at most
        ``low_ess_steps``).
      in_a_row: the current streak of low steps.
    """

    cfg: CorrectionConfig
    window: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    in_a_row: int = 0

    def observe(self, step: int, metrics: dict) -> LowEss | None:
        """Feeds RL step ``step``'s (1-based) logged ``metrics``; returns the guard's word
        at the step its episode reaches ``low_ess_steps`` low steps, None otherwise (also
        always with ``min_ess`` 0 or None). A NaN value is not low (the non-finite guard
        owns such steps)."""
        floor = self.cfg.min_ess
        if not floor:
            return None
        ess, kept = float(metrics["is_ess"]), float(metrics["kept_token_fraction"])
        if not (ess < floor or kept < floor):
            self.window, self.in_a_row = [], 0
            return None
        self.window = [*self.window, (ess, kept)][-self.cfg.low_ess_steps:]
        self.in_a_row += 1
        if self.in_a_row != self.cfg.low_ess_steps:
            return None
        mean_ess = sum(e for e, _ in self.window) / len(self.window)
        mean_kept = sum(k for _, k in self.window) / len(self.window)
        return LowEss(step, self.cfg.low_ess_steps, mean_ess, mean_kept,
                      self.cfg.on_low_ess == "stop",
                      low_ess_message(self.cfg, step, mean_ess, mean_kept))
