"""The mismatch of a quantized, evicting rollout split by source (``mismatch_sources``): the
sampler against each replay with one source removed, on the rollout's own rows, against
NumPy's k3 of direct ``score`` calls under the same records; logged by ``collect_rollouts``
only where the record was kept."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparse_rl_jax.kv.state import QuantRecord
from sparse_rl_jax.rollout.scoring import score
from sparse_rl_jax.training.collect_rounds import collect_rollouts
from sparse_rl_jax.training.mismatch_sources import SOURCE_ROWS, k3
from tiny_rl import step_context, tiny_task_policy


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return tiny_task_policy(tmp_path_factory.mktemp("sources"), dtype=jnp.float32)


def _numpy_k3(replay, sampler, mask):
    log_r = np.clip(np.asarray(replay, np.float64) - np.asarray(sampler, np.float64), -20, 20)
    valid = np.asarray(mask).astype(bool)
    return (np.exp(log_r) - log_r - 1.0)[valid].mean()


def test_k3_is_numpys():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(3, 5)) - 2, rng.normal(size=(3, 5)) - 2
    mask = rng.random((3, 5)) < 0.7
    np.testing.assert_allclose(k3(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32),
                                  jnp.asarray(mask)), _numpy_k3(a, b, mask), rtol=1e-5)


SPARROW = ("compression.method=sparrow", "compression.page_size=2",
           "compression.sparrow.budget_schedule=[[0,0]]", "compression.sparrow.dense_layers=[]")


@pytest.mark.parametrize("method", [(), SPARROW], ids=["rkv", "sparrow"])
def test_each_source_is_replayed_alone_on_the_first_rows(policy, method):
    """R-KV's eviction, or Sparrow's page selection (sink + 2 newest 2-token pages), is one
    source; int4 codes the other."""
    _, _, graphdef, params = policy
    # shadow_mask hands the rows' record to the update batch, where this test reads it
    ctx = step_context(policy, *method, "compression.quant=int4",
                       "sampling.record_evictions=true", "correction.kind=shadow_mask")
    batch, metrics, _ = collect_rollouts(ctx, params, 0)
    assert batch.record.quant == "int4"
    rows = slice(0, SOURCE_ROWS)
    args = (graphdef, params, batch.prompt[rows], batch.prompt_mask[rows],
            batch.response[rows])
    kw = dict(chunk_size=ctx.cfg.trainer.logp_chunk, temperature=ctx.sampling.temperature)
    evict_only = score(*args, jax.tree.map(lambda x: x[rows], batch.record.replace(quant="none")),
                       **kw).logp
    quant_only = score(*args, QuantRecord(quant="int4"), **kw).logp
    sampler, mask = batch.logp_sparse[rows], batch.loss_mask[rows]
    # what quantization adds: the sampler against its eviction alone; and the reverse
    np.testing.assert_allclose(metrics["mismatch_k3_from_quant"],
                               _numpy_k3(evict_only, sampler, mask), rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(metrics["mismatch_k3_from_eviction"],
                               _numpy_k3(quant_only, sampler, mask), rtol=1e-4, atol=1e-7)
    assert metrics["mismatch_k3_from_quant"] > 0 and metrics["mismatch_k3_from_eviction"] > 0
    if method:
        return
    # without the record (the default), the split is not logged
    _, plain, _ = collect_rollouts(step_context(policy, "compression.quant=int4"), params, 0)
    assert "mismatch_k3_from_quant" not in plain and "kv_quant_key_error" in plain
