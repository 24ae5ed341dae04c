"""Configuration of rollout sampling: decoding rule, lengths and group size."""

from __future__ import annotations

import dataclasses

from sparse_rl_jax.core.config_checks import (check, check_bool, check_choice, check_int,
                                              check_number, is_int)

ENGINES: tuple[str, ...] = ("static", "continuous")


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How tokens are drawn during a rollout.

    Attributes:
      max_new_tokens: response length limit ``M`` (static: sets the decode buffer shapes).
      temperature: softmax temperature (> 0); training rollouts use 1.0.
      top_p: nucleus mass in (0, 1]; 1.0 disables it.
      top_k: keep the k most likely tokens; 0 disables it.
      greedy: take the argmax (temperature/top-p/top-k then only affect nothing but the
        recorded log-prob, which is always under the temperature-scaled distribution).
      num_samples: samples per prompt (the GRPO group size); the prompt is prefilled once.
      eos_ids: token ids that end a response (the EOS token is part of the response).
      pad_id: id written after a response ended.
      prompt_bucket: prompt lengths are left-padded up to a multiple of this, so calls with
        similar prompt lengths reuse one compiled program. A training run and an evaluation
        pad every batch to one width, its data's longest prompt rounded up to a
        multiple of this (``SamplingConfig.one_width``): step 1 compiles the only program set.
      record_evictions: keep the rollout's replay record (``Rollout.record``: the int32
        ``[N, L, Hkv, P + M]`` eviction times of the evicting methods, the ``[N, L, Hkv, M, K]``
        selected pages of ``sparrow``) that lets ``score`` replay the sparse context exactly.
        Off, ``Rollout.record`` is None, which saves its memory (about 2 GB for a 28-layer,
        4-KV-head model at 1024 x 4.7k tokens); ``none`` has no record either way. None (the default) means "as needed": a run resolves it from
        what reads the record (``policy.resolve_sampling``: the ``shadow_mask`` learner, or
        ``sparrow``'s acceptance metric); the sampler alone, which cannot know, treats None
        as off. Pass True to replay a rollout yourself, or, with ``compression.quant`` on an
        evicting method or ``sparrow``, to log the mismatch split by source
        (``training.mismatch_sources``: ``mismatch_k3_from_quant``, ``_from_eviction``).
      engine: ``static`` (``sampler.generate``: one batch decoded until its longest row
        ends) or ``continuous`` (``engine.generate_continuous``: ``slots`` decode slots
        refilled as rows end; row for row the same rollout for the same key).
      slots: decode slots ``S`` of the continuous engine; 0 = sized by the memory plan
        where the device reports a memory limit (``memory_plan.engine_sizes``), else one per
        row of the call.
      chunk: decode steps per jitted chunk ``c`` of the continuous engine (between chunks
        the host retires finished rows and refills their slots); a chunk also ends early
        once an insert's worth of slots is free while rows are queued.
      insert_prompts: prompts the continuous engine prefills per insert call (each prompt
        once, fanned out to its ``num_samples`` rows, as the static prefill); 0 = enough
        prompts for a quarter of the slots.
      pool_pages: KV pages of the continuous engine's shared page pool for the rows of
        the paged layout (``none``, ``sparrow``), ``compression.page_size`` positions each: a
        row draws pages as it fills them and a retired row's pages go back, so the pool
        holds the resident tokens, not ``slots * max_len``. 0 = sized by the memory plan
        where the device reports a limit (``memory_plan.engine_sizes``), else one
        max-length row per slot (``slots * ceil((P + max_new_tokens) / page_size)``). A
        pool must hold one max-length row (``ceil((P + max_new_tokens) / page_size)``
        pages, ``P`` the bucketed prompt width): smaller is an error naming the smallest.
    """

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False
    num_samples: int = 1
    eos_ids: tuple[int, ...] = ()
    pad_id: int = 0
    prompt_bucket: int = 32
    record_evictions: bool | None = None
    engine: str = "static"
    slots: int = 0
    chunk: int = 16
    pool_pages: int = 0
    insert_prompts: int = 0

    def __post_init__(self):
        check_int(self, "max_new_tokens", 1)
        check_number(self, "temperature", gt=0, rule="must be > 0 (use greedy=True for argmax)")
        check_number(self, "top_p", gt=0, le=1)
        check_int(self, "top_k", 0, "must be an int >= 0 (0 disables it)")
        check_int(self, "num_samples", 1)
        check_int(self, "pad_id", 0)
        check_int(self, "prompt_bucket", 1)
        check_bool(self, "record_evictions", optional=True)
        check_choice(self, "engine", ENGINES)
        check_int(self, "slots", 0, "must be an int >= 1 (the smallest that holds one row), "
                  "or 0 for one slot per row")
        check_int(self, "chunk", 1, "must be an int >= 1 (the smallest that decodes a row)")
        check_int(self, "pool_pages", 0, "must be an int >= 1 (pages of one max-length row at "
                  "least), or 0 for one max-length row per slot")
        check_int(self, "insert_prompts", 0, "must be an int >= 1 (the smallest that inserts "
                  "a prompt), or 0 for a quarter of the slots")
        check(isinstance(self.eos_ids, tuple) and all(is_int(i) and i >= 0 for i in self.eos_ids),
              self, "eos_ids", "must be a tuple of non-negative ints")

    def one_width(self, longest: int) -> "SamplingConfig":
        """This config with ``prompt_bucket`` raised to ``longest`` rounded up to a multiple
        of it: every batch of prompts no longer than ``longest`` tokens then pads to that one
        width (capped at a compressing cache's capacity, ``sampler.bucket_prompts``), so one
        compiled program set serves them all. Applying it again with the same ``longest``
        changes nothing."""
        if not is_int(longest) or longest < 1:
            raise ValueError(f"one_width: longest must be a prompt length >= 1, got {longest!r}")
        return dataclasses.replace(
            self, prompt_bucket=-(-longest // self.prompt_bucket) * self.prompt_bucket)
