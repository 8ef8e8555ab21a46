"""The advice as a pure function: :func:`advise` maps a probe's measurements
(:class:`Facts`), the target hardware (:class:`Target`) and a memory budget to
an :class:`Advice`, one :class:`Decision` per question, each with the evidence
it read and the threshold it compared against.

No torch, no files, no clock: the same inputs give the same advice, which is
what lets every rank of a torchrun job agree and lets each rule be tested at
its threshold (``tests/test_advice_rules.py``). The thresholds, and where each
comes from, are :class:`Thresholds`' docstrings and ``docs/advise.md``; the data types are
``facts.py``'s.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

from mptrain.advice.facts import (  # noqa: F401  the data the rules read and give, importable from here too
    Advice,
    Cast,
    Decision,
    Facts,
    Layout,
    LinearFacts,
    StateOption,
    StepCasts,
    Target,
    Thresholds,
)

FP16_MAX_LOG2 = 15
"""Values below 2^16 fit fp16 (its largest is 65504 = 2^16 - 2^5): a bin
``[2^b, 2^(b+1))`` scaled by ``2^k`` fits when ``b + k + 1 <= 16``; this rule
asks ``b + k <= 15`` to keep the bin's top below 65504."""
FP16_MIN_LOG2 = -24
"""fp16's smallest subnormal is 2^-24: a bin whose top scaled by ``2^k`` is at
or below it (``b + k + 1 <= -24``) rounds to zero or to that one subnormal."""

# The float8 recipes the advice can pick, in the order it prefers them at equal
# coverage (cheapest casts first; tensorwise alone all-gathers float8 weights
# under FSDP2): recipe names, the probe's what-ifs of the same names measure them;
# and the precision= preset that trains each.
FP8_CANDIDATES = ("tensorwise", "rowwise", "mxfp8")
PRESET_OF = {"tensorwise": "fp8", "rowwise": "fp8-rowwise", "mxfp8": "mxfp8"}


BLOCK_OF = {"MX (mxfp8, mxfp4)": 32, "NVFP4": 16}
"""Elements per scaling block along a matmul's dimensions: MX formats' 1x32, NVFP4's 16 (and 16x16 weight tiles)."""


# ---------------------------------------------------------------------- float8


def passes(c: Cast, th: Thresholds) -> bool:
    return c.flush <= th.fp8_flush and c.saturate <= th.fp8_saturate and c.sqnr_db >= th.fp8_sqnr_db


def _failure(c: Optional[Cast], th: Thresholds, recipe: str) -> str:
    if c is None:
        return f"not measured with {recipe}"
    bad = []
    if c.flush > th.fp8_flush:
        bad.append(f"flushes {c.flush:.2%} > {th.fp8_flush:.2%}")
    if c.saturate > th.fp8_saturate:
        bad.append(f"saturates {c.saturate:.3%} > {th.fp8_saturate:.3%}")
    if c.sqnr_db < th.fp8_sqnr_db:
        bad.append(f"SQNR {c.sqnr_db:.1f} dB < {th.fp8_sqnr_db:g} dB")
    return ", ".join(bad) + (f" ({c.operand})" if c.operand else "")


def speedup(share: float, relative_time: float) -> float:
    """Amdahl's law: the step's speed-up when ``share`` of its time runs
    ``relative_time`` as long (matmul time only: casts are not counted)."""
    return 1.0 / ((1.0 - share) + share * relative_time)


def speed_words(ratio: float, noise: float = 0.0) -> str:
    """A speed ratio (new tokens/s over old; above 1 is faster) in words read off
    the ratio itself, so a slowdown is never called a speed-up: ``speed-up
    1.60x``, ``slowdown to 0.13x (7.7x slower)``, or, within ``noise`` of 1,
    ``1.06x, within noise (+-10%)``."""
    if not (ratio > 0 and math.isfinite(ratio)):
        return f"no speed figure ({ratio})"
    if noise > 0 and abs(ratio - 1.0) <= noise:
        return f"{ratio:.2f}x, within noise (+-{noise:.0%})"
    if f"{ratio:.2f}" == "1.00":
        return "no change (1.00x)"
    return f"speed-up {ratio:.2f}x" if ratio > 1 else f"slowdown to {ratio:.2f}x ({1 / ratio:.1f}x slower)"


def float8_plan(facts: Facts, target: Target, th: Thresholds) -> tuple[Decision, dict[str, dict], str, float, float]:
    """(the decision, per-linear table, the recipe, float8 FLOPs share, expected speed-up)."""
    layers: dict[str, dict] = {}
    for lin in facts.linears:
        layers[lin.name] = {"in_features": lin.in_features, "out_features": lin.out_features,
                            "flops_share": lin.flops_share, "kept_out": lin.kept_out,
                            "passes": [r for r in FP8_CANDIDATES if r in lin.casts and passes(lin.casts[r], th)],
                            "casts": {r: asdict(c) for r, c in lin.casts.items()}}
    candidates = [lin for lin in facts.linears if lin.kept_out is None and lin.casts]
    pick = FP8_CANDIDATES  # a mixture too: its experts pad their tokens to a block recipe's blocks
    coverage = {r: sum(lin.flops_share for lin in candidates if r in layers[lin.name]["passes"]) for r in pick}
    recipe = max(pick, key=lambda r: (coverage[r], -FP8_CANDIDATES.index(r)))
    share = coverage[recipe]
    failing = [lin for lin in candidates if recipe not in layers[lin.name]["passes"]]
    late = {x.what for x in late_failures(facts, recipe, th)}  # these stay in float8 until a phase switch
    for name, d in layers.items():
        d["late"] = name in late
    early = [lin for lin in failing if lin.name not in late]
    # against what the linears would run in otherwise: bf16 where native, else fp32
    compute = "bf16" if target.support.get("bf16") == "native" and "bf16" in target.matmul_time else "fp32"
    ratio = target.matmul_time.get("fp8", math.inf) / (target.matmul_time[compute] if compute == "bf16" else 1.0)
    gain = speedup(share, ratio) if math.isfinite(ratio) else 0.0
    kept = [f"{lin.name} ({lin.kept_out})" for lin in facts.linears if lin.kept_out]
    why = {lin.name: f"{lin.name}: {_failure(lin.casts.get(recipe), th, recipe)}" for lin in failing}
    evidence = (f"{len(candidates) - len(failing)} of {len(candidates)} linears within thresholds with {recipe} "
                f"({share:.0%} of the step's FLOPs in float8)")
    if early:
        evidence += f"; kept in bf16 for their casts: {'; '.join(why[lin.name] for lin in early)}"
    if late:
        evidence += ("; in float8 until the schedule's switch, failing only late in the probe: "
                     + "; ".join(why[lin.name] for lin in failing if lin.name in late))
    if kept:
        evidence += f"; kept out by the configuration's rules: {', '.join(kept)}"
    gain_text = speed_words(gain) if gain else "none (no float8 matmul on the target)"
    evidence += f"; expected speed on {target.name}: {gain_text} (matmul time only, {target.source})"
    choice = recipe + (f", excluding {', '.join(lin.name for lin in early)}" if early else "")
    decision = Decision("float8", choice, evidence,
                        f"flush <= {th.fp8_flush:.2%}, saturate <= {th.fp8_saturate:.3%}, "
                        f"SQNR >= {th.fp8_sqnr_db:g} dB per operand")
    decision.overrides = _exclude_overrides(facts, early)
    return decision, layers, recipe, share, gain


# -------------------------------------------------------------------- schedule
GEMM_KEYS = ("forward", "input_gradient", "weight_gradient")
"""The matmuls as ``precision.phases`` names them (its per-matmul keys), in order."""
OPERAND_GEMMS = {"input": ("forward", "weight_gradient"), "weight": ("forward", "input_gradient"),
                 "grad_output": ("input_gradient", "weight_gradient")}
"""The matmuls each operand the cast statistics measure enters."""


@dataclass(frozen=True)
class Late:
    """A float8 linear, or a noise-ratio signal, that passes early in the probe and fails late."""

    what: str
    """The linear's name, or the signal's metric."""
    gemms: tuple[str, ...]
    """The matmuls that fail (:data:`GEMM_KEYS`)."""
    good_until: int
    """The last monitored step before its first failure."""
    first_bad: int
    said: str
    """Its figures at the first failing step, in words."""


def _late_span(series: list[tuple[int, bool]], steps: int, th: Thresholds) -> Optional[tuple[int, int]]:
    """(the last passing step, the first failing one) of a per-step series of
    (step, fails), when it passes at every monitored step up to ``late_from`` of the
    probe's ``steps`` and fails at a later one; None when it never fails or fails early."""
    first = next((s for s, bad in series if bad), None)
    before = [s for s, _ in series if first is not None and s < first]
    if first is None or first <= th.late_from * steps or not before:
        return None
    return before[-1], first


def late_failures(facts: Facts, recipe: str, th: Thresholds) -> list[Late]:
    """The converted linears whose ``recipe`` casts pass the float8 thresholds at
    every monitored step of the probe's earlier part and fail later (the matmuls
    their failing operands enter), and the matmuls whose noise-ratio signal stays at
    or above ``noise_ratio`` early and falls below it later."""
    out = []
    for lin in facts.linears:
        series = lin.by_step.get(recipe, ()) if lin.kept_out is None else ()
        bad = [(sc.step, {op: c for op, c in sc.operands.items() if not passes(c, th)}) for sc in series]
        span = _late_span([(s, bool(ops)) for s, ops in bad], facts.steps, th)
        if span:
            ops = {op for _, o in bad for op in o}
            gemms = tuple(g for g in GEMM_KEYS if any(g in OPERAND_GEMMS.get(op, ()) for op in ops))
            first = dict(bad)[span[1]]
            out.append(Late(lin.name, gemms, *span, "; ".join(_failure(c, th, recipe) for c in first.values())))
    for gemm, values in facts.signals.items():
        span = _late_span([(s, v < th.noise_ratio) for s, v in values], facts.steps, th)
        if span:
            low = min(v for s, v in values if s >= span[1])
            out.append(Late(f"numerics/quant/{gemm}/noise_ratio", (gemm,), *span,
                            f"falls to {low:.3g} < {th.noise_ratio:.3f}"))
    return out


def schedule_plan(facts: Facts, recipe: str, th: Thresholds) -> Optional[Decision]:
    """A precision schedule where the probe shows float8 failing only late
    (:func:`late_failures`): float8 with ``recipe`` from the start, bf16 from the
    fraction of the run where the probe last passed, instead of giving the failing
    linears up for the whole run. None when nothing fails late (a linear that fails
    from the start keeps the float8 decision's exclusion)."""
    late = late_failures(facts, recipe, th)
    if not late:
        return None
    until = min(x.good_until for x in late)
    # rounded down to a twentieth: switching early costs speed, switching late costs the numbers
    start = max(0.05, math.floor(20 * until / facts.steps) / 20)
    gemms = [g for g in GEMM_KEYS if any(g in x.gemms for x in late)]
    per = ", ".join(f"{g}: none" for g in gemms)
    evidence = "; ".join(f"{x.what}: passes up to step {x.good_until}, fails from step {x.first_bad} of "
                         f"{facts.steps} ({x.said})" for x in late)
    evidence += (f"; the switch comes at the last step that passed, {until} of {facts.steps}, as a fraction of the "
                 "run (the probe runs the run's schedule over fewer steps; a longer run may drift sooner or later); "
                 f"only the failing matmuls unquantized instead: 'precision.phases=[{{start: {start:g}, {per}}}]' "
                 "(on the lab's emulated linears: a study of the numbers, slower than bf16)")
    signals = [g for g in gemms if g in facts.signals]
    if signals:
        evidence += (f"; or the run decides on its own signal: 'precision.phases=[{{when: \"{signals[0]}.noise_ratio "
                     f"< {th.noise_ratio:.3f}\", precision: bf16}}]' monitor.enabled=true monitor.fp8_casts=true")
    return Decision("schedule", f"float8 ({recipe}) until {start:g} of the run, then bf16: {', '.join(gemms)} "
                    "fail only late", evidence,
                    f"within the float8 thresholds (and a noise ratio >= {th.noise_ratio:.3f} where measured) at "
                    f"every monitored step up to {th.late_from:.0%} of the probe, outside them later",
                    [f"precision.phases=[{{start: {start:g}, precision: bf16}}]"])


def lab_plan(facts: Facts, th: Thresholds) -> Optional[Decision]:
    """The ``--lab`` candidates ranked by the SQNR of each converted linear's worst
    operand, averaged with the linears' FLOPs shares as weights (the noise each
    format adds where the step's work is), highest first, ties in the order
    given; each with its worst flush and saturation and the FLOPs share within
    the float8 thresholds (reported, not required: 4-bit formats keep 10-20 dB,
    below float8's 20). None without candidates."""
    if not facts.lab_candidates:
        return None
    lins = [lin for lin in facts.linears if lin.kept_out is None and lin.lab]
    figs: dict[str, tuple[float, float, float, float]] = {}
    for r in facts.lab_candidates:
        got = [(lin.flops_share, lin.lab[r]) for lin in lins if r in lin.lab]
        weight = sum(w for w, _ in got)
        if got and weight > 0:
            figs[r] = (sum(w * c.sqnr_db for w, c in got) / weight, max(c.flush for _, c in got),
                       max(c.saturate for _, c in got), sum(w for w, c in got if passes(c, th)))
    missing = [r for r in facts.lab_candidates if r not in figs]
    if not figs:
        return Decision("lab", "none measured", f"the probe logged no figures for {', '.join(missing)}",
                        "highest FLOPs-weighted worst-operand SQNR")
    ranked = sorted(figs, key=lambda r: (-figs[r][0], facts.lab_candidates.index(r)))
    parts = [f"{r}: {figs[r][0]:.1f} dB (flush <= {figs[r][1]:.2%}, saturate <= {figs[r][2]:.3%}, "
             f"{figs[r][3]:.0%} of the step's FLOPs within the float8 thresholds)" for r in ranked]
    evidence = "ranked over the converted linears: " + "; ".join(parts)
    if missing:
        evidence += f"; not measured: {', '.join(missing)}"
    evidence += "; lab recipes are emulated (fp32 products): a study of the format, no speed-up on any device here"
    best = ranked[0]
    return Decision("lab", best, evidence, "highest FLOPs-weighted SQNR of each linear's worst operand; flush, "
                    "saturate and the float8 thresholds reported, not applied",
                    ["precision=lab", f"precision.lab.recipe={best}"])


def _exclude_overrides(facts: Facts, failing: list[LinearFacts]) -> list[str]:
    if not failing:
        return []
    named = [lin.name for lin in facts.linears if lin.kept_out and lin.kept_out.startswith("matches precision.fp8.exclude")]
    return [f"precision.fp8.exclude=[{','.join([*named, *(lin.name for lin in failing)])}]"]


# ------------------------------------------------------------------------ fp16


def underflow_share(facts: Facts, k: int) -> float:
    """Share of the non-zero gradients that flush in fp16 at loss scale 2^k: the
    bins whose top, scaled, is at or below 2^-24. The first bin also holds
    everything below it, so it counts as flushed as soon as its lower edge
    reaches the line (an upper bound: some of it may not flush)."""
    total = sum(facts.grad_hist)
    if not total:
        return 0.0
    lo = facts.grad_hist_lo
    flushed = sum(n for i, n in enumerate(facts.grad_hist)
                  if lo + i + k + 1 <= FP16_MIN_LOG2 or (i == 0 and lo + k <= FP16_MIN_LOG2))
    return flushed / total


def scale_text(k: int) -> str:
    """2^k written exactly (an integer from 2^0 up; a config value Hydra reads back as the same float)."""
    return str(2 ** k) if k >= 0 else repr(2.0 ** k)


def top_bin(facts: Facts) -> Optional[int]:
    nonzero = [i for i, n in enumerate(facts.grad_hist) if n]
    return facts.grad_hist_lo + nonzero[-1] if nonzero else None


def fp16_plan(facts: Facts, th: Thresholds) -> tuple[Decision, int, float, bool]:
    """(the decision, log2 of the initial scale, expected skip rate, safe)."""
    default = facts.loss_scale_init_log2
    top = top_bin(facts)
    if top is None:
        return Decision("fp16", "no verdict", "the probe saw no non-zero gradient", "-"), default, 0.0, False
    best = FP16_MAX_LOG2 - top - th.fp16_headroom_binades
    at_default, at_best = underflow_share(facts, default), underflow_share(facts, best)
    acts_fit = facts.act_over_fp16_max < th.fp16_act_over_max
    safe = at_best <= th.fp16_underflow and acts_fit
    init = default if underflow_share(facts, default) <= th.fp16_underflow and default <= best else best
    steps = facts.grad_top_log2
    spikes = sum(1 for b in steps if b + init > FP16_MAX_LOG2) / len(steps) if steps else 0.0
    # A dynamic scaler that has found its level overflows about once per growth
    # interval (each growth is a probe upward); spikes seen in the probe add theirs.
    skip = 1.0 / facts.growth_interval + spikes
    evidence = (f"largest gradient ~2^{top + 1}; at the default scale 2^{default} {at_default:.3%} of the "
                f"non-zero gradients flush; at 2^{best} {at_best:.3%}; activations and logits reach "
                f"{facts.act_over_fp16_max:.2%} of 65504")
    if not acts_fit:
        choice = "unsafe: the forward pass overflows fp16 (loss scaling cannot help)"
    elif not safe:
        choice = f"unsafe: {at_best:.2%} of the gradients flush even at the largest scale that fits (2^{best})"
    elif init != default:
        choice = (f"safe with precision.loss_scale.init_scale={scale_text(init)} (2^{init}; "
                  f"{'unsafe' if at_default > th.fp16_underflow else 'skips its first steps'} at 2^{default}); "
                  f"expected skip rate ~{skip:.2%}")
    else:
        choice = f"safe at the default scale 2^{default}; expected skip rate ~{skip:.2%}"
    d = Decision("fp16", choice, evidence, f"flushed share <= {th.fp16_underflow:.1%} at the chosen scale, "
                 f"{th.fp16_headroom_binades} binade(s) of headroom, activations < {th.fp16_act_over_max:.0%} of max")
    if safe and init != default:
        d.overrides = [f"precision.loss_scale.init_scale={scale_text(init)}"]
    return d, init, skip, safe


# ------------------------------------------------------------------- precision


def precision_choice(facts: Facts, target: Target, th: Thresholds, fp16_safe: bool,
                     fp8_gain: float, recipe: str) -> Decision:
    s, t = target.support, target.matmul_time
    if target.device == "cpu":
        bf16_time = t.get("bf16", math.inf)
        if s.get("bf16") == "native" and bf16_time <= th.cpu_bf16_max_time:
            return Decision("precision", "bf16", f"bf16 is native on this CPU and its matmul takes "
                            f"{bf16_time:.2f}x fp32's ({target.source})", f"native and <= {th.cpu_bf16_max_time:g}x fp32",
                            ["precision=bf16"])
        why = (f"bf16 is {s.get('bf16', 'unknown')} on this CPU" if s.get("bf16") != "native"
               else f"bf16's matmul takes {bf16_time:.2f}x fp32's")
        return Decision("precision", "fp32", f"{why} ({target.source}); float8's casts cost more than its matmuls "
                        "save on a CPU (docs/fp8.md: 0.27-0.29x fp32's tokens/s), and fp16 has no fast CPU path",
                        f"bf16 only when native and <= {th.cpu_bf16_max_time:g}x fp32", ["precision=fp32"])
    # The size rule weighs the matmuls a token runs: a mixture's active parameters, not all its experts.
    n, counted = facts.matmul_params, "active parameters per token" if facts.mixture else "parameters"
    if (s.get("fp8") == "native" and n >= th.fp8_min_params and fp8_gain >= th.fp8_min_speedup):
        return Decision("precision", f"float8 ({recipe})", f"{target.name} has float8 matmuls; "
                        f"{n / 1e9:.2f}B {counted}; expected speed-up {fp8_gain:.2f}x",
                        f">= {th.fp8_min_params:.0e} {counted} and >= {th.fp8_min_speedup:g}x",
                        [f"precision={PRESET_OF[recipe]}"])
    fp8_note = ""
    if s.get("fp8") == "native":
        short = []
        if n < th.fp8_min_params:
            short.append(f"{n / 1e6:.1f}M {counted} (< {th.fp8_min_params:.0e})")
        if fp8_gain < th.fp8_min_speedup:
            short.append(f"expected {speed_words(fp8_gain) if fp8_gain else 'no speed-up'} "
                         f"(< {th.fp8_min_speedup:g}x)")
        fp8_note = f"; float8 not yet: {' and '.join(short)}"
    if s.get("bf16") == "native":
        return Decision("precision", "bf16", f"{target.name} has bf16 tensor cores{fp8_note}",
                        "bf16 wherever native", ["precision=bf16"])
    if s.get("fp16") == "native" and fp16_safe:
        return Decision("precision", "fp16", f"{target.name} has fp16 but not bf16 tensor cores, and the "
                        "gradients fit fp16 under loss scaling", "fp16 when safe and bf16 is not native",
                        ["precision=fp16"])
    return Decision("precision", "fp32", f"{target.name}: no native half precision that is safe here",
                    "fp32 when nothing else is native and safe", ["precision=fp32"])


# ----------------------------------------------------------------------- state


def state_choice(facts: Facts, preset: str, budget_gib: Optional[float],
                 th: Thresholds) -> tuple[Decision, Optional[StateOption]]:
    options = facts.state_options.get(preset, ())
    tried = []
    for opt in options:
        if opt.problem:
            tried.append(f"{opt.name}: {opt.problem}")
            continue
        if opt.rounds_updates and facts.update_lost_bf16 > th.lost_updates:
            tried.append(f"{opt.name}: would round away {facts.update_lost_bf16:.1%} of updates")
            continue
        if budget_gib is not None and opt.gib_per_rank > budget_gib:
            tried.append(f"{opt.name}: {opt.gib_per_rank:.3g} GiB")
            continue
        budget = f"fits {budget_gib:g} GiB per rank" if budget_gib is not None else "no budget given"
        evidence = f"{opt.name}: {opt.gib_per_rank:.3g} GiB per rank, {opt.bytes_per_param:.1f} bytes/param; {budget}"
        if tried:
            evidence += "; ruled out before it: " + "; ".join(tried)
        return Decision("state", opt.name, evidence, f"the first of {len(options)} options, most "
                        f"faithful first, that fits; bf16 weights without SR/Kahan only when <= "
                        f"{th.lost_updates:.0%} of updates are lost", list(opt.overrides)), opt
    smallest = smallest_option({preset: options})
    need = f"; the smallest is {smallest.name} at {smallest.gib_per_rank:.3g} GiB per rank" if smallest else ""
    budget = f"{budget_gib:g} GiB per rank" if budget_gib is not None else "any budget"
    return Decision("state", "none fits", f"no option under precision={preset} fits {budget}{need}: "
                    + "; ".join(tried), "the budget per rank"), None


def smallest_option(options: dict[str, tuple[StateOption, ...]]) -> Optional[StateOption]:
    """The runnable option with the fewest GiB per rank, under any precision (None: none can run)."""
    runnable = [o for opts in options.values() for o in opts if not o.problem]
    return min(runnable, key=lambda o: o.gib_per_rank) if runnable else None


# ----------------------------------------------------------------------- risks


def _growth(series: tuple[float, ...]) -> float:
    return series[-1] / series[0] if len(series) > 1 and series[0] > 0 else 1.0


def _logit_risk(topic: str, series: tuple[float, ...], limit: float, th: Thresholds, switch: str) -> Optional[Decision]:
    if not series:
        return None
    top, growth = max(series), _growth(series)
    if top <= limit and not (growth >= th.logit_growth and series[-1] >= 10):
        return None
    return Decision(topic, f"risk: consider {switch}", f"largest {top:.3g}, grew {growth:.2f}x over the probe",
                    f"> {limit:g}, or >= {th.logit_growth:g}x growth to >= 10", [switch])


def risks(facts: Facts, th: Thresholds) -> list[Decision]:
    out = [r for r in (
        _logit_risk("attention logits", facts.attn_logit_max, th.attn_logit, th, "model.qk_norm=true"),
        _logit_risk("output logits", facts.output_logit_max, th.output_logit, th, "train.z_loss=1e-4"),
    ) if r]
    adam = {g: v for g, v in facts.g2_over_v.items() if v > th.g2_over_v}
    if adam:
        out.append(Decision("adam second moment", "risk: consider optim.update_clip=1.0",
                            ", ".join(f"{g}: {v:.1%}" for g, v in adam.items()) + " of elements with g^2 > 10 v-hat",
                            f"> {th.g2_over_v:.0%} in a layer group", ["optim.update_clip=1.0"]))
    massive = {g: v for g, v in facts.act_max_over_rms.items() if v > th.massive_activation}
    if massive:
        out.append(Decision("massive activations", "risk: per-tensor float8 scales suffer there; prefer rowwise "
                            "or mxfp8, or keep those blocks in bf16",
                            ", ".join(f"{g}: max {v:.0f}x RMS" for g, v in massive.items()),
                            f"max/RMS > {th.massive_activation:g}"))
    return out


# ---------------------------------------------------------------------- layout


def float8_gather_text(recipe: str, chosen: bool, mesh: dict[str, int]) -> str:
    """Whether ``recipe``'s float8 weights (over ``dp_shard``) and activations
    (over ``tp``) can travel in float8 on ``mesh``; ``chosen``: float8 is the advice."""
    where = [d for d in ("dp_shard", "tp") if mesh.get(d, 1) > 1]
    if not where:
        return "float8 all-gather: nothing is gathered (dp_shard and tp are 1)"
    lead = f"float8 all-gather with {recipe}: " if chosen else "float8 is not advised; were it, "
    if recipe == "tensorwise" or not chosen:
        yes = ("possible with tensorwise (one scale per tensor, known before the gather): "
               + " and ".join({"dp_shard": "FSDP gathers the float8 weights (precision.fp8.fsdp_float8_all_gather, "
                                           "half of bf16's bytes)",
                               "tp": "TP can gather float8 activations (torchao's Float8ColwiseParallel)"}[d]
                              for d in where))
        return lead + yes + ("" if chosen else "; rowwise and mxfp8 could not (their scales are per row or "
                             "block of the operand as the matmul sees it: weights travel in bf16, cast after)")
    return lead + ("not possible: its scales are per row or block of the operand as the matmul sees it, so "
                   "weights and activations travel in bf16 and are cast after the gather")


def block_breaks(facts: Facts, tp: int) -> dict[str, list[str]]:
    """Per block format (:data:`BLOCK_OF`), the converted linears whose per-TP-rank
    width does not divide by its block, each as ``name out|in width/tp=w``."""
    lay = facts.layout
    out: dict[str, list[str]] = {k: [] for k in BLOCK_OF}
    for lin in facts.linears:
        dim = lay.split.get(lin.name) if lay else None
        if lin.kept_out is not None or dim is None or tp <= 1:
            continue
        side, width = ("out", lin.out_features) if dim == 0 else ("in", lin.in_features)
        for fmt, block in BLOCK_OF.items():
            if width % tp or (width // tp) % block:
                out[fmt].append(f"{lin.name} {side} {width}/{tp}={width / tp:g}")
    return out


def layout_plan(facts: Facts, recipe: str, preset: str, chosen: bool) -> Optional[Decision]:
    """What the mesh (:attr:`Facts.layout`) changes for the advice: whether the
    float8 recipe (``chosen``: float8 is advised) can all-gather in float8,
    whether each converted linear's per-TP-rank width keeps MX (32) and NVFP4
    (16) blocks whole, and the bytes per step per mesh dimension of the advised
    ``preset``, on paper. None without a mesh."""
    lay = facts.layout
    if lay is None:
        return None
    m = lay.mesh
    text = f"{m['dp_replicate']} x {m['dp_shard']} x {m['tp']} (dp_replicate x dp_shard x tp)"
    parts = [float8_gather_text(recipe, chosen, m)]
    breaks = block_breaks(facts, m["tp"])
    for fmt, bad in breaks.items():
        said = (f"straddle TP shards in {len(bad)} linear(s): {', '.join(bad[:4])}" + (", ..." if len(bad) > 4 else "")
                if bad else "every converted linear's per-rank width divides")
        parts.append(f"{fmt} blocks of {BLOCK_OF[fmt]} under tp={m['tp']}: {said}")
    comm = lay.comm.get(preset)
    if comm:
        parts.append(f"communication per step per rank under precision={preset}, on paper (payload; "
                     "python -m mptrain.memory --comm): "
                     + ", ".join(f"{d} {v / 2**30:.3g} GiB" for d, v in comm.items()))
    blocked = [f for f, bad in breaks.items() if bad]
    choice = text + ("; " + " and ".join(blocked) + " blocks do not fit this tp" if blocked else "")
    return Decision("layout", choice, "; ".join(parts), "tensorwise alone gathers float8; each split width "
                    "divisible by the block (MX 32, NVFP4 16) per TP rank")


# --------------------------------------------------------------------- mixture


def mixture_plan(facts: Facts) -> Optional[Decision]:
    """A mixture of experts' own rule: the routers compute in fp32 (``model.moe.router_dtype=fp32``,
    an override only where the probed configuration says ``compute``); the evidence says what
    a token uses against what memory holds. None for a dense model."""
    mx = facts.mixture
    if mx is None:
        return None
    evidence = (f"{_count(mx.params_active)} of {_count(mx.params)} parameters active per token "
                f"({mx.params_active / mx.params:.0%}; the matmul time follows them, the weights, gradients and "
                f"moments hold all); the routed experts are {mx.expert_share:.0%} of the weights "
                f"({mx.routed_layers} layers, top-{mx.top_k} of {mx.n_experts}), each expert's linears cast on their "
                f"own (no scale spans two experts), and under a recipe blocked along the tokens (mxfp8, "
                f"NVFP4, MXFP4) each expert pads its tokens with zero rows to whole blocks")
    if mx.router_dtype == "fp32":
        return Decision("mixture", "routers in fp32 (as configured)", evidence, _ROUTER_RULE)
    return Decision("mixture", "routers in fp32: set model.moe.router_dtype=fp32",
                    evidence + "; this configuration computes them in the compute dtype (the study switch)",
                    _ROUTER_RULE, ["model.moe.router_dtype=fp32"])


def _count(n: int) -> str:
    """A parameter count in words: ``15.79B``, ``0.34M``."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


_ROUTER_RULE = ("always: a router is a d_model x n_experts matmul, negligible in fp32, and in bf16 or fp16 "
                "near-equal experts trade places in the top-k")


# ---------------------------------------------------------------------- advise


def advise(facts: Facts, target: Target, budget_gib: Optional[float] = None,
           th: Thresholds = Thresholds()) -> Advice:
    """The advice for ``facts`` on ``target`` within ``budget_gib`` per rank."""
    f8, layers, recipe, share, gain = float8_plan(facts, target, th)
    f16, init, skip, safe = fp16_plan(facts, th)
    prec = precision_choice(facts, target, th, safe, gain, recipe)
    preset = next(o for o in prec.overrides if o.startswith("precision=")).split("=", 1)[1]
    state, opt = state_choice(facts, preset, budget_gib, th)
    overrides = list(prec.overrides)
    sched = schedule_plan(facts, recipe, th)
    if prec.choice.startswith("float8"):
        overrides += f8.overrides + (sched.overrides if sched else [])
    if prec.choice == "fp16":
        overrides += f16.overrides
    # a state option that names its own precision preset (bf16 weights) replaces the precision line
    if any(o.startswith("precision=") for o in state.overrides):
        overrides = [o for o in overrides if not o.startswith("precision=")]
    overrides += state.overrides
    expected = {"fp8_flops_share": share, "fp8_speedup": gain, "fp16_skip_rate": skip,
                "fp16_init_scale": 2.0 ** init}
    if opt is not None:
        expected.update(gib_per_rank=opt.gib_per_rank, bytes_per_param=opt.bytes_per_param)
    lay = layout_plan(facts, recipe, preset, prec.choice.startswith("float8"))
    mix = mixture_plan(facts)
    overrides += mix.overrides if mix else []
    return Advice(prec, f16, f8, state, risks(facts, th), overrides, layers, expected, lab_plan(facts, th), lay,
                  sched, mix)
