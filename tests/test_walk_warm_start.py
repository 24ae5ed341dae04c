"""The committed walk warm start (data/warm_starts/walk_ft) is the documented file and
solves held-out walk problems greedily under dense inference."""

from __future__ import annotations

import hashlib
from pathlib import Path

from sparse_rl_jax.config_io import load_config
from sparse_rl_jax.evaluation import eval_set, evaluate
from sparse_rl_jax.policy import load_policy, resolve_sampling
from sparse_rl_jax.rewards import get_reward_fn
from sparse_rl_jax.run_config import RunConfig

ROOT = Path(__file__).resolve().parents[1]
POLICY = ROOT / "data" / "warm_starts" / "walk_ft"
SHA256 = "c9f872fbf76fdb6e328ef52847c5bdb25b2cba86208daed07386eb2cfb2e2527"


def test_walk_warm_start_is_the_documented_file():
    digest = hashlib.sha256((POLICY / "model.safetensors").read_bytes()).hexdigest()
    assert digest == SHA256
    assert SHA256 in (POLICY / "README.md").read_text()


def test_walk_warm_start_solves_held_out_walks(tmp_path):
    cfg = load_config(RunConfig, ROOT / "configs" / "walk" / "common.yaml", [
        f"run_dir={tmp_path}", f"model.path={POLICY}", "eval.num_prompts=8"])
    graphdef, params, tokenizer = load_policy(cfg, str(POLICY), log=lambda _: None)
    prompts, answers = eval_set(cfg)
    (dense,) = evaluate(graphdef, params, tokenizer, prompts, answers,
                        get_reward_fn(cfg.data.reward), resolve_sampling(cfg, tokenizer), [],
                        samples=1, temperature=1.0, batch_size=8, seed=0,
                        add_special_tokens=cfg.data.add_special_tokens)
    assert dense.mode == "dense" and dense.pass_at_1 >= 7 / 8, dense
