"""Quantized KV (``compression.quant``) in the paged layouts: the paged cache, the continuous
engine's page pool and Sparrow's page-sparse cache over either. Oracle: the same view at full
precision fed the keys and values ``models.kv_quant.fake_quant`` gives (itself tested against
NumPy in ``test_kv_quant``): a quantized view must read exactly those, chunked or over every
slot, and Sparrow must select its pages by the means of those keys. Plus what a quantized page
stores, what the pool copies from a prefill, the bytes of a page; the GPU page kernel reading
int8 / fp8 pages as the XLA path does, and the levels each kernel refuses."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from models.config import ModelConfig
from models.kv_quant import fake_quant, get_quant
from models.page_pool import init_page_pool
from models.page_sparse import page_sparse_attention, page_sparse_cache
from models.paged_cache import init_paged_cache
from sparse_rl_jax.kv.compression_config import CompressionConfig
from sparse_rl_jax.training.memory_plan import engine_sizes, page_bytes
from sparse_rl_jax.training.model_section import ModelSection
from test_models_page_pool import _all_layers, _steps
from test_models_paged_cache import LAYER, B, D, L, _config, _forward

HQ, HKV, PS, MAX_LEN = 4, 2, 4, 20
R = MAX_LEN // PS


def _views(kind: str, quant: str, ps: int = PS):
    """An empty ``kind`` view (``paged`` / ``pool``) storing ``quant`` in ``ps``-token pages;
    the pool maps each row's pages to scattered pool pages."""
    if kind == "paged":
        return init_paged_cache(L, B, HKV, MAX_LEN, D, page_size=ps, chunk_pages=2, quant=quant)
    r = MAX_LEN // ps
    table = np.random.default_rng(3).permutation(2 * r)[:B * r].reshape(B, r)
    return init_page_pool(L, B, HKV, MAX_LEN, D, 2 * r, page_size=ps, chunk_pages=2,
                          quant=quant).replace(pages=jnp.asarray(table, jnp.int32))


@pytest.mark.parametrize("backend", ["blockwise", "reference"])
@pytest.mark.parametrize("kind", ["paged", "pool"])
@pytest.mark.parametrize("quant", ["int8", "fp8", "int4"])
def test_quantized_view_reads_the_fake_quantized_keys(quant, kind, backend):
    rng = np.random.default_rng(len(quant))
    cfg = _config(HQ, HKV)
    coded, exact = _views(kind, quant), _views(kind, "none")
    for q, k, v, q_pos in _steps(rng, 7, np.array([7, 3]), [1, 1, 4, 1], HQ, HKV):
        k = k * rng.uniform(0.1, 8.0, size=k.shape[:-1] + (1,)).astype(np.float32)
        got, coded = _forward(coded, cfg, LAYER, q, k, v, q_pos, backend)
        want, exact = _forward(exact, cfg, LAYER, q, *map(np.asarray, fake_quant(quant, k, v)),
                               q_pos, backend)
        np.testing.assert_array_equal(got, want)
    fmt = get_quant(quant)
    assert coded.k.dtype == jnp.dtype(fmt.code_dtype)
    assert coded.k.shape[-1] == D // fmt.per_byte and coded.k_scale.shape == coded.k.shape[:-1]
    assert coded.k_scale.dtype == jnp.bfloat16 and float(jnp.max(coded.k_scale)) > 0


def test_sparrow_on_quantized_pages_selects_by_the_keys_attention_reads():
    """On the paged cache (the pool's Sparrow rows: ``test_kv_quant_replay``'s engine rows)."""
    rng = np.random.default_rng(8)
    views = [page_sparse_cache(_views("paged", quant, ps=2), max_k=2, dense_layers=(0,),
                               dtype=jnp.float32).replace(budget=jnp.asarray([2, 1], jnp.int32))
             for quant in ("int4", "none")]
    for _, _, _, q_pos in _steps(rng, 9, np.array([9, 4]), [1] * 4, HQ, HKV):
        t = q_pos.shape[1]
        tokens = [(rng.normal(size=(B, t, HQ, D)).astype(np.float32),
                   *(rng.normal(size=(B, HKV, t, D)).astype(np.float32) for _ in range(2)))
                  for _ in range(L)]
        faked = [(q, *map(np.asarray, fake_quant("int4", k, v))) for q, k, v in tokens]
        (got, views[0]), (want, views[1]) = (_all_layers(views[0], q_pos, tokens),
                                             _all_layers(views[1], q_pos, faked))
        np.testing.assert_array_equal(views[0].selected, views[1].selected)
        np.testing.assert_allclose(views[0].page_keys, views[1].page_keys, atol=1e-6)
        np.testing.assert_allclose(np.stack(got), np.stack(want), atol=1e-6)
    assert views[0].page_keys.dtype == jnp.float32 and views[0].page_keys.shape[-1] == D
    # row 0 (13 tokens, 7 pages) is sparse: 2 of its 4 middle pages left out at the last step
    assert (np.asarray(views[0].selected)[1:, 0] >= 0).sum(-1).max() == 2 + 3


def test_put_rows_copies_codes_and_scales_and_refuses_another_level():
    rng = np.random.default_rng(2)
    cfg = _config(HQ, HKV)
    paged = init_paged_cache(L, B, HKV, MAX_LEN, D, page_size=PS, quant="int8")
    _, paged = _forward(paged, cfg, LAYER, *next(_steps(rng, 6, np.array([6, 2]), [], HQ, HKV)))
    pool = init_page_pool(L, B, HKV, MAX_LEN, D, 2 * R, page_size=PS, quant="int8")
    table = np.full((B, R), 2 * R, np.int32)
    table[0, :2], table[1, :1] = [7, 2], [4]
    pool = pool.replace(pages=jnp.asarray(table)).put_rows(paged, jnp.asarray([0, 1]))
    np.testing.assert_array_equal(pool.k[:, :, 2], paged.k[:, 0, :, PS:2 * PS])
    np.testing.assert_array_equal(pool.k_scale[:, :, 2], paged.k_scale[:, 0, :, PS:2 * PS])
    np.testing.assert_array_equal(pool.v_scale[:, :, 4], paged.v_scale[:, 1, :, :PS])
    with pytest.raises(ValueError, match="the rows store quant 'none', the pool 'int8'"):
        pool.put_rows(init_paged_cache(L, B, HKV, MAX_LEN, D, page_size=PS), jnp.asarray([0]))
    with pytest.raises(ValueError, match="PagedKVCache.k: expected"):
        paged.check(_config(HQ, HKV).__class__("llama", 64, HQ * 6, 32, L, num_heads=HQ,
                                               num_kv_heads=HKV, head_dim=6), B, 1, "blockwise")


def test_a_quantized_page_costs_its_codes_and_scales_and_the_pool_gets_more_pages():
    cfg = ModelConfig("llama", 512, 256, 512, 2, num_heads=2, num_kv_heads=1, head_dim=128)
    bf16 = page_bytes(cfg, 16, jnp.bfloat16)
    assert bf16 == 2 * 2 * 1 * 16 * 128 * 2
    assert page_bytes(cfg, 16, jnp.bfloat16, "int8") == 2 * 2 * 16 * (128 + 2)
    assert page_bytes(cfg, 16, jnp.bfloat16, "int4") == 2 * 2 * 16 * (64 + 2)
    sizes = {quant: engine_sizes(cfg, 2 ** 24, rows=64, prompt_len=64, new_tokens=192,
                                 compression=CompressionConfig(method="none", quant=quant),
                                 dtype=jnp.bfloat16, num_samples=1, record_evictions=False)
             for quant in ("none", "int8", "int4")}
    # the same limit: more pages (and slots) the fewer bytes a page costs (the other parts of
    # the plan, the prefill's activations first, grow with the slots: not the pages' ratio)
    assert sizes["none"][0] < sizes["int8"][0] < sizes["int4"][0]
    assert sizes["none"][1] < sizes["int8"][1] < sizes["int4"][1]
    assert bf16 / page_bytes(cfg, 16, jnp.bfloat16, "int8") >= 1.9
    assert bf16 / page_bytes(cfg, 16, jnp.bfloat16, "int4") >= 3.5


@pytest.mark.parametrize("quant", ["int8", "fp8"])
@pytest.mark.parametrize("kind", ["paged", "pool", "sparrow"])
def test_gpu_page_kernel_reads_quantized_pages_as_xla(kind, quant):
    """A decode step read in place by the GPU kernel (interpreted here) with the scale pages
    beside the code pages == the XLA path, which decodes chunk by chunk."""
    rng = np.random.default_rng(11)
    cfg, hq, hkv, d = _config(4, 2).__class__("llama", 64, 4 * 16, 32, L, num_heads=4,
                                              num_kv_heads=2, head_dim=16), 4, 2, 16
    view = (init_page_pool(L, B, hkv, 96, d, 13, page_size=16, quant=quant).replace(
        pages=jnp.asarray([[5, 0, 3, 9, 13, 13], [2, 6, 7, 13, 13, 13]], jnp.int32))
        if kind == "pool" else init_paged_cache(L, B, hkv, 96, d, page_size=16, quant=quant))

    def tokens(t):
        return [rng.normal(size=shape).astype(np.float32)
                for shape in ((B, t, hq, d), (B, hkv, t, d), (B, hkv, t, d))]

    lengths = np.array([61, 20])  # ragged rows: row 1 left-padded by 41
    prefill = np.where(np.arange(61) >= 61 - lengths[:, None],
                       np.arange(61) - (61 - lengths[:, None]), -1).astype(np.int32)
    _, view = _forward(view, cfg, LAYER, *tokens(61), prefill, "blockwise")
    step, step_pos = tokens(1), lengths[:, None].astype(np.int32)
    if kind == "sparrow":  # the sink, 1 of row 0's middle pages 1-2, the 2 newest
        view = view.write(jnp.asarray(LAYER), jnp.asarray(step[1]), jnp.asarray(step[2]),
                          jnp.asarray(step_pos))
        page_keys = jnp.asarray(rng.normal(size=(B, hkv, 6, d)), jnp.float32)
        (want, pages), (got, _) = (page_sparse_attention(
            jnp.asarray(step[0]), view, jnp.asarray(step_pos), jnp.asarray(LAYER), page_keys,
            jnp.ones((B,), jnp.int32), max_k=1, backend=backend)
            for backend in ("blockwise", "pallas_gpu"))
        assert (np.asarray(pages)[0, :, 1] >= 1).all()
    else:
        want, _ = _forward(view, cfg, LAYER, *step, step_pos, "blockwise")
        got, _ = _forward(view, cfg, LAYER, *step, step_pos, "pallas_gpu")
    assert np.abs(np.asarray(want)).max() > 0.1
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_page_kernels_refuse_levels_they_cannot_read():
    heads = _config(4, 2).__class__("llama", 64, 4 * 64, 32, L, num_heads=4, num_kv_heads=2,
                                    head_dim=64)
    with pytest.raises(ValueError, match=r"model\.attention.*compression.quant='int4'.*"
                                         r"gpu page kernel reads: \('none', 'int8', 'fp8'\)"):
        ModelSection(attention="pallas_gpu").backend("gpu", heads, 16, "int4")
    assert ModelSection(attention="pallas_gpu").backend("gpu", heads, 16, "fp8") == "pallas_gpu"
    assert ModelSection(attention="auto").backend("gpu", heads, 16, "int4") == "blockwise"
    with pytest.raises(ValueError, match=r"model\.attention.*tpu page kernel reads: \('none',\)"):
        ModelSection(attention="pallas_tpu").backend("tpu", heads, 16, "int8")
    with pytest.raises(ValueError, match="PagedKVCache.*compression.quant='int4'"):
        init_paged_cache(L, B, 2, 16, 64, page_size=16, quant="int4").check(
            heads, B, 1, "pallas_gpu")
