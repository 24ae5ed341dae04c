"""Config loading and merging through ``config_io.load_config``: the order in which ``base:``
chains, several config files and dotted overrides win, and nested sections merged key by key
(the ``compression`` sections too); the flat compression keys of before the sections; what
``run.py config`` prints and what the run directory's ``config.yaml`` holds."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from sparse_rl_jax.cli import main
from sparse_rl_jax.core.config_io import ConfigError, from_dict, load_config, save_config
from sparse_rl_jax.kv.compression_config import CompressionConfig
from sparse_rl_jax.kv.compression_sections import AlphaConfig
from sparse_rl_jax.training.run_config import DEFAULT_COMPRESSION, DEFAULT_SAMPLING, RunConfig


def _write(path, text: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_precedence_base_chain_then_files_in_order_then_overrides(tmp_path):
    # base chain: common <- tuned (a list of bases, relative to the file naming them) <- run
    _write(tmp_path / "bases" / "common.yaml",
           "trainer: {steps: 7, prompts_per_step: 4, minibatch_size: 8, seed: 1}\n"
           "sampling: {max_new_tokens: 44, temperature: 0.5}\n"
           "loss: {eps_high: 0.25}\n")
    _write(tmp_path / "bases" / "tuned.yaml",
           "sampling: {temperature: 0.6, top_k: 5}\nloss: {eps_high: 0.28}\n")
    run = _write(tmp_path / "run.yaml",
                 "base: [bases/common.yaml, bases/tuned.yaml]\n"
                 "sampling: {temperature: 0.7}\ntrainer: {steps: 9}\n")
    extra = _write(tmp_path / "extra.yaml",
                   "trainer: {steps: 10, seed: 2}\noptim: {lr: 1.0e-5}\n")
    cfg = load_config(RunConfig, [run, extra], ["trainer.steps=11", "sampling.top_p=0.9"])

    assert cfg.trainer.steps == 11  # override > extra.yaml (10) > run.yaml (9) > common (7)
    assert cfg.trainer.seed == 2  # the later file over the base chain of the earlier one
    assert cfg.sampling.temperature == 0.7  # a file over its bases
    assert cfg.loss.eps_high == 0.28  # a later base over an earlier one
    assert cfg.sampling.top_k == 5 and cfg.sampling.top_p == 0.9
    # keys a section does not name keep the value from below: the bases', then the defaults'
    assert (cfg.trainer.prompts_per_step, cfg.trainer.minibatch_size) == (4, 8)
    assert cfg.sampling.max_new_tokens == 44 and cfg.optim.lr == 1e-5
    # ... and a partial section keeps the run's embedded default for the rest, not the
    # section class's own (RunConfig's sampling default differs from SamplingConfig())
    assert cfg.sampling.prompt_bucket == DEFAULT_SAMPLING.prompt_bucket
    assert cfg.sampling.num_samples == DEFAULT_SAMPLING.num_samples
    assert cfg.compression == DEFAULT_COMPRESSION  # sections named nowhere are the defaults
    assert cfg.optim.weight_decay == RunConfig().optim.weight_decay


def test_nested_sections_merge_key_by_key(tmp_path):
    _write(tmp_path / "base.yaml",
           "data: {source: task, task: {n_min: 2, n_max: 5}, shuffle_seed: 3}\n")
    run = _write(tmp_path / "run.yaml", "base: base.yaml\ndata: {task: {n_max: 6}}\n")
    cfg = load_config(RunConfig, run, ["data.task.seed=4"])
    task = cfg.data.task
    assert (task.n_min, task.n_max, task.seed) == (2, 6, 4)
    assert cfg.data.shuffle_seed == 3 and cfg.data.source == "task"


def test_saved_config_loads_back_equal(tmp_path):
    cfg = load_config(RunConfig, None, ["compression.method=sparrow", "model.lora.rank=4",
                                        "data.task.n_max=6", "logging.backends=[jsonl]"])
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(RunConfig, tmp_path / "config.yaml") == cfg


@dataclasses.dataclass(frozen=True)
class _Derived:
    """A section with a field derived from another when left None."""

    kind: str = "a"
    flag: bool | None = None

    def __post_init__(self):
        if self.flag is None:
            object.__setattr__(self, "flag", self.kind == "a")


@dataclasses.dataclass(frozen=True)
class _Parent:
    derived: _Derived = dataclasses.field(default_factory=_Derived)
    pinned: _Derived = dataclasses.field(default_factory=lambda: _Derived(flag=True, kind="b"))


def test_a_partial_section_derives_its_derived_fields_anew():
    """Overriding one key of a section re-derives the fields its defaults derived (here
    ``flag`` from ``kind``), and keeps the ones the parent's default set on purpose."""
    built = from_dict(_Parent, {"derived": {"kind": "b"}, "pinned": {"kind": "a"}})
    assert built.derived == _Derived(kind="b")  # flag derived from kind b: False
    assert built.derived.flag is False
    assert built.pinned.flag is True  # pinned explicitly by the parent, not re-derived
    # the real case: correction.kind=tis gets tis's normalize (off), rs_upper follows is_upper
    cfg = load_config(RunConfig, None, ["correction.kind=tis", "correction.is_upper=1.2"])
    assert cfg.correction.normalize is False and cfg.correction.rs_upper == 1.2
    assert load_config(RunConfig, None,
                       ["correction.kind=sparse_rl"]).correction.normalize is True


def test_compression_sections_merge_through_base_files_and_overrides(tmp_path):
    """``compression.<section>`` merges key by key like any nested section: a base file, the
    file on top and an override each set a key of the same section."""
    _write(tmp_path / "base.yaml",
           "compression: {method: sparrow, sparrow: {dense_layers: [0]}, "
           "eviction: {budget: 20, window: 2}}\n")
    run = _write(tmp_path / "run.yaml", "base: base.yaml\n"
                 "compression: {eviction: {window: 3}, adapt: {enabled: true}}\n")
    cfg = load_config(RunConfig, run, ["compression.adapt.step=3",
                                       "compression.sparrow.budget_schedule=qwen3-4b-0.86"])
    comp = cfg.compression
    assert (comp.eviction.budget, comp.eviction.window) == (20, 3)
    assert comp.eviction.buffer == DEFAULT_COMPRESSION.eviction.buffer  # the run's default
    assert comp.sparrow.dense_layers == (0,) and comp.sparrow.ks[3] == 77
    assert comp.adapt.enabled and comp.adapt.step == 3 and comp.alpha == AlphaConfig()


@pytest.mark.parametrize("where", ["file", "base"])
def test_flat_compression_keys_in_a_file_name_their_new_place(tmp_path, where):
    flat = "compression: {method: rkv, budget: 64, alpha_threshold: 0.9}\n"
    _write(tmp_path / "base.yaml", flat if where == "base" else "")
    run = _write(tmp_path / "run.yaml", "base: base.yaml\n" + (flat if where == "file" else ""))
    with pytest.raises(ConfigError, match=r"^compression\.alpha_threshold moved to "
                                          r"compression\.alpha\.threshold; compression\.budget "
                                          r"moved to compression\.eviction\.budget$"):
        load_config(RunConfig, run)


@pytest.mark.parametrize("overrides", [
    ["compression.method=rkv", "compression.eviction.budget=28"],
    ["compression.method=sparrow", "compression.adapt.enabled=true",
     "compression.sparrow.budget_schedule=[[0, 1], [2000, 5]]"],
    ["compression.method=none", "compression.layout=dense"],
])
def test_saved_config_holds_every_section_and_loads_back_equal(tmp_path, overrides):
    """``config.yaml`` in the run directory is the full config (``save_config``), also the
    sections the method does not read, so loading it gives the same ``RunConfig``."""
    cfg = load_config(RunConfig, None, overrides)
    save_config(cfg, tmp_path / "config.yaml")
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert set(saved["compression"]) == {f.name for f in dataclasses.fields(CompressionConfig)}
    assert load_config(RunConfig, tmp_path / "config.yaml") == cfg


def _printed_compression(capsys, *argv) -> dict:
    """The ``compression`` section ``run.py config`` prints."""
    assert main(["config", *argv]) == 0
    return yaml.safe_load(capsys.readouterr().out)["compression"]


@pytest.mark.parametrize("overrides, sections", [
    (["compression.method=rkv"], {"eviction", "alpha"}),
    (["compression.method=streaming"], {"eviction", "alpha"}),
    (["compression.method=sparrow"], {"sparrow", "alpha"}),
    (["compression.method=sparrow", "compression.adapt.enabled=true"],
     {"sparrow", "alpha", "adapt"}),
    (["compression.method=none"], set()),
])
def test_run_py_config_prints_the_sections_the_method_reads(capsys, overrides, sections):
    """R-KV shows no Sparrow schedule, sparrow no eviction settings, none neither; ``--all``
    shows every section (what the run directory's ``config.yaml`` holds)."""
    shown = _printed_compression(capsys, *overrides)
    assert {k for k, v in shown.items() if isinstance(v, dict)} == sections
    assert {"method", "layout", "page_size"} <= set(shown)
    full = _printed_compression(capsys, "--all", *overrides)
    assert {k for k, v in full.items() if isinstance(v, dict)} == {"eviction", "sparrow",
                                                                   "alpha", "adapt"}
