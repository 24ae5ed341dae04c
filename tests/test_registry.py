"""Registries instead of string if-chains: a registered policy loss, advantage estimator,
correction kind, eviction score or attention backend is selectable by its config and is what
runs; duplicate and unknown names are clear errors; every config's allowed values are its
registry's names."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.attention import reference_attention
from models.attention_backends import (BACKENDS, AttentionBackend, attention, get_backend,
                                       kernel_backends, register_backend)
from models.config import ModelConfig
from models.paged_cache import init_paged_cache
from models.registry import Registry
from sparse_rl_jax.core.config_checks import FieldError
from sparse_rl_jax.kv.compression_config import CompressionConfig, methods
from sparse_rl_jax.kv.compression_sections import EvictionConfig
from sparse_rl_jax.kv.scores import EVICTION_SCORES, slot_scores
from sparse_rl_jax.rl.advantages import (ESTIMATORS, AdvantageConfig, compute_advantages,
                                         register_estimator)
from sparse_rl_jax.rl.correction_parts import AGGREGATIONS, DIVERGENCES, IS_MODES, Divergence
from sparse_rl_jax.rl.correction_presets import CORRECTION_PRESETS, Preset
from sparse_rl_jax.rl.corrections import compute_corrections
from sparse_rl_jax.rl.grpo_loss import LossBatch, grpo_loss
from sparse_rl_jax.rl.loss_config import CorrectionConfig, GRPOLossConfig
from sparse_rl_jax.rl.loss_terms import KL_ESTIMATORS, POLICY_LOSSES, PolicyLoss
from sparse_rl_jax.training.run_config import ModelSection


@contextlib.contextmanager
def registered(registry: Registry, name: str, entry):
    """``entry`` registered as ``name`` inside the block only."""
    registry.register(name, entry)
    try:
        yield entry
    finally:
        registry.unregister(name)


def test_registry_registers_in_order_and_names_unknown_and_duplicate_names():
    reg = Registry("widget")

    @reg.register("b")
    def b():
        return "b"

    assert b() == "b"  # the decorator returns the function unchanged
    reg.register("a", len)
    assert reg.names() == ("b", "a") and "a" in reg and "c" not in reg
    assert reg.get("a") is len
    with pytest.raises(ValueError, match=r"^widget 'a' is already registered$"):
        reg.register("a", max)
    with pytest.raises(ValueError, match=r"^widget 'c' is not registered; available: "
                                         r"\('b', 'a'\)$"):
        reg.get("c")
    with pytest.raises(ValueError, match="widget name must be a non-empty string"):
        reg.register("", max)
    assert reg.unregister("a") is len and reg.names() == ("b",)
    with pytest.raises(ValueError, match="widget 'a' is not registered"):
        reg.unregister("a")


def _rule(make) -> str:
    """The rule of the FieldError ``make()`` raises."""
    with pytest.raises(FieldError) as info:
        make()
    return info.value.rule


def test_config_allowed_values_are_the_registries_names():
    cases = [
        (lambda: GRPOLossConfig(policy_loss="nope"), POLICY_LOSSES.names()),
        (lambda: GRPOLossConfig(kl_kind="nope"), KL_ESTIMATORS.names()),
        (lambda: CorrectionConfig(kind="nope"), CORRECTION_PRESETS.names()),
        (lambda: CorrectionConfig(is_mode="nope"), IS_MODES.names()),
        (lambda: AdvantageConfig(estimator="nope"), ESTIMATORS.names()),
        (lambda: CompressionConfig(method="nope"), methods()),
    ]
    for make, names in cases:
        assert _rule(make) == f"must be one of {names}"
    assert POLICY_LOSSES.names() == ("ppo_clip", "cispo", "pg")
    assert KL_ESTIMATORS.names() == ("k1", "k2", "k3")
    assert CORRECTION_PRESETS.names() == (
        "none", "tis", "mis", "sparse_rl", "shadow_mask", "ppo_behaviour", "disabled",
        "decoupled_token_is", "decoupled_seq_is", "decoupled_seq_is_rs", "decoupled_geo_rs",
        "ppo_is_bypass", "pg_is", "pg_rs", "icepop", "opsm", "decoupled_geo_rs_veto",
        "decoupled_token_icepop", "decoupled_geo_rs_seq_tis", "decoupled_geo_rs_token_tis",
        "decoupled_k3_rs", "decoupled_k3_rs_seq_tis", "decoupled_k3_rs_token_tis",
        "bypass_ppo_clip", "bypass_ppo_clip_geo_rs", "bypass_ppo_clip_k3_rs", "bypass_pg_is",
        "bypass_pg_token_icepop", "bypass_pg_geo_rs", "bypass_pg_geo_rs_seq_tis",
        "bypass_pg_geo_rs_token_tis", "seq-mask-tis", "seq_mask_tis", "areal_geo_is",
        "adaptive_k3_rs_token_tis")
    assert IS_MODES.names() == ("truncate", "mask", "raw")
    assert AGGREGATIONS.names() == ("token", "seq_sum", "seq_mean", "seq_max")
    assert DIVERGENCES.names() == ("k1", "k2", "k3")
    assert ESTIMATORS.names() == ("grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")
    assert methods() == ("none", *EVICTION_SCORES.names(), "sparrow")
    assert EVICTION_SCORES.names() == ("snapkv", "rkv", "streaming")
    assert BACKENDS.names() == ("blockwise", "fused", "reference", "pallas_gpu", "pallas_tpu")
    assert _rule(lambda: ModelSection(attention="nope")) == (
        f"must be one of {('auto', 'xla') + kernel_backends()}")
    assert kernel_backends() == ("pallas_gpu", "pallas_tpu")


def test_duplicate_names_are_refused_with_the_kind_and_name():
    with pytest.raises(ValueError, match="policy loss 'cispo' is already registered"):
        POLICY_LOSSES.register("cispo", PolicyLoss(lambda *a: a))
    with pytest.raises(ValueError, match="advantage estimator 'grpo' is already registered"):
        register_estimator("grpo", default_scale="none")(lambda *a: a)
    with pytest.raises(ValueError, match="eviction score 'rkv' is already registered"):
        EVICTION_SCORES.register("rkv", lambda *a: a)
    with pytest.raises(ValueError, match="attention backend 'fused' is already registered"):
        register_backend(AttentionBackend("fused", reference_attention))


def _linear_loss(rho, clipped_rho, adv, log_pi_ratio, cfg):
    """The unclipped surrogate ``-rho A``; counts no token as clipped."""
    del clipped_rho, log_pi_ratio, cfg
    return -rho * adv, jnp.zeros(rho.shape, bool)


def test_a_registered_policy_loss_is_selectable_and_used():
    logp_new = jnp.asarray([[-0.5, -1.0, -2.0], [-0.1, -0.3, -0.7]], jnp.float32)
    old = jnp.asarray([[-0.6, -0.9, -2.5], [-0.2, -0.3, -0.2]], jnp.float32)
    mask = jnp.asarray([[1, 1, 0], [1, 1, 1]], jnp.float32)
    adv = jnp.asarray([1.5, -2.0], jnp.float32)
    batch = LossBatch(logp_old_dense=old, advantages=adv, loss_mask=mask,
                      is_weights=jnp.ones_like(mask), token_mask=mask.astype(bool),
                      seq_mask=jnp.ones((2,), bool))
    with registered(POLICY_LOSSES, "linear", PolicyLoss(_linear_loss)):
        cfg = GRPOLossConfig(policy_loss="linear", eps_low=5.0)  # no eps_low bound declared
        loss, metrics = grpo_loss(logp_new, batch, cfg)
        with pytest.raises(FieldError, match=r"clip_c=3\.0 \(dual-clip\) applies to "
                                             r"policy_loss='ppo_clip' only, not 'linear'"):
            GRPOLossConfig(policy_loss="linear", clip_c=3.0)
    # seq_mean_token_mean of -exp(logp_new - old) * A over the mask, computed here
    rho = np.exp(np.asarray(logp_new) - np.asarray(old))
    per_token = -rho * np.asarray(adv)[:, None]
    m = np.asarray(mask)
    want = np.mean((per_token * m).sum(1) / m.sum(1))
    np.testing.assert_allclose(float(loss), want, rtol=1e-6)
    assert float(metrics["clip_fraction"]) == 0.0
    assert "linear" not in POLICY_LOSSES.names()
    with pytest.raises(FieldError, match="policy_loss='linear' must be one of"):
        GRPOLossConfig(policy_loss="linear")


def test_a_registered_advantage_estimator_is_selectable_and_used():
    def max_baseline(rewards, group_size, cfg, response_mask, valid):
        """``R_i - max_G R``."""
        del cfg, response_mask
        groups = rewards.reshape(-1, group_size)
        out = groups - jnp.max(groups, axis=1, keepdims=True)
        return jnp.where(valid, out.reshape(-1), 0.0)

    rewards = np.asarray([1.0, 0.0, 3.0, 2.0, 5.0, 5.0], np.float32)
    register_estimator("max_baseline", default_scale="none", scales=("none",),
                       scale_rule="it subtracts the group's best reward only")(max_baseline)
    try:
        cfg = AdvantageConfig(estimator="max_baseline")
        assert cfg.scale == "none"
        got = compute_advantages(rewards, 3, cfg)
        with pytest.raises(FieldError, match=r"AdvantageConfig\.scale='group' is not defined "
                                             r"for estimator='max_baseline': it subtracts"):
            AdvantageConfig(estimator="max_baseline", scale="group")
        with pytest.warns(UserWarning, match="groups of one"):
            assert np.all(np.asarray(compute_advantages(rewards, 1, cfg)) == 0)
    finally:
        ESTIMATORS.unregister("max_baseline")
    np.testing.assert_array_equal(np.asarray(got), [-2.0, -3.0, 0.0, -3.0, 0.0, 0.0])


def test_a_registered_is_mode_and_preset_are_selectable_and_used():
    def halved(r, lower, upper):
        """Weight ``r / 2``; nothing altered."""
        del lower, upper
        return r / 2, jnp.zeros(r.shape, bool)

    dense = jnp.asarray([[-1.0, -0.2, -3.0]], jnp.float32)
    sparse = jnp.asarray([[-1.0, -1.0, -0.5]], jnp.float32)
    mask = jnp.ones((1, 3), jnp.float32)
    with registered(IS_MODES, "halved", halved), registered(CORRECTION_PRESETS, "halved_rs", Preset(
            {"is_level": "token", "is_mode": "halved", "rs_level": "token"}, "a test's")):
        out = compute_corrections(dense, sparse, mask, CorrectionConfig(kind="halved_rs"))
    r = np.exp(np.asarray(dense - sparse))
    np.testing.assert_allclose(np.asarray(out.weights), r / 2, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(out.token_mask), (r <= 1.5) & (r >= 0.5))
    assert np.asarray(out.seq_mask).all()  # no veto in the preset


def test_a_registered_divergence_and_aggregation_are_rejection_measures():
    """``rs`` takes its measures from the divergence x aggregation registries."""
    log_r = np.log(np.array([[1.0, 1.5, 1.0], [0.5, 1.0, 1.0], [1.1, 0.95, 1.0]]))
    dense, sparse = jnp.asarray(log_r, jnp.float32), jnp.zeros((3, 3), jnp.float32)
    mask = jnp.ones((3, 3), bool)
    with registered(DIVERGENCES, "kabs", Divergence(jnp.abs, banded=False)), \
            registered(AGGREGATIONS, "seq_median", lambda x, valid: jnp.median(x, axis=1)):
        cfg = CorrectionConfig(kind="none", rs="seq_max_kabs", rs_threshold=0.4)
        out = compute_corrections(dense, sparse, mask, cfg)  # |log 1.5| = 0.405 > 0.4
        np.testing.assert_array_equal(np.asarray(out.seq_mask), [False, False, True])
        cfg = CorrectionConfig(kind="none", rs="seq_median_k3", rs_threshold=1e-3)
        out = compute_corrections(dense, sparse, mask, cfg)  # row 2's median k3: 1.3e-3
        np.testing.assert_array_equal(np.asarray(out.seq_mask), [True, True, False])
    with pytest.raises(FieldError, match="rs='seq_max_kabs' must be 'none' or"):
        CorrectionConfig(kind="none", rs="seq_max_kabs", rs_threshold=0.4)


def test_a_registered_eviction_score_is_selectable_and_used():
    def oldest_first(cfg, queries, keys, pos, index):
        """Keep the oldest tokens: ``Z = -position``."""
        del cfg, queries, keys, index
        return -pos.astype(jnp.float32)

    b, hkv, hq, c, d, w, index = 1, 2, 4, 8, 4, 2, 6
    keys = jax.random.normal(jax.random.PRNGKey(0), (b, hkv, c, d))
    queries = jax.random.normal(jax.random.PRNGKey(1), (b, hq, w, d))
    pos = np.tile(np.asarray([0, 3, 1, -1, 5, 6, -1, -1], np.int32), (b, hkv, 1))
    with registered(EVICTION_SCORES, "oldest_first", oldest_first):
        cfg = CompressionConfig(method="oldest_first", eviction=EvictionConfig(budget=4, buffer=4, window=w))
        assert cfg.compresses and cfg.cache_layout == "budget"
        z = np.asarray(slot_scores(cfg, queries, keys, jnp.asarray(pos), jnp.int32(index)))
        with pytest.raises(FieldError, match=r"layout='paged' does not fit method "
                                             r"'oldest_first' \(needs 'budget'\)"):
            CompressionConfig(method="oldest_first", layout="paged", eviction=EvictionConfig(window=w))
    slot = np.arange(c)
    keep = (pos >= 0) & (slot < index) & (slot < index - w)
    np.testing.assert_array_equal(z, np.where(keep, -pos.astype(np.float32), -np.inf))
    with pytest.raises(FieldError, match=r"method='oldest_first' must be one of \('none', "
                                         r"'snapkv', 'rkv', 'streaming', 'sparrow'\)"):
        CompressionConfig(method="oldest_first")


def _qkv(b=2, t=6, hq=2, hkv=1, d=8):
    keys = jax.random.split(jax.random.PRNGKey(2), 3)
    q = jax.random.normal(keys[0], (b, t, hq, d))
    k = jax.random.normal(keys[1], (b, hkv, t, d))
    v = jax.random.normal(keys[2], (b, hkv, t, d))
    return q, k, v, jnp.tile(jnp.arange(t, dtype=jnp.int32), (b, 1))


def test_a_registered_attention_backend_is_selectable_and_used_by_the_caches():
    calls = []

    def counted(q, k, v, q_pos, k_pos, *, block_size, **visibility):
        """The reference einsum, counting its calls."""
        del block_size
        calls.append(q.shape)
        return reference_attention(q, k, v, q_pos, k_pos, **visibility)

    q, k, v, pos = _qkv()
    k_pos = jnp.broadcast_to(pos[:, None], k.shape[:3])
    cache = init_paged_cache(1, 2, 1, 8, 8, page_size=4)
    cache = cache.begin_forward(pos).write(jnp.int32(0), k, v, pos)
    cfg = ModelConfig("llama", 64, 16, 32, 1, num_heads=2, num_kv_heads=1, head_dim=8)
    with registered(BACKENDS, "counted", AttentionBackend("counted", counted)):
        got = attention(q, k, v, pos, k_pos, backend="counted")
        paged = cache.read(jnp.int32(0), q, pos, "counted")  # not chunked: every slot
        cache.check(cfg, 2, 1, "counted")
    assert calls == [q.shape, q.shape]
    np.testing.assert_allclose(np.asarray(got), np.asarray(
        attention(q, k, v, pos, k_pos, backend="reference")), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(paged), np.asarray(
        cache.read(jnp.int32(0), q, pos, "blockwise")), rtol=1e-5, atol=1e-6)


def test_a_backend_without_visibility_is_refused_by_every_cache_and_view():
    def causal_only(q, k, v, q_pos, k_pos, **unused):
        """The causal self-attention of a full forward."""
        del unused
        return reference_attention(q, k, v, q_pos, k_pos)

    q, k, v, pos = _qkv()
    cache = init_paged_cache(1, 2, 1, 8, 8, page_size=4)
    cfg = ModelConfig("llama", 64, 16, 32, 1, num_heads=2, num_kv_heads=1, head_dim=8)
    k_pos = jnp.broadcast_to(pos[:, None], k.shape[:3])
    backend = AttentionBackend("causal_only", causal_only, takes_visibility=False)
    with registered(BACKENDS, "causal_only", backend):
        assert get_backend("causal_only", "test") is backend
        full = attention(q, k, v, pos, k_pos, backend="causal_only")
        refused = (r"needs a full forward .*use one of \('blockwise', 'reference', 'pallas_gpu', "
                   r"'pallas_tpu'\)")
        with pytest.raises(ValueError, match="PagedKVCache: attention_backend='causal_only' "
                                             + refused):
            cache.check(cfg, 2, 1, "causal_only")
        with pytest.raises(ValueError, match="PagedKVCache.read: attention_backend="):
            cache.read(jnp.int32(0), q, pos, "causal_only")
        with pytest.raises(ValueError, match="attention: attention_backend='causal_only' "
                                             "needs a full forward"):
            attention(q, k, v, pos, k_pos, mask=jnp.ones((1, 1, 6, 6), bool),
                      backend="causal_only")
    np.testing.assert_allclose(np.asarray(full), np.asarray(
        reference_attention(q, k, v, pos, k_pos)), rtol=1e-6)


def test_unknown_backends_are_errors_naming_the_caller_and_the_backends():
    q, k, v, pos = _qkv()
    cache = init_paged_cache(1, 2, 1, 8, 8, page_size=4)
    allowed = (r"backend must be one of \('blockwise', 'fused', 'reference', 'pallas_gpu', "
               r"'pallas_tpu'\), got 'flash'")
    with pytest.raises(ValueError, match="PagedKVCache.read: " + allowed):
        cache.read(jnp.int32(0), q, pos, "flash")  # was silently the blockwise loop
    with pytest.raises(ValueError, match="attention: " + allowed):
        attention(q, k, v, pos, jnp.broadcast_to(pos[:, None], k.shape[:3]), backend="flash")
