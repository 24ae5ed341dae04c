"""Stage 0, used by every other stage: config checks, config file I/O and masked array math.

Imports nothing else from ``sparse_rl_jax``.
"""
