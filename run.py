#!/usr/bin/env python
"""``python run.py ...`` from a checkout: the ``sparse-rl`` command line, :mod:`sparse_rl_jax.cli`
(``python run.py --help`` lists the commands)."""

import sys

from sparse_rl_jax.cli import main

if __name__ == "__main__":
    sys.exit(main())
