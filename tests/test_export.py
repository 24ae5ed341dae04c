"""The exported policy (``final/``) as a user loads it: transformers ``AutoTokenizer`` +
``AutoModelForCausalLM`` generate exactly the project's greedy output."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from flax import nnx

import models
from sparse_rl_jax.kv.compression_config import CompressionConfig
from sparse_rl_jax.rollout.sampler import generate
from sparse_rl_jax.rollout.sampling_config import SamplingConfig
from sparse_rl_jax.tasks.task import TaskConfig, problem_at
from sparse_rl_jax.training.policy import export_policy
from sparse_rl_jax.training.run_config import WarmStartConfig
from sparse_rl_jax.training.warm_start import build_default_model

NEW_TOKENS = 12


def test_final_loads_with_auto_classes_and_generates_the_projects_greedy_text(tmp_path):
    task = TaskConfig(n_min=2, n_max=4)
    policy = build_default_model(
        tmp_path / "policy",
        WarmStartConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                        intermediate_size=64, steps=3, batch_size=4), task, log=lambda _: None)
    tok = models.Tokenizer(policy)
    graphdef, params = nnx.split(models.load_pretrained(policy, dtype=jnp.float32))
    final = export_policy(graphdef, params, tok, tmp_path / "final")

    prompts = [problem_at(task, i).prompt for i in range(3)]  # contain spaces: "A=6 B=5 ?"
    assert all(" " in p for p in prompts)
    ids, mask = tok.encode(prompts, add_special_tokens=False)
    rollout = generate(graphdef, params, ids, mask, jax.random.key(0),
                       SamplingConfig(max_new_tokens=NEW_TOKENS, greedy=True, num_samples=1,
                                      eos_ids=tok.eos_ids, pad_id=tok.pad_id),
                       CompressionConfig(method="none"))
    ours = tok.decode(rollout.response, rollout.response_mask)

    auto_tok = transformers.AutoTokenizer.from_pretrained(final)
    hf = transformers.AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).eval()
    for i, prompt in enumerate(prompts):
        enc = auto_tok(prompt, add_special_tokens=False, return_tensors="pt")
        assert enc["input_ids"][0].tolist() == ids[i][mask[i] == 1].tolist(), type(auto_tok)
        with torch.no_grad():
            out = hf.generate(**enc, max_new_tokens=NEW_TOKENS, do_sample=False,
                              eos_token_id=list(tok.eos_ids), pad_token_id=tok.pad_id)
        text = auto_tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        assert text == ours[i]
    assert np.asarray(rollout.response_mask).sum() > 0
