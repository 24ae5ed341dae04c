"""The decode-step cost model against a hand computation."""

from __future__ import annotations

import pytest

from models.config import ModelConfig
from sparse_rl_jax.kv.sparrow_cost import (DEVICES, Device, decode_step_cost, linear_params,
                                           rollout_seconds)

CFG = ModelConfig(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=16,
                  num_layers=3, num_heads=2, num_kv_heads=1, head_dim=4)
SLOW = Device("hand", bandwidth=1000.0, flops=2000.0)


def test_linear_params_by_hand():
    # per layer: q,o 8*4*2 each, k,v 8*4 each = 192; mlp 3*8*16 = 384; LM head 10*8
    assert linear_params(CFG) == 3 * (192 + 384) + 80


def test_sparse_step_by_hand():
    # L=40, 4-token pages -> 10 pages > k+3 = 5: layers 1, 2 sparse (80 tokens summed over
    # layers: 40 dense + 2 * 5 pages * 4), scoring reads 10 page means on 2 layers.
    cost = decode_step_cost(CFG, batch=2, cached_len=40, k=2, page_size=4, dense_layers=(0,),
                            itemsize=4)
    assert (cost.linear_bytes, cost.linear_flops) == (1808 * 4, 2 * 2 * 1808)
    assert (cost.attention_bytes, cost.attention_flops) == (2 * 80 * 2 * 4 * 4,
                                                            2 * 80 * 4 * 2 * 4)
    assert (cost.scoring_bytes, cost.scoring_flops) == (2 * 2 * 10 * 4 * 4, 2 * 2 * 10 * 2 * 4)
    assert cost.seconds(SLOW) == pytest.approx(7.232 + 5.12 + 0.64)  # all bandwidth-bound
    dense = decode_step_cost(CFG, batch=2, cached_len=40, page_size=4, itemsize=4)
    assert dense.attention_bytes == 2 * 120 * 2 * 4 * 4 and dense.scoring_bytes == 0


def test_short_rows_are_dense_and_rollout_sums_the_schedule():
    short = decode_step_cost(CFG, batch=1, cached_len=20, k=2, page_size=4)  # 5 pages <= 5
    assert short == decode_step_cost(CFG, batch=1, cached_len=20, page_size=4)
    kw = dict(batch=1, prompt_len=16, page_size=4, dense_layers=(0,))
    steps = [decode_step_cost(CFG, batch=1, cached_len=16 + t, page_size=4, dense_layers=(0,),
                              k=1 if 16 + t <= 24 else 3).seconds(SLOW) for t in range(1, 20)]
    got = rollout_seconds(CFG, SLOW, new_tokens=20, schedule=((0, 1), (28, 3)), **kw)
    assert got == pytest.approx(sum(steps))
    assert rollout_seconds(CFG, DEVICES["h100"], new_tokens=20, **kw) > 0
