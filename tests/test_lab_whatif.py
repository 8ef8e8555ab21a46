"""Cast statistics of the named recipes (#43 item 4, #51's one cast engine): a recipe's
figures against lab.cast's own round trip worked out here, saturation at a planted
value, each first overflow defined once, the what-ifs that kept their figures when
the statistics became the lab's casts, a CastWatch whose own casts are a lab recipe,
the what-if names the config takes, and one precision=lab run whose table and metrics
carry lab what-ifs."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from mptrain.core.errors import ConfigError
from mptrain.observe.fp8watch import CastWatch, report, table
from mptrain.precision import lab
from mptrain.precision.elements import element
from mptrain.precision.formats import thresholds
from mptrain.plan.build import build_plan
from mptrain.precision.fp8casts import WHATIFS, cast_counts, measured, summarize
from mptrain.precision.recipe import NAMED, build_recipe

from .conftest import make_cfg, train

FP32_REST = ["precision.compute_dtype=fp32", "precision.param_dtype=fp32"]
WHATIF = ["nvfp4", "nvfp4_4over6", "mxfp6_e2m3", "mxfp8", "rowwise"]


def _spread(rows: int = 64, cols: int = 64, seed: int = 0) -> torch.Tensor:
    """Gaussian values whose columns span four decades, so casts flush and round visibly."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, cols, generator=g) * torch.logspace(-3, 1, cols)


@pytest.mark.parametrize("recipe", ["mxfp6_e3m2", "mxfp6_e2m3", "nvfp4_4over6", "tensorwise",
                                    "hybrid_mxfp8_nvfp4", "block128x128", "nvfp4_rht"])
def test_lab_figures_are_lab_casts_own_round_trip(recipe):
    """Flush share and SQNR of each measured operand equal what lab.fake_quantize
    (nearest rounding, fixed Hadamard signs) does to the same tensor (two 128 x 128 tiles
    each way: block128x128's sums run over the tensor in its own order, not tile by tile)."""
    x = _spread(256, 256)
    for op_name in ("input", "weight", "grad_output"):
        op = measured(recipe)[op_name]
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
    got = summarize(*cast_counts(x, measured("mxfp6_e3m2")["input"]))
    assert got["saturate"] == 1 / 32 and got["scale_min"] == got["scale_max"] == 1.0
    # one rule (elements.overflow_threshold) for the lab's elements and the numerics monitor's formats
    assert element("e2m1").first_overflow == 7.0  # between 6 and 8; 6's code is odd: the tie goes up
    for name in ("e4m3", "e5m2"):
        assert element(name).first_overflow == thresholds(name).first_overflow
    assert element("e3m2").first_overflow == 30.0 and element("int8").first_overflow == 127.5
    assert thresholds("fp16").first_overflow == 65520.0


def test_whatifs_measure_the_named_recipes_casts():
    """One vocabulary: a what-if measures the named recipe's own specs (nvfp4's weight in
    its 16 x 16 tiles; nvfp4_1d's in rows of 16, the figures the nvfp4 what-if had before
    it meant the recipe), rounding to nearest; the float8 ones in the run's float8 format."""
    assert measured("nvfp4")["weight"].block == (16, 16) and measured("nvfp4_1d")["weight"].block == (1, 16)
    assert measured("nvfp4")["input"] == measured("nvfp4_1d")["input"] == lab.parse("e2m1/1x16/e4m3/nearest")
    assert measured("nvfp4_rht")["grad_output"].spec == "e2m1/1x16/e4m3/nearest/hadamard"
    assert measured("mxfp8")["input"].spec == "e4m3/1x32/ue8m0-rceil/nearest"
    assert measured("block1x128")["weight"].spec == "e4m3/1x128/fp32/nearest"
    run = {"input": "e4m3", "weight": "e4m3", "grad_output": "e5m2"}
    assert measured("block128x128", run)["grad_output"].spec == "e5m2/128x128/fp32/nearest"
    assert set(WHATIFS) == set(NAMED)


def test_watch_of_a_run_whose_own_casts_are_a_lab_recipe():
    """A lab run's own figures come from its recipe's operand specs; an operand the
    recipe leaves unquantized is not measured; lab what-ifs sit beside float8 ones."""
    own = build_recipe("mxfp6_e3m2", {"dgrad_grad_output": "none"})
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128))
    watch = CastWatch(model, ["0"], own, ["mxfp6_e2m3", "rowwise"])
    x = _spread(32, 64)
    handles = watch.start(torch.device("cpu"))
    model(x).backward(torch.randn(32, 128))
    for h in handles:
        h.remove()
    got = watch.scalars({**watch.sum_all, **watch.max_all})
    for op, t in (("input", x), ("weight", model[0].weight)):
        assert got[f"fp8.0/{op}/sqnr_db"] == summarize(*cast_counts(t, own.op("fwd_input")))["sqnr_db"]
        # two more mantissa bits: E2M3 keeps more signal than E3M2 on the same blocks
        assert got[f"fp8.0/{op}/mxfp6_e2m3/sqnr_db"] > got[f"fp8.0/{op}/sqnr_db"] + 3
    assert "fp8.0/grad_output/sqnr_db" not in got and "fp8.0/grad_output/mxfp6_e2m3/sqnr_db" in got
    assert table(report(got, own.name, 1)).startswith("lab casts at step 1 (recipe mxfp6_e3m2):")


def test_whatif_names_the_config_takes():
    for preset in ("precision=fp8", "precision=bf16", "precision=nvfp4"):
        build_plan(make_cfg(preset, f"monitor.fp8_whatif=[{','.join(WHATIF)}]"))
    with pytest.raises(ConfigError) as e:
        build_plan(make_cfg("precision=fp8", "monitor.fp8_whatif=[rowwise,mxfp7]"))
    msg = str(e.value)
    assert "mxfp7" in msg and all(n in msg for n in NAMED) and msg.count(". ") == 0


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
