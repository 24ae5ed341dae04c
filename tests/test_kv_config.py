"""CompressionConfig: validation on construction (errors name the dotted key), the flat keys of
before the sections, the sections each method reads, variant defaults, capacities."""

from __future__ import annotations

import dataclasses

import pytest

from sparse_rl_jax.core.config_io import ConfigError, from_dict, load_config
from sparse_rl_jax.kv.compression_config import CompressionConfig
from sparse_rl_jax.kv.compression_sections import AdaptConfig, EvictionConfig
from sparse_rl_jax.training.run_config import RunConfig


@pytest.mark.parametrize(
    "data,pattern",
    [
        ({"method": "h2o"},
         r"method='h2o' must be one of \('none', 'snapkv', 'rkv', 'streaming', 'sparrow'\)"),
        ({"eviction": {"head_mode": "all"}},
         r"eviction\.head_mode: 'all' is not one of \['per_head', 'shared'\]"),
        ({"eviction": {"gqa_pool": "sum"}},
         r"eviction\.gqa_pool: 'sum' is not one of \['max', 'mean'\]"),
        ({"eviction": {"pool": "min"}}, r"eviction\.pool: 'min' is not one of \['max', 'avg'\]"),
        ({"eviction": {"importance": "h2o"}},
         r"eviction\.importance: 'h2o' is not one of \['sparse_rl', 'kvpress_snapkv'\]"),
        ({"eviction": {"budget": 8, "window": 8}},
         r"eviction\.budget=8 must be an int > window \(8\)"),
        ({"eviction": {"buffer": 0}}, r"eviction\.buffer=0 must be an int >= 1"),
        ({"eviction": {"window": 0}}, r"eviction\.window=0 must be an int >= 1"),
        ({"eviction": {"pool_kernel": 4}}, r"eviction\.pool_kernel=4 must be an odd int >= 1"),
        ({"eviction": {"num_sinks": -1}}, r"eviction\.num_sinks=-1 must be an int >= 0"),
        ({"eviction": {"rkv_lambda": 1.5}}, r"eviction\.rkv_lambda=1\.5 must be in \[0, 1\]"),
        ({"eviction": {"redundancy_threshold": 2.0}},
         r"eviction\.redundancy_threshold=2\.0 must be in \[-1, 1\]"),
        ({"alpha": {"metric": "all"}},
         r"alpha\.metric: 'all' is not one of \['exact', 'top20', 'off'\]"),
        ({"layout": "flat"}, r"layout: 'flat' is not one of \['dense', 'budget', 'paged'\]"),
        ({"layout": "paged"},
         r"layout='paged' does not fit method 'snapkv' \(needs 'budget'\): method 'snapkv' "
         r"evicts"),
        ({"method": "sparrow", "layout": "dense"},
         r"layout='dense' does not fit method 'sparrow' \(needs 'paged'\): sparrow selects "
         r"among the pages of the paged cache"),
        ({"method": "none", "layout": "budget"},
         r"layout='budget' does not fit method 'none' \(needs 'paged' or 'dense'\): a budget "
         r"cache needs an eviction policy"),
        ({"method": "sparrow", "layout": "budget"},
         r"layout='budget' does not fit method 'sparrow' \(needs 'paged'\)"),
        ({"method": "rkv", "layout": "dense"},
         r"layout='dense' does not fit method 'rkv' \(needs 'budget'\): method 'rkv' evicts"),
    ],
)
def test_invalid_fields_name_the_dotted_key_and_allowed_values(data, pattern):
    """Loaded from YAML, every error names the key's full place (``compression.eviction.pool``)."""
    with pytest.raises(ConfigError, match=r"^compression\." + pattern):
        from_dict(CompressionConfig, data, prefix="compression")


def test_built_in_python_the_error_names_the_class():
    with pytest.raises(ConfigError, match=r"^EvictionConfig\.budget=16\.0 must be an int"):
        EvictionConfig(budget=16.0)
    with pytest.raises(ConfigError, match=r"^CompressionConfig\.layout='paged' does not fit"):
        CompressionConfig(method="rkv", layout="paged")
    with pytest.raises(ConfigError, match=r"^EvictionConfig\.head_mode='all' must be one of "
                                          r"\('per_head', 'shared'\)"):
        EvictionConfig(head_mode="all")
    with pytest.raises(ConfigError, match=r"^CompressionConfig\.method='h2o' must be one of"):
        CompressionConfig(method="h2o")
    with pytest.raises(ConfigError, match=r"^CompressionConfig\.eviction=\{'budget': 8\} must be "
                                          r"of type EvictionConfig"):
        CompressionConfig(eviction={"budget": 8})


@pytest.mark.parametrize("old, new", sorted(CompressionConfig.MOVED_KEYS.items()))
def test_flat_keys_of_before_the_sections_name_their_new_place(old, new):
    """A flat key (``compression.budget``) is refused with its new place, in a file or an
    override and as a Python keyword; every new place is a field of its section."""
    section, key = new.split(".")
    section_cls = type(getattr(CompressionConfig(), section))
    assert key in {f.name for f in dataclasses.fields(section_cls)}
    value = getattr(getattr(CompressionConfig(), section), key)
    with pytest.raises(ConfigError, match=rf"^compression\.{old} moved to compression\.{new}$"):
        from_dict(CompressionConfig, {"method": "rkv", old: value}, prefix="compression")
    with pytest.raises(ConfigError,
                       match=rf"^CompressionConfig\.{old} moved to CompressionConfig\.{new}$"):
        CompressionConfig(**{old: value})


def test_several_flat_keys_are_named_in_one_error():
    with pytest.raises(ConfigError, match=r"compression\.budget moved to compression\.eviction\."
                                          r"budget; compression\.window moved to "
                                          r"compression\.eviction\.window"):
        load_config(RunConfig, None, ["compression.budget=64", "compression.window=4"])


@pytest.mark.parametrize("method, adapt, used", [
    ("none", False, ()),
    ("rkv", False, ("eviction", "alpha")),
    ("snapkv", False, ("eviction", "alpha")),
    ("streaming", False, ("eviction", "alpha")),
    ("sparrow", False, ("sparrow", "alpha")),
    ("sparrow", True, ("sparrow", "alpha", "adapt")),
])
def test_used_sections_are_what_the_method_reads(method, adapt, used):
    cfg = CompressionConfig(method=method, adapt=AdaptConfig(enabled=adapt))
    assert cfg.used_sections == used


def test_defaults_are_the_papers():
    cfg = CompressionConfig()
    ev = cfg.eviction
    assert (ev.budget, ev.buffer, ev.window, cfg.capacity) == (512, 128, 8, 640)
    assert (ev.head_mode, ev.gqa_pool, ev.pool, ev.pool_kernel) == ("per_head", "max", "max", 7)
    assert (ev.rkv_lambda, ev.redundancy_threshold, ev.num_sinks) == (0.1, 0.5, 4)


def test_kvpress_variant_defaults_and_overrides():
    cfg = EvictionConfig(importance="kvpress_snapkv", window=64, budget=128)
    assert (cfg.gqa_pool, cfg.pool, cfg.pool_kernel) == ("mean", "avg", 5)
    cfg = EvictionConfig(importance="kvpress_snapkv", pool="max", pool_kernel=3, gqa_pool="max")
    assert (cfg.gqa_pool, cfg.pool, cfg.pool_kernel) == ("max", "max", 3)


def test_capacity_and_hashable():
    cfg = CompressionConfig(method="rkv", eviction=EvictionConfig(budget=32, buffer=8, window=4))
    assert cfg.capacity == 40 and cfg.cache_capacity(1000) == 40 and cfg.compresses
    dense = CompressionConfig(method="none", layout="dense")
    assert dense.cache_capacity(1000) == 1000 and not dense.compresses
    paged = CompressionConfig(method="none", page_size=16)  # none's own layout: whole pages
    assert paged.cache_layout == "paged" and paged.cache_capacity(1000) == 1008
    assert hash(cfg) == hash(CompressionConfig(method="rkv",
                                               eviction=EvictionConfig(budget=32, buffer=8,
                                                                       window=4)))


@pytest.mark.parametrize("method", ["none", "snapkv", "sparrow"])
def test_layout_defaults_to_the_methods_own_and_hashes_the_same(method):
    from sparse_rl_jax.training.trainer import config_hash

    implied = CompressionConfig(method=method)
    explicit = CompressionConfig(method=method, layout=implied.natural_layout)
    assert implied.layout is None and implied.cache_layout == explicit.cache_layout
    assert implied.cache_layout == {"none": "paged", "snapkv": "budget",
                                    "sparrow": "paged"}[method]
    assert implied.cache_capacity(1000) == explicit.cache_capacity(1000)
    # a run of an older config (no layout key) still resumes: same hash either way, and
    # every layout the method takes hashes alike (layout changes only speed and memory)
    assert config_hash(RunConfig(compression=implied)) == config_hash(
        RunConfig(compression=explicit))
    for layout in implied.valid_layouts:
        assert config_hash(RunConfig(compression=CompressionConfig(
            method=method, layout=layout))) == config_hash(RunConfig(compression=implied))


@pytest.mark.parametrize("config, overrides, expected", [
    (None, ["correction.kind=sparse_rl"], "42895e9c8c3d2f28"),
    (None, ["correction.kind=sparse_rl", "compression.method=sparrow",
            "compression.adapt.enabled=true"], "0d8f302732112a61"),
    ("configs/paper/qwen2.5-1.5b_rkv.yaml", [], "f8a13cb80472a91c"),
])
def test_runs_from_before_the_sections_still_resume(config, overrides, expected):
    """The config hash reads the compression config in its flat form of before the sections:
    these are the hashes the flat config gave (commit ee46664), so its runs resume. (Their
    correction, ``sparse_rl``, was the default then: an old run resumes from its own
    config.yaml, which names it; the new default trains differently, so its hash differs and
    an old run dir refuses it.)"""
    from pathlib import Path

    from sparse_rl_jax.training.trainer import config_hash

    root = Path(__file__).resolve().parents[1]
    cfg = load_config(RunConfig, config and root / config, overrides)
    assert config_hash(cfg) == expected
