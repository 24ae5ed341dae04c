"""The training loop: run config, memory plan, collecting rollout rounds, one RL step, the
warm start, evaluation, the pre-run checks and the trainer.

The top of the import graph: may import every other stage.
"""
