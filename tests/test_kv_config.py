"""CompressionConfig: validation on construction, variant defaults, capacities."""

from __future__ import annotations

import pytest

from sparse_rl_jax.kv.compression_config import CompressionConfig


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        ({"method": "h2o"}, r"method='h2o' must be one of \('none', 'snapkv', 'rkv', 'streaming', 'sparrow'\)"),
        ({"head_mode": "all"}, r"head_mode='all' must be one of \('per_head', 'shared'\)"),
        ({"gqa_pool": "sum"}, r"gqa_pool='sum' must be one of \('max', 'mean'\)"),
        ({"pool": "min"}, r"pool='min' must be one of \('max', 'avg'\)"),
        ({"importance": "h2o"}, r"importance='h2o' must be one of \('sparse_rl', 'kvpress_snapkv'\)"),
        ({"budget": 8, "window": 8}, r"budget=8 must be an int > window \(8\)"),
        ({"budget": 16.0}, r"budget=16.0 must be an int"),
        ({"buffer": 0}, r"buffer=0 must be an int >= 1"),
        ({"window": 0}, r"window=0 must be an int >= 1"),
        ({"pool_kernel": 4}, r"pool_kernel=4 must be an odd int >= 1"),
        ({"num_sinks": -1}, r"num_sinks=-1 must be an int >= 0"),
        ({"rkv_lambda": 1.5}, r"rkv_lambda=1.5 must be in \[0, 1\]"),
        ({"redundancy_threshold": 2.0}, r"redundancy_threshold=2.0 must be in \[-1, 1\]"),
        ({"layout": "flat"}, r"layout='flat' must be one of \('dense', 'budget', 'paged'\)"),
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
def test_invalid_fields_name_field_and_allowed_values(kwargs, pattern):
    with pytest.raises(ValueError, match=r"CompressionConfig\." + pattern):
        CompressionConfig(**kwargs)


def test_defaults_are_the_papers():
    cfg = CompressionConfig()
    assert (cfg.budget, cfg.buffer, cfg.window, cfg.capacity) == (512, 128, 8, 640)
    assert (cfg.head_mode, cfg.gqa_pool, cfg.pool, cfg.pool_kernel) == ("per_head", "max", "max", 7)
    assert (cfg.rkv_lambda, cfg.redundancy_threshold, cfg.num_sinks) == (0.1, 0.5, 4)


def test_kvpress_variant_defaults_and_overrides():
    cfg = CompressionConfig(importance="kvpress_snapkv", window=64, budget=128)
    assert (cfg.gqa_pool, cfg.pool, cfg.pool_kernel) == ("mean", "avg", 5)
    cfg = CompressionConfig(importance="kvpress_snapkv", pool="max", pool_kernel=3, gqa_pool="max")
    assert (cfg.gqa_pool, cfg.pool, cfg.pool_kernel) == ("max", "max", 3)


def test_capacity_and_hashable():
    cfg = CompressionConfig(method="rkv", budget=32, buffer=8, window=4)
    assert cfg.capacity == 40 and cfg.cache_capacity(1000) == 40 and cfg.compresses
    dense = CompressionConfig(method="none", layout="dense")
    assert dense.cache_capacity(1000) == 1000 and not dense.compresses
    paged = CompressionConfig(method="none", page_size=16)  # none's own layout: whole pages
    assert paged.cache_layout == "paged" and paged.cache_capacity(1000) == 1008
    assert hash(cfg) == hash(CompressionConfig(method="rkv", budget=32, buffer=8, window=4))


@pytest.mark.parametrize("method", ["none", "snapkv", "sparrow"])
def test_layout_defaults_to_the_methods_own_and_hashes_the_same(method):
    from sparse_rl_jax.training.run_config import RunConfig
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
