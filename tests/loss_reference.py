"""The NumPy oracle of `grpo_loss` (float64 value, central-difference gradient) and the
random batch the loss tests share."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from sparse_rl_jax.rl.grpo_loss import LossBatch


def np_loss(new, old, adv, mask, w, cfg, ref=None, valid=None, dense=None, kl_full=None,
            entropy=None, base=None):
    """Float64 reference: per-token policy (+ KL, + distillation, - entropy) terms, then the
    aggregation by loops.

    mask: the kept tokens; valid: the loss mask before rejection (None: = mask), which sets
    the denominator under `seq_denominator="all"` (Dr.GRPO's: all `b` rows). dense / kl_full: the shadow-mask teacher's
    log-probs and the per-token vocabulary KL (a constant here). entropy: per-token entropy.
    base: where the stop-gradient parts (CISPO's clipped weight, GSPO-token's sequence
    ratio) are evaluated; None = `new` (the value). `np_grad` holds it at the unperturbed
    point, which makes central differences give the stop-gradient forms' gradients.
    Log ratios are clamped to `cfg.log_ratio_clamp` where exponentiated; CISPO's factor
    `log rho` is not (its gradient survives any ratio).
    """
    valid = mask if valid is None else valid
    base = new if base is None else base
    b, t = new.shape
    c = cfg.log_ratio_clamp
    lr = np.clip(new - old, -c, c)
    lr_base = np.clip(base - old, -c, c)
    lr_pi = new - old  # CISPO's factor log rho: never exponentiated, so not clamped
    if cfg.ratio_level == "sequence":
        log_s = [np.clip(lr_base[i][mask[i]].mean(), -c, c) if mask[i].any() else 0.0
                 for i in range(b)]
        lr = np.array(log_s)[:, None] + lr - lr_base
        lr_pi = np.array(log_s)[:, None] + new - base
        lr_base = np.broadcast_to(np.array(log_s)[:, None], (b, t))
    per_seq_terms = []
    for i in range(b):
        terms = []
        for j in range(t):
            if not mask[i, j]:
                continue
            rho, a = np.exp(lr[i, j]), adv[i]
            lo, hi = 1 - cfg.eps_low, 1 + cfg.eps_high
            if cfg.policy_loss == "cispo":
                pol = -min(max(np.exp(lr_base[i, j]), lo), hi) * a * lr_pi[i, j]
            else:
                pol = max(-rho * a, -min(max(rho, lo), hi) * a)
                if cfg.clip_c is not None and a < 0:
                    pol = min(pol, -cfg.clip_c * a)
            pg = w[i, j] * pol
            kl = 0.0
            if ref is not None:
                d = np.clip(new[i, j] - ref[i, j], -c, c)
                kl = {"k1": d, "k2": d * d / 2, "k3": np.exp(-d) - 1 + d}[cfg.kl_kind]
            distill = 0.0
            if dense is not None:
                d = np.clip(new[i, j] - dense[i, j], -c, c)
                k3 = np.exp(-d) - 1 + d
                distill = kl_full[i, j] if cfg.distill_kind == "full" else k3
            bonus = cfg.entropy_coef * entropy[i, j] if entropy is not None else 0.0
            terms.append(pg + cfg.kl_coef * kl + cfg.distill_coef * distill - bonus)
        per_seq_terms.append(terms)
    nonempty = [x for x in per_seq_terms if x]
    if not nonempty:
        return 0.0
    if cfg.seq_denominator == "all":
        n_seq, n_tok = int(valid.any(1).sum()), int(valid.sum())
    else:
        n_seq, n_tok = len(nonempty), sum(len(x) for x in nonempty)
    if cfg.aggregation == "token_mean":
        return sum(v for x in nonempty for v in x) / n_tok
    if cfg.aggregation == "seq_mean_token_mean":
        return sum(sum(x) / len(x) for x in nonempty) / n_seq
    if cfg.aggregation == "seq_mean_token_sum_norm":  # Dr.GRPO: under "all", every row
        return sum(sum(x) for x in nonempty) / t / (b if cfg.seq_denominator == "all" else n_seq)
    return sum(sum(x) for x in nonempty) / n_seq


def np_grad(new, *args, h=1e-5, **kwargs):
    """Central differences of `np_loss` in `new`, stop-gradient parts held at `new`."""
    kwargs.setdefault("base", new.copy())
    g = np.zeros_like(new)
    for idx in np.ndindex(new.shape):
        up, down = new.copy(), new.copy()
        up[idx] += h
        down[idx] -= h
        g[idx] = (np_loss(up, *args, **kwargs) - np_loss(down, *args, **kwargs)) / (2 * h)
    return g


def random_batch(seed, b=6, t=5, with_ref=False):
    """A `[b, t]` batch with an empty row, a rejected sequence and rejected tokens.

    Returns `(new, batch, (old, adv, eff, weights), ref, loss_mask)`: NumPy float64 copies of
    what the `LossBatch` `batch` holds in float32, `eff` the effective (kept) token mask.
    """
    rng = np.random.default_rng(seed)
    old = rng.normal(-1.2, 0.6, (b, t))
    new = old + rng.normal(0.0, 0.35, (b, t))  # rho spread across the clip band
    loss_mask = rng.random((b, t)) < 0.85
    loss_mask[0] = False
    token_mask = loss_mask & (rng.random((b, t)) < 0.85)
    seq_mask = np.ones(b, bool)
    seq_mask[1] = False
    weights = rng.uniform(0.0, 1.6, (b, t))
    adv = rng.normal(0.0, 1.0, b)
    ref = old + rng.normal(0.0, 0.3, (b, t)) if with_ref else None
    batch = LossBatch(
        logp_old_dense=jnp.asarray(old, jnp.float32),
        advantages=jnp.asarray(adv, jnp.float32),
        loss_mask=jnp.asarray(loss_mask),
        is_weights=jnp.asarray(weights, jnp.float32),
        token_mask=jnp.asarray(token_mask),
        seq_mask=jnp.asarray(seq_mask),
        logp_ref=None if ref is None else jnp.asarray(ref, jnp.float32),
    )
    eff = loss_mask & token_mask & seq_mask[:, None]
    # round through float32 so the reference sees exactly what JAX sees
    f = lambda x: None if x is None else np.asarray(x, np.float32).astype(np.float64)  # noqa: E731
    return f(new), batch, (f(old), f(adv), eff, f(weights)), f(ref), loss_mask

