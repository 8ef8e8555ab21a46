"""The arithmetic of the cast statistics (mptrain/precision/fp8casts.py, the format lab's
cast): flushed and saturated shares against counts worked out by hand, the SQNR against
torchao's own casts, stale (given) scales, and shards that add up to the whole; the
4-bit what-ifs (nvfp4, nvfp4_rht, mxfp4) against the lab's round trips, the run's
float8 format for float8 what-ifs, and the watch of a run whose own casts are 4-bit."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from mptrain.precision import lab
from mptrain.precision.fp8casts import WHATIFS, cast_counts, measured, summarize
from mptrain.precision.formats import thresholds
from mptrain.precision.recipe import build_recipe
from mptrain.observe.fp8watch import CastWatch, report, table

from .aids import cast_stats

FP8_RECIPES = ("tensorwise", "rowwise", "mxfp8", "block1x128", "block128x128")
"""The float8 what-ifs of the default list."""
FP4_RECIPES = ("nvfp4", "nvfp4_rht", "mxfp4")
"""The 4-bit what-ifs of the default list."""
OPERANDS = ("input", "weight", "grad_output")


def _outlier_tensor(rows: int = 256, cols: int = 256) -> torch.Tensor:
    """Small values (|x| in [0.5e-3, 1e-3], random signs) and one outlier of 1e4 at
    (0, 0). Scaled for the outlier, every small value falls below e4m3's smallest
    subnormal and flushes; scaled for themselves (amax <= 1e-3), none does."""
    g = torch.Generator().manual_seed(0)
    x = (0.5e-3 + 0.5e-3 * torch.rand(rows, cols, generator=g)) * (torch.randint(0, 2, (rows, cols), generator=g) * 2 - 1)
    x[0, 0] = 1e4
    return x


def test_planted_outlier_flushes_what_shares_its_scale():
    x = _outlier_tensor()
    n = x.numel()
    # what shares the outlier's scale flushes: all of the tensor, its row, its 128 x 128
    # tile, its 128- or 32-element block; the outlier itself does not
    expected = {"tensorwise": n - 1, "block128x128": 128 * 128 - 1, "rowwise": 255, "block1x128": 127,
                "mxfp8": 31}
    got = {r: cast_stats(x, r) for r in FP8_RECIPES}
    for recipe, flushed in expected.items():
        assert got[recipe]["flush"] == pytest.approx(flushed / n, abs=0), recipe
        assert got[recipe]["saturate"] == 0, recipe  # scales from the current amax: nothing clamps
        assert got[recipe]["amax"] == pytest.approx(1e4)
    order = sorted(FP8_RECIPES, key=lambda r: -got[r]["flush"])
    assert order == ["tensorwise", "block128x128", "rowwise", "block1x128", "mxfp8"]
    # Flushed values are lost signal: among scales of one kind, finer is better. (Across
    # kinds the outlier decides: a power-of-two scale puts it at 312.5, which e4m3 rounds
    # to 320, while max / amax puts it exactly on 448.)
    assert got["block1x128"]["sqnr_db"] > got["tensorwise"]["sqnr_db"]  # fp32 scales
    assert got["mxfp8"]["sqnr_db"] > got["rowwise"]["sqnr_db"]  # power-of-two scales


def test_mx_floor_scales_clamp_what_rceil_scales_keep():
    """OCP MX's shared exponent, floor(log2 amax) - 8 for e4m3, lets a block's largest
    values reach 2x the element format's max: 500 > 448 clamps. Rounding amax / max
    up (rceil, torchao's MXFP8 training) does not."""
    x = torch.ones(1, 32)
    x[0, 3] = 500.0
    floor = cast_stats(x, "e4m3/1x32/ue8m0/nearest")
    rceil = cast_stats(x, "e4m3/1x32/ue8m0-rceil/nearest")
    assert summarize(*cast_counts(x, measured("mxfp8")["input"])) == rceil  # mxfp8's rule
    assert floor["saturate"] == pytest.approx(1 / 32) and floor["scale_max"] == 1.0
    assert rceil["saturate"] == 0 and rceil["scale_max"] == 0.5


@pytest.mark.parametrize("recipe,granularity", [("tensorwise", "TENSORWISE"), ("rowwise", "AXISWISE")])
def test_sqnr_equals_torchaos_own_cast(recipe, granularity):
    """The statistics describe the cast torchao really does: its float8 tensor, divided
    by its scale, gives the same noise as the cast computed here."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig

    x = torch.randn(64, 96) * torch.logspace(-3, 2, 96)  # columns of very different sizes
    f8 = hp_tensor_to_float8_dynamic(x, torch.float8_e4m3fn, LinearMMConfig(),
                                     scaling_granularity=getattr(ScalingGranularity, granularity),
                                     axiswise_dim=-1 if recipe == "rowwise" else None,
                                     round_scales_to_power_of_2=recipe == "rowwise")
    back = f8._data.float() / f8._scale
    theirs = 10 * math.log10(x.double().square().sum() / (x.double() - back.double()).square().sum())
    ours = cast_stats(x, recipe)
    assert ours["sqnr_db"] == pytest.approx(theirs, rel=1e-9)
    assert ours["scale_max"] == pytest.approx(float(f8._scale.max()), rel=1e-6)
    assert ours["flush"] == pytest.approx(float(((f8._data.float() == 0) & (x != 0)).sum()) / x.numel(), abs=0)


def test_a_stale_scale_saturates_after_the_amax_jumps():
    """The failure of scales taken from an older amax (delayed scaling): values past the
    old amax clamp. Scales from the current amax clamp nothing."""
    x = torch.linspace(-1, 1, 1000).reshape(1, -1)
    op = measured("tensorwise")["input"]
    _, old = cast_counts(x, op)
    jumped = x * 4  # 3/4 of the values now lie beyond the old amax of 1
    stale = summarize(*cast_counts(jumped, op, scale=old[1:2]))
    # clamped: what would not have rounded to 448 (first_overflow, 464) under the old scale
    beyond = (jumped.abs() * old[1] >= thresholds("e4m3").first_overflow).sum() / jumped.numel()
    assert stale["saturate"] == pytest.approx(beyond.item(), rel=1e-6) and 0.7 < stale["saturate"] < 0.75
    assert cast_stats(jumped, "tensorwise")["saturate"] == 0


def test_shards_add_up_to_the_whole():
    """Rows split across ranks (as FSDP shards dim 0): summed counts and maxed maxima
    of the parts equal the whole's, for the recipes whose groups do not straddle them."""
    x = _outlier_tensor(128, 256)
    for recipe in ("rowwise", "mxfp8", "block1x128", "mxfp4"):  # nvfp4's per-tensor scale straddles
        op = measured(recipe)["input"]
        whole = summarize(*cast_counts(x, op))
        parts = [cast_counts(p, op) for p in x.chunk(2)]
        sums = sum(p[0] for p in parts)
        maxes = torch.maximum(parts[0][1], parts[1][1])
        assert summarize(sums, maxes) == pytest.approx(whole, rel=1e-12), recipe


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_watch_measures_the_operands_torchaos_linear_casts(recipe):
    """CastWatch on a real torchao Float8Linear under bf16 CPU autocast: its figures
    for the run's own casts equal torchao's casts of the three operands the layer
    really casts (the input as it comes, since torchao casts it to the autocast dtype
    only under CUDA autocast; the fp32 weight; the output gradient in e5m2), and a
    what-if recipe is measured on the same tensors."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig

    from mptrain.precision.policy import PrecisionPolicy
    from mptrain.precision.recipe import precision_plan

    from .conftest import make_cfg

    torch.manual_seed(0)
    policy = PrecisionPolicy(precision_plan(make_cfg("precision=fp8", f"precision.fp8.recipe={recipe}").precision),
                             torch.device("cpu"))
    model = policy.convert_model(nn.Sequential(nn.Linear(64, 128)))
    watch = CastWatch.of_run(policy.fp8, model, ["mxfp8"])
    x = torch.randn(32, 64) * torch.logspace(-4, 1, 64)  # inputs of very different sizes
    seen = {}
    handles = watch.start(torch.device("cpu"))
    with policy.autocast():
        y = model(x)
    y.register_hook(lambda g: seen.setdefault("grad_output", g))
    y.float().backward(torch.randn(32, 128) * torch.logspace(-14, 0, 128))  # a range beyond e5m2's: some flush
    for h in handles:
        h.remove()
    got = watch.scalars({**watch.sum_all, **watch.max_all})
    axis = {"input": -1, "weight": 0, "grad_output": -1}  # weight: torchao casts W^T along dim 0
    for op, t, fmt in (("input", x, torch.float8_e4m3fn),
                       ("weight", model[0].weight.detach().t(), torch.float8_e4m3fn),
                       ("grad_output", seen["grad_output"], torch.float8_e5m2)):
        f8 = hp_tensor_to_float8_dynamic(
            t, fmt, LinearMMConfig(), axiswise_dim=axis[op] if recipe == "rowwise" else None,
            scaling_granularity=ScalingGranularity.AXISWISE if recipe == "rowwise" else ScalingGranularity.TENSORWISE,
            round_scales_to_power_of_2=recipe == "rowwise")
        hp, back = t.double(), (f8._data.float() / f8._scale).double()
        sqnr = 10 * math.log10(hp.square().sum() / (hp - back).square().sum())
        flush = float(((f8._data.float() == 0) & (t != 0)).sum() / (t != 0).sum())
        assert got[f"fp8.0/{op}/sqnr_db"] == pytest.approx(sqnr, rel=1e-9), op
        assert got[f"fp8.0/{op}/flush"] == flush, op
        assert got[f"fp8.0/{op}/scale_max"] == pytest.approx(float(f8._scale.max()), rel=1e-7), op
        assert f"fp8.0/{op}/mxfp8/sqnr_db" in got
    assert got["fp8.0/grad_output/flush"] > 0  # the test can tell flushing from none
    assert f"fp8.0/input/{recipe}/flush" not in got  # the run's own recipe is not a what-if


# ------------------------------------------------------------------ 4-bit what-ifs
def _direct(x: torch.Tensor, recipe: str) -> dict[str, float]:
    """SQNR, flushed and saturated shares and scale range of a 4-bit what-if, from
    the lab's round trip (``lab.fake_quantize``) itself: the last dimension padded
    with zeros to the block, and for nvfp4_rht the transformed tensor (what the
    format holds)."""
    spec = {"nvfp4": "e2m1/1x16/e4m3/nearest", "nvfp4_rht": "e2m1/1x16/e4m3/nearest",
            "mxfp4": "e2m1/1x32/ue8m0/nearest"}[recipe]
    op = lab.parse(spec)
    b = op.block[1]
    x = torch.nn.functional.pad(x, (0, (-x.shape[-1]) % b))
    if recipe == "nvfp4_rht":
        x = lab.hadamard(x, lab.fixed_signs(x.device))
    back = lab.fake_quantize(x, op)
    hp = x.double()
    c = lab.cast(x, op)
    # what each block's elements were divided by: the two levels (nvfp4), the power of two (mxfp4)
    scales = (c.decode if recipe != "mxfp4" else 1.0 / c.multiplier).reshape(x.shape[0], -1)
    live = scales[x.reshape(-1, b).abs().amax(1).reshape(x.shape[0], -1) > 0]
    scaled = x / scales.repeat_interleave(b, dim=1)
    n = int((x != 0).sum())
    return {"sqnr_db": 10 * math.log10(hp.square().sum() / (hp - back.double()).square().sum()),
            "flush": int(((back == 0) & (x != 0)).sum()) / n, "saturate": int((scaled.abs() >= 7).sum()) / n,
            "scale_max": 1 / float(live.min()), "scale_min": 1 / float(live.max())}


@pytest.mark.parametrize("recipe", FP4_RECIPES)
@pytest.mark.parametrize("cols", [256, 200])  # 200: padded to the block
def test_fp4_whatif_figures_are_those_of_the_round_trip(recipe, cols):
    x = torch.randn(64, cols, generator=torch.Generator().manual_seed(1)) * torch.logspace(-4, 1, cols)
    got = cast_stats(x, recipe)
    want = _direct(x, recipe)
    assert got["sqnr_db"] == pytest.approx(want["sqnr_db"], rel=1e-9)
    assert got["flush"] == pytest.approx(want["flush"], abs=1e-12) and got["flush"] > 0
    # clamped past 7: never with nvfp4's scales from the current amax (E4M3 rounding
    # leaves at most 6.4); mxfp4's floor rule lets a block's largest values reach 8
    assert got["saturate"] == pytest.approx(want["saturate"], abs=1e-12)
    assert (got["saturate"] > 0) == (recipe == "mxfp4")
    # the scale is the multiplier, as for float8 (nvfp4's reciprocal form: within an ulp)
    assert got["scale_max"] == pytest.approx(want["scale_max"], rel=1e-6)
    assert got["scale_min"] == pytest.approx(want["scale_min"], rel=1e-6)


def test_fp4_planted_flush_and_saturation():
    """Counted by hand. nvfp4: rows of [1000, 1 x 15]: the 1s, scaled by 6/1000, flush
    (15 of 16); the Hadamard transform spreads the 1000 over the block (every value
    about 250 +- 4): none flushes. mxfp4, one block of 32 with amax 7.5: its scale,
    2**(floor(log2 7.5) - 2) = 1, leaves 7.5 past 7, clamped (saturated), and 6.5,
    which rounds to 6 anyway, not; 0.2 flushes and 0.25 too (the tie goes to 0)."""
    rows = torch.ones(32, 16)
    rows[:, 0] = 1000.0
    nv, rht = cast_stats(rows, "nvfp4"), cast_stats(rows, "nvfp4_rht")
    assert nv["flush"] == 15 / 16 and nv["saturate"] == 0
    assert rht["flush"] == 0 and rht["saturate"] == 0
    block = torch.ones(1, 32)
    block[0, :4] = torch.tensor([7.5, 6.5, 0.2, 0.25])
    mx = cast_stats(block, "mxfp4")
    assert mx["saturate"] == 1 / 32 and mx["flush"] == 2 / 32 and mx["scale_max"] == 1.0
    assert cast_stats(block, "nvfp4")["saturate"] == 0  # E4M3 block scales fit 7.5 below 6


def test_rht_spreads_an_outlier_channel():
    """One input channel 100x the rest: with 1 x 16 blocks its neighbours in each block
    are scaled for it and mostly flush; the Hadamard transform spreads it over the
    block, and the flushed share falls to that of a Gaussian tensor. The SQNR, which
    weighs errors by energy and is carried by the outlier channel, does not rise:
    the transform brings back the small values, which hold little of the energy."""
    g = torch.Generator().manual_seed(0)
    gauss = torch.randn(256, 256, generator=g)
    x = gauss.clone()
    x[:, 3] *= 100
    nv, rht, ref = cast_stats(x, "nvfp4"), cast_stats(x, "nvfp4_rht"), cast_stats(gauss, "nvfp4")
    assert nv["flush"] > 1.5 * rht["flush"]
    assert rht["flush"] == pytest.approx(ref["flush"], rel=0.1)
    assert rht["sqnr_db"] == pytest.approx(ref["sqnr_db"], abs=4.0)  # about a Gaussian's ~20 dB


def test_whatifs_draw_no_random_numbers_and_float8_ones_take_the_runs_format():
    """Every what-if rounds to nearest (nvfp4's stochastic gradients too: the monitor must
    not change the run); a float8 what-if casts to the run's float8 format per operand
    (E4M3 where the run has none), any other as its specs say; given scales are fp32
    multipliers, refused for a power-of-two rule."""
    x = torch.randn(32, 64)
    state = torch.get_rng_state()
    for recipe in WHATIFS:
        for op in measured(recipe).values():
            if op is not None:
                cast_counts(x, op)
    assert torch.equal(torch.get_rng_state(), state)
    assert not any(o.stochastic for r in WHATIFS for o in measured(r).values() if o)
    e5m2_run = {"input": "e4m3", "weight": "e4m3", "grad_output": "e5m2"}
    assert [measured(r, e5m2_run)["grad_output"].element.name for r in ("rowwise", "mxfp8", "nvfp4", "mxfp4")] == [
        "e5m2", "e5m2", "e2m1", "e2m1"]
    fp4_run = dict.fromkeys(OPERANDS, "e2m1")
    assert measured("tensorwise", fp4_run)["grad_output"].spec == "e4m3/tensor/fp32/nearest"
    assert measured("tensorwise")["grad_output"].spec == "e5m2/tensor/fp32/nearest"  # its own spec
    assert measured("hybrid_mxfp8_nvfp4", fp4_run)["grad_output"].element.name == "e2m1"  # not all float8
    with pytest.raises(lab.SpecError, match="given scales"):
        cast_counts(x, measured("mxfp4")["input"], scale=torch.ones(2))


def test_a_float8_run_can_ask_for_the_4bit_whatifs():
    from mptrain.core.errors import ConfigError
    from mptrain.plan.build import build_plan

    from .conftest import make_cfg

    assert set(FP4_RECIPES) | set(FP8_RECIPES) <= set(WHATIFS)
    build_plan(make_cfg("precision=fp8", "monitor.fp8_whatif=[rowwise,nvfp4,nvfp4_rht,mxfp4]"))
    with pytest.raises(ConfigError, match="nvfp5"):
        build_plan(make_cfg("precision=fp8", "monitor.fp8_whatif=[nvfp5]"))


def test_a_renamed_whatif_names_its_new_name():
    """block1x32 is mxfp8's cast: the old name is one sentence naming the new (the lab's
    fp8_* names likewise, test_labtrain.py)."""
    from mptrain.core.errors import ConfigError
    from mptrain.plan.build import build_plan

    from .conftest import make_cfg

    with pytest.raises(ConfigError, match=r"monitor.fp8_whatif: block1x32 is now called mxfp8.*write mxfp8"):
        build_plan(make_cfg("precision=fp8", "monitor.fp8_whatif=[rowwise,block1x32]"))


def _watch_one_linear(recipe: str, whatif: list[str]):
    """A CastWatch over one nn.Linear(64, 128) whose own casts are the named recipe's,
    for one forward and backward pass: (scalars, {operand: the tensor measured})."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128))
    watch = CastWatch(model, ["0"], build_recipe(recipe), whatif)
    x = torch.randn(32, 64) * torch.logspace(-3, 1, 64)
    seen = {"input": x, "weight": model[0].weight.detach()}
    handles = watch.start(torch.device("cpu"))
    y = model(x)
    y.register_hook(lambda g: seen.setdefault("grad_output", g))
    y.backward(torch.randn(32, 128))
    for h in handles:
        h.remove()
    return watch.scalars({**watch.sum_all, **watch.max_all}), seen


@pytest.mark.parametrize("recipe", ["nvfp4", "mxfp4"])
def test_watch_of_a_run_whose_own_casts_are_4bit(recipe):
    """A run whose own recipe is nvfp4 or mxfp4 (E2M1 for every operand): its figures
    are that recipe's casts (nvfp4's weight in 16 x 16 tiles), its float8 what-ifs cast
    to E4M3, and its 4-bit what-ifs to E2M1."""
    other = "mxfp4" if recipe == "nvfp4" else "nvfp4"
    got, seen = _watch_one_linear(recipe, ["tensorwise", other, "nvfp4_rht"])
    for op, t in seen.items():
        own = cast_stats(t, recipe, operand=op)
        assert got[f"fp8.0/{op}/sqnr_db"] == pytest.approx(own["sqnr_db"], rel=1e-12)
        assert got[f"fp8.0/{op}/scale_max"] == own["scale_max"]
        assert got[f"fp8.0/{op}/tensorwise/sqnr_db"] == pytest.approx(
            cast_stats(t, "tensorwise", operand=op)["sqnr_db"])
        assert got[f"fp8.0/{op}/{other}/flush"] == cast_stats(t, other, operand=op)["flush"]
        assert f"fp8.0/{op}/nvfp4_rht/sqnr_db" in got
    assert got["fp8/worst/flush"] > 0 and "fp8/worst/tensorwise/sqnr_db" in got
    assert table(report(got, recipe, 1)).startswith(f"4-bit casts at step 1 (recipe {recipe}):")


def test_watch_of_a_float8_run_measures_the_4bit_whatifs():
    got, seen = _watch_one_linear("tensorwise", list(FP4_RECIPES))
    for op, t in seen.items():
        for recipe in FP4_RECIPES:
            want = cast_stats(t, recipe, operand=op)
            assert got[f"fp8.0/{op}/{recipe}/sqnr_db"] == pytest.approx(want["sqnr_db"], rel=1e-12), (op, recipe)
            assert got[f"fp8.0/{op}/{recipe}/saturate"] == want["saturate"]
        # 4-bit keeps less than float8 did
        assert got[f"fp8.0/{op}/nvfp4/sqnr_db"] < got[f"fp8.0/{op}/sqnr_db"]
