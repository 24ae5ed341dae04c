"""The jax/flax pairs docs/gpus_tpus.md and pyproject state, checked before flax is imported."""

from __future__ import annotations

import pytest

from models.versions import check_jax_flax


@pytest.mark.parametrize("jax_v, flax_v", [("0.10.2", "0.12.8"), ("0.11.2", "0.12.10"),
                                           ("0.11.2", "0.13.0")])
def test_pairs_that_import_pass(jax_v, flax_v):
    check_jax_flax(jax_v, flax_v)


def test_jax_011_with_old_flax_names_both_versions_and_the_fix():
    with pytest.raises(ImportError, match=r"jax 0.11.2 needs flax >= 0.12.10, found flax 0.12.8"
                                          r".*pip install 'flax>=0.12.10'"):
        check_jax_flax("0.11.2", "0.12.8")

