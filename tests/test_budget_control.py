"""Sparrow's closed loop (``compression.adapt``): the update rule against a plain-Python
reference, the per-bin p5 against a NumPy loop, config errors, the sampler taking new ks
without recompiling, and a short training run (k moves by the logged p5; a resumed run
continues with the checkpointed ks)."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

from benchmarks.kit.compile_count import count_compiles
from sparse_rl_jax.core.config_io import (ConfigError, apply_overrides, from_dict, load_config,
                                          to_dict)
from sparse_rl_jax.kv.compression_config import CompressionConfig
from sparse_rl_jax.kv.compression_sections import AdaptConfig, AlphaConfig, SparrowConfig
from sparse_rl_jax.records.metrics_writer import read_metrics
from sparse_rl_jax.rollout.sampler import generate
from sparse_rl_jax.rollout.sampling_config import SamplingConfig
from sparse_rl_jax.training import budget_control
from sparse_rl_jax.training.run_config import RunConfig
from tiny_hf import left_padded_batch
from tiny_rl import tiny_task_policy

LOOP = CompressionConfig(
    method="sparrow", page_size=4,
    sparrow=SparrowConfig(dense_layers=(), budget_schedule=((0, 1), (32, 2), (48, 3))),
    alpha=AlphaConfig(threshold=0.9),
    adapt=AdaptConfig(enabled=True, step=2, margin=0.05, min_k=1, max_k=6))


def reference_next(ks, p5, *, threshold, margin, step, low, highs):
    """The rule as written in the docs, one bin at a time."""
    out = []
    for k, value, high in zip(ks, p5, highs):
        if not math.isnan(value) and value < threshold:
            k = k + step
        elif not math.isnan(value) and value >= threshold + margin:
            k = k - step
        out.append(max(low, min(high, k)))
    return tuple(out)


def test_upper_bounds_are_the_bins_middle_pages_and_the_compiled_max():
    # bin 0 ends below 32 (7 pages of 4 -> 4 middle), bin 1 below 48 (11 -> 8, capped at 6)
    assert budget_control.upper_ks(LOOP) == (4, 6, 6)
    assert LOOP.max_pages_k == 6 and budget_control.initial_ks(LOOP) == (1, 2, 3)


@pytest.mark.parametrize("ks, p5", [
    ((1, 2, 3), (0.5, 0.92, 0.99)),      # raise / hold (inside the margin) / lower
    ((4, 6, 1), (0.1, 0.1, 1.0)),        # raises clipped at the bounds; lower clipped at min
    ((3, 3, 3), (math.nan, 0.9, 0.95)),  # no tokens: hold; exactly the threshold: hold;
])                                       # exactly threshold + margin: lower
def test_next_ks_matches_reference(ks, p5):
    want = reference_next(ks, p5, threshold=0.9, margin=0.05, step=2, low=1, highs=(4, 6, 6))
    got = budget_control.next_ks(LOOP, ks, np.asarray(p5))
    assert got == want
    assert all(isinstance(k, int) for k in got)


def test_next_ks_random_against_reference():
    rng = np.random.default_rng(0)
    for _ in range(200):
        ks = tuple(int(k) for k in rng.integers(1, [5, 7, 7]))
        p5 = tuple(rng.choice([math.nan, 0.9, 0.95, *rng.random(3)]) for _ in range(3))
        assert budget_control.next_ks(LOOP, ks, np.asarray(p5)) == reference_next(
            ks, p5, threshold=0.9, margin=0.05, step=2, low=1, highs=(4, 6, 6))


def reference_bin_p5(alpha, mask, plen):
    """LOOP's per-bin p5, one token at a time: a row's position counts its valid tokens from 1,
    the token at position ``p >= 2`` was decoded at ``plen + p - 1`` (position 1: the dense
    prefill's), alpha clipped to [0, 1]."""
    pooled = {0: [], 1: [], 2: []}
    for row in range(alpha.shape[0]):
        position = 0
        for col in range(alpha.shape[1]):
            if not mask[row, col]:
                continue
            position += 1
            if position >= 2:
                covered = math.ceil((plen[row] + position - 1) / 4) * 4
                pooled[0 if covered < 32 else 1 if covered < 48 else 2].append(
                    min(max(alpha[row, col], 0.0), 1.0))
    return np.asarray([np.percentile(v, 5) if v else np.nan for v in pooled.values()])


def test_bin_p5_pools_tokens_by_cached_length():
    rng = np.random.default_rng(1)
    n, m = 5, 40
    alpha = rng.random((n, m))
    mask = (np.arange(m)[None, :] < rng.integers(5, m, size=(n, 1))).astype(np.int32)
    plen = rng.integers(3, 20, size=n)
    pooled = {0: [], 1: [], 2: []}
    for row in range(n):
        for t in range(1, m):  # contiguous rows: column t is position t + 1, length plen + t
            if mask[row, t]:
                covered = math.ceil((plen[row] + t) / 4) * 4
                pooled[0 if covered < 32 else 1 if covered < 48 else 2].append(alpha[row, t])
    got = budget_control.bin_p5(LOOP, alpha, mask, plen)
    for i, values in pooled.items():
        want = np.percentile(values, 5) if values else np.nan
        np.testing.assert_allclose(got[i], want, equal_nan=True)
    np.testing.assert_allclose(got, reference_bin_p5(alpha, mask, plen), equal_nan=True)


def test_bin_p5_counts_positions_over_valid_tokens_only():
    rng = np.random.default_rng(4)
    alpha = rng.random((3, 40))
    mask = np.ones((3, 40), np.int32)
    mask[0, 5:15] = 0   # a hole: column 15 is position 6, decoded at plen + 5
    mask[1, :12] = 0    # left padding: column 12 is position 1 (the dense prefill's)
    mask[2, 1::2] = 0   # every other token
    plen = np.array([20, 20, 20])
    got = budget_control.bin_p5(LOOP, alpha, mask, plen)
    np.testing.assert_allclose(got, reference_bin_p5(alpha, mask, plen), equal_nan=True)


def test_bin_p5_clips_alpha_to_the_unit_interval():
    rng = np.random.default_rng(5)
    alpha = rng.uniform(-0.5, 1.5, size=(4, 40))
    mask = np.ones((4, 40), np.int32)
    plen = np.array([3, 9, 17, 24])
    got = budget_control.bin_p5(LOOP, alpha, mask, plen)
    np.testing.assert_allclose(got, reference_bin_p5(alpha, mask, plen), equal_nan=True)
    assert np.all((got >= 0) & (got <= 1))
    high = budget_control.bin_p5(LOOP, alpha + 2.0, mask, plen)  # every value above 1
    np.testing.assert_array_equal(high, 1.0)


@pytest.mark.parametrize("override, message", [
    ("adapt.step=0", "compression.adapt.step=0 must be an int >= 1"),
    ("adapt.margin=1.0", "compression.adapt.margin=1.0 must be in [0, 1)"),
    ("adapt.min_k=-1", "compression.adapt.min_k=-1 must be an int >= 0"),
    # above the schedule's smallest k (1)
    ("adapt.min_k=2", "compression.adapt.min_k=2 must be <= every k of sparrow.budget_schedule"),
    # below the schedule's largest k (3)
    ("adapt.max_k=2", "compression.adapt.max_k=2 must be >= every k of sparrow.budget_schedule"),
    ("alpha.metric='off'", "compression.adapt.enabled=True needs alpha.metric exact or top20"),
    ("adapt.enabled=1", "compression.adapt.enabled: expected true/false, got 1"),
])
def test_config_errors_name_the_dotted_key(override, message):
    data = apply_overrides(to_dict(LOOP), [override])
    with pytest.raises(ConfigError) as err:
        from_dict(CompressionConfig, data, prefix="compression")
    assert str(err.value).startswith(message)
    with pytest.raises(ConfigError, match=r"^CompressionConfig\.adapt\.enabled=True needs method "
                                          r"sparrow"):
        CompressionConfig(method="rkv", adapt=AdaptConfig(enabled=True))


def test_run_config_rejects_the_loop_without_a_record():
    with pytest.raises(ConfigError, match=r"sampling\.record_evictions"):
        load_config(RunConfig, None, ["compression.method=sparrow",
                                      "compression.adapt.enabled=true",
                                      "sampling.record_evictions=false"])


def test_restored_ks_checks_the_checkpoint():
    assert budget_control.restored_ks(LOOP, [4, 6, 1]) == (4, 6, 1)
    assert budget_control.restored_ks(LOOP, None) == (1, 2, 3)
    for bad in ([1, 2], [5, 2, 3], [0, 2, 3]):
        with pytest.raises(ValueError, match="budget_ks"):
            budget_control.restored_ks(LOOP, bad)


def test_sampler_takes_new_ks_without_recompiling(tmp_path):
    _, _, graphdef, params = tiny_task_policy(tmp_path)
    prompt, mask = left_padded_batch(np.random.default_rng(0), [9, 5], width=9)
    sampling = SamplingConfig(max_new_tokens=40, prompt_bucket=4, record_evictions=True)
    used = {}
    with count_compiles() as compiles:
        for ks in [(1, 2, 3), (4, 6, 6), (1, 1, 1)]:
            r = generate(graphdef, params, prompt, mask, jax.random.key(0), sampling, LOOP, ks)
            record = np.asarray(r.record.pages)[0, 0, 0]  # row 0 (9-token prompt), layer 0
            used[ks] = (record >= 0).sum(-1)  # pages per step: k + 3 once long enough
    assert compiles["jit(decode_loop)"] == 1, compiles
    lengths = 9 + np.arange(1, 41)  # cached length at response step r (record row r - 1)
    for ks, pages in used.items():
        for r, length in enumerate(lengths[:-1]):  # row r: the step that sampled token r + 1
            n = math.ceil(length / 4)
            k = ks[0 if n * 4 < 32 else 1 if n * 4 < 48 else 2]
            assert pages[r] == min(n, k + 3), (ks, r)
    with pytest.raises(ValueError, match="budget_ks"):
        generate(graphdef, params, prompt, mask, jax.random.key(0), sampling, LOOP, (1, 7, 1))


def _loop_config(policy_path, run_dir, *overrides):
    return load_config(RunConfig, None, [
        f"model.path={policy_path}", f"run_dir={run_dir}", "data.task.n_min=2",
        "data.task.n_max=4", "sampling.max_new_tokens=24", "sampling.num_samples=2",
        "sampling.prompt_bucket=8", "compression.method=sparrow", "compression.page_size=4",
        "compression.sparrow.dense_layers=[]",
        "compression.sparrow.budget_schedule=[[0, 1], [32, 2]]",
        "compression.adapt.enabled=true", "compression.adapt.step=1", "compression.adapt.max_k=3",
        "compression.adapt.margin=0.0", "trainer.prompts_per_step=2",
        "trainer.minibatch_size=4", "trainer.logp_chunk=8", "trainer.checkpoint_every=1",
        "trainer.plots=false", "trainer.export_final=false", "correction.kind=none",
        *overrides])


def _ks_and_p5(records):
    return [([r[f"sparrow_k_bin{i}"] for i in range(2)],
             [r.get(f"alpha_p5_kbin{i}", math.nan) for i in range(2)]) for r in records]


@pytest.mark.parametrize("threshold", ["1.0", "0.01"])
def test_training_moves_k_by_the_live_p5(tmp_path, threshold):
    """threshold 1: every bin with a sparse token is below it (k rises); threshold 0.01 with
    no margin: every bin with tokens has slack (k falls to adapt.min_k)."""
    from sparse_rl_jax.training.trainer import train

    path = tiny_task_policy(tmp_path / "policy")[0]
    train(_loop_config(path, tmp_path / "run", "trainer.steps=2",
                       f"compression.alpha.threshold={threshold}"), log=lambda _: None)
    steps = _ks_and_p5(read_metrics(tmp_path / "run" / "metrics.jsonl"))
    assert steps[0][0] == [1, 2]  # the schedule's own ks first
    (ks, p5), (after, _) = steps
    assert tuple(after) == reference_next(ks, p5, threshold=float(threshold), margin=0.0,
                                          step=1, low=0, highs=(3, 3))
    moved = [b - a for a, b in zip(ks, after)]
    assert (max(moved) > 0) if threshold == "1.0" else (min(moved) < 0)


def test_resumed_training_continues_with_the_checkpointed_ks(tmp_path):
    """A run stopped after one step resumes with the ks its checkpoint saved (moved by step
    1's p5), not the schedule's own."""
    from sparse_rl_jax.training.trainer import train

    path = tiny_task_policy(tmp_path / "policy")[0]
    run_dir = tmp_path / "run"
    train(_loop_config(path, run_dir, "trainer.steps=1", "compression.alpha.threshold=1.0"),
          log=lambda _: None)
    messages = []
    train(_loop_config(path, run_dir, "trainer.steps=2", "compression.alpha.threshold=1.0"),
          log=messages.append)
    assert any("resumed from step 1" in m for m in messages)
    (ks, p5), (resumed, _) = _ks_and_p5(read_metrics(run_dir / "metrics.jsonl"))
    assert ks == [1, 2] and resumed != ks
    assert tuple(resumed) == reference_next(ks, p5, threshold=1.0, margin=0.0, step=1, low=0,
                                            highs=(3, 3))
