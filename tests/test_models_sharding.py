"""Params sharded over 8 fake CPU devices (fsdp=4, tensor=2) give the transformers logits."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import models

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import sys
    import jax
    jax.config.update("jax_default_matmul_precision", "highest")
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.sharding import PartitionSpec as P
    import models
    from tiny_hf import hf_logits, left_padded_batch, make_tiny_hf, positions_from_mask

    assert jax.device_count() == 8
    path = make_tiny_hf(sys.argv[1], "qwen2")
    mesh = models.make_mesh(fsdp=4, tensor=2)
    model = models.load_pretrained(path, dtype=jnp.float32, mesh=mesh)
    q = model.layers.self_attn.q_proj.kernel[...]  # layer-stacked: [L, H, Hq * D]
    assert q.sharding.spec == P(None, "fsdp", "tensor"), q.sharding
    assert {s.data.shape for s in q.addressable_shards} == {(2, 16, 32)}
    assert model.embed_tokens.embedding[...].sharding.spec == P("tensor", "fsdp")
    assert model.layers.mlp.down_proj.kernel[...].sharding.spec == P(None, "tensor", "fsdp")
    assert model.layers.self_attn.k_proj.bias[...].sharding.spec == P(None, "tensor")
    assert model.norm.weight[...].sharding.spec == P()
    # a dimension the axis does not divide falls back to replicated on that dim
    assert models.partition_spec("layers/0/mlp/up_proj/kernel", (64, 5), mesh) == P("fsdp")
    assert models.partition_spec("layers/0/mlp/up_proj/kernel", (10, 64), mesh) == P(None, "tensor")
    try:
        models.make_mesh(data=3)
        raise AssertionError("make_mesh(data=3) accepted 8 devices")
    except ValueError as e:
        assert str(e).startswith("fsdp:"), e

    graphdef, params = nnx.split(model)
    fwd = jax.jit(lambda p, t, pos: nnx.merge(graphdef, p)(t, pos).logits)
    tokens, mask = left_padded_batch(np.random.default_rng(0), [12, 9, 4, 12], 12)
    got = np.asarray(fwd(params, tokens, positions_from_mask(mask)))
    ref = hf_logits(path, tokens, mask)
    err = np.abs(got - ref)[mask == 1].max()
    assert err <= 1e-4, err
    print("sharded max abs diff", err)
""")


def test_sharded_params_match_transformers(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           # appended, so the child keeps conftest's fast-compile flag
           "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")
           + " --xla_force_host_platform_device_count=8",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "sharded max abs diff" in proc.stdout


def test_make_mesh_validates_sizes():
    with pytest.raises(ValueError, match="mesh axis data=0 must be a positive int or -1"):
        models.make_mesh(data=0)
    with pytest.raises(ValueError, match="mesh axis tensor=-1 must not be -1 as fsdp is: only "
                                         "one mesh axis may be -1"):
        models.make_mesh(fsdp=-1, tensor=-1)
    with pytest.raises(ValueError, match="need 2 devices, have 1"):
        models.make_mesh(fsdp=2)
    mesh = models.make_mesh()
    assert dict(mesh.shape) == {"data": 1, "fsdp": 1, "tensor": 1}


def test_every_param_has_a_rule_and_unknown_paths_are_rejected():
    mesh = models.make_mesh()
    with pytest.raises(ValueError, match="no partition rule matches parameter 'foo/bar'"):
        models.partition_spec("foo/bar", (4,), mesh)
    cfg = models.ModelConfig("qwen3", 128, 64, 128, 2, num_heads=4, num_kv_heads=2, head_dim=16,
                             qk_norm=True)
    abstract = nnx.eval_shape(lambda: models.Decoder(cfg, rngs=nnx.Rngs(0)))
    shardings = jax.tree.leaves(models.param_shardings(nnx.state(abstract), mesh))
    assert len(shardings) == 11 + 3 and all(s.mesh == mesh for s in shardings)
    assert models.partition_spec("layers/0/self_attn/q_norm/weight", (16,), mesh) == P()
    assert models.partition_spec("layers/self_attn/q_norm/weight", (2, 16), mesh) == P()
