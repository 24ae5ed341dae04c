"""Sampling and scoring: token sampling, the rollout sampler (prefill + jitted decode over a
compressed KV cache), teacher-forced scoring with the replay of a rollout's sparse context,
and the acceptance statistics between the two.

Imports ``core``, ``kv`` and ``models``.
"""
