"""The committed walk warm starts (data/warm_starts/walk_ft, walk_local, walk_local2) are the
documented files and solve held-out walk problems greedily under dense inference."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from sparse_rl_jax.core.config_io import load_config
from sparse_rl_jax.tasks.rewards import get_reward_fn
from sparse_rl_jax.training.evaluation import eval_set, evaluate
from sparse_rl_jax.training.policy import load_policy, resolve_sampling
from sparse_rl_jax.training.run_config import RunConfig

ROOT = Path(__file__).resolve().parents[1]
# name -> (sha256 of model.safetensors, the walk overrides it was trained for)
WARM_STARTS = {
    "walk_ft": ("c9f872fbf76fdb6e328ef52847c5bdb25b2cba86208daed07386eb2cfb2e2527", []),
    "walk_local": ("ff92f2c1da22d8f539289d40be2425ed9369d5a4722460a88171eb221cbd1f65",
                   ["data.walk.echo_every=2", "sampling.max_new_tokens=200"]),
    "walk_local2": ("984363064a5dc9f14b48c11a04f97ec5577a4da82775705523003855a3cedae2",
                    ["data.walk.echo_every=2", "sampling.max_new_tokens=200"]),
}


@pytest.mark.parametrize("name", sorted(WARM_STARTS))
def test_walk_warm_start_is_the_documented_file(name):
    policy, (sha256, _) = ROOT / "data" / "warm_starts" / name, WARM_STARTS[name]
    digest = hashlib.sha256((policy / "model.safetensors").read_bytes()).hexdigest()
    assert digest == sha256
    assert sha256 in (policy / "README.md").read_text()


@pytest.mark.parametrize("name", sorted(WARM_STARTS))
def test_walk_warm_start_solves_held_out_walks(tmp_path, name):
    policy, (_, overrides) = ROOT / "data" / "warm_starts" / name, WARM_STARTS[name]
    cfg = load_config(RunConfig, ROOT / "configs" / "walk" / "common.yaml", [
        f"run_dir={tmp_path}", f"model.path={policy}", "eval.num_prompts=8", *overrides])
    graphdef, params, tokenizer = load_policy(cfg, str(policy), log=lambda _: None)
    prompts, answers = eval_set(cfg)
    (dense,) = evaluate(graphdef, params, tokenizer, prompts, answers,
                        get_reward_fn(cfg.data.reward), resolve_sampling(cfg, tokenizer), [],
                        samples=1, temperature=1.0, batch_size=8, seed=0,
                        add_special_tokens=cfg.data.add_special_tokens)
    assert dense.mode == "dense" and dense.pass_at_1 >= 7 / 8, dense
