"""The walk experiment's arms (``experiments/reproduce.py``): each arm's label and its run-config
overrides, from the methods, budgets, control rates, lags, quantization levels and correction
presets an experiment names."""

from __future__ import annotations

from sparse_rl_jax.rl.loss_config import CorrectionConfig

DISTILL = 0.1  # shadow-mask arm's loss.distill_coef (the paper's value is not public)
ARM_KINDS = ("dense", "naive", "sparse-rl", "shadow-mask")  # the first word of an arm's label


def correction_arm(name: str) -> list[str]:
    """The overrides of a ``--corrections`` arm: the named preset
    (``correction_presets.CORRECTION_PRESETS``), the low-r gradient share logged, and the
    shadow-mask arm's distillation where the preset replays the record."""
    replays = CorrectionConfig(kind=name).replay
    return [f"correction.kind={name}", "trainer.low_r_grad_share=true",
            *([f"loss.distill_coef={DISTILL}"] if replays else [])]


def arms(methods: list[str], budgets: list[int], controls: tuple[float, ...] = (),
         lags: tuple[int, ...] = (), quants: tuple[str, ...] = (),
         corrections: tuple[str, ...] = (), quant_alone: bool = True
         ) -> list[tuple[str, list[str]]]:
    """(label, overrides) of every arm: dense once, then naive and Sparse-RL on the positive
    control per rate in ``controls`` (dense rollouts, ``data.control_missed_increment``; walk
    task only), then naive, Sparse-RL and shadow-mask per budget and method. With ``lags``,
    the per-budget arms are asynchronous instead (``trainer.mode: async``), one pair per lag
    ``k``: Sparse-RL under the decoupled objective, against naive = standard PPO with the
    ratio to the sampler's log-probs (``correction.kind: ppo_behaviour``). With ``quants``
    (quantized KV, ``compression.quant``), naive and Sparse-RL per level instead: on
    quantization alone (``<kind> none <level>``, a dense cache of that level) and on each
    budget's eviction with it (``<kind> <method> <budget> <level>``; without ``quant_alone``,
    only the latter). With ``corrections``
    (preset names), every place that has a naive / Sparse-RL (/ shadow-mask) set has one arm
    per named correction instead, labelled by its name (``<name> <method> <budget>``,
    ``<name> control <q>``, ``... lag <k>``, ``... <level>``; :func:`correction_arm`); a
    replaying one (shadow_mask) has no control arm: the injected rows carry no record."""
    def kinds(*default, replay=True):
        return [(name, correction_arm(name)) for name in corrections
                if replay or not CorrectionConfig(kind=name).replay] or list(default)
    naive = ("naive", ["correction.kind=none", "trainer.low_r_grad_share=true"])
    plain_naive = ("naive", ["correction.kind=none"])
    sparse_rl = ("sparse-rl", ["correction.kind=sparse_rl"])
    out = [("dense", ["compression.method=none", "correction.kind=none"])]
    for rate in controls:
        setting = ["compression.method=none", f"data.control_missed_increment={rate}"]
        out += [(f"{kind} control {rate:g}", [*setting, *over])
                for kind, over in kinds(naive, sparse_rl, replay=False)]
    for quant in quants if quant_alone else ():
        alone = ["compression.method=none", "compression.layout=dense",
                 f"compression.quant={quant}"]
        out += [(f"{kind} none {quant}", [*alone, *over])
                for kind, over in kinds(plain_naive, sparse_rl)]
    for budget in budgets:
        for method in methods:
            setting = [f"compression.method={method}", f"compression.eviction.budget={budget}"]
            for quant in quants:
                # the record lets the run log its mismatch split by source (mismatch_sources)
                both = [*setting, f"compression.quant={quant}", "sampling.record_evictions=true"]
                out += [(f"{kind} {method} {budget} {quant}", [*both, *over])
                        for kind, over in kinds(plain_naive, sparse_rl)]
            for lag in lags:
                timing = [*setting, "trainer.mode=async", f"trainer.max_lag={lag}"]
                out += [(f"{kind} {method} {budget} lag {lag}", [*timing, *over])
                        for kind, over in kinds(("naive", ["correction.kind=ppo_behaviour"]),
                                                sparse_rl)]
            if lags or quants:
                continue
            shadow = ("shadow-mask",
                      ["correction.kind=shadow_mask", f"loss.distill_coef={DISTILL}"])
            # the naive arm also logs the gradient share a 1e-4 veto would have removed
            out += [(f"{kind} {method} {budget}", [*setting, *over])
                    for kind, over in kinds(naive, sparse_rl, shadow)]
    return out

