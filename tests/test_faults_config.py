"""Fault matrix, config and CLI (issues 17 and 21): a bad config file, override or
config-level value is one ``config error:`` / ``error:`` line with exit 2 before anything is
written; ``--debug`` shows the traceback."""

from __future__ import annotations

import jax
import pytest

from fault_helpers import existing_run, refused, run, run_args, snapshot

pytest_plugins = ("fault_helpers",)  # the tiny model + data fixture


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
    ("warm_start.steps=1", "warm_start.steps=1 must be an int >= 2"),
    ("warm_start.shuffled_fraction=1", "warm_start.shuffled_fraction=1.0 must be in [0, 1)"),
    ("warm_start.target_accuracy=0", "warm_start.target_accuracy=0.0 must be None or in (0, 1]"),
    ("warm_start.lr_schedule=linear", "warm_start.lr_schedule='linear' must be one of "
                                      "('cosine', 'constant')"),
    ("warm_start.curriculum_steps=-1", "warm_start.curriculum_steps=-1 must be an int >= 0"),
    ("warm_start.check_every=0", "warm_start.check_every=0 must be an int >= 1"),
    ("optim.decay_steps=-1", "optim.decay_steps=-1 must be an int >= 0"),
    ("trainer.max_nonfinite_steps=0", "trainer.max_nonfinite_steps=0 must be an int >= 1"),
    ("run_dir=", "run_dir='' must be a directory path"),
    ("sampling.engine=paged", "sampling.engine='paged' must be one of ('static', 'continuous')"),
    ("sampling.slots=-1", "sampling.slots=-1 must be an int >= 1 (the smallest that holds one "
                          "row), or 0 for one slot per row"),
    ("sampling.chunk=0", "sampling.chunk=0 must be an int >= 1 (the smallest that decodes a "
                         "row)"),
    ("trainer.steps=[1", "override 'trainer.steps=[1': value is not plain YAML"),
    ("trainer.steps=!!python/object/apply:os.system [touch /tmp/x]", "not plain YAML"),
    ("trainer.steps=!foo x", "not plain YAML"),
    # the flat compression keys of before the sections name their new place
    ("compression.budget=64", "compression.budget moved to compression.eviction.budget"),
    ("compression.adapt_k=true", "compression.adapt_k moved to compression.adapt.enabled"),
    ("compression.alpha_metric='off'",
     "compression.alpha_metric moved to compression.alpha.metric"),
    # bad values inside a section name the full dotted key
    ("compression.eviction.budget=2", "compression.eviction.budget=2 must be an int > window (4)"),
    ("compression.eviction.pool_kernel=4",
     "compression.eviction.pool_kernel=4 must be an odd int >= 1"),
    ("compression.sparrow.dense_layers=[0,0]",
     "compression.sparrow.dense_layers=(0, 0) must be distinct ints >= 0"),
    ("compression.alpha.threshold=0", "compression.alpha.threshold=0.0 must be in (0, 1]"),
    ("compression.adapt.step=0", "compression.adapt.step=0 must be an int >= 1"),
    ("compression.eviction.budgett=64", "compression.eviction: unknown key(s) "
                                        "['compression.eviction.budgett']"),
    ("compression.eviction=64", "compression.eviction: expected a mapping for EvictionConfig"),
])
def test_bad_config_or_override_is_one_config_error_line(capsys, override, expected):
    refused(capsys, ["config", override], expected, prefix="config error")


@pytest.mark.parametrize("base", ["1", "null", "[base.yaml, 1]", "{a: 1}"])
def test_base_that_is_not_paths_is_a_config_error(tmp_path, capsys, base):
    (tmp_path / "base.yaml").write_text("trainer: {steps: 3}\n")
    config = tmp_path / "c.yaml"
    config.write_text(f"base: {base}\n")
    refused(capsys, ["config", "--config", str(config)], "'base' must be a file path",
            prefix="config error")


def test_non_utf8_config_file_is_a_config_error(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_bytes(b"trainer: {steps: \xff}\n")
    refused(capsys, ["config", "--config", str(config)], "is not valid YAML",
            prefix="config error")


@pytest.mark.parametrize("extra,expected,prefix", [
    (["mesh.data=2"], f"not fit the {jax.device_count()} device(s)", "config error"),
    (["data.reward=bogus"], "reward fn 'bogus' is not registered", "error"),
    (["--distributed"], "--distributed: cannot initialize (no coordinator found", "error"),
    (["sampling.eos_ids=[2, 128]"], "sampling.eos_ids=(2, 128): ids must be below the "
                                    "model's vocab_size=128", "error"),
    (["sampling.pad_id=999"], "sampling.pad_id=999", "error"),
    (["compression.method=sparrow", "compression.sparrow.dense_layers=[0,7]"],
     "compression.sparrow.dense_layers=(0, 7) names a layer the model (2 layers) does not "
     "have", "error"),
])
def test_run_level_config_errors_before_any_state(tiny, tmp_path, capsys, extra, expected,
                                                  prefix):
    _, model, data = tiny
    refused(capsys, run_args(model, data, tmp_path / "run") + extra, expected, prefix=prefix)
    assert not (tmp_path / "run").exists()


# a page kernel no platform runs on int8 pages: the TPU one reads unquantized pages only
REFUSED_BACKEND = ["model.attention=pallas_tpu", "compression.quant=int8"]


def test_a_backend_this_platform_refuses_writes_nothing_and_a_fixed_rerun_trains(
        tiny, tmp_path, capsys):
    """The attention backend is checked against the platform and the model before the run
    directory is written, so the rerun with a working backend is not refused as "a run with
    a different config"."""
    _, model, data = tiny
    args = run_args(model, data, tmp_path / "run")
    refused(capsys, args + REFUSED_BACKEND, "model.attention='pallas_tpu'",
            "choices that do: ('auto', 'xla'", prefix="config error")
    assert not (tmp_path / "run").exists()
    assert run.main(args + ["model.attention=xla", "compression.quant=int8", "trainer.plots=false",
                            "trainer.export_final=false"]) == 0
    assert (tmp_path / "run" / "manifest.json").is_file()


def test_a_backend_this_platform_refuses_leaves_an_existing_run_dir_untouched(
        tiny, tmp_path, capsys):
    run_dir = existing_run(tiny, tmp_path, ["compression.quant=int8"])
    before = snapshot(run_dir)
    _, model, data = tiny
    refused(capsys, run_args(model, data, run_dir) + REFUSED_BACKEND,
            "model.attention='pallas_tpu'", prefix="config error")
    assert snapshot(run_dir) == before


@pytest.mark.parametrize("override,field", [("sampling.pad_id=999", "sampling.pad_id=999"),
                                            ("sampling.eos_ids=[2,999]",
                                             "sampling.eos_ids=(2, 999)")])
def test_embedded_default_ids_beyond_its_vocab_before_any_state(tmp_path, capsys, override,
                                                                field):
    """model.path null: the embedded default's vocabulary (its task tokenizer) is known
    before it is built, so no config.yaml, manifest or warm start is written."""
    from sparse_rl_jax.training.preflight import default_task_tokenizer

    vocab = default_task_tokenizer().vocab_size
    refused(capsys, ["train", override, "trainer.steps=1", f"run_dir={tmp_path / 'run'}"],
            f"{field}: ids must be below the model's vocab_size={vocab}")
    assert not (tmp_path / "run").exists()


def test_debug_shows_the_traceback(tiny, tmp_path, capsys):
    _, model, data = tiny
    assert run.main(run_args(model, data, tmp_path / "run") + ["--debug", "data.reward=bogus"]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err
    assert err.strip().splitlines()[-1].startswith("error: reward fn 'bogus'")
