"""What a run leaves on disk: checkpoints, the run directory, metrics, progress lines and plots.

Imports ``core`` only.
"""
