"""Each rule of :mod:`mptrain.advice.rules` at and around its threshold.

The facts are built by hand (no probe, no torch): :func:`facts` gives a healthy
model and each test changes one field with ``dataclasses.replace``. Thresholds
are crossed with ``math.nextafter`` so "just above" is the next float up. A
recommended schedule is also planned (``make_plan``): the line must run.
"""
from __future__ import annotations

import dataclasses
import json
import math

import pytest

from mptrain.advice.rules import (
    FP8_CANDIDATES,
    PRESET_OF,
    Cast,
    Facts,
    Layout,
    LinearFacts,
    StateOption,
    Target,
    Thresholds,
    advise,
    block_breaks,
    float8_gather_text,
    float8_plan,
    fp16_plan,
    layout_plan,
    precision_choice,
    risks,
    smallest_option,
    speedup,
    state_choice,
    top_bin,
    underflow_share,
)

TH = Thresholds()
H100 = Target("h100", "cuda", {"bf16": "native", "fp16": "native", "fp8": "native"},
              {"bf16": 0.5, "fp16": 0.5, "fp8": 0.25}, "test")
A100 = Target("a100", "cuda", {"bf16": "native", "fp16": "native", "fp8": "unavailable"},
              {"bf16": 0.5, "fp16": 0.5}, "test")
V100 = Target("v100", "cuda", {"bf16": "unavailable", "fp16": "native", "fp8": "unavailable"},
              {"fp16": 0.125}, "test")


def cpu(bf16: str = "native", bf16_time: float = 0.75) -> Target:
    return Target("cpu", "cpu", {"bf16": bf16, "fp16": "emulated", "fp8": "unavailable"},
                  {"bf16": bf16_time}, "test")


def up(x: float) -> float:
    return math.nextafter(x, math.inf)


def down(x: float) -> float:
    return math.nextafter(x, -math.inf)


# ------------------------------------------------------------------ the factory

GOOD = Cast(flush=1e-4, saturate=0.0, sqnr_db=30.0, operand="input")
BAD = Cast(flush=0.5, saturate=0.5, sqnr_db=3.0, operand="grad_output")
LM_HEAD_RULE = "matches precision.fp8.exclude 'lm_head'"
QKV, FC, PROJ, HEAD = "blocks.0.attn.qkv", "blocks.0.mlp.fc", "blocks.1.mlp.proj", "lm_head"
PRESETS = ("fp32", "bf16", "fp16", "fp8", "fp8-rowwise", "mxfp8")
LO, NBINS = -40, 57  # the numerics monitor's histogram: bins -40..16


def casts(**changes: Cast) -> dict[str, Cast]:
    """Every candidate recipe within thresholds, but for ``changes``."""
    out = {r: GOOD for r in FP8_CANDIDATES}
    out.update(changes)
    return out


def hist(bins: dict[int, int], lo: int = LO, nbins: int = NBINS) -> tuple[int, ...]:
    """A gradient histogram from {floor(log2|g|): count}."""
    out = [0] * nbins
    for b, n in bins.items():
        out[min(max(b - lo, 0), nbins - 1)] += n  # clamped into the end bins, as the monitor does
    return tuple(out)


def triangle(centre: int = -12, half: int = 10, unit: int = 1000) -> dict[int, int]:
    """Counts peaking at ``centre``, from ``centre - half`` to ``centre + half``."""
    return {b: unit * (half + 1 - abs(b - centre)) for b in range(centre - half, centre + half + 1)}


HEALTHY_BINS = triangle()  # -22..-2, top bin -2 (largest gradient < 2^-1)


def options(preset: str) -> tuple[StateOption, ...]:
    return (StateOption(f"{preset}: fp32 state", ("optim.state_dtype=fp32",), 12.5, 16.0),
            StateOption(f"{preset}: bf16 state", ("optim.state_dtype=bf16",), 9.25, 12.0),
            StateOption(f"{preset}: bf16 state, sharded", ("optim.state_dtype=bf16", "train.fsdp=true"), 6.75, 8.0))


def facts(**changes) -> Facts:
    """A healthy 120k-parameter model: every linear within thresholds for every
    recipe, fp16-safe gradients, no risk; ``changes`` replace fields."""
    f = Facts(
        model="gpt-test", params=120_000, world=1, steps=40, monitored_steps=4,
        grad_hist_lo=LO, grad_hist=hist(HEALTHY_BINS), grad_top_log2=(-3, -2, -2, -3),
        act_over_fp16_max=0.01, update_lost_bf16=0.001,
        linears=(LinearFacts(QKV, 64, 192, 0.25, casts()),
                 LinearFacts(FC, 64, 256, 0.25, casts()),
                 LinearFacts(PROJ, 256, 64, 0.25, casts()),
                 LinearFacts(HEAD, 64, 256, 0.125, {}, LM_HEAD_RULE)),
        attn_logit_max=(8.0, 9.0, 9.5, 10.0), output_logit_max=(12.0, 12.5, 13.0, 13.0),
        g2_over_v={"embed": 0.001, "blocks": 0.002, "head": 0.003},
        act_max_over_rms={"block0": 12.0, "block1": 15.0},
        state_options={p: options(p) for p in PRESETS},
    )
    return dataclasses.replace(f, **changes)


def with_casts(name: str, f: Facts | None = None, **recipe_casts: Cast) -> Facts:
    """``f`` (default: healthy) with linear ``name``'s casts changed."""
    f = f or facts()
    lins = tuple(dataclasses.replace(lin, casts=casts(**recipe_casts)) if lin.name == name else lin
                 for lin in f.linears)
    return dataclasses.replace(f, linears=lins)


def test_factory_is_healthy():
    a = advise(facts(), H100)
    assert a.float8.choice == "tensorwise" and a.float8.overrides == []
    assert a.fp16.choice.startswith("safe at the default scale 2^16")
    assert a.precision.choice == "bf16"
    assert a.state.choice == "bf16: fp32 state"
    assert a.risks == []
    assert a.overrides == ["precision=bf16", "optim.state_dtype=fp32"]
    assert top_bin(facts()) == -2


# ---------------------------------------------------------------------- float8

FLUSH_CASES = [(0.0099, True), (TH.fp8_flush, True), (up(TH.fp8_flush), False), (0.02, False)]
SATURATE_CASES = [(0.0, True), (TH.fp8_saturate, True), (up(TH.fp8_saturate), False), (2e-4, False)]
SQNR_CASES = [(25.0, True), (TH.fp8_sqnr_db, True), (down(TH.fp8_sqnr_db), False), (19.5, False)]


def _check_exclusion(f: Facts, ok: bool, why: str):
    d, layers, recipe, share, _ = float8_plan(f, H100, TH)
    assert recipe == "tensorwise"
    if ok:
        assert d.choice == "tensorwise"
        assert d.overrides == []
        assert layers[QKV]["passes"] == list(FP8_CANDIDATES)
        assert share == 0.75
    else:
        assert d.choice == f"tensorwise, excluding {QKV}"
        assert d.overrides == [f"precision.fp8.exclude=[{HEAD},{QKV}]"]
        assert layers[QKV]["passes"] == []
        assert f"{QKV}: {why}" in d.evidence
        assert share == 0.5
    for other in (FC, PROJ):
        assert other not in d.choice
        assert layers[other]["passes"] == list(FP8_CANDIDATES)


@pytest.mark.parametrize("flush,ok", FLUSH_CASES)
def test_float8_flush_threshold(flush, ok):
    c = dataclasses.replace(GOOD, flush=flush)
    _check_exclusion(with_casts(QKV, tensorwise=c, rowwise=c, mxfp8=c), ok, "flushes")


@pytest.mark.parametrize("saturate,ok", SATURATE_CASES)
def test_float8_saturate_threshold(saturate, ok):
    c = dataclasses.replace(GOOD, saturate=saturate)
    _check_exclusion(with_casts(QKV, tensorwise=c, rowwise=c, mxfp8=c), ok, "saturates")


@pytest.mark.parametrize("sqnr,ok", SQNR_CASES)
def test_float8_sqnr_threshold(sqnr, ok):
    c = dataclasses.replace(GOOD, sqnr_db=sqnr)
    _check_exclusion(with_casts(QKV, tensorwise=c, rowwise=c, mxfp8=c), ok, "SQNR")


def test_float8_failure_names_operand():
    d, *_ = float8_plan(with_casts(FC, tensorwise=BAD, rowwise=BAD, mxfp8=BAD), H100, TH)
    assert d.choice == f"tensorwise, excluding {FC}"
    assert "flushes" in d.evidence and "saturates" in d.evidence and "SQNR 3.0 dB" in d.evidence
    assert "(grad_output)" in d.evidence


def test_float8_exclude_keeps_only_name_rules():
    """Linears kept out for another reason are not written into precision.fp8.exclude."""
    f = with_casts(QKV, tensorwise=BAD, rowwise=BAD, mxfp8=BAD)
    f = dataclasses.replace(f, linears=(*f.linears, LinearFacts("blocks.1.attn.out", 8, 8, 0.0625, {},
                                                                 "not converted by the probe")))
    d, *_ = float8_plan(f, H100, TH)
    assert d.overrides == [f"precision.fp8.exclude=[{HEAD},{QKV}]"]


def test_float8_kept_out_linear_is_not_a_candidate_even_with_bad_casts():
    lins = tuple(dataclasses.replace(lin, casts=casts(tensorwise=BAD, rowwise=BAD, mxfp8=BAD))
                 if lin.name == HEAD else lin for lin in facts().linears)
    d, layers, recipe, share, _ = float8_plan(facts(linears=lins), H100, TH)
    assert (d.choice, d.overrides, recipe, share) == ("tensorwise", [], "tensorwise", 0.75)
    assert layers[HEAD]["kept_out"] == LM_HEAD_RULE
    assert "3 of 3 linears" in d.evidence


def test_float8_untouched_model():
    d, layers, recipe, share, gain = float8_plan(facts(), H100, TH)
    assert d.choice == "tensorwise" and d.overrides == []
    assert "3 of 3 linears within thresholds with tensorwise (75% of the step's FLOPs" in d.evidence
    assert f"kept out by the configuration's rules: {HEAD} ({LM_HEAD_RULE})" in d.evidence
    assert "kept in bf16" not in d.evidence
    assert layers[HEAD]["passes"] == [] and layers[HEAD]["casts"] == {}
    assert gain == speedup(0.75, 0.5)


def test_float8_picks_recipe_with_more_coverage():
    # qkv fails tensorwise and mxfp8 but passes rowwise: rowwise covers 75%, the others 50%
    f = with_casts(QKV, tensorwise=BAD, mxfp8=BAD)
    d, layers, recipe, share, _ = float8_plan(f, H100, TH)
    assert recipe == "rowwise" and d.choice == "rowwise" and d.overrides == []
    assert share == 0.75
    assert layers[QKV]["passes"] == ["rowwise"]
    # ... and mxfp8 when only it covers qkv
    d, _, recipe, _, _ = float8_plan(with_casts(QKV, tensorwise=BAD, rowwise=BAD), H100, TH)
    assert recipe == "mxfp8" and d.choice == "mxfp8"


def test_float8_equal_coverage_prefers_tensorwise():
    # qkv passes only rowwise, fc only tensorwise: 50% each, mxfp8 (both fail) 25%
    f = with_casts(FC, f=with_casts(QKV, tensorwise=BAD, mxfp8=BAD), rowwise=BAD, mxfp8=BAD)
    d, _, recipe, share, _ = float8_plan(f, H100, TH)
    assert recipe == "tensorwise" and share == 0.5
    assert d.choice == f"tensorwise, excluding {QKV}"
    assert d.overrides == [f"precision.fp8.exclude=[{HEAD},{QKV}]"]
    # rowwise before mxfp8 at equal coverage
    f = with_casts(FC, f=with_casts(QKV, tensorwise=BAD, mxfp8=BAD), tensorwise=BAD, rowwise=BAD)
    d, _, recipe, share, _ = float8_plan(f, H100, TH)
    assert recipe == "rowwise" and share == 0.5
    assert d.choice == f"rowwise, excluding {FC}"


def test_float8_no_fp8_on_target_gives_no_speedup():
    d, _, _, share, gain = float8_plan(facts(), A100, TH)
    assert share == 0.75 and gain == 0.0
    assert "none (no float8 matmul on the target)" in d.evidence


def test_float8_speedup_is_against_what_the_linears_would_run_in_otherwise():
    """A CPU whose bf16 is emulated (84x fp32 measured) runs its linears in fp32, so
    float8's 4x-fp32 matmul is a slow-down there, not a gain over emulated bf16."""
    emulated = Target("cpu", "cpu", {"bf16": "emulated", "fp16": "emulated", "fp8": "emulated"},
                      {"bf16": 84.0, "fp16": 81.0, "fp8": 4.0}, "test")
    d, _, _, share, gain = float8_plan(facts(), emulated, TH)
    assert gain == pytest.approx(speedup(share, 4.0)) and gain < 1
    assert f"expected speed on cpu: slowdown to {gain:.2f}x" in d.evidence and "speed-up" not in d.evidence
    native = dataclasses.replace(emulated, support={"bf16": "native", "fp16": "native", "fp8": "emulated"},
                                 matmul_time={"bf16": 0.5, "fp8": 0.25})
    assert float8_plan(facts(), native, TH)[4] == pytest.approx(speedup(share, 0.5))


def test_float8_linear_without_the_chosen_recipes_figures_is_excluded():
    f = with_casts(QKV, tensorwise=BAD, mxfp8=BAD)  # rowwise wins (75% vs 50%)
    lins = tuple(dataclasses.replace(lin, casts={"tensorwise": GOOD}) if lin.name == PROJ else lin
                 for lin in f.linears)  # proj: no rowwise or mxfp8 figures
    # qkv 37.5%: rowwise (qkv, fc) 62.5% beats tensorwise (fc, proj) 50%
    lins = tuple(dataclasses.replace(lin, flops_share=0.375) if lin.name == QKV else lin for lin in lins)
    d, layers, recipe, _, _ = float8_plan(dataclasses.replace(f, linears=lins), H100, TH)
    assert recipe == "rowwise"
    assert layers[PROJ]["passes"] == ["tensorwise"]
    assert d.choice == f"rowwise, excluding {PROJ}"
    assert d.overrides == [f"precision.fp8.exclude=[{HEAD},{PROJ}]"]


# ------------------------------------------------------------ float8 speed-up


def test_speedup_is_amdahl():
    assert speedup(0.0, 0.25) == 1.0
    assert speedup(1.0, 0.25) == 4.0
    assert speedup(0.5, 0.5) == pytest.approx(4 / 3)
    assert speedup(0.75, 0.5) == pytest.approx(1.6)
    assert speedup(0.9, 0.1) == pytest.approx(1 / (0.1 + 0.09))
    assert speedup(0.5, 1.0) == 1.0


def _precision(f: Facts, target: Target = H100, th: Thresholds = TH):
    _, _, recipe, _, gain = float8_plan(f, target, th)
    _, _, _, safe = fp16_plan(f, th)
    return precision_choice(f, target, th, safe, gain, recipe), gain


@pytest.mark.parametrize("params,fp8", [(int(TH.fp8_min_params) - 1, False), (int(TH.fp8_min_params), True),
                                        (int(TH.fp8_min_params) + 1, True), (120_000, False)])
def test_precision_float8_params_threshold(params, fp8):
    d, gain = _precision(facts(params=params))
    assert gain == pytest.approx(1.6)
    if fp8:
        assert d.choice == "float8 (tensorwise)"
        assert d.overrides == ["precision=fp8"]
        assert "expected speed-up 1.60x" in d.evidence
    else:
        assert d.choice == "bf16" and d.overrides == ["precision=bf16"]
        assert "float8 not yet" in d.evidence
        assert f"{params / 1e6:.1f}M parameters" in d.evidence


def test_precision_float8_speedup_threshold():
    f = facts(params=2_000_000_000)
    _, gain = _precision(f)
    for min_speedup, fp8 in ((down(gain), True), (gain, True), (up(gain), False)):
        th = dataclasses.replace(TH, fp8_min_speedup=min_speedup)
        d, _ = _precision(f, th=th)
        if fp8:
            assert d.choice == "float8 (tensorwise)" and d.overrides == ["precision=fp8"]
        else:
            assert d.choice == "bf16" and d.overrides == ["precision=bf16"]
            assert "float8 not yet" in d.evidence and f"speed-up {gain:.2f}x" in d.evidence


def test_precision_float8_speedup_follows_coverage():
    # only fc in float8: 25% of the FLOPs at half the time -> 1.14x; exclude fc too -> none
    f = with_casts(PROJ, f=with_casts(QKV, tensorwise=BAD, rowwise=BAD, mxfp8=BAD),
                   tensorwise=BAD, rowwise=BAD, mxfp8=BAD)
    f = dataclasses.replace(f, params=2_000_000_000)
    d, gain = _precision(f)
    assert gain == pytest.approx(speedup(0.25, 0.5)) and gain >= TH.fp8_min_speedup
    assert d.choice == "float8 (tensorwise)"
    f = with_casts(FC, f=f, tensorwise=BAD, rowwise=BAD, mxfp8=BAD)
    d, gain = _precision(f)
    assert gain == 1.0 and d.choice == "bf16"


@pytest.mark.parametrize("recipe", FP8_CANDIDATES)
def test_precision_float8_preset_from_preset_of(recipe):
    bad_others = {r: BAD for r in FP8_CANDIDATES if r != recipe}
    f = dataclasses.replace(with_casts(QKV, **bad_others), params=2_000_000_000)
    a = advise(f, H100)
    assert a.float8.choice == recipe  # 75% of the FLOPs with it, 50% with the others
    assert a.precision.choice == f"float8 ({recipe})"
    assert a.precision.overrides == [f"precision={PRESET_OF[recipe]}"]
    assert a.state.choice == f"{PRESET_OF[recipe]}: fp32 state"  # the state options under that preset
    assert a.overrides[0] == f"precision={PRESET_OF[recipe]}"
    assert PRESET_OF["rowwise"] == "fp8-rowwise"


def test_precision_without_native_fp8_is_bf16_without_float8_note():
    d, _ = _precision(facts(params=2_000_000_000), A100)
    assert d.choice == "bf16" and "float8 not yet" not in d.evidence


# ------------------------------------------------------------ precision on CPU


def test_precision_cpu_emulated_bf16_is_fp32():
    d, _ = _precision(facts(), cpu("emulated", 0.5))
    assert d.choice == "fp32" and d.overrides == ["precision=fp32"]
    assert "bf16 is emulated on this CPU" in d.evidence


@pytest.mark.parametrize("t,choice", [(0.5, "bf16"), (TH.cpu_bf16_max_time, "bf16"),
                                      (up(TH.cpu_bf16_max_time), "fp32"), (1.5, "fp32")])
def test_precision_cpu_bf16_time_threshold(t, choice):
    d, _ = _precision(facts(params=2_000_000_000), cpu("native", t))
    assert d.choice == choice and d.overrides == [f"precision={choice}"]
    if choice == "fp32":
        assert "bf16's matmul takes" in d.evidence


def test_precision_cpu_without_bf16_time_is_fp32():
    d, _ = _precision(facts(), Target("cpu", "cpu", {"bf16": "native"}, {}, "test"))
    assert d.choice == "fp32"


def test_precision_v100_fp16_only_when_safe():
    d, _ = _precision(facts(params=2_000_000_000), V100)
    assert d.choice == "fp16" and d.overrides == ["precision=fp16"]
    d, _ = _precision(facts(act_over_fp16_max=0.9), V100)
    assert d.choice == "fp32" and d.overrides == ["precision=fp32"]
    d, _ = _precision(facts(grad_hist=(0,) * NBINS), V100)  # no verdict: not safe
    assert d.choice == "fp32"


# ------------------------------------------------------------------------ fp16

DEEP_LO, DEEP_NBINS = -60, 77  # a histogram that reaches below what flushes at 2^16


def test_fp16_default_histogram_safe_at_default():
    d, init, skip, safe = fp16_plan(facts(), TH)
    assert safe and init == 16
    assert d.choice == f"safe at the default scale 2^16; expected skip rate ~{1 / 2000:.2%}"
    assert d.overrides == []
    assert skip == 1 / 2000


def test_fp16_small_gradients_raise_init_scale():
    small = {b - 20: n for b, n in HEALTHY_BINS.items()}  # -42..-22
    f = facts(grad_hist_lo=DEEP_LO, grad_hist=hist(small, DEEP_LO, DEEP_NBINS), grad_top_log2=(-23, -22, -22))
    assert top_bin(f) == -22
    assert underflow_share(f, 16) == pytest.approx(3000 / 121_000)  # bins -42, -41 flush at 2^16
    d, init, skip, safe = fp16_plan(f, TH)
    assert safe
    assert init == 15 - (-22) - TH.fp16_headroom_binades == 36
    assert d.choice.startswith("safe with precision.loss_scale.init_scale=")
    assert "unsafe at 2^16" in d.choice
    assert len(d.overrides) == 1 and d.overrides[0].startswith("precision.loss_scale.init_scale=")
    assert advise(f, V100).expected["fp16_init_scale"] == 2.0 ** 36
    assert skip == 1 / 2000


def test_fp16_raised_init_scale_override_is_exact():
    small = {b - 20: n for b, n in HEALTHY_BINS.items()}
    f = facts(grad_hist_lo=DEEP_LO, grad_hist=hist(small, DEEP_LO, DEEP_NBINS), grad_top_log2=(-22,))
    d, init, _, _ = fp16_plan(f, TH)
    assert init == 36
    value = d.overrides[0].split("=", 1)[1]
    assert float(value) == 2.0 ** 36


def test_fp16_raised_init_scale_override_value():
    # top bin -5 -> 2^(15 + 5 - 1) = 2^19; 0.5% of the gradients at 2^-42 flush at 2^16, none at 2^19
    bins = {-5: 1000, -12: 100_000, -42: 500}
    f = facts(grad_hist_lo=DEEP_LO, grad_hist=hist(bins, DEEP_LO, DEEP_NBINS), grad_top_log2=(-6, -5))
    d, init, _, safe = fp16_plan(f, TH)
    assert safe and init == 19
    assert d.overrides == ["precision.loss_scale.init_scale=524288"]
    a = advise(f, V100)
    assert a.precision.choice == "fp16"
    assert a.overrides == ["precision=fp16", "precision.loss_scale.init_scale=524288", "optim.state_dtype=fp32"]


def test_fp16_large_gradients_lower_init_scale():
    # top bin 2 -> 2^(15 - 2 - 1) = 2^12 < the default: safe, but the default skips its first steps
    bins = {b + 4: n for b, n in HEALTHY_BINS.items()}
    f = facts(grad_hist=hist(bins), grad_top_log2=(1, 2))
    d, init, _, safe = fp16_plan(f, TH)
    assert safe and init == 12
    assert "skips its first steps at 2^16" in d.choice
    assert d.overrides == ["precision.loss_scale.init_scale=4096"]


def test_fp16_small_gradients_at_the_monitors_histogram_floor():
    small = {b - 20: n for b, n in HEALTHY_BINS.items()}  # -42..-22: -42, -41 clamp into bin -40
    f = facts(grad_hist=hist(small), grad_top_log2=(-22,))
    assert f.grad_hist_lo == -40 and f.grad_hist[0] == 6000
    assert underflow_share(f, 16) > TH.fp16_underflow
    d, init, _, safe = fp16_plan(f, TH)
    assert not d.choice.startswith("safe at the default")
    assert init == 36


def test_underflow_share_boundary_bin():
    f = facts(grad_hist=hist({-30: 1, -29: 3}))
    # bin -30's top 2^-29 scaled by 2^5 is exactly 2^-24: flushed; bin -29's is 2^-23: not
    assert underflow_share(f, 5) == 0.25
    assert underflow_share(f, 6) == 0.0
    assert underflow_share(f, 4) == 1.0  # bin -29's top now exactly 2^-24
    assert underflow_share(facts(grad_hist=(0,) * NBINS), 16) == 0.0
    # the first bin holds everything below it: it counts once its lower edge reaches 2^-24
    f = facts(grad_hist=hist({-40: 1, -12: 1}))
    assert underflow_share(f, 15) == 0.5 and underflow_share(f, 16) == 0.5 and underflow_share(f, 17) == 0.0


@pytest.mark.parametrize("flushed,total,safe", [(999, 1_000_000, True), (1, 1000, True), (1000, 1_000_000, True),
                                                (1001, 1_000_000, False), (2, 1000, False)])
def test_fp16_underflow_threshold(flushed, total, safe):
    bins = {-2: 1, -12: total - 1 - flushed, -45: flushed}  # top -2: the largest scale that fits is 2^16
    f = facts(grad_hist_lo=DEEP_LO, grad_hist=hist(bins, DEEP_LO, DEEP_NBINS))
    assert underflow_share(f, 16) == flushed / total
    d, init, _, ok = fp16_plan(f, TH)
    assert ok is safe and init == 16
    if safe:
        assert d.choice.startswith("safe at the default scale 2^16")
    else:
        assert d.choice.startswith("unsafe: ") and "even at the largest scale that fits (2^16)" in d.choice
        assert d.overrides == []


@pytest.mark.parametrize("act,safe", [(0.25, True), (down(TH.fp16_act_over_max), True),
                                      (TH.fp16_act_over_max, False), (0.75, False), (2.0, False)])
def test_fp16_activations_threshold(act, safe):
    d, _, _, ok = fp16_plan(facts(act_over_fp16_max=act), TH)
    assert ok is safe
    if not safe:
        assert d.choice == "unsafe: the forward pass overflows fp16 (loss scaling cannot help)"
        assert advise(facts(act_over_fp16_max=act), V100).precision.choice == "fp32"


def test_fp16_unsafe_activations_whatever_the_gradients():
    bins = {-5: 1000, -12: 100_000, -42: 500}  # would be safe with a raised scale
    f = facts(grad_hist_lo=DEEP_LO, grad_hist=hist(bins, DEEP_LO, DEEP_NBINS), act_over_fp16_max=0.6)
    d, _, _, safe = fp16_plan(f, TH)
    assert not safe and d.overrides == [] and "forward pass overflows" in d.choice


@pytest.mark.parametrize("tops,spikes", [((-3, -2, -2, -3), 0.0), ((-1, -1, -1, -1), 0.0),
                                         ((-1, -1, 0, -2), 0.25), ((0, 1, -2, -2), 0.5)])
def test_fp16_skip_rate(tops, spikes):
    # init 2^16: a step whose top bin is b overflows when b + 16 > 15
    d, init, skip, _ = fp16_plan(facts(grad_top_log2=tops, growth_interval=1000), TH)
    assert init == 16
    assert skip == pytest.approx(1 / 1000 + spikes)
    assert f"expected skip rate ~{skip:.2%}" in d.choice


def test_fp16_no_gradients_no_verdict():
    d, init, skip, safe = fp16_plan(facts(grad_hist=(0,) * NBINS), TH)
    assert (d.choice, init, skip, safe) == ("no verdict", 16, 0.0, False)


# ----------------------------------------------------------------------- state


def test_state_no_budget_first_runnable():
    f = facts()
    d, opt = state_choice(f, "bf16", None, TH)
    assert opt == f.state_options["bf16"][0]
    assert d.choice == "bf16: fp32 state" and d.overrides == ["optim.state_dtype=fp32"]
    assert "12.5 GiB per rank, 16.0 bytes/param; no budget given" in d.evidence


def test_state_budget_threshold():
    f = facts()
    d, _ = state_choice(f, "bf16", 12.5, TH)  # exactly the first option's figure: fits
    assert d.choice == "bf16: fp32 state" and "fits 12.5 GiB per rank" in d.evidence
    d, opt = state_choice(f, "bf16", down(12.5), TH)
    assert d.choice == "bf16: bf16 state" and opt.gib_per_rank == 9.25
    assert d.overrides == ["optim.state_dtype=bf16"]
    assert "9.25 GiB per rank" in d.evidence
    assert "ruled out before it: bf16: fp32 state: 12.5 GiB" in d.evidence
    d, _ = state_choice(f, "bf16", 9.0, TH)
    assert d.choice == "bf16: bf16 state, sharded" and "6.75 GiB per rank" in d.evidence
    assert d.overrides == ["optim.state_dtype=bf16", "train.fsdp=true"]


def test_state_problem_option_skipped_and_named():
    opts = options("bf16")
    opts = (dataclasses.replace(opts[0], problem="needs world > 1"), *opts[1:])
    d, opt = state_choice(facts(state_options={"bf16": opts}), "bf16", None, TH)
    assert d.choice == "bf16: bf16 state" and opt is opts[1]
    assert "bf16: fp32 state: needs world > 1" in d.evidence


@pytest.mark.parametrize("lost,taken", [(0.005, True), (TH.lost_updates, True), (up(TH.lost_updates), False),
                                        (0.05, False)])
def test_state_rounds_updates_threshold(lost, taken):
    opts = options("bf16")
    opts = (dataclasses.replace(opts[0], rounds_updates=True), *opts[1:])
    d, _ = state_choice(facts(update_lost_bf16=lost, state_options={"bf16": opts}), "bf16", None, TH)
    if taken:
        assert d.choice == "bf16: fp32 state"
    else:
        assert d.choice == "bf16: bf16 state"
        assert f"bf16: fp32 state: would round away {lost:.1%} of updates" in d.evidence


def test_state_none_fits():
    f = facts()
    d, opt = state_choice(f, "bf16", 6.0, TH)
    assert opt is None and d.choice == "none fits" and d.overrides == []
    assert "no option under precision=bf16 fits 6 GiB per rank" in d.evidence
    assert "the smallest is bf16: bf16 state, sharded at 6.75 GiB per rank" in d.evidence
    a = advise(f, H100, budget_gib=6.0)
    assert a.state.choice == "none fits"
    assert a.overrides == ["precision=bf16"]
    assert "gib_per_rank" not in a.expected


def test_state_missing_preset_none_fits():
    d, opt = state_choice(facts(state_options={}), "bf16", None, TH)
    assert opt is None and d.choice == "none fits" and "smallest" not in d.evidence


def test_smallest_option():
    f = facts()
    assert smallest_option(f.state_options).gib_per_rank == 6.75
    tiny = StateOption("fp8: tiny", ("optim.state_dtype=fp8",), 1.5, 4.0)
    broken = StateOption("fp16: broken", (), 0.5, 2.0, problem="refused")
    opts = {**f.state_options, "fp8": (*f.state_options["fp8"], tiny), "fp16": (broken,)}
    assert smallest_option(opts) is tiny  # across presets, skipping the one that cannot run
    assert smallest_option({"fp16": (broken,)}) is None
    assert smallest_option({}) is None


# ----------------------------------------------------------------------- risks


def _topics(f: Facts) -> dict[str, object]:
    return {r.topic: r for r in risks(f, TH)}


@pytest.mark.parametrize("series,risk", [((40.0, TH.attn_logit), False), ((40.0, up(TH.attn_logit)), True),
                                         ((60.0, 40.0), True), ((49.0,), False), ((51.0,), True)])
def test_risk_attention_logit_threshold(series, risk):
    r = _topics(facts(attn_logit_max=series)).get("attention logits")
    if risk:
        assert r.choice == "risk: consider model.qk_norm=true" and r.overrides == ["model.qk_norm=true"]
    else:
        assert r is None


@pytest.mark.parametrize("series,risk", [((10.0, 20.0), True), ((10.0, 19.9), False), ((12.0, 30.0), True),
                                         ((12.0, 23.9), False), ((4.0, 8.0), False), ((20.0, 10.0), False)])
def test_risk_logit_growth(series, risk):
    r = _topics(facts(attn_logit_max=series)).get("attention logits")
    assert (r is not None) is risk
    if risk:
        assert f"grew {series[-1] / series[0]:.2f}x" in r.evidence


def test_risk_logit_growth_counts_where_it_ends():
    """Growth is a risk once the logits reach 10, wherever they started."""
    assert "attention logits" in _topics(facts(attn_logit_max=(9.0, 18.0)))
    assert "attention logits" not in _topics(facts(attn_logit_max=(4.5, 9.9)))


@pytest.mark.parametrize("series,risk", [((40.0, TH.output_logit), False), ((40.0, up(TH.output_logit)), True)])
def test_risk_output_logits(series, risk):
    r = _topics(facts(output_logit_max=series)).get("output logits")
    if risk:
        assert r.overrides == ["train.z_loss=1e-4"] and r.choice == "risk: consider train.z_loss=1e-4"
        assert "attention logits" not in _topics(facts(output_logit_max=series))
    else:
        assert r is None


@pytest.mark.parametrize("v,risk", [(0.04, False), (TH.g2_over_v, False), (up(TH.g2_over_v), True), (0.2, True)])
def test_risk_g2_over_v(v, risk):
    r = _topics(facts(g2_over_v={"embed": 0.001, "blocks.1": v, "head": 0.003})).get("adam second moment")
    if risk:
        assert r.overrides == ["optim.update_clip=1.0"] and "optim.update_clip=1.0" in r.choice
        assert r.evidence.startswith(f"blocks.1: {v:.1%}")
        assert "embed" not in r.evidence and "head" not in r.evidence
    else:
        assert r is None


@pytest.mark.parametrize("v,risk", [(99.0, False), (TH.massive_activation, False),
                                    (up(TH.massive_activation), True), (1000.0, True)])
def test_risk_massive_activations(v, risk):
    r = _topics(facts(act_max_over_rms={"block0": 12.0, "block1": v})).get("massive activations")
    if risk:
        assert r.evidence == f"block1: max {v:.0f}x RMS"
        assert "rowwise" in r.choice and r.overrides == []
    else:
        assert r is None


def test_risk_empty_series():
    assert risks(facts(attn_logit_max=(), output_logit_max=()), TH) == []


# ---------------------------------------------------------------------- advise


def test_advise_float8_line_includes_exclusions():
    f = dataclasses.replace(with_casts(QKV, tensorwise=BAD, rowwise=BAD, mxfp8=BAD), params=2_000_000_000)
    a = advise(f, H100)
    assert a.precision.choice == "float8 (tensorwise)"
    assert a.overrides == ["precision=fp8", f"precision.fp8.exclude=[{HEAD},{QKV}]", "optim.state_dtype=fp32"]
    assert a.state.choice == "fp8: fp32 state"
    assert a.expected["fp8_flops_share"] == 0.5
    assert a.expected["fp8_speedup"] == pytest.approx(speedup(0.5, 0.5))


def test_advise_no_exclusions_unless_float8_chosen():
    f = with_casts(QKV, tensorwise=BAD, rowwise=BAD, mxfp8=BAD)  # 120k params: bf16
    a = advise(f, H100)
    assert a.precision.choice == "bf16"
    assert a.float8.overrides == [f"precision.fp8.exclude=[{HEAD},{QKV}]"]
    assert a.overrides == ["precision=bf16", "optim.state_dtype=fp32"]


def test_advise_init_scale_only_when_fp16_chosen():
    bins = {-5: 1000, -12: 100_000, -42: 500}
    f = facts(grad_hist_lo=DEEP_LO, grad_hist=hist(bins, DEEP_LO, DEEP_NBINS), grad_top_log2=(-5,))
    a = advise(f, H100)
    assert a.fp16.overrides == ["precision.loss_scale.init_scale=524288"]
    assert a.overrides == ["precision=bf16", "optim.state_dtype=fp32"]
    assert a.expected["fp16_init_scale"] == 2.0 ** 19
    a = advise(f, V100, budget_gib=10.0)
    assert a.overrides == ["precision=fp16", "precision.loss_scale.init_scale=524288", "optim.state_dtype=bf16"]
    assert a.state.choice == "fp16: bf16 state"
    assert (a.expected["gib_per_rank"], a.expected["bytes_per_param"]) == (9.25, 12.0)


def test_advise_bf16_weights_state_replaces_precision():
    kahan = StateOption("bf16 weights, Kahan", ("precision=bf16-pure-kahan",), 5.0, 6.0)
    opts = {**facts().state_options, "bf16": (kahan,)}
    a = advise(facts(state_options=opts), H100)
    assert a.precision.overrides == ["precision=bf16"]
    assert a.overrides == ["precision=bf16-pure-kahan"]
    assert [o for o in a.overrides if o.startswith("precision=")] == ["precision=bf16-pure-kahan"]


def test_advise_bf16_weights_state_keeps_float8_exclusions():
    kahan = StateOption("fp8 + bf16 weights", ("precision=fp8-bf16-weights",), 5.0, 6.0)
    f = dataclasses.replace(with_casts(QKV, tensorwise=BAD, rowwise=BAD, mxfp8=BAD), params=2_000_000_000,
                            state_options={**facts().state_options, "fp8": (kahan,)})
    a = advise(f, H100)
    assert a.overrides == [f"precision.fp8.exclude=[{HEAD},{QKV}]", "precision=fp8-bf16-weights"]


def test_advise_cpu():
    a = advise(facts(), cpu("native", 0.8))
    assert a.overrides == ["precision=bf16", "optim.state_dtype=fp32"]
    a = advise(facts(), cpu("emulated", 0.8))
    assert a.overrides == ["precision=fp32", "optim.state_dtype=fp32"]
    assert a.state.choice == "fp32: fp32 state"
    assert a.expected["fp8_speedup"] == 0.0


def test_advise_json_and_purity():
    f = dataclasses.replace(with_casts(QKV, tensorwise=BAD, mxfp8=BAD), params=2_000_000_000,
                            attn_logit_max=(30.0, 70.0), act_max_over_rms={"block0": 400.0})
    a, b = advise(f, H100, budget_gib=10.0), advise(f, H100, budget_gib=10.0)
    text = json.dumps(a.to_json(), allow_nan=False)
    assert json.loads(text) == a.to_json()
    assert a == b and a.to_json() == b.to_json()
    assert text == json.dumps(b.to_json(), allow_nan=False)
    topics = [d["topic"] for d in a.to_json()["decisions"]]
    assert topics == ["precision", "fp16", "float8", "state", "attention logits", "massive activations"]
    assert a.overrides == ["precision=fp8-rowwise", "optim.state_dtype=bf16"]  # risks stay out of the line
    # the inputs are not changed
    assert f == dataclasses.replace(with_casts(QKV, tensorwise=BAD, mxfp8=BAD), params=2_000_000_000,
                                    attn_logit_max=(30.0, 70.0), act_max_over_rms={"block0": 400.0})


def test_advise_override_line_parses_as_hydra_overrides():
    parser = pytest.importorskip("hydra.core.override_parser.overrides_parser").OverridesParser.create()
    f = dataclasses.replace(with_casts(QKV, tensorwise=BAD, rowwise=BAD, mxfp8=BAD), params=2_000_000_000)
    parsed = {o.key_or_group: o.value() for o in parser.parse_overrides(advise(f, H100).overrides)}
    assert parsed["precision"] == "fp8"
    assert parsed["precision.fp8.exclude"] == [HEAD, QKV]


# ------------------------------------------------------------------ lab candidates


def _with_lab(figures: dict[str, dict[str, Cast]], order: tuple[str, ...]) -> Facts:
    """The healthy facts with per-linear lab figures ({linear: {recipe: Cast}}) and ``--lab`` ``order``."""
    f = facts(lab_candidates=order)
    lins = tuple(dataclasses.replace(lin, lab=figures.get(lin.name, {})) for lin in f.linears)
    return dataclasses.replace(f, linears=lins)


def test_lab_candidates_rank_by_flops_weighted_worst_sqnr():
    """QKV, FC and PROJ carry a quarter of the FLOPs each: A scores (30 + 30 + 12) / 3 =
    24 dB, B 20 dB everywhere; A ranks first although one linear falls below 20 dB, and
    the evidence gives each one's figures; the head (kept out) is not counted."""
    a = {QKV: Cast(0.001, 0.0, 30.0, "input"), FC: Cast(0.001, 0.0, 30.0, "input"),
         PROJ: Cast(0.02, 0.001, 12.0, "grad_output")}
    figs = {name: {"B": Cast(0.0, 0.0, 20.0, "weight"), "A": a[name]} for name in a}
    figs[HEAD] = {"A": Cast(0.9, 0.9, -10.0, "input")}
    d = advise(_with_lab(figs, ("B", "A")), H100).lab
    assert d.choice == "A" and d.overrides == ["precision=lab", "precision.lab.recipe=A"]
    assert "A: 24.0 dB (flush <= 2.00%, saturate <= 0.100%, 50% of the step's FLOPs within the float8 " \
           "thresholds); B: 20.0 dB (flush <= 0.00%, saturate <= 0.000%, 75% of the step's FLOPs" in d.evidence
    # equal scores keep the order given; a candidate without figures is named, not ranked
    same = {name: {"B": Cast(0.0, 0.0, 20.0), "A": Cast(0.0, 0.0, 20.0)} for name in a}
    d = advise(_with_lab(same, ("B", "A", "C")), H100).lab
    assert d.choice == "B" and "not measured: C" in d.evidence
    assert advise(facts(), H100).lab is None and "lab" not in {x.topic for x in advise(facts(), H100).decisions()}


# ---------------------------------------------------------------------- layout

def laid_out(tp: int = 2, shard: int = 4, replicate: int = 1, comm: dict | None = None, **changes) -> Facts:
    """The healthy facts advised for a mesh: qkv and fc split by output row,
    the projection by input column, the head (kept out of float8) by vocabulary row."""
    lay = Layout({"dp_replicate": replicate, "dp_shard": shard, "tp": tp}, tp > 1,
                 {QKV: 0, FC: 0, PROJ: 1, HEAD: 0}, comm or {})
    return facts(layout=lay, **changes)


def test_no_mesh_no_layout_decision():
    a = advise(facts(), H100)
    assert a.layout is None and all(d.topic != "layout" for d in a.decisions())


def test_layout_blocks_fit_at_tp2_and_mx_breaks_at_tp4():
    """Per-rank widths: qkv's 192 outputs, fc's 256, proj's 256 inputs. At tp=2
    (96, 128, 128) MX's 32 and NVFP4's 16 divide all three; at tp=4 qkv keeps
    48, which 16 divides and 32 does not. The head is kept out of float8: its
    split does not count."""
    two = layout_plan(laid_out(tp=2), "tensorwise", "bf16", False)
    assert two.choice == "1 x 4 x 2 (dp_replicate x dp_shard x tp)"
    assert two.evidence.count("every converted linear's per-rank width divides") == 2
    four = layout_plan(laid_out(tp=4, shard=2), "tensorwise", "bf16", False)
    assert four.choice.endswith("; MX (mxfp8, mxfp4) blocks do not fit this tp")
    assert f"MX (mxfp8, mxfp4) blocks of 32 under tp=4: straddle TP shards in 1 linear(s): {QKV} out 192/4=48" \
        in four.evidence
    assert "NVFP4 blocks of 16 under tp=4: every converted linear's per-rank width divides" in four.evidence
    # a width tp does not divide breaks both (192 / 3 = 64 is whole and fits both)
    assert block_breaks(laid_out(tp=3), 3) == {fmt: [f"{FC} out 256/3=85.3333", f"{PROJ} in 256/3=85.3333"]
                                               for fmt in ("MX (mxfp8, mxfp4)", "NVFP4")}


def test_layout_float8_all_gather_tensorwise_yes_rowwise_no():
    """Tensorwise's one scale per tensor is known before the gather: FSDP can
    gather float8 weights, TP float8 activations; rowwise's scales are per row
    of the operand as the matmul sees it: the gathers stay bf16."""
    big = laid_out(params=2_000_000_000)
    a = advise(big, H100)
    assert a.precision.choice == "float8 (tensorwise)"
    assert "float8 all-gather with tensorwise: possible with tensorwise" in a.layout.evidence
    assert "FSDP gathers the float8 weights" in a.layout.evidence and "TP can gather" in a.layout.evidence
    rowwise = float8_gather_text("rowwise", True, {"dp_replicate": 1, "dp_shard": 4, "tp": 2})
    assert rowwise.startswith("float8 all-gather with rowwise: not possible")
    bf16 = float8_gather_text("tensorwise", False, {"dp_replicate": 1, "dp_shard": 4, "tp": 1})
    assert bf16.startswith("float8 is not advised; were it, possible with tensorwise") and "TP can" not in bf16
    assert "rowwise and mxfp8 could not" in bf16
    assert float8_gather_text("tensorwise", True, {"dp_replicate": 8, "dp_shard": 1, "tp": 1}).endswith(
        "nothing is gathered (dp_shard and tp are 1)")


def test_layout_gives_the_advised_presets_bytes_per_dimension():
    comm = {"bf16": {"dp_shard": 1.5 * 2**30, "tp": 2**31}, "fp8": {"dp_shard": 0.75 * 2**30, "tp": 2**31}}
    a = advise(laid_out(comm=comm), H100)
    assert a.precision.choice == "bf16"
    assert "under precision=bf16, on paper (payload; python -m mptrain.memory --comm): dp_shard 1.5 GiB, tp 2 GiB" \
        in a.layout.evidence
    assert "layout" in [d["topic"] for d in a.to_json()["decisions"]]
    assert a.overrides == advise(facts(), H100).overrides  # the layout changes the text, not the line to paste


# ------------------------------------------------------------------ schedule: failing only late
MONITORED = (1, 10, 20, 21, 30, 40)
"""The probe's monitored steps in these tests (40 steps; the earlier part ends at step 20)."""
FAILS_LATE = {1: GOOD, 10: GOOD, 20: GOOD, 21: GOOD, 30: BAD, 40: BAD}


def stepped(name: str, at: dict[int, Cast], f: Facts | None = None) -> Facts:
    """``f`` (default: healthy) with linear ``name``'s output-gradient casts ``at`` each
    monitored step (its input and weight healthy), the same under every candidate
    recipe, and its worst over the probe as its casts, as the probe reads them."""
    from mptrain.advice.rules import StepCasts

    f = f or facts()
    series = tuple(StepCasts(s, {"input": GOOD, "weight": GOOD, "grad_output": c}) for s, c in sorted(at.items()))
    worst = min(at.values(), key=lambda c: (c is GOOD, c.sqnr_db))
    lins = tuple(dataclasses.replace(lin, casts=casts(**dict.fromkeys(FP8_CANDIDATES, worst)),
                                     by_step=dict.fromkeys(FP8_CANDIDATES, series)) if lin.name == name else lin
                 for lin in f.linears)
    return dataclasses.replace(f, linears=lins)


def big(f: Facts) -> Facts:
    """``f`` for a 2B-parameter model, so that float8 is the advice on an H100."""
    return dataclasses.replace(f, params=2_000_000_000)


def test_a_linear_failing_only_late_gets_a_schedule_not_an_exclusion():
    """QKV's output gradient passes up to step 21 of 40 and fails from 30: it stays in
    float8, and the advice switches to bf16 from the fraction where it last passed
    (21/40, rounded down to a twentieth: 0.5), for the two matmuls that operand enters."""
    from mptrain.advice.rules import schedule_plan

    a = advise(big(stepped(QKV, FAILS_LATE)), H100)
    assert a.precision.choice == "float8 (tensorwise)"
    assert a.float8.choice == "tensorwise" and a.float8.overrides == []  # not given up for the whole run
    assert "failing only late in the probe" in a.float8.evidence and a.float8_layers[QKV]["late"]
    assert a.schedule.choice == "float8 (tensorwise) until 0.5 of the run, then bf16: input_gradient, " \
                                "weight_gradient fail only late"
    assert f"{QKV}: passes up to step 21, fails from step 30 of 40" in a.schedule.evidence
    assert a.overrides == ["precision=fp8", "precision.phases=[{start: 0.5, precision: bf16}]", "optim.state_dtype=fp32"]
    assert [d.topic for d in a.decisions()][:4] == ["precision", "fp16", "float8", "schedule"]
    # the earlier part ends at late_from of the probe: a first failure at step 20 is early, at 21 late
    assert schedule_plan(stepped(QKV, {**FAILS_LATE, 20: BAD}), "tensorwise", TH) is None
    assert schedule_plan(stepped(QKV, {**FAILS_LATE, 21: BAD}), "tensorwise", TH).overrides == [
        "precision.phases=[{start: 0.5, precision: bf16}]"]


def test_a_linear_failing_throughout_or_early_keeps_the_exclusion():
    """Failing at every step, or early and then recovering: the float8 decision's exclusion, no schedule."""
    for at in (dict.fromkeys(MONITORED, BAD), {**dict.fromkeys(MONITORED, GOOD), 10: BAD}):
        a = advise(big(stepped(QKV, at)), H100)
        assert a.schedule is None and not a.float8_layers[QKV]["late"]
        assert a.float8.choice == f"tensorwise, excluding {QKV}"
        assert a.overrides == ["precision=fp8", f"precision.fp8.exclude=[{HEAD},{QKV}]", "optim.state_dtype=fp32"]


def test_a_linear_passing_throughout_gets_no_schedule():
    a = advise(big(stepped(QKV, dict.fromkeys(MONITORED, GOOD))), H100)
    assert a.schedule is None and a.overrides == ["precision=fp8", "optim.state_dtype=fp32"]


def test_one_linear_failing_throughout_and_one_failing_late():
    """Each gets its own advice: the exclusion for the first, the schedule for the second."""
    a = advise(big(stepped(FC, FAILS_LATE, stepped(QKV, dict.fromkeys(MONITORED, BAD)))), H100)
    assert a.float8.choice == f"tensorwise, excluding {QKV}"
    assert a.overrides == ["precision=fp8", f"precision.fp8.exclude=[{HEAD},{QKV}]",
                           "precision.phases=[{start: 0.5, precision: bf16}]", "optim.state_dtype=fp32"]
    assert FC in a.schedule.evidence and QKV not in a.schedule.evidence


def test_the_noise_ratio_signal_falling_late_gets_a_schedule():
    """The weight gradient's noise ratio above sqrt(3) in the probe's first half and
    below it from step 30 (casts healthy throughout): a schedule for that matmul, with
    the form that lets the run decide on the same signal; below it early: none."""
    from mptrain.advice.rules import schedule_plan

    series = ((1, 3.0), (10, 2.5), (20, 2.0), (30, down(math.sqrt(3))), (40, 1.2))
    a = advise(big(facts(signals={"weight_gradient": series})), H100)
    assert a.schedule.choice.endswith("until 0.5 of the run, then bf16: weight_gradient fail only late")
    assert "numerics/quant/weight_gradient/noise_ratio: passes up to step 20, fails from step 30" in a.schedule.evidence
    assert "'precision.phases=[{when: \"weight_gradient.noise_ratio < 1.732\", precision: bf16}]'" in a.schedule.evidence
    assert "precision.phases=[{start: 0.5, precision: bf16}]" in a.overrides
    at_threshold = ((1, 3.0), (20, 2.0), (30, math.sqrt(3)), (40, math.sqrt(3)))  # not below: passes
    assert schedule_plan(facts(signals={"weight_gradient": at_threshold}), "tensorwise", TH) is None
    early = ((1, 3.0), (10, 1.5), (30, 1.2), (40, 1.1))
    assert schedule_plan(facts(signals={"weight_gradient": early}), "tensorwise", TH) is None


def test_the_schedule_stays_out_of_the_line_unless_float8_is_advised():
    """Like the float8 exclusions: a 120k-parameter model gets bf16 on an H100, and the
    schedule is reported, not applied."""
    a = advise(stepped(QKV, FAILS_LATE), H100)
    assert a.precision.choice == "bf16" and a.schedule is not None
    assert a.overrides == ["precision=bf16", "optim.state_dtype=fp32"]


def test_every_recommended_schedule_builds_a_plan():
    """The override line (as pasted: its phases word quoted for the shell), the
    per-matmul alternative and the signal form in the evidence, each composed with
    ``train.py``'s config and planned: the phases the advice names exist and pass the
    plan's checks."""
    import re
    import shlex

    from mptrain.advice.answer import experiment_yaml, override_line

    from .conftest import make_plan

    a = advise(big(stepped(QKV, FAILS_LATE, facts(signals={"weight_gradient": (
        (1, 3.0), (20, 2.0), (30, 1.5), (40, 1.2))}))), H100)
    line = override_line(a)
    assert "'precision.phases=[{start: 0.5, precision: bf16}]'" in line and shlex.split(line) == a.overrides
    plan = make_plan(*a.overrides)
    assert [ph.precision.name for ph in plan.phases] == ["fp8", "bf16"]
    assert plan.phases[1].start == plan.train.max_steps // 2
    per, when = re.findall(r"'(precision\.phases=[^']*)'", a.schedule.evidence)
    assert per == "precision.phases=[{start: 0.5, input_gradient: none, weight_gradient: none}]"
    lab = make_plan("precision=fp8", per).phases[1].precision.recipe
    assert (lab.specs["dgrad_grad_output"], lab.specs["wgrad_input"], lab.specs["fwd_input"] != "none") == \
        ("none", "none", True)
    signal = make_plan("precision=fp8", when, "monitor.enabled=true", "monitor.fp8_casts=true").phases[1]
    assert signal.trigger.metric == "numerics/quant/weight_gradient/noise_ratio"
    assert signal.trigger.threshold == 1.732 and signal.precision.name == "bf16"
    assert "phases:\n  - start: 0.5\n    precision: bf16" in experiment_yaml(a.overrides)


def test_the_probe_reads_per_step_casts_and_the_signal():
    """probe.py's readers on hand-made metrics rows: each monitored step's casts per
    operand (what :func:`late_failures` reads), and the noise ratio where a row has it."""
    from mptrain.advice.probe import signals, step_casts

    rows = [{"step": 1, "fp8.blocks.0.attn.qkv/input/flush": 0.0, "fp8.blocks.0.attn.qkv/input/saturate": 0.0,
             "fp8.blocks.0.attn.qkv/input/sqnr_db": 30.0, "numerics/quant/weight_gradient/noise_ratio": 2.5},
            {"step": 2},
            {"step": 3, "fp8.blocks.0.attn.qkv/input/rowwise/flush": 0.5,
             "fp8.blocks.0.attn.qkv/input/rowwise/saturate": 0.0, "fp8.blocks.0.attn.qkv/input/rowwise/sqnr_db": 3.0,
             "numerics/quant/weight_gradient/noise_ratio": float("nan")}]
    own = step_casts(rows, "blocks.0.attn.qkv", None)
    assert [(sc.step, sc.operands["input"].sqnr_db) for sc in own] == [(1, 30.0)]
    assert [sc.step for sc in step_casts(rows, "blocks.0.attn.qkv", "rowwise")] == [3]
    assert signals(rows) == {"weight_gradient": ((1, 2.5),)}  # the NaN left out, the other matmuls absent
