"""Checkpointer: round trip, keep-last-N, resume, atomicity under SIGKILL, errors, sharding."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sparse_rl_jax.records.checkpoint import Checkpointer, CheckpointError

REPO = Path(__file__).resolve().parents[1]


def _train_state(seed: int) -> dict:
    """params + adam state after one real update + typed keys of two impls + step."""
    k = jax.random.key(seed)
    params = {
        "w": jax.random.normal(jax.random.fold_in(k, 1), (3, 4)),
        "b": jax.random.normal(jax.random.fold_in(k, 2), (4,)),
    }
    tx = optax.adam(1e-2)
    opt = tx.init(params)
    grads = jax.tree.map(lambda p: jnp.sin(p) + 0.5, params)
    updates, opt = tx.update(grads, opt, params)
    return {
        "params": optax.apply_updates(params, updates),
        "opt": opt,
        "rng": jax.random.split(jax.random.fold_in(k, 3))[1],
        "rbg": jax.random.key(seed, impl="rbg"),
        "step": jnp.asarray(seed, jnp.int32),
    }


def _host(tree) -> dict:
    """Plain numpy copy (typed keys as key_data), keyed by leaf path."""

    def leaf(x):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.array(x)

    flat = jax.tree_util.tree_flatten_with_path(jax.tree.map(leaf, tree))[0]
    return {jax.tree_util.keystr(p): v for p, v in flat}


def _assert_same(a, b) -> None:
    ha, hb = _host(a), _host(b)
    assert ha.keys() == hb.keys()
    for name in ha:
        np.testing.assert_array_equal(ha[name], hb[name], err_msg=name)
        assert ha[name].dtype == hb[name].dtype, name


def _abstract(seed: int = 0):
    return jax.eval_shape(lambda: _train_state(seed))


def _step_dirs(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.is_dir())


def test_round_trip_params_adam_keys_meta(tmp_path):
    state = _train_state(7)
    expected = _host(state)
    meta = {"data_position": 17, "config_hash": "abc123", "epoch": 0}
    with Checkpointer(tmp_path, keep=2) as ckpt:
        assert ckpt.save(5, state, meta)
        for leaf in jax.tree.leaves(state):  # async save must not need the buffers any more
            leaf.delete()
        ckpt.wait()

    with Checkpointer(tmp_path, read_only=True) as ckpt:
        assert ckpt.latest_step() == 5
        assert ckpt.read_meta() == meta
        restored, restored_meta = ckpt.restore(_abstract())
    assert restored_meta == meta
    got = _host(restored)
    assert got.keys() == expected.keys()
    for name, value in got.items():
        np.testing.assert_array_equal(value, expected[name], err_msg=name)
        assert value.dtype == expected[name].dtype, name
    assert isinstance(restored["opt"][0], optax.ScaleByAdamState)
    assert restored["rng"].dtype == jax.random.key(0).dtype
    assert restored["rbg"].dtype == jax.random.key(0, impl="rbg").dtype
    # The restored key drives the same random stream as the original one.
    fresh = _train_state(7)
    np.testing.assert_array_equal(
        jax.random.uniform(restored["rng"], (5,)), jax.random.uniform(fresh["rng"], (5,))
    )
    # The restored optimizer state continues training exactly like the original.
    tx = optax.adam(1e-2)
    grads = jax.tree.map(jnp.cos, fresh["params"])
    want, _ = tx.update(grads, fresh["opt"], fresh["params"])
    got, _ = tx.update(grads, restored["opt"], restored["params"])
    jax.tree.map(np.testing.assert_array_equal, got, want)


def test_keep_last_n_and_save_every(tmp_path):
    with Checkpointer(tmp_path, keep=2, save_every=3) as ckpt:
        saved = [step for step in range(1, 11) if ckpt.save(step, _train_state(step), {"s": step})]
        assert saved == [3, 6, 9]
        assert ckpt.save(10, _train_state(10), {"s": 10}, force=True)
        ckpt.wait()
        assert ckpt.all_steps() == [9, 10]
    assert _step_dirs(tmp_path) == ["10", "9"]


def test_resume_picks_latest(tmp_path):
    with Checkpointer(tmp_path, keep=5) as ckpt:
        for step in (2, 4):
            ckpt.save(step, _train_state(step), {"data_position": step * 10})
    with Checkpointer(tmp_path, keep=5) as ckpt:
        assert ckpt.latest_step() == 4
        state, meta = ckpt.restore(_abstract())
        older, older_meta = ckpt.restore(_abstract(), step=2)
    _assert_same(state, _train_state(4))
    assert meta == {"data_position": 40}
    _assert_same(older, _train_state(2))
    assert older_meta == {"data_position": 20}


def test_save_refuses_old_steps_and_bad_meta_before_writing(tmp_path):
    with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(TypeError, match=r"meta\['pos'\]"):
            ckpt.save(1, _train_state(1), {"pos": object()})
        assert _step_dirs(tmp_path) == []
        ckpt.save(3, _train_state(3), {})
        ckpt.wait()
        with pytest.raises(CheckpointError, match="already holds step 3"):
            ckpt.save(2, _train_state(2), {})
        with pytest.raises(ValueError, match="step"):
            ckpt.save(-1, _train_state(2), {})
    assert _step_dirs(tmp_path) == ["3"]
    with pytest.raises(ValueError, match="keep"):
        Checkpointer(tmp_path, keep=0)
    with pytest.raises(ValueError, match="save_every"):
        Checkpointer(tmp_path, save_every=0)


_KILLED_SAVE = textwrap.dedent(
    """
    import sys, time
    import jax, jax.numpy as jnp
    from orbax.checkpoint._src.path import async_path
    from sparse_rl_jax.records.checkpoint import Checkpointer

    ckpt = Checkpointer(sys.argv[1], keep=3)
    ckpt.save(1, {"w": jnp.full((256, 256), 1.0), "rng": jax.random.key(1)}, {"step": 1})
    ckpt.wait()

    async def rename_then_hang(src, dst):  # the commit point of an orbax save
        print("COMMITTING", src, flush=True)
        time.sleep(600)

    async_path.rename = rename_then_hang
    ckpt.save(2, {"w": jnp.full((256, 256), 2.0), "rng": jax.random.key(2)}, {"step": 2})
    ckpt.wait()
    """
)


def test_kill_during_save_keeps_previous_checkpoint(tmp_path):
    """SIGKILL after every byte of step 2 is written but before orbax commits it."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_SAVE, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"},
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("COMMITTING"), line
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    leftovers = [name for name in _step_dirs(tmp_path) if name != "1"]
    assert len(leftovers) == 1 and leftovers[0].startswith("2.") and "tmp" in leftovers[0]
    assert any((tmp_path / leftovers[0]).rglob("*"))  # the partial save really wrote files

    target = {
        "w": jax.ShapeDtypeStruct((256, 256), jnp.float32),
        "rng": jax.eval_shape(lambda: jax.random.key(0)),
    }
    with Checkpointer(tmp_path, read_only=True) as ckpt:
        assert ckpt.all_steps() == [1]
        assert ckpt.latest_step() == 1
        state, meta = ckpt.restore(target)
    np.testing.assert_array_equal(state["w"], np.ones((256, 256), np.float32))
    np.testing.assert_array_equal(
        jax.random.key_data(state["rng"]), jax.random.key_data(jax.random.key(1))
    )
    assert meta == {"step": 1}

    # A writable Checkpointer clears the unfinished directory and step 2 can be saved again.
    with Checkpointer(tmp_path, keep=3) as ckpt:
        ckpt.save(2, {"w": jnp.full((256, 256), 2.0), "rng": jax.random.key(2)}, {"step": 2})
        ckpt.wait()
        state, meta = ckpt.restore(target)
    assert _step_dirs(tmp_path) == ["1", "2"]
    np.testing.assert_array_equal(state["w"], np.full((256, 256), 2.0, np.float32))
    assert meta == {"step": 2}


def test_mismatched_target_errors_name_the_leaf(tmp_path):
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, _train_state(1), {})
        ckpt.wait()
        good = _abstract()

        extra = {**good, "ema": good["params"]}
        with pytest.raises(CheckpointError, match=r"not in the checkpoint: \['ema/b', 'ema/w'\]"):
            ckpt.restore(extra)

        missing = {k: v for k, v in good.items() if k != "step"}
        with pytest.raises(CheckpointError, match=r"not in the target: \['step'\]"):
            ckpt.restore(missing)

        wide_w = jax.ShapeDtypeStruct((4, 4), jnp.float32)
        wrong_shape = {**good, "params": {**good["params"], "w": wide_w}}
        shape_msg = r"'params/w' has shape \(3, 4\) in the checkpoint but \(4, 4\) in the target"
        with pytest.raises(CheckpointError, match=shape_msg):
            ckpt.restore(wrong_shape)

        raw_key = {**good, "rng": jax.ShapeDtypeStruct((2,), jnp.uint32)}
        with pytest.raises(CheckpointError, match="'rng' was saved as a typed PRNG key"):
            ckpt.restore(raw_key)

        other_impl = {**good, "rbg": jax.eval_shape(lambda: jax.random.key(0))}
        with pytest.raises(CheckpointError, match="'rbg' was saved with PRNG impl 'rbg'"):
            ckpt.restore(other_impl)

        with pytest.raises(CheckpointError, match=r"step 9 not found .* available steps: \[1\]"):
            ckpt.restore(good, step=9)


# Reading a corrupt file fails one tensorstore read while others are in flight; orbax closes its
# event loop and a late tensorstore callback may then hit the closed loop (harmless, timing
# dependent, inside orbax).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_missing_and_corrupt_checkpoints(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        Checkpointer(tmp_path / "nowhere", read_only=True)
    with Checkpointer(tmp_path / "empty") as ckpt:
        with pytest.raises(CheckpointError, match="no checkpoint found"):
            ckpt.restore(_abstract())

    directory = tmp_path / "run"
    with Checkpointer(directory) as ckpt:
        ckpt.save(1, _train_state(1), {"x": 1})
    for path in (directory / "1" / "state").rglob("*"):
        if path.is_file() and "ocdbt" in str(path):
            path.write_bytes(b"garbage")
    with Checkpointer(directory, read_only=True) as ckpt:
        with pytest.raises(CheckpointError, match=r"checkpoint step 1 in .*run"):
            ckpt.restore(_abstract())

    (directory / "1" / "meta" / "metadata").unlink()
    with Checkpointer(directory, read_only=True) as ckpt:
        with pytest.raises(CheckpointError, match="cannot read 'meta'"):
            ckpt.read_meta()


_SHARDED = textwrap.dedent(
    """
    import sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from sparse_rl_jax.records.checkpoint import Checkpointer

    assert jax.device_count() == 2
    mesh = jax.make_mesh((2,), ("data",))
    w = np.arange(24, dtype=np.float32).reshape(4, 6)
    keys = jax.random.split(jax.random.key(5), 4)
    with Checkpointer(sys.argv[1]) as ckpt:  # saved from one device
        ckpt.save(1, {"w": jnp.asarray(w), "keys": keys}, {"k": "v"})
        ckpt.wait()
        row = NamedSharding(mesh, P("data"))
        target = {
            "w": jax.ShapeDtypeStruct((4, 6), jnp.float32, sharding=row),
            "keys": jax.ShapeDtypeStruct(keys.shape, keys.dtype, sharding=row),
        }
        state, meta = ckpt.restore(target)
    assert meta == {"k": "v"}
    for name in ("w", "keys"):
        assert state[name].sharding == row, (name, state[name].sharding)
        assert [s.data.shape[0] for s in state[name].addressable_shards] == [2, 2]
    np.testing.assert_array_equal(np.asarray(state["w"]), w)
    np.testing.assert_array_equal(jax.random.key_data(state["keys"]), jax.random.key_data(keys))
    # The shards hold the right rows: device 1 has rows 2..3.
    shard = [s for s in state["w"].addressable_shards if s.index[0].start == 2][0]
    np.testing.assert_array_equal(np.asarray(shard.data), w[2:])
    print("SHARDED_OK")
    """
)


def test_sharded_restore_on_two_devices(tmp_path):
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "JAX_PLATFORMS": "cpu",
        # appended, so the child keeps conftest's fast-compile flag
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")
        + " --xla_force_host_platform_device_count=2",
    }
    result = subprocess.run(
        [sys.executable, "-c", _SHARDED, str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "SHARDED_OK" in result.stdout


def test_read_only_open_logs_no_read_only_notice(tmp_path, caplog):
    with Checkpointer(tmp_path, keep=1) as ckpt:
        ckpt.save(1, {"w": jnp.ones(3)}, {"data_position": 1})
        ckpt.wait()
    import logging

    with caplog.at_level(logging.INFO):
        with Checkpointer(tmp_path, read_only=True) as ckpt:
            assert ckpt.latest_step() == 1
    assert not [r for r in caplog.records if "read only" in r.getMessage()]
    # orbax does emit it without the filter (so the assertion above can fail)
    import orbax.checkpoint as ocp

    caplog.clear()
    with caplog.at_level(logging.INFO):
        ocp.CheckpointManager(tmp_path, options=ocp.CheckpointManagerOptions(
            read_only=True, save_interval_steps=0, create=False)).close()
    assert [r for r in caplog.records if "read only" in r.getMessage()]
