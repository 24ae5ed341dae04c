"""The Pallas page kernels (``models.paged_kernels``), run in Pallas interpret mode on CPU,
against the XLA path: a static paged cache's decode step (ragged rows, empty slots), page-pool
rows (tables out of order, unmapped entries) and a tiny model's decode log-probs; plus the
``model.attention`` choice and the shapes a kernel refuses. (Sparrow's selected pages:
``tests/test_sparrow.py``.)"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from models.attention import reference_attention
from models.attention_backends import KernelShapes, resolve_attention
from models.config import ModelConfig
from models.page_pool import PagePoolCache
from models.paged_cache import PagedKVCache, init_paged_cache
from models.paged_kernels import paged_kernel_attention
from sparse_rl_jax.core.config_io import ConfigError, from_dict
from sparse_rl_jax.training.run_config import ModelSection, RunConfig
from tiny_hf import make_tiny_hf

KERNELS = ("gpu", "tpu")


@pytest.mark.parametrize("kernel", KERNELS)
def test_paged_cache_decode_step_equals_xla(kernel):
    """Rows of 13, 5 and no tokens (one slot emptied inside a page): the kernel reading the
    cache's pages in place == the chunked XLA loop == the einsum oracle over every slot."""
    rng = np.random.default_rng(3)
    n_layers, b, hkv, g, d, ps, c = 2, 3, 2, 2, 16, 4, 24
    lengths = np.array([13, 5, 0])
    k, v = (jnp.asarray(rng.normal(size=(n_layers, b, hkv, c, d)), jnp.float32)
            for _ in range(2))
    pos = np.where(np.arange(c) < lengths[:, None], np.arange(c), -1)
    pos[0, 6] = -1  # an evicted slot
    cache = PagedKVCache(k=k, v=v, pos=jnp.asarray(pos, jnp.int32),
                         index=jnp.zeros((), jnp.int32), page_size=ps)
    q = jnp.asarray(rng.normal(size=(b, 1, hkv * g, d)), jnp.float32)
    q_pos = jnp.asarray(lengths - 1)[:, None]
    layer = jnp.asarray(1)
    got = np.asarray(cache.read(layer, q, q_pos, f"pallas_{kernel}"))
    np.testing.assert_allclose(got, np.asarray(cache.read(layer, q, q_pos, "blockwise")),
                               atol=1e-5)
    np.testing.assert_allclose(got, np.asarray(cache.read(layer, q, q_pos, "reference")),
                               atol=1e-5)
    assert not got[2].any()  # a padding query sees nothing


@pytest.mark.parametrize("kernel", KERNELS)
def test_pool_rows_equal_xla_over_gathered_pages(kernel):
    """Pool pages ``[L, Hkv, N, page_size, D]`` through ``[B, R]`` tables out of order, with
    unmapped entries (``N``), ragged rows and an empty slot == the reference attention over
    each row's pages gathered into a contiguous ``[B, Hkv, R * page_size, D]``."""
    rng = np.random.default_rng(4)
    n_layers, n, hkv, ps, d, g = 2, 9, 2, 4, 16, 3
    tables = np.array([[7, 2, 5, n], [0, n, n, n], [8, 4, 1, 3]], np.int32)
    b, r = tables.shape
    lengths = np.array([11, 3, 16])
    pos = np.where(np.arange(r * ps) < lengths[:, None], np.arange(r * ps), -1)
    pos[0, 4] = -1
    kp, vp = (rng.normal(size=(n_layers, hkv, n, ps, d)).astype(np.float32) for _ in range(2))
    q = rng.normal(size=(b, 1, hkv * g, d)).astype(np.float32)
    q_pos = (lengths - 1)[:, None]
    layer = 1
    got = paged_kernel_attention(
        jnp.asarray(q), jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(layer),
        jnp.asarray(tables)[:, None], jnp.asarray(pos, jnp.int32)[:, None], jnp.asarray(q_pos),
        jnp.asarray(-(-lengths // ps)), kernel=kernel)

    def gather(pages):  # unmapped pages read as zeros
        padded = np.concatenate([pages[layer], np.zeros((hkv, 1, ps, d), np.float32)], 1)
        return padded[:, tables].transpose(1, 0, 2, 3, 4).reshape(b, hkv, r * ps, d)

    head_pos = np.broadcast_to(pos[:, None], (b, hkv, r * ps))
    want = reference_attention(jnp.asarray(q), jnp.asarray(gather(kp)), jnp.asarray(gather(vp)),
                               jnp.asarray(q_pos), jnp.asarray(head_pos))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    # the pool's own decode read: the kernel over its pages in place == its XLA chunked read
    pool = PagePoolCache(k=jnp.asarray(kp), v=jnp.asarray(vp), pages=jnp.asarray(tables),
                         pos=jnp.asarray(pos, jnp.int32), index=jnp.asarray(lengths),
                         page_size=ps)
    args = (jnp.asarray(layer), jnp.asarray(q), jnp.asarray(q_pos))
    np.testing.assert_allclose(np.asarray(pool.read(*args, f"pallas_{kernel}")),
                               np.asarray(pool.read(*args, "blockwise")), atol=1e-5)


def test_model_decode_log_probs_equal_xla(tmp_path):
    """A tiny GQA model (head_dim 16): prefill of ragged left-padded prompts, then decode
    steps through a paged cache of 16-slot pages; the GPU kernel's log-probs == XLA's."""
    path = make_tiny_hf(tmp_path, "qwen2", tokenizer=False, std=0.2)
    graphdef, params = nnx.split(models.load_pretrained(path, dtype=jnp.float32))
    cfg = nnx.merge(graphdef, params).config
    rng = np.random.default_rng(5)
    lengths, width, steps = np.array([9, 4]), 9, 3
    prompt = rng.integers(6, 120, size=(2, width)).astype(np.int32)
    positions = np.arange(width) - (width - lengths[:, None])
    positions = np.where(positions >= 0, positions, -1).astype(np.int32)
    tokens = rng.integers(6, 120, size=(2, steps)).astype(np.int32)

    def log_probs(backend):
        @jax.jit
        def forward(tokens, positions, kv):
            out = nnx.merge(graphdef, params)(tokens, positions, kv=kv,
                                              attention_backend=backend)
            return jax.nn.log_softmax(out.logits[:, -1]), out.kv

        kv = init_paged_cache(cfg.num_layers, 2, cfg.num_kv_heads, width + steps,
                              cfg.head_dim, page_size=16)
        _, kv = forward(jnp.asarray(prompt), jnp.asarray(positions), kv)
        got = []
        for s in range(steps):
            step, kv = forward(jnp.asarray(tokens[:, s:s + 1]),
                               jnp.asarray(lengths + s)[:, None], kv)
            got.append(step)
        return np.stack(got)

    np.testing.assert_allclose(log_probs("pallas_gpu"), log_probs("blockwise"), atol=1e-5)


SHAPES = KernelShapes(page_size=16, num_q_heads=4, num_kv_heads=2, head_dim=128)


def test_resolve_attention_picks_the_platforms_kernel_and_xla_elsewhere():
    assert resolve_attention("auto", "gpu", SHAPES) == "pallas_gpu"
    assert resolve_attention("auto", "tpu", SHAPES) == "pallas_tpu"
    assert resolve_attention("auto", "cpu", SHAPES) == "blockwise"
    assert resolve_attention("xla", "gpu", SHAPES) == "blockwise"
    odd = KernelShapes(page_size=12, num_q_heads=4, num_kv_heads=2, head_dim=128)
    assert resolve_attention("auto", "gpu", odd) == "blockwise"  # auto falls back, no error


@pytest.mark.parametrize("choice,platform,shapes,says", [
    ("pallas_tpu", "gpu", SHAPES, "runs on 'tpu' only, this platform is 'gpu'"),
    ("pallas_gpu", "cpu", None, "runs on 'gpu' only"),
    ("pallas_gpu", "gpu", KernelShapes(16, 4, 2, 80), "head_dim=80"),
    ("pallas_gpu", "gpu", KernelShapes(8, 4, 2, 64), "page_size=8"),
    ("pallas_tpu", "tpu", KernelShapes(16, 4, 2, 64), "head_dim=64"),
    ("pallas_gpu", "gpu", KernelShapes(16, 6, 4, 64), "num_q_heads=6"),
    ("triton", "gpu", SHAPES, "must be one of"),
])
def test_a_kernel_that_cannot_run_is_an_error_naming_the_key(choice, platform, shapes, says):
    with pytest.raises(ValueError, match="model.attention") as err:
        resolve_attention(choice, platform, shapes)
    assert says in str(err.value)
    if "must be one of" not in says:  # names the choices that do work here
        assert "choices that do: ('auto', 'xla'" in str(err.value)


def test_model_section_names_the_key_and_the_choices_that_work():
    """``model.attention`` takes the registry's choices when the config is read (no JAX
    backend touched then: ``jax.distributed.initialize`` comes after); ``backend`` refuses a
    kernel off its platform or for the model's shapes, naming the key."""
    with pytest.raises(ConfigError, match=r"model.attention: 'flash' is not one of \['auto', "
                       r"'xla', 'pallas_gpu', 'pallas_tpu'\]"):
        from_dict(RunConfig, {"model": {"attention": "flash"}})
    heads = ModelConfig("llama", 64, 512, 32, 2, num_heads=4, num_kv_heads=2, head_dim=128)
    with pytest.raises(ConfigError, match=r"model.attention='pallas_tpu' cannot run here: its "
                       r"kernel runs on 'tpu' only, this platform is 'cpu'; choices that do: "
                       r"\('auto', 'xla'\)"):
        ModelSection(attention="pallas_tpu").backend("cpu", heads, 16)
    with pytest.raises(ConfigError, match=r"model.attention='pallas_gpu' .*page_size=12"):
        ModelSection(attention="pallas_gpu").backend("gpu", heads, 12)
    assert ModelSection(attention="pallas_gpu").backend("gpu", heads, 16) == "pallas_gpu"
    assert ModelSection(attention="auto").backend("tpu", heads, 16) == "pallas_tpu"
    assert ModelSection().backend("gpu", heads, 16) == "blockwise"  # the default: xla


def test_cache_check_refuses_a_head_dim_the_kernel_cannot_take():
    cfg = ModelConfig("llama", 64, 32, 32, 2, num_heads=4, num_kv_heads=2, head_dim=8)
    cache = init_paged_cache(2, 1, 2, 32, 8, page_size=16)
    with pytest.raises(ValueError, match="PagedKVCache.*pallas_gpu.*head_dim=8"):
        cache.check(cfg, 1, 1, "pallas_gpu")
    cache.check(cfg, 1, 1, "blockwise")


@pytest.mark.parametrize("kernel,platform,call", [
    ("gpu", "cuda", "xla.gpu.triton"), ("tpu", "tpu", "tpu_custom_call")])
def test_kernels_lower_for_their_compiler_at_model_shapes(kernel, platform, call):
    """From this CPU, each kernel lowers (Triton IR / Mosaic MLIR built in Python) at
    Qwen2.5-1.5B heads in bf16, for pool pages and for the static cache's folded pages with
    Sparrow's per-head tables: one custom call of its compiler, not Mosaic GPU for Triton.
    The chip is an abstract device (jax >= 0.12 reads the GPU's compute capability from it
    when no GPU is attached). (Compiling that IR and running it needs the device.)"""
    chip = {"cuda": "NVIDIA H100", "tpu": "TPU v5 lite"}[platform]
    target = jax.sharding.AbstractMesh(
        (1,), ("x",), (jax.sharding.AxisType.Explicit,),
        abstract_device=jax.sharding.AbstractDevice(chip, None, platform))
    b, hq, hkv, d, ps, n, r = 4, 12, 2, 128, 16, 64, 8
    spec = jax.ShapeDtypeStruct
    for hp, ht in ((hkv, 1), (1, hkv)):
        pages = spec((2, hp, n, ps, d), jnp.bfloat16)
        args = (spec((b, 1, hq, d), jnp.bfloat16), pages, pages, spec((), jnp.int32),
                spec((b, ht, r), jnp.int32), spec((b, ht, r * ps), jnp.int32),
                spec((b, 1), jnp.int32), spec((b,), jnp.int32))
        lower = jax.jit(lambda *a: paged_kernel_attention(*a, kernel=kernel, interpret=False))
        with jax.sharding.use_abstract_mesh(target):
            text = lower.trace(*args).lower(lowering_platforms=(platform,)).as_text()
        calls = [line for line in text.splitlines() if "stablehlo.custom_call" in line]
        assert len(calls) == 1 and call in calls[0], calls
