"""Property tests of slot selection: window survives, empties go first, temporal order, top-Z."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparse_rl_jax.kv.selection import select_slots

C = 24  # fixed capacity so the jitted selection compiles once per (budget, window, mode)


@functools.lru_cache(maxsize=None)
def _selector(budget: int, window: int, head_mode: str):
    return jax.jit(
        functools.partial(select_slots, budget=budget, window=window, head_mode=head_mode)
    )


@st.composite
def cases(draw):
    window = draw(st.integers(1, 6))
    budget = draw(st.integers(window + 1, 16))
    index = draw(st.integers(window, C))
    seed = draw(st.integers(0, 2**31 - 1))
    left_pad = draw(st.booleans())
    rng = np.random.default_rng(seed)
    b, h = 2, 3
    live = np.arange(C) < index
    if left_pad:  # per-row left padding, identical over heads
        pads = rng.integers(0, index + 1, size=b)
        valid = (np.arange(C)[None, None, :] >= pads[:, None, None]) & live
        valid = np.broadcast_to(valid, (b, h, C)).copy()
    else:  # arbitrary holes per head (after per-head evictions)
        valid = (rng.random((b, h, C)) < draw(st.floats(0.0, 1.0))) & live
    pos = np.where(valid, np.cumsum(valid, axis=-1) - 1, -1).astype(np.int32)
    # coarse scores so ties happen; -inf on window/empty like slot_scores
    z = rng.integers(-3, 4, size=(b, h, C)).astype(np.float32)
    z[..., index - window :] = -np.inf
    z[~valid] = -np.inf
    return z, pos, index, budget, window


def _check_row(kept, z, valid, index, window, budget):
    """Invariants for one row/head: kept slot ids ``kept [budget]``."""
    kept = list(kept)
    assert len(set(kept)) == budget
    win = list(range(index - window, index))
    assert kept[-window:] == win, "window must survive, last, in order"
    live = [s for s in kept if s < index]
    assert live == sorted(live), "temporal order"
    assert all(s >= index for s in kept[: len(kept) - len(live)]), "fillers beyond index go first"
    non_window = [s for s in range(index - window) if valid[s]]
    evicted = [s for s in non_window if s not in kept]
    kept_empty = [s for s in kept if not valid[s] and s not in win]
    assert not (evicted and kept_empty), "an empty slot survived while a valid token was evicted"
    kept_valid = [s for s in non_window if s in kept]
    if evicted and kept_valid:
        assert min(z[s] for s in kept_valid) >= max(z[s] for s in evicted), "top by Z"


@settings(max_examples=30, deadline=None)
@given(cases())
def test_per_head_selection_invariants(case):
    z, pos, index, budget, window = case
    kept = np.asarray(_selector(budget, window, "per_head")(z, pos, np.int32(index)))
    assert kept.shape == (2, 3, budget) and kept.dtype == np.int32
    for b in range(2):
        for h in range(3):
            _check_row(kept[b, h], z[b, h], pos[b, h] >= 0, index, window, budget)


@settings(max_examples=30, deadline=None)
@given(cases())
def test_shared_selection_invariants(case):
    z, pos, index, budget, window = case
    kept = np.asarray(_selector(budget, window, "shared")(z, pos, np.int32(index)))
    assert kept.shape == (2, 3, budget)
    for b in range(2):
        assert all((kept[b, h] == kept[b, 0]).all() for h in range(3)), "one set per row"
        valid = (pos[b] >= 0).any(axis=0)
        total = np.where(pos[b] >= 0, z[b], 0.0).sum(axis=0)  # rank the sum of Z over heads
        _check_row(kept[b, 0], total, valid, index, window, budget)


def test_rejects_bad_sizes():
    z = np.zeros((1, 1, 8), np.float32)
    pos = np.zeros((1, 1, 8), np.int32)
    with pytest.raises(ValueError, match="window < budget <= capacity"):
        select_slots(z, pos, np.int32(8), budget=9, window=2)
    with pytest.raises(ValueError, match="head_mode"):
        select_slots(z, pos, np.int32(8), budget=4, window=2, head_mode="all")
