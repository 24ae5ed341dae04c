"""models.shapes.check_shape, and the public boundaries that name a wrongly shaped argument."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.shapes import check_shape
from sparse_rl_jax.kv.state import EvictionRecord, visibility_from_record
from sparse_rl_jax.rl.grpo_loss import LossBatch
from sparse_rl_jax.rl.update_step import Minibatch
from sparse_rl_jax.rollout.sampler import bucket_prompts
from sparse_rl_jax.training.rl_step import check_minibatch


def test_message_names_the_tensor_its_axes_and_both_shapes():
    wanted = r"^logp_old: expected \[B, T\] = \[4, 16\], got \[4, 15\]$"
    with pytest.raises(ValueError, match=wanted):
        check_shape("logp_old", np.zeros((4, 15)), B=4, T=16)
    with pytest.raises(ValueError, match=r"^x: expected \[B\] = \[\*\], got \[2, 3\]$"):
        check_shape("x", np.zeros((2, 3)), B=None)
    with pytest.raises(ValueError, match=r"^m: expected \[L, S\] = \[1\|4, 5\], got \[2, 5\]$"):
        check_shape("m", np.zeros((2, 5)), L={1, 4}, S=5)
    with pytest.raises(ValueError, match=r"^tokens: expected dtype int, got float32$"):
        check_shape("tokens", np.zeros((2, 3), np.float32), dtype=int, B=2, T=3)


def test_accepted_inputs_pass():
    check_shape("absent", None, B=3)  # an optional argument left out
    check_shape("m", np.zeros((4, 5)), L={1, 4}, S=5)
    check_shape("tokens", [[1, 2], [3, 4]], dtype=int, B=2, T=None)  # anything np.asarray takes


def test_checks_run_at_trace_time_under_jit():
    @jax.jit
    def f(x):
        check_shape("x", x, B=3)
        return x

    assert f(jnp.zeros(3)).shape == (3,)
    with pytest.raises(ValueError, match=r"x: expected \[B\] = \[3\], got \[4\]"):
        f(jnp.zeros(4))


def _minibatch(n=4, p=3, m=5):
    mask = jnp.ones((n, m), jnp.int32)
    loss = LossBatch(logp_old_dense=jnp.zeros((n, m)), advantages=jnp.zeros((n,)),
                     loss_mask=mask, is_weights=jnp.ones((n, m)), token_mask=mask,
                     seq_mask=jnp.ones((n,), bool))
    return Minibatch(jnp.zeros((n, p), jnp.int32), jnp.ones((n, p), jnp.int32),
                     jnp.zeros((n, m), jnp.int32), loss)


def test_update_names_the_bad_leaf_of_its_minibatch():
    full = _minibatch()
    check_minibatch(full)
    bad = full._replace(loss=full.loss.replace(seq_mask=jnp.ones((3,), bool)))
    with pytest.raises(ValueError, match=r"full\.loss\.seq_mask: expected \[B\] = \[4\], got \[3"):
        check_minibatch(bad)
    with pytest.raises(ValueError, match=r"full\.prompt_mask: expected \[N, P\] = \[4, 3\]"):
        check_minibatch(full._replace(prompt_mask=jnp.ones((4, 2), jnp.int32)))
    with pytest.raises(ValueError, match=r"record\.evicted_at: expected \[N, L, Hkv, T\] = "
                                         r"\[4, \*, \*, 8\], got \[4, 1, 1, 7\]"):
        check_minibatch(full._replace(record=EvictionRecord(jnp.zeros((4, 1, 1, 7), jnp.int32))))


def test_sampler_and_replay_name_their_arguments():
    with pytest.raises(ValueError, match=r"prompt_mask: expected \[B, P\] = \[2, 4\], got \[2, 3"):
        bucket_prompts(np.ones((2, 4), np.int32), np.ones((2, 3), np.int32), 4)
    with pytest.raises(ValueError, match=r"prompt: expected dtype int, got float32"):
        bucket_prompts(np.ones((2, 4), np.float32), np.ones((2, 4), np.int32), 4)
    with pytest.raises(ValueError, match=r"positions: expected \[B, S\] = \[2, \*\], got \[3, 4\]"):
        visibility_from_record(jnp.zeros((1, 2, 1, 6), jnp.int32), jnp.zeros((3, 4), jnp.int32))
