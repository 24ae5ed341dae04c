"""A plain NumPy (float64, one sequence at a time) reference of ``compute_corrections``,
written from the sources: verl's ``rollout_corr_helper.py`` (IS at token / sequence level,
truncation, IcePop's zeroed weights, rejection bands, the k1/k2/k3 rejection measures at
token / sum / mean / max, batch normalisation, the token veto), slime's ``mis.py``
(Sparse-RL: truncate, reject, veto, normalise), ``compute_opsm_mask`` (DeepSeek-V3.2's
off-policy sequence masking) and our adaptive threshold (``np.quantile``)."""

from __future__ import annotations

import numpy as np


def level_ratio(lr: np.ndarray, level: str, clamp: float) -> np.ndarray:
    """The ratio of ``level`` at each of one sequence's tokens (``lr``: its clamped token log
    ratios)."""
    if level == "token":
        return np.exp(lr)
    agg = lr.sum() if level == "sequence" else lr.mean()
    return np.full(len(lr), np.exp(np.clip(agg, -clamp, clamp)))


def verl_measure(lr: np.ndarray, option: str) -> np.ndarray:
    """verl's value of the rejection option at one sequence's tokens (``lr``: their clamped
    log ratios): the per-token divergence, or its sequence sum / mean / max."""
    agg, div = option.rsplit("_", 1)
    token = {"k1": -lr, "k2": 0.5 * lr ** 2, "k3": np.exp(lr) - 1.0 - lr}[div]
    reduce = {"token": lambda x: x, "seq_sum": np.sum, "seq_mean": np.mean, "seq_max": np.max}
    return np.broadcast_to(reduce[agg](token), lr.shape)


def verl_thresholds(rs: str, spec) -> list[tuple[str, float | None, float]]:
    """``(option, lower, upper)`` per option of verl's ``rollout_rs`` / threshold grammar."""
    options = list(dict.fromkeys(o.strip() for o in rs.split(",")))
    entries = [str(spec)] if not isinstance(spec, str) else spec.split(",")
    entries = entries * len(options) if len(entries) == 1 else entries
    out = []
    for option, entry in zip(options, entries):
        if option.endswith("k1"):
            lo, up = (map(float, entry.split("_"))) if "_" in entry else (
                1 / float(entry), float(entry))
            out.append((option, lo, up))
        else:
            out.append((option, None, float(entry)))
    return out


def verl_rejects(lr: np.ndarray, option: str, lower, upper) -> np.ndarray:
    """Tokens of one sequence that the option rejects (all of them for a sequence option)."""
    value = verl_measure(lr, option)
    if lower is not None:
        return (value < np.log(lower)) | (value > np.log(upper))
    return value > upper


def np_corrections(old, sparse, mask, cfg, advantages=None):
    """``(weights, token_mask, seq_mask, metrics)`` of ``cfg``'s parts."""
    b, t = old.shape
    c = cfg.log_ratio_clamp
    weights = np.zeros((b, t))
    altered = np.zeros((b, t), bool)
    token_mask = np.zeros((b, t), bool)
    seq_mask = np.ones(b, bool)
    veto = np.zeros(b, bool)
    opsm = np.zeros(b, bool)
    tok_lr = np.zeros((b, t))
    seq_weight = []
    for i in range(b):
        idx = np.flatnonzero(mask[i])
        if len(idx) == 0:
            continue
        diff = old[i, idx] - sparse[i, idx]
        lr = np.clip(np.where(np.isnan(diff), -c, diff), -c, c)
        tok_lr[i, idx] = lr
        w = np.ones(len(idx))
        if cfg.is_level != "none":
            r = level_ratio(lr, cfg.is_level, c)
            if cfg.is_mode == "truncate":
                w, alt = np.minimum(r, cfg.is_upper), r > cfg.is_upper
            elif cfg.is_mode == "raw":
                w, alt = r, np.zeros(len(r), bool)
            else:  # mask: IcePop, weight r inside the band, 0 outside
                alt = (r < cfg.is_lower) | (r > cfg.is_upper)
                w = np.where(alt, 0.0, r)
            altered[i, idx] = alt
        weights[i, idx] = w
        seq_weight.append(w.mean())
        token_mask[i, idx] = True
        if cfg.rs_level != "none":
            r = level_ratio(lr, cfg.rs_level, c)
            rej = (r < cfg.rs_lower) | (r > cfg.rs_upper)
            if cfg.rs_level == "token":
                token_mask[i, idx] = ~rej
            elif rej.any():
                seq_mask[i] = False
        for option, lower, upper in ([] if cfg.rs == "none" else
                                     verl_thresholds(cfg.rs, cfg.rs_threshold)):
            if cfg.rs_target_rate is not None:  # the adaptive threshold, set per batch below
                continue
            rej = verl_rejects(lr, option, lower, upper)
            if option.startswith("token"):
                token_mask[i, idx] &= ~rej
            elif rej.any():
                seq_mask[i] = False
        if cfg.veto and np.any(np.exp(lr) < cfg.veto_threshold):
            veto[i] = True
        if cfg.opsm and advantages[i] < 0 and np.mean(-lr) > cfg.opsm_delta:
            opsm[i] = True
        if veto[i] or opsm[i]:
            seq_mask[i] = False
    adaptive = {}
    if cfg.rs_target_rate is not None:
        (option, _, floor), = verl_thresholds(cfg.rs, cfg.rs_threshold)
        rows = np.flatnonzero(mask.any(1))
        value = np.array([verl_measure(tok_lr[i][mask[i]], option)[0] for i in rows])
        threshold = max(floor, np.quantile(value, 1 - cfg.rs_target_rate)) if len(rows) else floor
        seq_mask[rows[value > threshold]] = False
        adaptive["rs_adaptive_threshold"] = threshold
    factor = 1.0
    if cfg.normalize:
        mean = weights[mask].mean() if cfg.is_level in ("none", "token") else np.mean(seq_weight)
        if mean >= 1e-8:
            factor = mean
    weights = weights / factor

    nonempty = mask.any(1)
    kept = token_mask & seq_mask[:, None]
    lr_valid = tok_lr[mask]
    w_kept = np.where(kept, weights, 0.0)[mask]
    ess = w_kept.sum() ** 2 / (len(w_kept) * np.sum(w_kept ** 2)) if np.any(w_kept) else 0.0
    alt_fraction = altered[mask].mean()
    metrics = {
        "rejection_rate": (~seq_mask[nonempty]).mean(),
        "veto_fraction": veto[nonempty].mean(),
        "opsm_fraction": opsm[nonempty].mean(),
        "token_mask_fraction": (~token_mask[mask]).mean(),
        "kept_token_fraction": kept[mask].mean(),
        "is_truncated_fraction": alt_fraction if cfg.is_mode == "truncate" else 0.0,
        "is_masked_fraction": alt_fraction if cfg.is_mode == "mask" else 0.0,
        **adaptive,
        "is_ess": ess,
        "mismatch_k3": np.mean(np.exp(lr_valid) - lr_valid - 1),
        "log_ratio_mean": lr_valid.mean(),
        "log_ratio_max": lr_valid.max(),
        "log_ratio_min": lr_valid.min(),
        "is_weight_mean": weights[kept].mean() if kept.any() else 0.0,
        "is_norm_factor": factor,
        "low_r_token_fraction": (np.exp(lr_valid) < 1e-4).mean(),
        "low_r_sequence_fraction": np.mean([np.any(np.exp(tok_lr[i][mask[i]]) < 1e-4)
                                            for i in np.flatnonzero(nonempty)]),
    }
    return weights, token_mask, seq_mask, metrics


def random_rollout(seed: int, b: int = 8, t: int = 7):
    """Log-probs whose per-sequence mismatch scale varies from tiny to large; one empty row,
    padding, and a few catastrophic tokens, so every branch (accept, reject at each level,
    truncate, zero, veto) is visited; advantages of both signs."""
    rng = np.random.default_rng(seed)
    old = rng.normal(-1.5, 0.7, (b, t))
    scale = np.geomspace(0.02, 1.0, b)[rng.permutation(b)][:, None]
    sparse = old + rng.normal(0.0, 1.0, (b, t)) * scale
    mask = rng.random((b, t)) < 0.8
    mask[0] = False
    mask[1, :3] = True
    sparse[1, 1] = old[1, 1] + 12.0  # r = e^-12 < 1e-4: vetoed where the veto is on
    garbage = ~mask
    old[garbage] = rng.choice([np.nan, np.inf, -np.inf], size=garbage.sum())
    sparse[garbage] = rng.choice([np.nan, np.inf, -np.inf], size=garbage.sum())
    advantages = rng.normal(0.0, 1.0, b)
    return (old.astype(np.float32), sparse.astype(np.float32), mask,
            advantages.astype(np.float32))
