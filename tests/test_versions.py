"""The jax/flax pairs docs/gpus_tpus.md and pyproject state, checked before flax is imported."""

from __future__ import annotations

import pytest

from models.versions import check_jax_flax


@pytest.mark.parametrize("jax_v, flax_v", [("0.10.2", "0.12.8"), ("0.11.2", "0.12.10"),
                                           ("0.12.0.1", "0.12.10"), ("0.12.0.1", "0.12.12")])
def test_pairs_that_import_pass(jax_v, flax_v):
    check_jax_flax(jax_v, flax_v)


@pytest.mark.parametrize("jax_v, flax_v", [("0.11.2", "0.12.8"), ("0.12.0.1", "0.12.8"),
                                           ("0.12.0.1", "0.12.9")])
def test_new_jax_with_old_flax_names_both_versions_and_the_fix(jax_v, flax_v):
    with pytest.raises(ImportError, match=rf"jax {jax_v} needs flax >= 0.12.10, found flax "
                                          rf"{flax_v}.*pip install 'flax>=0.12.10'"):
        check_jax_flax(jax_v, flax_v)

