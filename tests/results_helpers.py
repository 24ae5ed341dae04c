"""Made-up runs in reproduce.py's results.json format, for the tests of the result pages
and the study rules."""


def run(arm, seed, dense, sparse=None, collapsed=False, reward_last=0.8, rejection=0.0,
        share=None, seq=0.05, steps=20):
    """One made-up run in reproduce.py's results.json format."""
    own = "dense" if sparse is None else "sparse (rkv 32)"
    evals = [{"mode": "dense", "pass_at_1": dense, "avg_at_k": dense}]
    if sparse is not None:
        evals.append({"mode": own, "pass_at_1": sparse, "avg_at_k": sparse})
    curve = {"reward_mean": [0.9] * steps, "low_r_sequence_fraction": [seq] * steps}
    if share is not None:
        curve["low_r_grad_share"] = [share] * (steps // 2) + [0.0] * (steps - steps // 2)
    return {"arm": arm, "seed": seed, "own_eval": own, "reward_first": 0.9,
            "reward_last": reward_last, "collapsed": collapsed, "rejection_rate": rejection,
            "clip_fraction": 0.0, "mismatch_k3": 0.1, "truncated_fraction": 0.01,
            "low_r_sequence_fraction": seq, "kv_token_savings": 0.4, "eval": evals,
            "steps": curve}
