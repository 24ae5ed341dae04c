"""Sparrow page-sparse decode: config, schedule, page scoring/selection against NumPy, and
the sampler's log-probs against the selection-record replay and (in the
dense regime) against the dense sampler."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from benchmarks.kit.compile_count import count_compiles
from models.attention import reference_attention
from models.page_sparse import gather_pages, page_sparse_attention, select_pages
from models.paged_cache import PagedKVCache
from sparse_rl_jax.core.config_io import ConfigError, from_dict
from sparse_rl_jax.kv.compression_config import CompressionConfig
from sparse_rl_jax.kv.compression_sections import SPARROW_PRESETS, SparrowConfig
from sparse_rl_jax.kv.page_sparsity import PageRecord, schedule_budget
from sparse_rl_jax.kv.state import init_state
from sparse_rl_jax.rollout.acceptance import score_acceptance
from sparse_rl_jax.rollout.sampler import generate
from sparse_rl_jax.rollout.sampling_config import SamplingConfig
from sparse_rl_jax.rollout.scoring import score
from sparse_rl_jax.training import memory_plan
from tiny_hf import left_padded_batch, make_tiny_hf


# ---------------------------------------------------------------- config and schedule


def test_config_resolves_presets_and_yaml_lists():
    cfg = CompressionConfig(method="sparrow",
                            sparrow=SparrowConfig(budget_schedule="qwen3-4b-0.86"))
    assert len(cfg.sparrow.budget_schedule) == 20
    assert cfg.sparrow.budget_schedule[3] == (6000, 77) and cfg.max_pages_k == 509
    assert not cfg.compresses and cfg.page_sparse and cfg.cache_capacity(100) == 112  # pages
    yaml = from_dict(CompressionConfig, {"method": "sparrow", "page_size": 8, "sparrow": {
        "budget_schedule": [[0, 2], [64, 5]], "dense_layers": [0]}})
    assert yaml.sparrow.budget_schedule == ((0, 2), (64, 5)) and yaml.sparrow.dense_layers == (0,)


@pytest.mark.parametrize("data, message", [
    ({"sparrow": {"budget_schedule": [[0, 4], [320, 5], [160, 6]]}},
     "sparrow.budget_schedule[2]=(160, 6) must start after budget_schedule[1] (starts strictly"),
    ({"sparrow": {"budget_schedule": [[16, 4]]}},
     "sparrow.budget_schedule[0]=(16, 4) must start at 0"),
    ({"sparrow": {"budget_schedule": [[0, 20], [320, 5]]}},
     "sparrow.budget_schedule[0]=(0, 20) has k larger than the 16 middle pages"),
    ({"sparrow": {"budget_schedule": [[0, 2], [40, 3]]}},
     "sparrow.budget_schedule[1]=(40, 3) must start at a multiple of page_size=16"),
    ({"sparrow": {"budget_schedule": "qwen9"}}, "sparrow.budget_schedule='qwen9' is not a preset"),
    ({"alpha": {"threshold": 0.0}}, "alpha.threshold=0.0 must be in (0, 1]"),
    ({"alpha": {"threshold": 1.5}}, "alpha.threshold=1.5 must be in (0, 1]"),
    ({"sparrow": {"dense_layers": [1, 1]}}, "sparrow.dense_layers=(1, 1) must be distinct"),
    ({"page_size": 0}, "page_size=0 must be an int >= 1"),
])
def test_config_errors_name_the_dotted_key(data, message):
    """Within a section or across sections (a schedule against ``page_size``), the error names
    the key's full place."""
    with pytest.raises(ConfigError) as err:
        from_dict(CompressionConfig, {"method": "sparrow", **data}, prefix="compression")
    assert str(err.value).startswith("compression." + message)


def test_schedule_lookup_matches_official_bins():
    for name, ks in SPARROW_PRESETS.items():
        cfg = CompressionConfig(method="sparrow", sparrow=SparrowConfig(budget_schedule=name))
        lengths = np.array([1, 15, 16, 17, 1999, 2000, 2001, 2016, 2017, 3999, 4000, 4001,
                            37999, 38000, 38001, 60000, 100000])
        got = np.asarray(schedule_budget(cfg, jnp.asarray(lengths)))
        want = [ks[min(math.ceil(n / 16) // 125, 19)] for n in lengths]
        np.testing.assert_array_equal(got, want)



@pytest.mark.parametrize("name", sorted(SPARROW_PRESETS))
def test_every_preset_is_a_valid_schedule(name):
    """Each preset resolves through the config to 20 bins starting at 0 and 2000 tokens apart
    (strictly increasing), with positive int k."""
    cfg = CompressionConfig(method="sparrow", sparrow=SparrowConfig(budget_schedule=name))
    starts = [start for start, _ in cfg.sparrow.budget_schedule]
    ks = list(cfg.sparrow.ks)
    assert starts == [2000 * i for i in range(20)]
    assert all(b > a for a, b in zip(starts, starts[1:]))
    assert all(isinstance(k, int) and k > 0 for k in ks)
    assert tuple(ks) == SPARROW_PRESETS[name]


def test_presets_match_upstream_spot_checks():
    """New presets against Sparrow's own numbers, written here by hand from upstream."""
    # Upstream: github.com/Infini-AI-Lab/Sparrow, vortex_torch/vortex_torch/indexer/
    # utils_sglang.py (_SCHEDULE_POLICY_VALUES), commit b8cb9870c524b7ab0288d9aa3c620e5990d69655.
    assert len(SPARROW_PRESETS) == 20
    assert SPARROW_PRESETS["qwen3-1.7b-0.75"] == (29, 29, 45, 45, 61, 61, 77, 77) + (93,) * 12
    assert SPARROW_PRESETS["qwen3-14b-0.86"] == ((29, 45, 77, 125, 253) + (381,) * 10
                                                 + (509, 637, 637, 893, 893))
    cfg = CompressionConfig(method="sparrow",
                            sparrow=SparrowConfig(budget_schedule="qwen3-4b-0.92"))
    assert cfg.sparrow.budget_schedule[9] == (18000, 1021) and cfg.max_pages_k == 1149

# ---------------------------------------------------------------- selection vs NumPy


def np_select(q_mean, page_keys, n, k):
    """NumPy reference: sets of selected pages per (row, head)."""
    b, h = q_mean.shape[:2]
    out = {}
    for i in range(b):
        for j in range(h):
            scores = page_keys[i, j] @ q_mean[i, j]
            middle = sorted(range(1, n[i] - 2), key=lambda p: (-scores[p], p))[: k[i]]
            out[i, j] = {0} | set(middle) | {p for p in (n[i] - 2, n[i] - 1) if p >= 1}
    return out


def test_select_pages_matches_numpy_with_ties_and_small_rows():
    rng = np.random.default_rng(0)
    b, h, p, d = 5, 3, 12, 4
    q = rng.normal(size=(b, h, d)).astype(np.float32)
    keys = rng.normal(size=(b, h, p, d)).astype(np.float32)
    keys[0, :, 1:] = keys[0, :, 1:2]  # row 0: every middle page ties -> lowest indices win
    keys[1, 0, 5] = keys[1, 0, 3]  # an exact tie between pages 3 and 5
    n = np.array([12, 10, 3, 1, 6])  # row 2: no middle page; row 3: the sink page only
    k = np.array([4, 2, 3, 3, 5])  # row 4 is dense (n <= k + 3)
    got = np.asarray(select_pages(jnp.asarray(q), jnp.asarray(keys), jnp.asarray(n),
                                  jnp.asarray(k), max_k=5))
    assert got.shape == (b, h, 5 + 3)
    want = np_select(q, keys, n, k)
    for (i, j), pages in want.items():
        chosen = [x for x in got[i, j] if x >= 0]
        assert len(chosen) == len(set(chosen)) and set(chosen) == pages, (i, j, got[i, j])
        assert got[i, j, 0] == 0  # sink page always kept
        assert {n[i] - 1} <= set(chosen)  # newest page always kept
    assert set(got[0, 0][1:5]) == {1, 2, 3, 4}
    assert set(got[4, 0][got[4, 0] >= 0]) == set(range(6))


@pytest.mark.parametrize("backend", ["blockwise", "pallas_gpu", "pallas_tpu"])
def test_page_sparse_attention_equals_masked_reference(backend):
    """Selected pages of one layer of a paged cache (slot = position), gathered (XLA) or read
    in place through per-(row, head) tables by a Pallas kernel (interpreted off its
    platform) == reference attention over that layer's whole cache masked to those pages."""
    rng = np.random.default_rng(1)
    n_layers, layer, b, hkv, g, d, c, ps = 2, 1, 3, 2, 2, 8, 48, 4
    lengths = np.array([40, 23, 9])
    k, v = (rng.normal(size=(n_layers, b, hkv, c, d)).astype(np.float32) for _ in range(2))
    pos = np.where(np.arange(c) < lengths[:, None], np.arange(c), -1).astype(np.int32)  # [B, C]
    q = rng.normal(size=(b, 1, hkv * g, d)).astype(np.float32)
    q_pos = (lengths - 1)[:, None]
    n_pages = c // ps
    page_keys = np.zeros((b, hkv, n_pages, d), np.float32)
    for i in range(b):
        for p in range(-(-lengths[i] // ps)):
            page_keys[i, :, p] = k[layer, i, :, p * ps: min((p + 1) * ps, lengths[i])].mean(1)
    budget = np.array([2, 3, 1])
    cache = PagedKVCache(k=jnp.asarray(k), v=jnp.asarray(v), pos=jnp.asarray(pos),
                         index=jnp.zeros((), jnp.int32), page_size=ps)
    out, pages = page_sparse_attention(
        jnp.asarray(q), cache, jnp.asarray(q_pos), jnp.asarray(layer), jnp.asarray(page_keys),
        jnp.asarray(budget), max_k=3, backend=backend)
    q_mean = q[:, 0].reshape(b, hkv, g, d).mean(2)
    want = np_select(q_mean, page_keys, -(-lengths // ps), budget)
    mask = np.zeros((b, hkv, 1, c), bool)
    for (i, j), sel in want.items():
        mask[i, j, 0] = np.isin(np.where(pos[i] >= 0, pos[i] // ps, -1), list(sel))
    head_pos = np.broadcast_to(pos[:, None], (b, hkv, c))
    ref = reference_attention(jnp.asarray(q), jnp.asarray(k[layer]), jnp.asarray(v[layer]),
                              jnp.asarray(q_pos), jnp.asarray(head_pos), mask=jnp.asarray(mask))
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5)
    # only the selected pages are read: the gather holds K * ps slots, not C
    gk, _, gpos = gather_pages(cache, pages, jnp.asarray(layer), jnp.float32)
    assert gk.shape[2] == (3 + 3) * ps and int(jnp.sum(gpos >= 0)) == int(mask.sum())


# ---------------------------------------------------------------- the sampler


def _tiny(tmp_path_factory, heads, kv_heads, layers=2):
    path = make_tiny_hf(tmp_path_factory.mktemp(f"sparrow{heads}{kv_heads}"), "qwen2",
                        tokenizer=False, std=0.2, hidden_size=32, num_hidden_layers=layers,
                        num_attention_heads=heads, num_key_value_heads=kv_heads,
                        intermediate_size=64)
    return nnx.split(models.load_pretrained(path, dtype=jnp.float32))


SPARROW = CompressionConfig(method="sparrow", page_size=4, sparrow=SparrowConfig(
    budget_schedule=((0, 1), (32, 3)), dense_layers=(0,)))
SAMPLING = SamplingConfig(max_new_tokens=30, num_samples=2, prompt_bucket=4, record_evictions=True)


@pytest.mark.parametrize("heads, kv_heads", [(2, 2), (4, 2), (4, 1)])
def test_sampler_logp_equals_selection_record_replay(tmp_path_factory, heads, kv_heads):
    graphdef, params = _tiny(tmp_path_factory, heads, kv_heads)
    prompt, mask = left_padded_batch(np.random.default_rng(0), [11, 5, 8], width=11)
    r = generate(graphdef, params, prompt, mask, jax.random.key(3), SAMPLING, SPARROW)
    resp = r.response_mask.astype(bool)
    record = r.record
    assert isinstance(record, PageRecord) and record.page_size == 4
    replay = score(graphdef, params, r.prompt, r.prompt_mask, r.response, record)
    err = float(jnp.max(jnp.where(resp, jnp.abs(replay.logp - r.logp), 0)))
    assert err < 1e-4, err
    if heads == 4 and kv_heads == 2:  # the policy is really sparse: dense scoring differs
        dense = score(graphdef, params, r.prompt, r.prompt_mask, r.response)
        assert float(jnp.max(jnp.where(resp, jnp.abs(dense.logp - r.logp), 0))) > 1e-2
        alpha = np.asarray(score_acceptance(graphdef, params, r.prompt, r.prompt_mask,
                                            r.response, record))
        valid = alpha[np.asarray(resp)]
        assert valid.min() < 0.999 and valid.max() <= 1 + 1e-5 and valid.min() > 0
    record = np.moveaxis(np.asarray(r.record.pages), 0, 1)  # [L, N, Hkv, M, K]
    assert np.all(record[0] == -1) and np.all(record[1:, :, :, 0] >= -1)
    used = (record[1:] >= 0).sum(-1)[:, np.asarray(resp)[:, :-1].nonzero()[0]]
    assert used.max() == 1 + 3 + 2  # sink + top-3 + 2 newest once long enough
    # the memory plan counts exactly these buffers: the selection record and the page keys
    n, (p, m) = r.response.shape[0], (r.prompt.shape[1], SAMPLING.max_new_tokens)
    cfg = nnx.merge(graphdef, params).config
    est = memory_plan.estimate("rollout", cfg, batch=n, prompt_len=p, new_tokens=m,
                               compression=SPARROW, num_samples=SAMPLING.num_samples)
    assert est.parts["record"] == record.nbytes
    state = jax.eval_shape(lambda: init_state(
        SPARROW, num_layers=cfg.num_layers, batch=n, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=cfg.head_dim, max_len=p + m))
    page_keys = state.cache.page_keys  # kept by the cache (tests/test_models_kv_view.py)
    per_row = page_keys.size * page_keys.dtype.itemsize // n
    assert est.parts["page_keys"] == per_row * (n + n // SAMPLING.num_samples)


def test_dense_regime_equals_dense_sampler(tmp_path_factory):
    """Every row short enough (ceil(L / 16) <= k + 3): sparrow == the dense cache."""
    graphdef, params = _tiny(tmp_path_factory, 4, 2)
    prompt, mask = left_padded_batch(np.random.default_rng(0), [11, 5, 8], width=11)
    wide = CompressionConfig(method="sparrow", page_size=4,
                             sparrow=SparrowConfig(budget_schedule=((0, 9),), dense_layers=()))
    sampling = SamplingConfig(max_new_tokens=12, num_samples=2, prompt_bucket=4,
                              record_evictions=True)
    sparse = generate(graphdef, params, prompt, mask, jax.random.key(5), sampling, wide)
    dense = generate(graphdef, params, prompt, mask, jax.random.key(5), sampling,
                     CompressionConfig(method="none"))
    np.testing.assert_array_equal(np.asarray(sparse.response), np.asarray(dense.response))
    np.testing.assert_allclose(np.asarray(sparse.logp), np.asarray(dense.logp), atol=1e-5)
    alpha = score_acceptance(graphdef, params, sparse.prompt, sparse.prompt_mask,
                             sparse.response, sparse.record)
    np.testing.assert_allclose(np.asarray(alpha)[np.asarray(sparse.response_mask) > 0], 1.0,
                               atol=1e-5)


def test_decode_compiles_once_per_schedule(tmp_path_factory):
    """k changes between bins inside one rollout (and rollouts repeat) without recompiling the
    decode loop: one compile per schedule (the schedule is part of the static config)."""
    graphdef, params = _tiny(tmp_path_factory, 4, 2)
    prompt, mask = left_padded_batch(np.random.default_rng(1), [11, 5], width=11)
    sampling = SamplingConfig(max_new_tokens=22, prompt_bucket=4,  # lengths 13 .. 34 cross 32
                              record_evictions=True)
    with count_compiles() as compiles:
        for seed in (1, 2):
            r = generate(graphdef, params, prompt, mask, jax.random.key(seed), sampling, SPARROW)
    used = (np.asarray(r.record.pages)[0, 1, 0] >= 0).sum(-1)  # row 0, layer 1, head 0: [M]
    assert {1 + 1 + 2, 1 + 3 + 2} <= set(used.tolist())  # k = 1, then k = 3 in one rollout
    assert compiles["jit(decode_loop)"] == 1, compiles
