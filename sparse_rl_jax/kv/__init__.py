"""The KV cache budget: compression config, eviction scores and selection, the eviction state
of a rollout, page sparsity (Sparrow's schedule) and its cost model.

Imports ``core`` and ``models`` only.
"""
