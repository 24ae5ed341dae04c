"""Shadow-mask training: the learner scores with the rollout's record (``Rollout.record``: on-policy
for the sparse policy, evicting methods and Sparrow alike) and distils toward the dense policy
of the same params.

Oracles: plain GRPO on the same batch (no compression), the sampler's own log-probs (ratio 1
at the first update), and NumPy over the model's full logits (vocabulary KL)."""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import models

from sparse_rl_jax.core.config_io import ConfigError, load_config
from sparse_rl_jax.kv.compression_config import CompressionConfig
from sparse_rl_jax.kv.compression_sections import EvictionConfig, SparrowConfig
from sparse_rl_jax.kv.page_sparsity import PageRecord
from sparse_rl_jax.kv.state import NEVER, EvictionRecord
from sparse_rl_jax.rl.corrections import compute_corrections
from sparse_rl_jax.rl.grpo_loss import LossBatch, grpo_loss
from sparse_rl_jax.rl.loss_config import CorrectionConfig, GRPOLossConfig
from sparse_rl_jax.rl.update_step import Minibatch, update_step
from sparse_rl_jax.rollout.sampler import generate
from sparse_rl_jax.rollout.sampling_config import SamplingConfig
from sparse_rl_jax.rollout.scoring import (concatenate_records, score, sequence_positions,
                                           shadow_logprobs)
from sparse_rl_jax.training.policy import resolve_sampling
from sparse_rl_jax.training.run_config import RunConfig
from tiny_hf import left_padded_batch, tiny_policy

CHUNK = 7  # does not divide the response length: padded chunks are exercised
SGD = optax.sgd(1.0)  # params_after - params_before = -grad
# Two loss configs shared by the tests, so the jitted update compiles once per config.
K3 = GRPOLossConfig(distill_coef=0.1)
FULL = GRPOLossConfig(distill_coef=0.5, distill_kind="full")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    graphdef, params = tiny_policy(tmp_path_factory.mktemp("shadow"))
    prompt, mask = left_padded_batch(np.random.default_rng(0), [11, 5, 8], width=11)
    return graphdef, params, prompt, mask


# Sparrow on the 1-layer tiny policy: pages of 4 tokens, k = 1 (sink + 1 + 2 newest pages).
SPARROW = CompressionConfig(method="sparrow", page_size=4,
                            sparrow=SparrowConfig(budget_schedule=((0, 1),), dense_layers=()))


def _rollout(tiny, method, temperature=1.0, prompts=None):
    graphdef, params, prompt, mask = tiny
    if prompts is not None:
        prompt, mask = prompts
    sampling = SamplingConfig(max_new_tokens=24, num_samples=2, prompt_bucket=4,
                              record_evictions=True, temperature=temperature)
    compression = (SPARROW if method == "sparrow" else CompressionConfig(
        method=method, eviction=EvictionConfig(budget=12, buffer=4, window=4)))
    return generate(graphdef, params, prompt, mask, jax.random.key(3), sampling, compression)


def _minibatch(rollout, logp_old, record, kind="shadow_mask"):
    mask = rollout.response_mask
    adv = jnp.asarray(np.random.default_rng(1).normal(0, 1, mask.shape[0]), jnp.float32)
    corr = compute_corrections(logp_old, rollout.logp, mask, CorrectionConfig(kind=kind))
    loss = LossBatch.from_corrections(logp_old, adv, mask, corr)
    return Minibatch(rollout.prompt, rollout.prompt_mask, rollout.response, loss, record)


_update = jax.jit(update_step, static_argnames=("graphdef", "loss_cfg", "optimizer",
                                                 "chunk_size", "temperature"))


def _step(tiny, batch, cfg, temperature=1.0):
    graphdef, params, _, _ = tiny
    new, _, metrics = _update(graphdef, params, SGD.init(params), batch, loss_cfg=cfg,
                              optimizer=SGD, chunk_size=CHUNK, temperature=temperature)
    delta = jax.tree.map(lambda a, b: np.asarray(a - b), new, params)
    return jax.device_get(metrics), delta


def test_without_compression_shadow_mask_equals_plain_grpo(tiny):
    rollout = _rollout(tiny, "none")
    assert int(rollout.num_compressions) == 0 and rollout.record is None  # nothing to replay
    plain = _minibatch(rollout, rollout.logp, None, kind="none")
    cfg = nnx.merge(tiny[0], tiny[1]).config
    (n, p), (_, m) = rollout.prompt.shape, rollout.response.shape
    evicts_nothing = EvictionRecord(
        jnp.full((n, cfg.num_layers, cfg.num_kv_heads, p + m), NEVER, jnp.int32))
    shadow = _minibatch(rollout, rollout.logp, evicts_nothing)
    m_plain, d_plain = _step(tiny, plain, GRPOLossConfig())
    m_shadow, d_shadow = _step(tiny, shadow, FULL)
    # Sparse == dense here: both distillation measures vanish and the update is GRPO's.
    assert abs(float(m_shadow["distill_kl"])) < 1e-6 and abs(float(m_shadow["distill_k3"])) < 1e-6
    np.testing.assert_allclose(m_shadow["loss"], m_plain["loss"], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(m_shadow["grad_norm"], m_plain["grad_norm"], rtol=1e-4)
    for a, b in zip(jax.tree.leaves(d_shadow), jax.tree.leaves(d_plain)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_ratio_is_one_at_the_first_update_and_distillation_measures_the_gap(tiny, temperature):
    """Also at a sampling temperature other than 1: student, teacher and the sampler's
    recorded log-probs are all the tempered policy."""
    graphdef, params, _, _ = tiny
    rollout = _rollout(tiny, "rkv", temperature)
    assert int(rollout.num_compressions) >= 3
    valid = np.asarray(rollout.response_mask, bool)
    dense = score(graphdef, params, rollout.prompt, rollout.prompt_mask, rollout.response,
                  temperature=temperature).logp
    assert np.max(np.abs(np.asarray(dense - rollout.logp))[valid]) > 1e-2  # a real mismatch
    batch = _minibatch(rollout, rollout.logp, rollout.record)
    metrics, delta = _step(tiny, batch, K3, temperature)
    # On-policy for the sampler: the ratio is 1 up to the replay's float error.
    assert float(metrics["log_ratio_abs_max"]) <= 1e-4
    assert float(metrics["ratio_std"]) <= 1e-4 and float(metrics["clip_fraction"]) == 0.0
    # The teacher is the dense policy of the same params: k3 at the sampled tokens.
    d = np.asarray(rollout.logp - dense, np.float64)[valid]
    np.testing.assert_allclose(metrics["distill_k3"], np.mean(np.exp(-d) - 1 + d), rtol=1e-3)
    assert float(metrics["distill_kl"]) > 1e-3
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(delta))


def test_sparrow_shadow_mask_replays_the_sampler_and_its_first_update_is_on_policy(tiny):
    """Sparrow's record (its pages) goes through the same protocol: shadow-mask's
    dense-with-pages log-probs are the sampler's own (the replay oracle), the dense ones are
    not, and the first update's ratio is 1."""
    graphdef, params, _, _ = tiny
    rollout = _rollout(tiny, "sparrow")
    assert isinstance(rollout.record, PageRecord)
    valid = np.asarray(rollout.response_mask, bool)
    out = shadow_logprobs(nnx.merge(graphdef, params), rollout.prompt, rollout.prompt_mask,
                          rollout.response, rollout.record, chunk_size=CHUNK)
    np.testing.assert_allclose(np.asarray(out.logp_sparse)[valid],
                               np.asarray(rollout.logp)[valid], atol=1e-4)
    assert np.max(np.abs(np.asarray(out.logp_dense - rollout.logp))[valid]) > 1e-2
    metrics, delta = _step(tiny, _minibatch(rollout, rollout.logp, rollout.record), K3)
    assert float(metrics["log_ratio_abs_max"]) <= 1e-4 and float(metrics["distill_k3"]) > 0
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(delta))


@pytest.mark.parametrize("method", ["rkv", "sparrow"])
def test_records_of_rounds_of_different_prompt_widths_replay_concatenated(tiny, method):
    """Dynamic sampling concatenates rounds whose prompts were bucketed to different widths:
    the concatenated record replays every row, left-padded to the widest prompt, to the
    sampler's log-probs."""
    graphdef, params, _, _ = tiny
    wide_prompts = left_padded_batch(np.random.default_rng(4), [15, 7, 13], width=15)
    rounds = [_rollout(tiny, method), _rollout(tiny, method, prompts=wide_prompts)]
    width = max(r.prompt.shape[1] for r in rounds)
    assert rounds[0].prompt.shape[1] < width

    def cat(name, pad=False):
        return jnp.concatenate([
            jnp.pad(getattr(r, name), ((0, 0), (width - r.prompt.shape[1] if pad else 0, 0)))
            for r in rounds])

    replay = score(graphdef, params, cat("prompt", True), cat("prompt_mask", True),
                   cat("response"), concatenate_records([r.record for r in rounds])).logp
    logp, valid = cat("logp"), np.asarray(cat("response_mask"), bool)
    np.testing.assert_allclose(np.asarray(replay)[valid], np.asarray(logp)[valid], atol=1e-4)


def test_gradients_finite_at_extreme_mismatch(tiny):
    rollout = _rollout(tiny, "rkv")
    old = np.asarray(rollout.logp).copy()
    old[0, :3] = -np.inf  # the sampler claims impossible tokens
    old[1, :] = 1e4
    old[2, :] -= 50.0
    batch = _minibatch(rollout, jnp.asarray(old), rollout.record)
    for cfg in (K3, FULL):
        metrics, delta = _step(tiny, batch, cfg)
        assert all(np.isfinite(float(v)) for v in metrics.values())
        assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(delta))
        assert float(metrics["log_ratio_abs_max"]) == 20.0  # clamped


def _np_log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_vocabulary_kl_matches_numpy_over_full_logits_and_teacher_gets_no_gradient(tiny):
    graphdef, params, _, _ = tiny
    rollout = _rollout(tiny, "snapkv")
    args = (rollout.prompt, rollout.prompt_mask, rollout.response, rollout.record)
    out = jax.jit(lambda p: shadow_logprobs(nnx.merge(graphdef, p), *args, chunk_size=CHUNK,
                                            with_kl=True))(params)
    model = nnx.merge(graphdef, params)
    p_len, m = rollout.prompt.shape[1], rollout.response.shape[1]
    tokens = jnp.concatenate([rollout.prompt, rollout.response], axis=1)
    positions = sequence_positions(rollout.prompt_mask, m)
    expiry = rollout.record.replay_view(positions, rollout.prompt_mask.sum(axis=1), m)
    assert isinstance(expiry, models.ExpiryRecord)

    def logits(kv):
        full = model(tokens, positions, kv=kv).logits
        return np.asarray(full[:, p_len - 1 : p_len - 1 + m], np.float64)

    ls, ld = _np_log_softmax(logits(expiry)), _np_log_softmax(logits(None))
    valid = np.asarray(rollout.response_mask, bool)
    kl = (np.exp(ld) * (ld - ls)).sum(-1)
    np.testing.assert_allclose(np.asarray(out.kl_full)[valid], kl[valid], atol=2e-5)
    assert kl[valid].max() > 1e-2  # compression changed the distributions
    targets = np.asarray(rollout.response)[..., None]
    pick = lambda lp: np.take_along_axis(lp, targets, -1)[..., 0]  # noqa: E731
    np.testing.assert_allclose(np.asarray(out.logp_sparse)[valid], pick(ls)[valid], atol=2e-5)
    np.testing.assert_allclose(np.asarray(out.logp_dense)[valid], pick(ld)[valid], atol=2e-5)

    # Gradients: the chunked, rematerialised KL against the unchunked one from full logits.
    # The teacher's log-probs are added with a large weight: any gradient through them
    # would break the equality (the unchunked reference has none).
    w = jnp.asarray(valid, jnp.float32)

    def chunked(p):
        out = shadow_logprobs(nnx.merge(graphdef, p), *args, chunk_size=CHUNK, with_kl=True)
        return jnp.sum(w * (out.kl_full + 1e3 * out.logp_dense))

    def unchunked(p):
        mdl = nnx.merge(graphdef, p)
        teacher = nnx.merge(graphdef, jax.lax.stop_gradient(p))
        cut = lambda x: x[:, p_len - 1 : p_len - 1 + m]  # noqa: E731
        s = jax.nn.log_softmax(cut(mdl(tokens, positions, kv=expiry).logits), -1)
        d = jax.nn.log_softmax(cut(teacher(tokens, positions).logits), -1)
        return jnp.sum(w * jnp.sum(jnp.exp(d) * (d - s), -1)) + jax.lax.stop_gradient(
            1e3 * jnp.sum(w * jnp.take_along_axis(d, rollout.response[..., None], -1)[..., 0]))

    g_chunked = jax.jit(jax.grad(chunked))(params)
    g_full = jax.jit(jax.grad(unchunked))(params)
    for a, b in zip(jax.tree.leaves(g_chunked), jax.tree.leaves(g_full)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_config_keeps_the_record_and_rejects_contradictions():
    shadow = ["correction.kind=shadow_mask"]
    cfg = load_config(RunConfig, None, shadow)
    assert cfg.sampling.record_evictions is None  # auto
    tok = types.SimpleNamespace(eos_ids=[2], pad_id=0)
    assert resolve_sampling(cfg, tok).record_evictions is True
    assert resolve_sampling(RunConfig(), tok).record_evictions is False
    explicit = load_config(RunConfig, None, ["sampling.record_evictions=true"])
    assert resolve_sampling(explicit, tok).record_evictions is True
    with pytest.raises(ConfigError, match=r"sampling\.record_evictions=False cannot be false "
                                          r"with correction\.replay \(shadow_mask"):
        load_config(RunConfig, None, [*shadow, "sampling.record_evictions=false"])
    with pytest.raises(ConfigError, match=r"loss\.distill_coef=0\.1 needs correction\.replay "
                                          r"\(shadow_mask; got correction\.kind="
                                          rf"'{CorrectionConfig().kind}'\)"):
        load_config(RunConfig, None, ["loss.distill_coef=0.1"])
    with pytest.raises(ConfigError, match=r"loss\.distill_kind='full' needs correction\.replay"):
        load_config(RunConfig, None, ["loss.distill_kind=full"])
    with pytest.raises(ConfigError, match=r"loss\.distill_kind='reverse' must be one of"):
        load_config(RunConfig, None, [*shadow, "loss.distill_kind=reverse"])
    assert dataclasses.replace(cfg.loss, distill_coef=0.2).distill_coef == 0.2


def test_entropy_bonus_gradient_through_the_chunked_scorer(tiny):
    """update_step with entropy_coef: the chunked scorer's entropy and its gradient against
    the same loss built from the model's full logits."""
    graphdef, params, _, _ = tiny
    rollout = _rollout(tiny, "rkv")
    batch = _minibatch(rollout, rollout.logp, None, kind="none")
    cfg = GRPOLossConfig(entropy_coef=0.5)
    metrics, delta = _step(tiny, batch, cfg)
    p_len, m = rollout.prompt.shape[1], rollout.response.shape[1]
    tokens = jnp.concatenate([rollout.prompt, rollout.response], axis=1)
    positions = sequence_positions(rollout.prompt_mask, m)

    def reference(p):
        full = nnx.merge(graphdef, p)(tokens, positions).logits[:, p_len - 1 : p_len - 1 + m]
        lp = jax.nn.log_softmax(full, -1)
        logp = jnp.take_along_axis(lp, rollout.response[..., None], -1)[..., 0]
        entropy = -jnp.sum(jnp.exp(lp) * lp, -1)
        return grpo_loss(logp, batch.loss, cfg, entropy=entropy)

    (loss, ref_metrics), grads = jax.jit(jax.value_and_grad(reference, has_aux=True))(params)
    assert float(ref_metrics["entropy_loss"]) > 0
    np.testing.assert_allclose(metrics["loss"], float(loss), rtol=1e-5)
    np.testing.assert_allclose(metrics["entropy_loss"], ref_metrics["entropy_loss"], rtol=1e-5)
    for a, g in zip(jax.tree.leaves(delta), jax.tree.leaves(grads)):
        np.testing.assert_allclose(a, -np.asarray(g), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("overrides, needed", [
    ([], False),  # rkv rollouts, sparse_rl corrections: dense scoring reads no record
    (["compression.method=none"], False),
    (["compression.method=sparrow"], True),  # the acceptance alpha replays the page record
    (["compression.method=sparrow", "compression.alpha.metric='off'"], False),
    (["correction.kind=shadow_mask"], True),
    (["correction.kind=shadow_mask", "compression.method=snapkv"], True),
    (["correction.kind=shadow_mask", "compression.method=sparrow"], True),
])
def test_record_default_is_what_the_run_reads(overrides, needed):
    assert SamplingConfig().record_evictions is None
    cfg = load_config(RunConfig, None, overrides)
    tok = types.SimpleNamespace(eos_ids=[2], pad_id=0)
    assert resolve_sampling(cfg, tok).record_evictions is needed
