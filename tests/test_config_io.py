"""Config loading and merging through ``config_io.load_config``: the order in which ``base:``
chains, several config files and dotted overrides win, and nested sections merged key by key."""

from __future__ import annotations

import dataclasses

from sparse_rl_jax.core.config_io import from_dict, load_config, save_config
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
    assert load_config(RunConfig, None, []).correction.normalize is True
