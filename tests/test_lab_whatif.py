"""Cast statistics of the format lab's recipes (#43 item 4): a lab operand's
figures against lab.cast's own round trip worked out here, saturation at a
planted value, the 4-bit statistics' names against the lab recipes of the same
name, a CastWatch whose own casts are a lab recipe, the what-if names the config
takes, and one precision=lab run whose table and metrics carry lab what-ifs."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from mptrain.core.errors import ConfigError
from mptrain.observe.fp8watch import CastWatch, report, table
from mptrain.precision import fp4, lab, labtrain
from mptrain.precision.elements import element
from mptrain.precision.formats import thresholds
from mptrain.precision.fp8casts import (
    LAB_RECIPES,
    RECIPES,
    cast_counts,
    first_overflow,
    lab_counts,
    lab_operand,
    summarize,
)
from mptrain.plan.build import build_plan

from .conftest import make_cfg, train

FP32_REST = ["precision.compute_dtype=fp32", "precision.param_dtype=fp32"]
WHATIF = ["nvfp4", "nvfp4_4over6", "mxfp6_e2m3", "mxfp8", "rowwise"]


def _spread(rows: int = 64, cols: int = 64, seed: int = 0) -> torch.Tensor:
    """Gaussian values whose columns span four decades, so casts flush and round visibly."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g) * torch.logspace(-3, 1, cols)


@pytest.mark.parametrize("recipe", ["mxfp6_e3m2", "mxfp6_e2m3", "nvfp4_4over6", "fp8_tensorwise",
                                    "hybrid_mxfp8_nvfp4"])
def test_lab_figures_are_lab_casts_own_round_trip(recipe):
    """Flush share and SQNR of each measured operand equal what lab.fake_quantize
    (nearest rounding, fixed Hadamard signs) does to the same tensor."""
    x = _spread()
    for op_name in ("input", "weight", "grad_output"):
        op = lab_operand(recipe, op_name)
        assert op.rounding == "nearest"  # even where the recipe rounds this operand stochastically
        signs = lab.fixed_signs(x.device) if op.transform == "hadamard" else None
        basis = lab.hadamard(x, signs) if op.transform else x  # measured where the format holds the values
        rt = lab.fake_quantize(x, op, signs=signs)
        nz = basis != 0
        got = summarize(*cast_counts(x, op))
        assert got["flush"] == ((rt == 0) & nz).sum().item() / nz.sum().item(), (recipe, op_name)
        want_sqnr = 10 * math.log10(basis.double().square().sum().item() / (basis - rt).double().square().sum().item())
        assert got["sqnr_db"] == pytest.approx(want_sqnr, rel=1e-9), (recipe, op_name)
        assert got["amax"] == basis.abs().max().item()


def test_saturation_counts_what_the_clamp_changed():
    """MXFP6 E3M2 (largest 28, spacing 4 at the top) with OCP's floor scale: a block
    of 32 whose maximum is 31 keeps scale 1; 31 would round to 32 without the clamp
    (counted), 29 rounds to 28 anyway (not counted)."""
    x = torch.full((1, 32), 0.5)
    x[0, 0], x[0, 1] = 31.0, 29.0
    got = summarize(*lab_counts(x, lab_operand("mxfp6_e3m2", "input")))
    assert got["saturate"] == 1 / 32 and got["scale_min"] == got["scale_max"] == 1.0
    # the generalized threshold agrees with the float8 and E2M1 ones the monitor already had
    assert first_overflow(element("e2m1")) == fp4.E2M1_FIRST_OVERFLOW
    for name in ("e4m3", "e5m2"):
        assert first_overflow(element(name)) == thresholds(name).first_overflow
    assert first_overflow(element("e3m2")) == 30.0 and first_overflow(element("int8")) == 127.5


def test_shared_names_keep_their_meaning_and_equal_the_lab_casts():
    """nvfp4 and mxfp4 keep the statistics' meaning; they are the lab recipe's casts
    (rounded to nearest) wherever the lab's spec has the same blocks: every operand
    of mxfp4, nvfp4's input and output gradient (its weight is 16 x 16 tiles in the
    lab recipe, a row of 16 in the statistic)."""
    x = _spread(seed=1)
    pairs = [("mxfp4", op) for op in ("input", "weight", "grad_output")]
    pairs += [("nvfp4", "input"), ("nvfp4", "grad_output")]
    for name, op in pairs:
        old, new = cast_counts(x, name, "e2m1"), cast_counts(x, lab_operand(name, op))
        assert torch.equal(old[0], new[0]) and torch.equal(old[1], new[1]), (name, op)
    assert lab_operand("nvfp4", "weight").block == (16, 16)
    with pytest.raises(ValueError, match="lab recipe"):
        cast_counts(x, "mxfp6_e3m2")


def test_watch_of_a_run_whose_own_casts_are_a_lab_recipe():
    """A lab run's own figures come from its recipe's operand specs; an operand the
    recipe leaves unquantized is not measured; lab what-ifs sit beside float8 ones."""
    own = labtrain.build_recipe("mxfp6_e3m2", {"dgrad_grad_output": "none"})
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128))
    watch = CastWatch(model, ["0"], own.name, own.formats(), ["mxfp6_e2m3", "rowwise"], own=own)
    x = _spread(32, 64)
    handles = watch.start(torch.device("cpu"))
    model(x).backward(torch.randn(32, 128))
    for h in handles:
        h.remove()
    got = watch.scalars({**watch.sum_all, **watch.max_all})
    for op, t in (("input", x), ("weight", model[0].weight)):
        assert got[f"fp8.0/{op}/sqnr_db"] == summarize(*lab_counts(t, own.op("fwd_input")))["sqnr_db"]
        # two more mantissa bits: E2M3 keeps more signal than E3M2 on the same blocks
        assert got[f"fp8.0/{op}/mxfp6_e2m3/sqnr_db"] > got[f"fp8.0/{op}/sqnr_db"] + 3
    assert "fp8.0/grad_output/sqnr_db" not in got and "fp8.0/grad_output/mxfp6_e2m3/sqnr_db" in got
    assert table(report(got, own.name, 1)).startswith("lab casts at step 1 (recipe mxfp6_e3m2):")


def test_whatif_names_the_config_takes():
    for preset in ("precision=fp8", "precision=bf16", "precision=nvfp4"):
        build_plan(make_cfg(preset, f"monitor.fp8_whatif=[{','.join(WHATIF)}]"))
    assert set(RECIPES) & set(LAB_RECIPES) == set() and {"nvfp4", "mxfp4"} <= set(labtrain.NAMED)
    with pytest.raises(ConfigError) as e:
        build_plan(make_cfg("precision=fp8", "monitor.fp8_whatif=[rowwise,mxfp7]"))
    msg = str(e.value)
    assert "mxfp7" in msg and all(n in msg for n in LAB_RECIPES) and msg.count(". ") == 0


@pytest.fixture(scope="module")
def lab_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("labwhatif") / "run"
    s, rows = train(d, "precision=lab", "precision.lab.recipe=mxfp6_e3m2", *FP32_REST, "train.max_steps=3",
                    "monitor.every=2", f"monitor.fp8_whatif=[{','.join(WHATIF)}]")
    return d, s, rows


def test_a_lab_run_prints_and_logs_its_whatifs(lab_run):
    d, s, rows = lab_run
    first = rows[0]
    # one block of two is kept out (the recipe's last 15%, rounded up): block0's four linears measured
    assert "fp8.block1.mlp.fc/input/sqnr_db" not in first
    for layer in ("block0.attn.qkv", "block0.mlp.fc"):
        for op in ("input", "weight", "grad_output"):
            own = first[f"fp8.{layer}/{op}/sqnr_db"]
            fig = {w: first[f"fp8.{layer}/{op}/{w}/sqnr_db"] for w in WHATIF}
            assert all(f"fp8.{layer}/{op}/{w}/flush" in first for w in WHATIF)
            # wider elements keep more: mxfp8 > E2M3 > E3M2 (the run's own) > 4-bit
            assert fig["mxfp8"] > fig["mxfp6_e2m3"] > own > max(fig["nvfp4"], fig["nvfp4_4over6"]), (layer, op)
    casts = s["fp8_casts"]
    assert casts["recipe"] == "mxfp6_e3m2" and set(casts["layers"]["block0.mlp.fc"]["input"]["whatif"]) == set(WHATIF)
    log = (d / "train.log").read_text()
    assert f"lab casts at step {casts['step']} (recipe mxfp6_e3m2):" in log and "mxfp6_e2m3 (" in log
