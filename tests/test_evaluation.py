"""The policy evaluation (in-training and ``run.py eval``): dense greedy pass@1 against
transformers' greedy generate scored by the same reward, and the behaviours that tie the
other numbers to it (a cache that never evicts is dense; sampling at a vanishing temperature
is greedy)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

import models
from benchmarks.kit.compile_count import count_compiles
from sparse_rl_jax.core.config_io import load_config
from sparse_rl_jax.kv.compression_config import CompressionConfig
from sparse_rl_jax.kv.compression_sections import EvictionConfig
from sparse_rl_jax.rollout.sampling_config import SamplingConfig
from sparse_rl_jax.training.evaluation import _modes as eval_modes
from sparse_rl_jax.training.evaluation import eval_metrics, evaluate, mode_name
from sparse_rl_jax.training.policy import load_policy
from sparse_rl_jax.training.run_config import RunConfig
from tiny_hf import load_hf, make_tiny_hf

NEW_TOKENS = 6
PROMPTS = ["ab", "hello", "xyz12", "Q?", "0 1 2", "k", "The cat", "~~"]
ANSWERS = list("aeiou13x")


def contains_answer(completions, answers):
    """1.0 where the completion contains the answer character: a reward that a random
    policy earns on some prompts and not on others."""
    return [float(a in c) for c, a in zip(completions, answers)]


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    path = make_tiny_hf(tmp_path_factory.mktemp("eval"), std=0.3)
    tok = models.Tokenizer(path)
    graphdef, params = nnx.split(models.load_pretrained(path, dtype=jnp.float32))
    sampling = SamplingConfig(max_new_tokens=NEW_TOKENS, num_samples=2, eos_ids=tok.eos_ids,
                              pad_id=tok.pad_id, prompt_bucket=4)
    return path, tok, graphdef, params, sampling


def hf_greedy_rewards(path, sampling) -> np.ndarray:
    """The oracle: transformers greedy generate per prompt, decoded and rewarded."""
    hf = load_hf(path)
    hf_tok = transformers.PreTrainedTokenizerFast.from_pretrained(path)
    texts = []
    for prompt in PROMPTS:
        enc = hf_tok(prompt, add_special_tokens=False, return_tensors="pt")
        with torch.no_grad():
            out = hf.generate(**enc, max_new_tokens=NEW_TOKENS, do_sample=False,
                              eos_token_id=list(sampling.eos_ids), pad_token_id=sampling.pad_id)
        texts.append(hf_tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True))
    return np.asarray(contains_answer(texts, ANSWERS))


def test_dense_pass_at_1_equals_transformers_greedy_and_a_roomy_cache_is_dense(policy):
    path, tok, graphdef, params, sampling = policy
    oracle = hf_greedy_rewards(path, sampling)
    assert 0 < oracle.mean() < 1  # the reward separates prompts: the check can fail
    # never evicts here
    roomy = CompressionConfig(method="rkv", eviction=EvictionConfig(budget=64, buffer=8, window=2))
    out = eval_metrics(graphdef, params, tok, PROMPTS, ANSWERS, contains_answer, sampling, roomy,
                       batch_size=8, samples=4, temperature=1.0)
    assert out["eval/dense_pass_at_1"] == pytest.approx(oracle.mean())
    assert out["eval/sparse_pass_at_1"] == out["eval/dense_pass_at_1"]
    assert out["eval/sparse_avg_at_k"] == out["eval/dense_avg_at_k"]  # same key, same draws
    assert out["eval/sparse_gap"] == 0
    assert 0 <= out["eval/dense_avg_at_k"] <= 1
    assert (out["eval/dense_avg_at_k"] * 4 * len(PROMPTS)).is_integer()  # k draws per prompt


def test_avg_at_k_at_a_vanishing_temperature_is_greedy_pass_at_1(policy):
    _, tok, graphdef, params, sampling = policy
    dense = CompressionConfig(method="none")
    hot, = evaluate(graphdef, params, tok, PROMPTS, ANSWERS, contains_answer, sampling, dense,
                    samples=3, temperature=1.0, batch_size=8)
    cold, = evaluate(graphdef, params, tok, PROMPTS, ANSWERS, contains_answer, sampling, dense,
                     samples=3, temperature=1e-6, batch_size=8)
    assert cold.avg_at_k == cold.pass_at_1 == hot.pass_at_1
    assert hot.k == cold.k == 3 and cold.mode == "dense"


def test_a_batch_of_longer_prompts_compiles_nothing(policy):
    """Eval batches whose prompts reach two widths alone (prompt_bucket 4: the short four
    fit 4 columns, the long four need 8) all pad to the longest prompt's: in each pass
    (greedy, then sampled) only the first batch compiles."""
    _, tok, graphdef, params, sampling = policy
    order = sorted(range(len(PROMPTS)), key=lambda i: len(PROMPTS[i]))
    prompts, answers = [PROMPTS[i] for i in order], [ANSWERS[i] for i in order]
    widths = [tok.encode(prompts[i:i + 4], add_special_tokens=False,
                         pad_to_multiple_of=sampling.prompt_bucket)[0].shape[1] for i in (0, 4)]
    assert widths[0] < widths[1]  # alone, the second batch would compile a new program set
    totals = []

    def reward(completions, answers):  # called once per batch, after its rollout
        totals.append(sum(compiles.values()))
        return contains_answer(completions, answers)

    jax.clear_caches()  # compiled before (by other tests) would hide a compile
    with count_compiles() as compiles:
        evaluate(graphdef, params, tok, prompts, answers, reward, sampling,
                 CompressionConfig(method="none"), samples=2, temperature=1.0, batch_size=4)
    assert len(totals) == 4  # (greedy, sampled) x 2 batches
    assert totals[1::2] == totals[0::2], totals  # the second batch of a pass: no compile


def test_a_quantized_cache_is_evaluated_under_its_own_name():
    """The dense cache at a quant level gets its own row (``quantized (<level>)``), as does a
    quantized sparse one (``sparse (<method> <budget> <level>)``), after the dense row; a
    setting that neither compresses nor quantizes adds none (what the quantized samplers
    compute: ``test_kv_quant_replay``)."""
    rkv = EvictionConfig(budget=64, buffer=8, window=2)
    settings = [CompressionConfig(method="none", quant="int8"), CompressionConfig(method="none"),
                CompressionConfig(method="rkv", quant="fp8", eviction=rkv),
                CompressionConfig(method="rkv", eviction=rkv)]
    assert [mode_name(c) for c in eval_modes(settings)] == [
        "dense", "quantized (int8)", "sparse (rkv 64 fp8)", "sparse (rkv 64)"]


def test_eval_of_a_directory_without_checkpoints_fails_before_building_a_warm_start(tmp_path):
    cfg = load_config(RunConfig, None, [f"run_dir={tmp_path / 'run'}"])
    with pytest.raises(FileNotFoundError, match="neither an HF checkpoint .* nor a run dir"):
        load_policy(cfg)
    assert not (tmp_path / "run").exists()  # the embedded default was not built
