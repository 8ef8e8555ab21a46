"""The arithmetic of float8 cast statistics (mptrain/fp8stats.py): flushed and
saturated shares against counts worked out by hand, the SQNR against torchao's
own casts, stale scales, and shards that add up to the whole."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from mptrain.precision.fp8casts import RECIPES, cast_counts, summarize
from mptrain.precision.formats import thresholds
from mptrain.observe.fp8watch import CastWatch

from .aids import cast_stats


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
                "block1x32": 31}
    got = {r: cast_stats(x, r) for r in RECIPES}
    for recipe, flushed in expected.items():
        assert got[recipe]["flush"] == pytest.approx(flushed / n, abs=0), recipe
        assert got[recipe]["saturate"] == 0, recipe  # scales from the current amax: nothing clamps
        assert got[recipe]["amax"] == pytest.approx(1e4)
    order = sorted(RECIPES, key=lambda r: -got[r]["flush"])
    assert order == ["tensorwise", "block128x128", "rowwise", "block1x128", "block1x32"]
    # Flushed values are lost signal: among scales of one kind, finer is better. (Across
    # kinds the outlier decides: a power-of-two scale puts it at 312.5, which e4m3 rounds
    # to 320, while max / amax puts it exactly on 448.)
    assert got["block1x128"]["sqnr_db"] > got["tensorwise"]["sqnr_db"]  # fp32 scales
    assert got["block1x32"]["sqnr_db"] > got["rowwise"]["sqnr_db"]  # power-of-two scales


def test_mx_floor_scales_clamp_what_rceil_scales_keep():
    """OCP MX's shared exponent, floor(log2 amax) - 8 for e4m3, lets a block's largest
    values reach 2x the element format's max: 500 > 448 clamps. Rounding amax / max
    up (rceil, torchao's MXFP8 training) does not."""
    x = torch.ones(1, 32)
    x[0, 3] = 500.0
    floor = cast_stats(x, "block1x32", mx_rounding="floor")
    rceil = cast_stats(x, "block1x32", mx_rounding="rceil")
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
    _, old = cast_counts(x, "tensorwise")
    jumped = x * 4  # 3/4 of the values now lie beyond the old amax of 1
    stale = summarize(*cast_counts(jumped, "tensorwise", scale=old[1:2]))
    # clamped: what would not have rounded to 448 (first_overflow, 464) under the old scale
    beyond = (jumped.abs() * old[1] >= thresholds("e4m3").first_overflow).sum() / jumped.numel()
    assert stale["saturate"] == pytest.approx(beyond.item(), rel=1e-6) and 0.7 < stale["saturate"] < 0.75
    assert cast_stats(jumped, "tensorwise")["saturate"] == 0


def test_shards_add_up_to_the_whole():
    """Rows split across ranks (as FSDP shards dim 0): summed counts and maxed maxima
    of the parts equal the whole's, for the recipes whose groups do not straddle them."""
    x = _outlier_tensor(128, 256)
    for recipe in ("rowwise", "block1x32", "block1x128"):
        whole = summarize(*cast_counts(x, recipe))
        parts = [cast_counts(p, recipe) for p in x.chunk(2)]
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

    from .conftest import make_cfg

    torch.manual_seed(0)
    policy = PrecisionPolicy(make_cfg("precision=fp8", f"precision.fp8.recipe={recipe}").precision,
                             torch.device("cpu"))
    model = policy.convert_model(nn.Sequential(nn.Linear(64, 128)))
    watch = CastWatch.of_run(policy.fp8, model, ["block1x32"])
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
        assert f"fp8.0/{op}/block1x32/sqnr_db" in got
    assert got["fp8.0/grad_output/flush"] > 0  # the test can tell flushing from none
    assert f"fp8.0/input/{recipe}/flush" not in got  # the run's own recipe is not a what-if
