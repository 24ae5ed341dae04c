"""A training run's inputs, each checked before the run directory is written (policy,
tokenizer, prompts, eval set), and the one prompt width they need.

Every batch of a run, training and eval, pads its prompts to one width: the longest prompt
the run can roll out, rounded up to ``sampling.prompt_bucket``. Step 1 then compiles the only
program set, and no batch compiles another mid-run. (The alternative, compiling one program
set per bucket the data reaches before step 1, cost the default run a second full compile,
88 s on a loaded 2-core machine, for a bucket its first 600 steps never reach; padding the
rare narrower batch costs about 1 s once.)
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

from sparse_rl_jax.rollout.sampling_config import SamplingConfig
from sparse_rl_jax.tasks.prompt_source import PromptSource
from sparse_rl_jax.training.policy import policy_path, resolve_sampling
from sparse_rl_jax.training.preflight import (checked_eval_set, checked_prompt_source,
                                              load_checked_policy)
from sparse_rl_jax.training.run_config import RunConfig


class Prepared(NamedTuple):
    """A run's inputs, each checked (:func:`prepare`).

    Attributes:
      tokenizer: ``models.Tokenizer``; model: the policy (``models.Decoder``).
      source: the training prompts (``preflight.checked_prompt_source``).
      eval_data: ``(prompts, answers)`` evaluated during training, or None.
      longest_prompt: tokens of the longest prompt the run can roll out (training and eval).
    """

    tokenizer: Any
    model: Any
    source: PromptSource
    eval_data: tuple[list[str], list[str]] | None
    longest_prompt: int


def prepare(cfg: RunConfig, mesh, log: Callable[[str], None]) -> Prepared:
    """The run's :class:`Prepared` inputs with everything checked; the default model is
    built (in the run directory, so after ``trainer._preflight_default``) when ``model.path``
    is None."""
    tokenizer, model = load_checked_policy(policy_path(cfg, log), cfg, mesh)
    context = model.config.max_position_embeddings
    source, longest = checked_prompt_source(cfg, tokenizer, context)
    eval_data, longest_eval = checked_eval_set(cfg, tokenizer, context)
    return Prepared(tokenizer, model, source, eval_data, max(longest, longest_eval))


def run_sampling(cfg: RunConfig, tokenizer, longest_prompt: int) -> SamplingConfig:
    """The run's sampling settings (``policy.resolve_sampling``) at one prompt width for
    every batch, training and eval: the longest prompt rounded up to
    ``sampling.prompt_bucket`` (``SamplingConfig.one_width``). Step 1 then compiles the
    only program set; a batch of shorter prompts pads to it instead of compiling another
    mid-run (the default run: prompts of 17 to 33 tokens, a batch of 32 has a 33-token one
    in 1096 of its first 1100 steps)."""
    return resolve_sampling(cfg, tokenizer).one_width(longest_prompt)


def width_line(cfg: RunConfig, sampling: SamplingConfig, longest_prompt: int) -> str:
    """The progress line naming the run's one prompt width."""
    width, comp = sampling.prompt_bucket, cfg.compression
    capped = ""
    if comp.compresses and comp.capacity < width:
        width, capped = comp.capacity, f", capped at the KV cache's {comp.capacity}"
    return (f"prompt width {width} for every batch: the longest prompt ({longest_prompt} "
            f"tokens) rounded up to sampling.prompt_bucket={cfg.sampling.prompt_bucket}"
            f"{capped}; one program set, compiled in step 1")
