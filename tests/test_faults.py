"""The fault matrix (issues 17 and 21): every bad input is one named error line with exit 2
before anything is written; run directories are locked, never overwritten by a refused
resume, and fall back past corrupt checkpoints; a full disk during a save leaves the
committed checkpoints intact; a non-finite update never reaches the params.

Cases call ``run.py``'s ``main`` in-process on a tiny random HF model; none trains, so the
module stays fast. (SIGKILL during training / during a checkpoint save, and resuming a moved
run directory, run the real trainer in tests/test_trainer.py.) The README's reliability
section lists each case with its outcome.
"""

from __future__ import annotations

import json
import os
import pickle
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import models
from sparse_rl_jax.checkpoint import CheckpointError, Checkpointer
from sparse_rl_jax.config_io import load_config
from sparse_rl_jax.run_config import RunConfig
from sparse_rl_jax.run_dir import LOCK, RunDirError, check_resumable, open_run_dir
from sparse_rl_jax.trainer import config_hash
from tiny_hf import make_tiny_hf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import run  # noqa: E402  (run.py at the repository root)

RECORDS = [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(1, 5)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny qwen2 checkpoint (vocab 128, char tokenizer of 102 ids) and a JSONL file."""
    root = tmp_path_factory.mktemp("faults")
    model = make_tiny_hf(root, "qwen2", name="model")
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return root, Path(model), data


def _args(model, data, run_dir):
    return ["train", f"model.path={model}", "data.source=jsonl", f"data.jsonl.path={data}",
            "data.reward=task_exact", "sampling.max_new_tokens=8", "sampling.num_samples=2",
            "sampling.prompt_bucket=8", "compression.budget=16",
            "compression.buffer=4", "compression.window=2", "trainer.steps=1",
            "trainer.prompts_per_step=2", "trainer.minibatch_size=4", f"run_dir={run_dir}"]


def _refused(capsys, argv, *expected: str, prefix: str = "error") -> None:
    """``run.main(argv)`` exits 2 with one ``prefix:`` line on stderr holding ``expected``."""
    assert run.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"{prefix}: "), err
    for text in expected:
        assert text in err[0], err[0]


# -- config and CLI ------------------------------------------------------------------------

@pytest.mark.parametrize("override,expected", [
    ("optim.lr=.inf", "optim.lr: must be a finite number"),
    ("optim.lr=.nan", "optim.lr: must be a finite number"),
    ("sampling.temperature=.inf", "sampling.temperature: must be a finite number"),
    ("warm_start.lr=.inf", "warm_start.lr: must be a finite number"),
    ("optim.eps=-1", "optim.eps=-1.0 must be > 0"),
    ("trainer.seed=-1", "trainer.seed=-1 must be an int >= 0"),
    ("data.shuffle_seed=-1", "data.shuffle_seed=-1 must be an int >= 0"),
    ("eval.task_seed=-1", "eval.task_seed=-1 must be an int >= 0"),
    ("warm_start.seed=-1", "warm_start.seed=-1 must be an int >= 0"),
    ("optim.decay_steps=-1", "optim.decay_steps=-1 must be an int >= 0"),
    ("trainer.max_nonfinite_steps=0", "trainer.max_nonfinite_steps=0 must be an int >= 1"),
    ("run_dir=", "run_dir='' must be a directory path"),
    ("trainer.steps=[1", "override 'trainer.steps=[1': value is not plain YAML"),
    ("trainer.steps=!!python/object/apply:os.system [touch /tmp/x]", "not plain YAML"),
    ("trainer.steps=!foo x", "not plain YAML"),
])
def test_bad_config_or_override_is_one_config_error_line(capsys, override, expected):
    _refused(capsys, ["config", override], expected, prefix="config error")


@pytest.mark.parametrize("base", ["1", "null", "[base.yaml, 1]", "{a: 1}"])
def test_base_that_is_not_paths_is_a_config_error(tmp_path, capsys, base):
    (tmp_path / "base.yaml").write_text("trainer: {steps: 3}\n")
    config = tmp_path / "c.yaml"
    config.write_text(f"base: {base}\n")
    _refused(capsys, ["config", "--config", str(config)], "'base' must be a file path",
             prefix="config error")


def test_non_utf8_config_file_is_a_config_error(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_bytes(b"trainer: {steps: \xff}\n")
    _refused(capsys, ["config", "--config", str(config)], "is not valid YAML",
             prefix="config error")


@pytest.mark.parametrize("extra,expected,prefix", [
    (["mesh.data=2"], f"not fit the {jax.device_count()} device(s)", "config error"),
    (["data.reward=bogus"], "reward fn 'bogus' is not registered", "error"),
    (["--distributed"], "--distributed: cannot initialize (no coordinator found", "error"),
    (["sampling.eos_ids=[2, 128]"], "sampling.eos_ids=(2, 128): ids must be below the "
                                    "model's vocab_size=128", "error"),
    (["sampling.pad_id=999"], "sampling.pad_id=999", "error"),
])
def test_run_level_config_errors_before_any_state(tiny, tmp_path, capsys, extra, expected,
                                                  prefix):
    _, model, data = tiny
    _refused(capsys, _args(model, data, tmp_path / "run") + extra, expected, prefix=prefix)
    assert not (tmp_path / "run").exists()


# -- model and tokenizer directories ------------------------------------------------------

def _break_config(path):
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (path / "config.json").write_text(json.dumps(cfg))


def _rewrite_tensors(path, change):
    tensors = load_file(path / "model.safetensors")
    change(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def _shard(path):
    (path / "model.safetensors").rename(path / "model-00001-of-00002.safetensors")
    weight_map = {name: "model-00001-of-00002.safetensors"
                  for name in load_file(path / "model-00001-of-00002.safetensors")}
    weight_map["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _nan_tensor(t):
    t["model.layers.1.mlp.up_proj.weight"][0, 0] = np.nan


def _drop_tokenizer(path):
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (path / name).unlink(missing_ok=True)


MODEL_FAULTS = {
    "unsupported_model_type": (_break_config, "model_type: unsupported 'gpt2'"),
    "config_not_json": (lambda p: (p / "config.json").write_text("{oops"), "invalid JSON"),
    "empty_safetensors": (lambda p: (p / "model.safetensors").write_bytes(b""),
                          "not a readable safetensors file"),
    "garbage_safetensors": (lambda p: (p / "model.safetensors").write_bytes(os.urandom(4096)),
                            "not a readable safetensors file"),
    "truncated_safetensors": (
        lambda p: (p / "model.safetensors").write_bytes(
            (p / "model.safetensors").read_bytes()[:5000]), "not a readable safetensors file"),
    "wrong_shape": (lambda p: _rewrite_tensors(p, lambda t: t.update(
        {"lm_head.weight": np.zeros((128, 32), np.float32)})),
        "tensor 'lm_head.weight' has wrong shape: expected (128, 64), got (128, 32)"),
    "wrong_dtype": (lambda p: _rewrite_tensors(p, lambda t: t.update(
        {"lm_head.weight": np.zeros((128, 64), np.int32)})),
        "tensor 'lm_head.weight' has dtype I32"),
    "missing_tensor": (lambda p: _rewrite_tensors(p, lambda t: t.pop("lm_head.weight")),
                       "missing tensor 'lm_head.weight'"),
    "missing_shard": (_shard, "lists shard model-00002-of-00002.safetensors, which does not "
                              "exist"),
    "index_not_json": (lambda p: (p / "model.safetensors.index.json").write_text("{"),
                       "model.safetensors.index.json: not a valid safetensors index"),
    "nan_tensor": (lambda p: _rewrite_tensors(p, _nan_tensor),
                   "tensor(s) model.layers.1.mlp.up_proj.weight hold NaN or inf values"),
    "no_tokenizer": (_drop_tokenizer, "no tokenizer in"),
}


@pytest.mark.parametrize("fault", sorted(MODEL_FAULTS))
def test_broken_model_dir_is_one_error_line_before_any_state(tiny, tmp_path, capsys, fault):
    _, model, data = tiny
    broken = tmp_path / "model"
    shutil.copytree(model, broken)
    make_fault, expected = MODEL_FAULTS[fault]
    make_fault(broken)
    _refused(capsys, _args(broken, data, tmp_path / "run"), expected)
    assert not (tmp_path / "run").exists()


def test_tokenizer_larger_than_embedding_names_both_numbers(tiny, tmp_path, capsys):
    _, _, data = tiny
    small = make_tiny_hf(tmp_path, "qwen2", name="small", vocab_size=64)  # tokenizer: 102 ids
    _refused(capsys, _args(small, data, tmp_path / "run"),
             "ids up to 101 (vocabulary of 102", "embedding of 64 rows")
    assert not (tmp_path / "run").exists()


def test_remote_code_and_pickle_are_never_executed_or_read(tiny, tmp_path):
    """auto_map code next to the checkpoint and a pickle pytorch_model.bin stay untouched."""
    _, model, _ = tiny
    target = tmp_path / "model"
    shutil.copytree(model, target)
    sentinel = tmp_path / "executed"
    (target / "evil.py").write_text(f"open({str(sentinel)!r}, 'w').write('code')\n"
                                    "class Evil: pass\n")
    for name, key in (("config.json", "AutoConfig"), ("tokenizer_config.json", "AutoTokenizer")):
        cfg = json.loads((target / name).read_text())
        cfg["auto_map"] = {key: "evil.Evil", "AutoModelForCausalLM": "evil.Evil"}
        (target / name).write_text(json.dumps(cfg))

    class Payload:
        def __reduce__(self):
            return (open, (str(sentinel), "w"))

    (target / "pytorch_model.bin").write_bytes(pickle.dumps(Payload()))
    cfg = load_config(RunConfig, None, [f"model.path={target}"])
    from sparse_rl_jax.preflight import load_checked_policy

    tokenizer, loaded = load_checked_policy(str(target), cfg, models.make_mesh())
    assert loaded.config.vocab_size == 128 and tokenizer.vocab_size == 102
    assert not sentinel.exists()


# -- data ----------------------------------------------------------------------------------

DATA_FAULTS = {
    "malformed_line": (b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": \n', "data.jsonl:2: "
                       "invalid JSON"),
    "missing_field": (b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2="}\n',
                      "data.jsonl:2: missing field(s) ['answer']"),
    "empty_file": (b"", "holds 0 usable records"),
    "non_utf8": (b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "\xff\xfe", "answer": "1"}\n',
                 "data.jsonl:2: invalid JSON"),
    "prompt_longer_than_cache": (
        b'{"prompt": "1+1=", "answer": "2"}\n' + json.dumps(
            {"prompt": "1+" * 20 + "1=", "answer": "21"}).encode() + b"\n",
        "data.jsonl:2: the prompt has 42 tokens, more than the KV cache (compression.budget "
        "+ buffer = 20) holds (20)"),
    "empty_prompt": (b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "", "answer": "0"}\n',
                     "data.jsonl:2: "),
}


@pytest.mark.parametrize("fault", sorted(DATA_FAULTS))
def test_bad_data_names_file_and_line_before_any_state(tiny, tmp_path, capsys, fault):
    _, model, _ = tiny
    content, expected = DATA_FAULTS[fault]
    data = tmp_path / "data.jsonl"
    data.write_bytes(content)
    _refused(capsys, _args(model, data, tmp_path / "run"), expected)
    assert not (tmp_path / "run").exists()


def test_prompt_longer_than_model_context(tiny, tmp_path, capsys):
    _, model, _ = tiny
    data = tmp_path / "data.jsonl"
    long = {"prompt": "1+" * 150 + "1=", "answer": "151"}
    data.write_text(json.dumps(RECORDS[0]) + "\n" + json.dumps(long) + "\n")
    _refused(capsys, _args(model, data, tmp_path / "run") + ["compression.method=none"],
             "data.jsonl:2: the prompt has 302 tokens, more than the model context "
             "(max_position_embeddings) holds (256)")
    assert not (tmp_path / "run").exists()


def test_data_skip_mode_counts_and_goes_on(tiny, tmp_path):
    from sparse_rl_jax.datasets import DatasetConfig, load_jsonl

    data = tmp_path / "data.jsonl"
    data.write_bytes(DATA_FAULTS["non_utf8"][0] + DATA_FAULTS["malformed_line"][0])
    loaded = load_jsonl(DatasetConfig(path=str(data), on_error="skip"))
    assert len(loaded) == 2 and [s.line for s in loaded.skipped] == [2, 4]


# -- run directories -----------------------------------------------------------------------

def _read_only_dir(tmp_path) -> Path:
    """A directory this process cannot write: chmod 555, or (as root, which ignores modes)
    a sysfs directory."""
    if os.geteuid() != 0:
        path = tmp_path / "ro"
        path.mkdir()
        path.chmod(0o555)
        return path
    return Path("/sys/kernel")


@pytest.mark.parametrize("layout,expected", [
    ("file", "is a file, not a directory"),
    ("parent_file", "its parent"),
    ("read_only", "is not writable"),
    ("parent_read_only", "cannot be created"),
    ("foreign_dir", "is a non-empty directory that is not a run directory"),
])
def test_unusable_run_dir_is_one_error_line(tiny, tmp_path, capsys, layout, expected):
    _, model, data = tiny
    if layout == "file":
        run_dir = tmp_path / "f"
        run_dir.write_text("x")
    elif layout == "parent_file":
        (tmp_path / "f").write_text("x")
        run_dir = tmp_path / "f" / "run"
    elif layout == "read_only":
        run_dir = _read_only_dir(tmp_path)
    elif layout == "parent_read_only":
        run_dir = _read_only_dir(tmp_path) / "run"
    else:
        run_dir = tmp_path / "home"
        run_dir.mkdir()
        (run_dir / "notes.txt").write_text("mine")
    _refused(capsys, _args(model, data, run_dir), expected)
    if layout == "foreign_dir":
        assert sorted(p.name for p in run_dir.iterdir()) == ["notes.txt"]


def _existing_run(tiny, tmp_path, overrides=()):
    """A run directory as a run of the base config leaves it (manifest, config.yaml)."""
    _, model, data = tiny
    run_dir = tmp_path / "run"
    cfg = load_config(RunConfig, None, _args(model, data, run_dir)[1:] + list(overrides))
    owner = open_run_dir(run_dir, config_hash(cfg), None)
    owner.write_manifest(4)
    (run_dir / "config.yaml").write_text("the record of the run\n")
    owner.close()
    return run_dir


def _snapshot(run_dir):
    return {p.relative_to(run_dir): p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}


def test_refused_resume_leaves_the_run_dir_untouched(tiny, tmp_path, capsys):
    _, model, data = tiny
    run_dir = _existing_run(tiny, tmp_path)
    before = _snapshot(run_dir)
    _refused(capsys, _args(model, data, run_dir) + ["optim.lr=0.5"],
             "holds a run with a different config")
    assert _snapshot(run_dir) == before


def test_config_hash_ignores_where_the_run_lives_and_how_long(tiny, tmp_path):
    _, model, data = tiny
    base = _args(model, data, tmp_path / "a")[1:]
    same = [load_config(RunConfig, None, base + extra) for extra in
            ([], [f"run_dir={tmp_path / 'moved'}"], ["trainer.steps=9", "eval.samples=3",
                                                      "trainer.checkpoint_every=2"])]
    assert len({config_hash(c) for c in same}) == 1
    different = [load_config(RunConfig, None, base + [extra]) for extra in
                 ("trainer.seed=1", "optim.lr=0.5", "compression.budget=24")]
    assert config_hash(same[0]) not in {config_hash(c) for c in different}


def test_second_run_on_a_locked_run_dir_refuses(tiny, tmp_path, capsys):
    _, model, data = tiny
    run_dir = _existing_run(tiny, tmp_path)
    (run_dir / LOCK).write_text(json.dumps({"pid": os.getppid(), "host": os.uname().nodename}))
    before = _snapshot(run_dir)
    _refused(capsys, _args(model, data, run_dir), f"is in use by another run (pid {os.getppid()}")
    assert _snapshot(run_dir) == before


def test_stale_lock_of_a_dead_process_is_taken_over(tiny, tmp_path):
    run_dir = _existing_run(tiny, tmp_path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (run_dir / LOCK).write_text(json.dumps({"pid": dead.pid, "host": os.uname().nodename}))
    cfg = load_config(RunConfig, None, _args(*tiny[1:], run_dir)[1:])
    manifest = check_resumable(run_dir, config_hash(cfg), lambda: None)
    assert manifest["last_good_step"] == 4
    owner = open_run_dir(run_dir, config_hash(cfg), manifest)
    assert json.loads((run_dir / LOCK).read_text())["pid"] == os.getpid()
    with pytest.raises(RunDirError, match="in use by another run"):  # a second opener
        (run_dir / LOCK).write_text(json.dumps({"pid": os.getppid(),
                                                "host": os.uname().nodename}))
        check_resumable(run_dir, config_hash(cfg), lambda: None)
    owner.close()


# -- checkpoints ---------------------------------------------------------------------------

def _state(value):
    return {"w": jnp.full((64, 64), value, jnp.float32), "b": jnp.arange(8, dtype=jnp.int32)}


@pytest.mark.parametrize("corruption", ["garbage_files", "nan_weights"])
def test_corrupt_latest_checkpoint_falls_back_and_says_why(tmp_path, corruption):
    with Checkpointer(tmp_path / "ckpt", keep=5) as ckpt:
        for step in (1, 2, 3):
            value = np.nan if corruption == "nan_weights" and step == 3 else float(step)
            ckpt.save(step, _state(value), {"step": step})
    if corruption == "garbage_files":
        for file in (tmp_path / "ckpt" / "3" / "state").rglob("*"):
            if file.is_file():
                file.write_bytes(b"garbage")
    logs = []
    with Checkpointer(tmp_path / "ckpt", keep=5) as ckpt:
        state, meta = ckpt.restore_newest_good(_state(0.0), log=logs.append)
        assert meta["step"] == 2 and float(state["w"][0, 0]) == 2.0
        assert ckpt.all_steps() == [1, 2]
        ckpt.save(3, _state(30.0), {"step": 3})  # the run can save step 3 again
    assert len(logs) == 1 and logs[0].startswith("warning: skipping checkpoint step 3: ")
    if corruption == "nan_weights":
        assert "leaves ['w'] hold NaN or inf" in logs[0]
    assert (tmp_path / "ckpt.corrupt" / "3").is_dir()  # kept for inspection
    with Checkpointer(tmp_path / "ckpt", read_only=True) as ckpt:
        assert float(ckpt.restore(_state(0.0))[0]["w"][0, 0]) == 30.0


def test_disk_full_during_save_is_a_clear_error_and_keeps_earlier_checkpoints(tmp_path):
    """RLIMIT_FSIZE makes every write past 64 KiB fail (EFBIG) like a full disk."""
    big = {"w": jax.random.normal(jax.random.key(0), (256, 256))}  # 256 KiB, incompressible
    with Checkpointer(tmp_path / "ckpt", keep=5) as ckpt:
        ckpt.save(1, big, {"step": 1})
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, limits[1]))
    try:
        with pytest.raises(CheckpointError, match=r"saving a checkpoint in .* failed") as err:
            ckpt = Checkpointer(tmp_path / "ckpt", keep=5)
            try:
                ckpt.save(2, {"w": big["w"] * 2}, {"step": 2})
                ckpt.wait()
            finally:
                resource.setrlimit(resource.RLIMIT_FSIZE, limits)
                try:
                    ckpt.close()
                except CheckpointError:
                    pass
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, previous)
    assert "(disk full?)" in str(err.value) and "committed checkpoints: [1]" in str(err.value)
    with Checkpointer(tmp_path / "ckpt", keep=5) as ckpt:
        assert ckpt.all_steps() == [1]  # the half-written step 2 is not taken for one
        state, meta = ckpt.restore_newest_good(big, log=lambda _: None)
        assert meta["step"] == 1
        np.testing.assert_array_equal(np.asarray(state["w"]), np.asarray(big["w"]))


# -- non-finite updates --------------------------------------------------------------------

def test_nonfinite_loss_skips_the_update(tmp_path):
    """A NaN advantage makes the loss NaN: params and optimizer state stay bit-identical."""
    from flax import nnx

    from sparse_rl_jax.grpo_loss import LossBatch
    from sparse_rl_jax.loss_config import GRPOLossConfig
    from sparse_rl_jax.optim import OptimConfig, make_optimizer
    from sparse_rl_jax.train_step import Minibatch, update_step

    model_dir = make_tiny_hf(tmp_path, "qwen2", tokenizer=False, num_hidden_layers=1,
                             hidden_size=32, intermediate_size=32)
    graphdef, params = nnx.split(models.load_pretrained(model_dir, dtype=jnp.float32))
    optimizer = make_optimizer(OptimConfig(lr=1e-2))
    opt_state = optimizer.init(params)
    n, p, m = 2, 3, 4
    mask = jnp.ones((n, m), bool)
    update = jax.jit(lambda pr, s, b: update_step(
        graphdef, pr, s, b, loss_cfg=GRPOLossConfig(), optimizer=optimizer,
        chunk_size=4))

    def run_update(advantages):
        batch = Minibatch(jnp.full((n, p), 7, jnp.int32), jnp.ones((n, p), jnp.int32),
                          jnp.full((n, m), 9, jnp.int32),
                          LossBatch(logp_old_dense=jnp.full((n, m), -1.0),
                                    advantages=advantages, loss_mask=mask,
                                    is_weights=jnp.ones((n, m)), token_mask=mask,
                                    seq_mask=jnp.ones((n,), bool)))
        return update(params, opt_state, batch)

    new_params, new_state, metrics = run_update(jnp.array([1.0, jnp.nan]))
    assert float(metrics["nonfinite_update"]) == 1.0
    for a, b in zip(jax.tree.leaves((params, opt_state)), jax.tree.leaves((new_params,
                                                                          new_state))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    moved, _, metrics = run_update(jnp.array([1.0, -1.0]))
    assert float(metrics["nonfinite_update"]) == 0.0
    assert any(not np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(moved)))


def test_nonfinite_streak_stops_the_run_naming_the_step():
    from sparse_rl_jax.trainer import NonFiniteError, NonFiniteGuard

    guard = NonFiniteGuard(limit=3)
    for step, nonfinite in enumerate([True, False, True, True], start=1):
        guard.record(step, nonfinite)
    assert (guard.skipped, guard.in_a_row) == (3, 2)
    with pytest.raises(NonFiniteError, match=r"step 5: .* 3 RL steps in a row \(steps 3..5"):
        guard.record(5, True)


def test_debug_shows_the_traceback(tiny, tmp_path, capsys):
    _, model, data = tiny
    assert run.main(_args(model, data, tmp_path / "run") + ["--debug", "data.reward=bogus"]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err
    assert err.strip().splitlines()[-1].startswith("error: reward fn 'bogus'")
