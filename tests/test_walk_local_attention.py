"""experiments/walk_local_attention.py: the stale-key dropout rule and a smoke run."""

from __future__ import annotations

import numpy as np

import models
from experiments import walk_local_attention as script


def test_stale_key_expiry_follows_the_rule():
    never = script.NEVER
    drop = script.Dropout(window=(3, 6), keep_old=0.25, extra=7, protect=4, keep_prompt=0.3,
                          hide_after=9, full_rows=0.2)
    lengths = np.array([10, 13, 8, 12] * 50)
    expiry = script.stale_key_expiry(lengths, 40, 3, 2, drop, np.random.default_rng(0))
    assert expiry.shape == (3, 200, 2, 40) and expiry.dtype == np.int32
    full_rows, kept_old, kept_prompt, hidden_old, hidden_prompt = 0, 0, 0, 0, 0
    for row, p in enumerate(lengths):
        e = expiry[:, row]
        if (e == never).all():
            full_rows += 1
            continue
        assert (e[..., :4] == never).all()  # the protected facts
        prompt = e[..., 4:p]
        hidden = prompt[prompt != never]
        assert ((hidden >= p + 9) & (hidden < p + 9 + 20)).all()
        kept_prompt += (prompt == never).sum()
        hidden_prompt += hidden.size
        # response keys: hidden at s + W + U[0, 7) with one W in [3, 6) for the row
        s = np.arange(p, 40)
        old = e[..., p:]
        lag = (old - s)[old != never]
        assert (lag >= 3).all() and (lag < 6 + 7 - 1).all()
        windows = {w for w in range(3, 6) if ((lag >= w) & (lag < w + 7)).all()}
        assert windows, f"row {row}: no single window explains the lags"
        kept_old += (old == never).sum()
        hidden_old += lag.size
    assert 20 <= full_rows <= 60  # 0.2 of 200
    assert abs(kept_prompt / (kept_prompt + hidden_prompt) - 0.3) < 0.05
    assert abs(kept_old / (kept_old + hidden_old) - 0.25) < 0.03


def test_smoke_run_writes_a_loadable_policy(tmp_path, capsys):
    out = tmp_path / "local"
    assert script.main(["--out", str(out), "--plain", "--steps", "2", "--batch", "2",
                           "data.walk.echo_every=2", "warm_start.hidden_size=32"]) == 0
    assert "held-out loss: full context" in capsys.readouterr().out
    model = models.load_pretrained(out)
    assert model.config.hidden_size == 32 and (out / "tokenizer.json").is_file()
