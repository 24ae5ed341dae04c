"""LoRA (``model.lora``): an update trains the adapters only, the merged export and the PEFT
adapter reproduce the adapted model in ``transformers`` / ``peft``, a resumed LoRA run equals
an uninterrupted one, and bad ``model.lora`` settings are config errors naming the field.

Oracles: bit equality of the frozen base weights; ``transformers`` (and ``peft``) logits of
the exported directories; the uninterrupted run."""

from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import peft
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file

import models
from benchmarks.kit.compile_count import count_compiles
from models.lora import LoRA, LoRADropoutKey
from sparse_rl_jax.core.config_io import ConfigError, load_config
from sparse_rl_jax.records.checkpoint import CheckpointError, Checkpointer
from sparse_rl_jax.records.checkpoint_state import base_fingerprint
from sparse_rl_jax.records.metrics_writer import read_metrics
from sparse_rl_jax.rl.corrections import compute_corrections
from sparse_rl_jax.rl.grpo_loss import LossBatch
from sparse_rl_jax.rl.kl_reference import kl_reference
from sparse_rl_jax.rl.loss_config import CorrectionConfig, GRPOLossConfig
from sparse_rl_jax.rl.optim import OptimConfig, make_optimizer
from sparse_rl_jax.rl.update_step import (Minibatch, dropout_key, init_optimizer, jit_update_step,
                                          minibatch_loss)
from sparse_rl_jax.rollout.scoring import score
from sparse_rl_jax.tasks.rewards import available_reward_fns, register_reward_fn
from sparse_rl_jax.tasks.task import TaskConfig
from sparse_rl_jax.training.policy import LORA_ADAPTER_DIR, export_policy, load_policy
from sparse_rl_jax.training.run_config import RunConfig, WarmStartConfig
from sparse_rl_jax.training.trainer import train
from sparse_rl_jax.training.warm_start import build_default_model
from tiny_hf import hf_logits, left_padded_batch, load_hf, make_tiny_hf

RANK, ALPHA = 4, 8.0


def _adapted(path, targets=models.LORA_TARGETS, seed=0, dropout=0.0):
    """The fp32 checkpoint at ``path`` with rank-4 adapters; ``(graphdef, lora, base)``."""
    model = models.load_pretrained(path, dtype=jnp.float32)
    models.add_lora(model, RANK, ALPHA, targets, rngs=nnx.Rngs(seed),
                    mesh=models.make_mesh(devices=jax.devices()[:1]), dropout=dropout)
    graphdef, state = nnx.split(model)
    return (graphdef, *models.split_trainable(state))


def _minibatch(n=4, width=5, m=6) -> Minibatch:
    rng = np.random.default_rng(0)
    prompt, prompt_mask = left_padded_batch(rng, [5, 3, 4, 2][:n], width=width)
    logp_old = jnp.asarray(-rng.uniform(2.0, 6.0, (n, m)), jnp.float32)
    mask = jnp.ones((n, m), jnp.int32)
    corrections = compute_corrections(logp_old, logp_old, mask, CorrectionConfig(kind="none"))
    loss = LossBatch.from_corrections(logp_old, jnp.asarray(rng.normal(0, 1, n), jnp.float32),
                                      mask, corrections)
    return Minibatch(jnp.asarray(prompt), jnp.asarray(prompt_mask),
                     jnp.asarray(rng.integers(3, 100, (n, m)), jnp.int32), loss)


def _with_nonzero_adapters(lora, seed=1):
    """``lora`` plus N(0, 0.05) noise, so that B != 0 and the adapters change the model."""
    noise = jax.random.split(jax.random.key(seed), len(jax.tree.leaves(lora)))
    leaves, tree = jax.tree.flatten(lora)
    return jax.tree.unflatten(tree, [x + 0.05 * jax.random.normal(k, x.shape)
                                     for x, k in zip(leaves, noise)])


def test_update_trains_only_the_adapters(tmp_path):
    path = make_tiny_hf(tmp_path, "qwen2", tokenizer=False, hidden_size=32,
                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                        intermediate_size=64)
    graphdef, lora, base = _adapted(path, targets=("q_proj", "v_proj", "down_proj"))
    params = nnx.merge_state(lora, base)
    base_before = jax.tree.map(np.array, base)
    lora_before = jax.tree.map(np.array, lora)
    optimizer = make_optimizer(OptimConfig(lr=1e-2))
    mesh = models.make_mesh(devices=jax.devices()[:1])
    opt_state, opt_shardings = init_optimizer(optimizer, params, mesh)
    # The optimizer state holds moments of the adapters only.
    lora_sizes = sorted(x.size for x in jax.tree.leaves(lora))
    moments = sorted(x.size for x in jax.tree.leaves(opt_state) if x.ndim > 0)
    assert moments == sorted(lora_sizes * 2)
    update = jit_update_step(graphdef, loss_cfg=GRPOLossConfig(), optimizer=optimizer,
                             param_shardings=jax.tree.map(lambda x: x.sharding, params),
                             opt_shardings=opt_shardings,
                             batch_sharding=jax.sharding.NamedSharding(
                                 mesh, jax.sharding.PartitionSpec()),
                             chunk_size=4)
    params, opt_state, metrics = update(params, opt_state, _minibatch())
    assert float(metrics["nonfinite_update"]) == 0 and float(metrics["grad_norm"]) > 0
    lora_after, base_after = models.split_trainable(params)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, base_after),
                 base_before)
    changed = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - b).max()), lora_after,
                           lora_before)
    assert all(change > 1e-4 for change in jax.tree.leaves(changed)), changed


def test_merged_export_and_adapter_match_the_adapted_model(tmp_path):
    path = make_tiny_hf(tmp_path / "base", "qwen2")
    graphdef, lora, base = _adapted(path)
    lora = _with_nonzero_adapters(lora)
    model = nnx.merge(graphdef, lora, base)
    rng = np.random.default_rng(0)
    tokens, mask = left_padded_batch(rng, [7, 4], width=7)
    ours = np.asarray(model(jnp.asarray(tokens), attention_mask=jnp.asarray(mask)).logits)
    plain = nnx.merge(graphdef, jax.tree.map(jnp.zeros_like, lora), base)
    plain = np.asarray(plain(jnp.asarray(tokens), attention_mask=jnp.asarray(mask)).logits)
    valid = mask.astype(bool)
    assert np.abs(ours - plain)[valid].max() > 1e-2  # the adapters matter

    models.save_pretrained(model, tmp_path / "merged")
    models.save_adapter(model, tmp_path / "adapter")
    merged = hf_logits(tmp_path / "merged", tokens, mask)
    np.testing.assert_allclose(merged[valid], ours[valid], atol=1e-4, rtol=0)
    with_adapter = peft.PeftModel.from_pretrained(load_hf(path), tmp_path / "adapter")
    np.testing.assert_allclose(hf_logits(with_adapter, tokens, mask)[valid], ours[valid],
                               atol=1e-4, rtol=0)
    assert models.has_lora(model) and not models.has_lora(models.merge_lora(model))


def test_kl_reference_of_a_lora_policy_is_the_base_model(tmp_path):
    """With adapters, the KL reference scores like the checkpoint loaded without LoRA, and
    shares the policy's base arrays instead of copying them."""
    path = make_tiny_hf(tmp_path, "qwen2", tokenizer=False, hidden_size=32,
                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                        intermediate_size=64)
    graphdef, lora, base = _adapted(path)
    params = nnx.merge_state(_with_nonzero_adapters(lora), base)
    reference = kl_reference(params)(params)
    ref_base = models.split_trainable(reference)[1]
    assert all(a is b for a, b in zip(jax.tree.leaves(ref_base), jax.tree.leaves(base)))
    plain_graphdef, plain = nnx.split(models.load_pretrained(path, dtype=jnp.float32))
    batch = _minibatch()
    def logp(g, p):
        return np.asarray(score(g, p, batch.prompt, batch.prompt_mask, batch.response,
                                chunk_size=4).logp)
    np.testing.assert_array_equal(logp(graphdef, reference), logp(plain_graphdef, plain))
    assert np.abs(logp(graphdef, params) - logp(plain_graphdef, plain)).max() > 1e-3


def test_lora_dropout_acts_in_the_update_only(tmp_path):
    """Dropout 0.5 changes the update's gradients (deterministically per key) but no score
    outside it; dropout 0 with a key is today's update, bit for bit."""
    path = make_tiny_hf(tmp_path, "qwen2", tokenizer=False, hidden_size=32,
                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                        intermediate_size=64)
    targets = ("q_proj", "down_proj")
    plain_def, lora, base = _adapted(path, targets)
    drop_def, drop_lora, _ = _adapted(path, targets, dropout=0.5)
    jax.tree.map(np.testing.assert_array_equal, drop_lora, lora)  # the rate draws nothing
    lora = _with_nonzero_adapters(lora)
    batch, cfg = _minibatch(), GRPOLossConfig()
    key = dropout_key(0, 3, 1)

    def grads(graphdef, key):
        return jax.jit(jax.grad(lambda p: minibatch_loss(
            graphdef, p, base, batch, None, loss_cfg=cfg, chunk_size=4, dropout_key=key)[0]))(
                lora)

    def logp(graphdef):
        return score(graphdef, nnx.merge_state(lora, base), batch.prompt, batch.prompt_mask,
                     batch.response, chunk_size=4).logp

    np.testing.assert_array_equal(logp(drop_def), logp(plain_def))  # scoring: no dropout
    today = grads(plain_def, None)
    jax.tree.map(np.testing.assert_array_equal, grads(plain_def, key), today)
    jax.tree.map(np.testing.assert_array_equal, grads(drop_def, None), today)
    dropped = grads(drop_def, key)
    jax.tree.map(np.testing.assert_array_equal, grads(drop_def, key), dropped)
    change = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), dropped, today)
    assert all(c > 1e-4 for c in jax.tree.leaves(change)), change
    other = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()),
                         grads(drop_def, dropout_key(0, 3, 2)), dropped)
    assert max(jax.tree.leaves(other)) > 1e-4


def test_lora_dropout_masks_the_adapter_input():
    """One adapter with keys: ``(alpha / r) * (x * keep / (1 - p)) @ A @ B`` (NumPy), with
    ``keep`` the Bernoulli(1 - p) draw of its key; without keys ``(alpha / r) x @ A @ B``."""
    p, rank, alpha = 0.25, 2, 3.0
    adapter = LoRA(6, rank, 5, alpha=alpha, num_layers=1, dtype=jnp.float32,
                   param_dtype=jnp.float32, rngs=nnx.Rngs(0), dropout=p)
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(6, rank)), rng.normal(size=(rank, 5))
    adapter.lora_a[...] = jnp.asarray(a, jnp.float32)  # one layer's slices, as the scan does
    adapter.lora_b[...] = jnp.asarray(b, jnp.float32)
    x = rng.normal(size=(3, 4, 6)).astype(np.float32)
    np.testing.assert_allclose(adapter(jnp.asarray(x)), alpha / rank * x @ a @ b, rtol=1e-5)
    key = jax.random.key(7)
    adapter.dropout_key = LoRADropoutKey(key)
    keep = np.asarray(jax.random.bernoulli(key, 1 - p, x.shape))
    assert 0 < keep.mean() < 1
    np.testing.assert_allclose(adapter(jnp.asarray(x)),
                               alpha / rank * (x * keep / (1 - p)) @ a @ b, rtol=1e-5)


def length_parity(completions, answers):
    """A reward that differs between samples (the tiny policy's task reward is 0 everywhere),
    so the advantages and the adapters' gradients are not zero."""
    return np.array([float(len(c) % 2) for c in completions], np.float32)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A tiny warm-started policy and a LoRA run config for it (adapter dropout, a KL term)."""
    if "length_parity" not in available_reward_fns():
        register_reward_fn("length_parity", lambda: length_parity)
    root = tmp_path_factory.mktemp("lora_run")
    policy = build_default_model(
        root / "policy",
        WarmStartConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                        intermediate_size=64, steps=2, batch_size=4),
        TaskConfig(n_min=2, n_max=4), log=lambda _: None)
    config = root / "lora.yaml"
    config.write_text(f"""
model: {{path: {policy}, lora: {{rank: 2, alpha: 4.0, targets: [q_proj, up_proj],
                               dropout: 0.1}}}}
loss: {{kl_coef: 0.01}}
data: {{task: {{n_min: 2, n_max: 4}}, reward: length_parity}}
sampling: {{max_new_tokens: 8, num_samples: 4, prompt_bucket: 8}}
compression: {{method: none}}
optim: {{lr: 1.0e-2}}
trainer: {{steps: 2, prompts_per_step: 2, minibatch_size: 4, checkpoint_every: 1,
          logp_chunk: 8, plots: false}}
""")
    return root, config


def _comparable(records):
    return [{k: v for k, v in r.items() if not k.startswith("time_") and not k.endswith("_share")
             and k != "tokens_per_second"} for r in records]


@pytest.fixture(scope="module")
def finished_lora_run(lora_run):
    """``(root, config, run directory, compilations)`` of a finished 2-step LoRA run of
    ``lora_run`` (``compile_count.count_compiles`` over the run)."""
    root, config = lora_run
    with count_compiles() as compiles:
        train(load_config(RunConfig, config, [f"run_dir={root / 'a'}"]), log=lambda _: None)
    return root, config, root / "a", compiles


def test_a_two_step_run_compiles_the_update_once(finished_lora_run):
    """Four updates (2 steps x 2 minibatches, a checkpoint after each step) reuse one
    compiled update: params, optimizer state and key keep their shapes, dtypes and
    shardings from call to call."""
    compiles = finished_lora_run[3]
    assert compiles["jit(update_minibatch)"] == 1, dict(compiles)


def _assert_same_files(expected_dir, actual_dir):
    """The exported merged weights and the adapter of two directories are bit-identical."""
    for name in ("model.safetensors", f"{LORA_ADAPTER_DIR}/adapter_model.safetensors"):
        expected, actual = load_file(expected_dir / name), load_file(actual_dir / name)
        assert actual.keys() == expected.keys()
        for key in expected:
            np.testing.assert_array_equal(actual[key], expected[key], err_msg=key)


def test_resumed_lora_run_equals_an_uninterrupted_one(finished_lora_run):
    """A copy of a finished 2-step run (adapter dropout 0.1, a KL term to the base) without
    its step-2 checkpoint and export (what a run killed after step 1 leaves) resumes to the
    same metrics, merged export and adapter."""
    root, config, a, _ = finished_lora_run
    b = root / "b"
    shutil.copytree(a, b)
    shutil.rmtree(b / "checkpoints" / "2")
    shutil.rmtree(b / "final")
    last = read_metrics(a / "metrics.jsonl")[-1]
    assert last["grad_norm"] > 0 and last["kl_loss"] > 0  # the adapted policy left the base
    seen = []
    train(load_config(RunConfig, config, [f"run_dir={b}"]), log=lambda _: None,
          on_step=lambda step, metrics: seen.append((step, dict(metrics))))
    assert _comparable(read_metrics(b / "metrics.jsonl")) == _comparable(
        read_metrics(a / "metrics.jsonl"))
    # The per-step callback saw the resumed step only, with the metrics written for it.
    assert [step for step, _ in seen] == [2]
    written = read_metrics(b / "metrics.jsonl")[-1]
    assert seen[0][1] and all(written[k] == pytest.approx(v, nan_ok=True)
                              for k, v in seen[0][1].items())
    _assert_same_files(a / "final", b / "final")
    adapter = load_file(a / "final" / LORA_ADAPTER_DIR / "adapter_model.safetensors")
    assert any(np.abs(x).max() > 0 for key, x in adapter.items() if "lora_B" in key)


def _bytes_under(path) -> int:
    """Bytes of the files under ``path``."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_lora_checkpoint_stores_the_adapters_and_names_its_base(finished_lora_run):
    """The saved params are the adapters alone (q_proj and up_proj, A and B), far smaller
    than the base weights, and the meta records the base the run loaded."""
    root, _, a, _ = finished_lora_run
    with Checkpointer(a / "checkpoints", read_only=True) as ckpt:
        shapes, meta = ckpt.stored_shapes(), ckpt.read_meta()
    saved = sorted(name for name in shapes if name.startswith("params/"))
    assert saved == [f"params/layers/{block}/{proj}/lora/{ab}"
                     for block, proj in (("mlp", "up_proj"), ("self_attn", "q_proj"))
                     for ab in ("lora_a/value", "lora_b/value")]
    base_bytes = sum(x.nbytes for x in load_file(root / "policy" / "model.safetensors").values())
    # Adapters + their Adam moments: 3 x 320 float32 values; the rest is orbax's metadata.
    assert 4 * sum(np.prod(shape) for shape in shapes.values()) < base_bytes / 10
    assert _bytes_under(a / "checkpoints" / "2" / "state") < base_bytes
    assert meta["lora_base"] == {"path": str((root / "policy").resolve()),
                                 "fingerprint": base_fingerprint(root / "policy")}


def test_export_from_a_lora_checkpoint_equals_the_final_export(finished_lora_run, tmp_path):
    """``load_policy`` puts the checkpoint's adapters on the base: its export (merged and
    adapter alone) is the run's own final export."""
    _, config, a, _ = finished_lora_run
    graphdef, params, tokenizer = load_policy(load_config(RunConfig, config, [f"run_dir={a}"]),
                                              log=lambda _: None)
    _assert_same_files(a / "final", export_policy(graphdef, params, tokenizer, tmp_path / "x"))


def test_lora_resume_on_another_base_is_refused_naming_model_path(lora_run, tmp_path):
    """The base's fingerprint depends on its content only (a copy keeps it); after the base
    changes under a LoRA run, resuming or loading its checkpoint names ``model.path``."""
    root, config = lora_run
    base = tmp_path / "base"
    shutil.copytree(root / "policy", base)
    assert base_fingerprint(base) == base_fingerprint(root / "policy")
    overrides = [f"run_dir={tmp_path / 'run'}", f"model.path={base}"]
    train(load_config(RunConfig, config, [*overrides, "trainer.steps=1"]), log=lambda _: None)
    weights = load_file(base / "model.safetensors")
    name = sorted(weights)[-1]
    weights[name] = weights[name] + np.float32(1e-3).astype(weights[name].dtype)
    save_file(weights, base / "model.safetensors", metadata={"format": "pt"})
    assert base_fingerprint(base) != base_fingerprint(root / "policy")
    cfg = load_config(RunConfig, config, overrides)
    with pytest.raises(CheckpointError, match=r"lora_base\.fingerprint=.*model\.path"):
        train(cfg, log=lambda _: None)
    with pytest.raises(CheckpointError, match=r"lora_base\.fingerprint=.*model\.path"):
        load_policy(cfg, log=lambda _: None)


@pytest.mark.parametrize("override, field", [
    ("model.lora.rank=0", "model.lora.rank"),
    ("model.lora.rank=-2", "model.lora.rank"),
    ("model.lora.alpha=0", "model.lora.alpha"),
    ("model.lora.targets=[q_proj,qkv]", "model.lora.targets"),
    ("model.lora.targets=[]", "model.lora.targets"),
    ("model.lora.dropout=1.0", "model.lora.dropout"),
    ("model.lora.dropout=-0.1", "model.lora.dropout"),
])
def test_bad_lora_config_names_the_field(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(RunConfig, None, [override])


def test_lora_target_naming_no_module_is_refused_by_the_model(tmp_path):
    model = models.load_pretrained(make_tiny_hf(tmp_path, "llama", tokenizer=False),
                                   dtype=jnp.float32)
    with pytest.raises(ValueError, match="name no module"):
        models.add_lora(model, RANK, ALPHA, ("q_proj", "lm_head"), rngs=nnx.Rngs(0))
    assert not models.has_lora(model)


def test_lora_params_follow_their_kernels_layout():
    """A follows its kernel's input dim and B its output dim over fsdp=4 x tensor=2."""
    mesh = jax.sharding.AbstractMesh((1, 4, 2), models.MESH_AXES)
    layout = {
        "layers/self_attn/q_proj/lora/lora_a": ((2, 64, 8), P(None, "fsdp")),
        "layers/self_attn/q_proj/lora/lora_b": ((2, 8, 64), P(None, None, "tensor")),
        "layers/mlp/down_proj/lora/lora_a": ((2, 128, 8), P(None, "tensor")),
        "layers/mlp/down_proj/lora/lora_b": ((2, 8, 64), P(None, None, "fsdp")),
    }
    for path, (shape, spec) in layout.items():
        assert models.partition_spec(path, shape, mesh) == spec, path
