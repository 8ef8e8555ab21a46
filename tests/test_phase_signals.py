"""The signals that say when (mptrain/observe/quant.py), the figures a run that changes
precision mid-run would read: each matmul's quantization noise ratio against products
cast by hand in the training layouts, a matmul with nothing quantized left out, the
generators left as they were; the share of weight codes that changed, on a weight
whose codes are planted; the bias quantized norm weights would add, on weights whose
E2M1 values are worked out by hand; and one tiny nvfp4 run that logs them all and
trains bit for bit as the same run with the monitor off."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from mptrain.model.gpt import LayerNorm
from mptrain.observe.fp8watch import CastWatch
from mptrain.observe.numerics import NumericsMonitor
from mptrain.observe.quant import gemm_noise, weight_codes
from mptrain.precision import lab
from mptrain.precision.elements import all_formats
from mptrain.precision.fp8casts import statistic_cast
from mptrain.precision.labtrain import LabLinear
from mptrain.precision.recipe import build_recipe

from .conftest import train

# nvfp4 with 1 x 16 weight blocks (so that the input gradient's transposed weight is cast
# along the other dimension than the forward's) and gradients rounded to nearest (so that
# a product cast by hand draws nothing and must match)
NEAREST_1D = {"dgrad_grad_output": "e2m1/1x16/e4m3/nearest", "wgrad_grad_output": "e2m1/1x16/e4m3/nearest/hadamard"}
GEMMS = ("forward", "input_gradient", "weight_gradient")


def _monitor(model: nn.Module, converted: list[str], recipe) -> NumericsMonitor:
    """The numerics monitor of one process, every step, with the cast watch of ``converted``."""
    cfg = SimpleNamespace(enabled=True, every=1, histogram=False, activations=False, stability=False)
    return NumericsMonitor(cfg, model, fp8_watch=CastWatch(model, converted, recipe, []))


def _step(mon: NumericsMonitor, model: nn.Module, x: torch.Tensor, dy: torch.Tensor, step: int = 0) -> dict:
    """One monitored step without an optimizer: forward ``x``, backward ``dy``, collect."""
    mon.start_step(step)
    model(x).backward(dy)
    mon.after_backward(model, None)
    mon.before_optimizer(model)
    mon.after_optimizer(model, torch.tensor(0.0))
    return mon.collect()[0]


def _two_linears(recipe) -> nn.Sequential:
    """64 -> 32 -> 32, weights with rows of very different sizes (so the block direction matters)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32, bias=False), nn.Linear(32, 32, bias=False))
    with torch.no_grad():
        for lin in model:
            lin.weight.mul_(torch.logspace(-2, 1, lin.out_features).reshape(-1, 1))
    return nn.Sequential(*(LabLinear.from_linear(lin, recipe) for lin in model))


def _by_hand(recipe, x, w, dy, dgrad_layout: str = "transposed") -> dict[str, tuple[float, float]]:
    """(||P||^2, ||P_q - P||^2) per matmul, cast with lab.fake_quantize in the layouts the
    lab's module docstring tabulates (``dgrad_layout`` "forward": the weight blocked as in
    the forward, the wrong layout for 1 x 16 blocks)."""
    fq = lab.fake_quantize
    s = lab.fixed_signs(torch.device("cpu"))  # nvfp4's weight-gradient transform
    w_dgrad = (fq(w.t().contiguous(), recipe.op("dgrad_weight")).t() if dgrad_layout == "transposed"
               else fq(w, recipe.op("dgrad_weight")))
    pairs = {
        "forward": (x @ w.t(), fq(x, recipe.op("fwd_input")) @ fq(w, recipe.op("fwd_weight")).t()),
        "input_gradient": (dy @ w, fq(dy, recipe.op("dgrad_grad_output")) @ w_dgrad),
        "weight_gradient": (dy.t() @ x, fq(dy.t().contiguous(), recipe.op("wgrad_grad_output"), signs=s)
                            @ fq(x.t().contiguous(), recipe.op("wgrad_input"), signs=s).t()),
    }
    return {g: (float(p.double().square().sum()), float((q - p).double().square().sum())) for g, (p, q) in pairs.items()}


def test_noise_ratios_are_the_products_cast_by_hand():
    """Two linears, each matmul cast as the recipe says (1 x 16 weight blocks along each
    matmul's own contraction dimension, Hadamard-transformed weight-gradient operands):
    per layer sqrt(||P||^2 / ||P_q - P||^2), and over both the ratio of the summed sums."""
    recipe = build_recipe("nvfp4_1d", NEAREST_1D)
    model = _two_linears(recipe)
    seen: dict = {}

    def keep(i: int):
        def hook(mod, args, out) -> None:  # each linear's input and output gradient, as the step has them
            seen["x", i] = args[0].detach()
            out.register_hook(lambda g: seen.__setitem__(("dy", i), g))
        return hook

    for i, lin in enumerate(model):
        lin.register_forward_hook(keep(i))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 64, generator=g) * torch.logspace(-1, 1, 64)
    dy = torch.randn(32, 32, generator=g)
    got = _step(_monitor(model, ["0", "1"], recipe), model, x, dy)
    hand = [_by_hand(recipe, seen[("x", i)], lin.weight.detach(), seen[("dy", i)]) for i, lin in enumerate(model)]
    for gemm in GEMMS:
        for i in (0, 1):
            sig, noise = hand[i][gemm]
            assert got[f"numerics/quant.{i}/{gemm}/noise_ratio"] == pytest.approx(math.sqrt(sig / noise), rel=1e-9)
        total = [sum(h[gemm][k] for h in hand) for k in (0, 1)]
        assert got[f"numerics/quant/{gemm}/noise_ratio"] == pytest.approx(math.sqrt(total[0] / total[1]), rel=1e-9)
        assert 1 < got[f"numerics/quant/{gemm}/noise_ratio"] < 100  # E2M1: a few x to tens x, not exact
    # the layout matters: the input gradient's weight blocked as in the forward gives another
    # figure (by 0.4% here, thousands of times the tolerance the right layout is held to)
    wrong = _by_hand(recipe, seen[("x", 0)], model[0].weight.detach(), seen[("dy", 0)], dgrad_layout="forward")
    assert got["numerics/quant.0/input_gradient/noise_ratio"] != pytest.approx(
        math.sqrt(wrong["input_gradient"][0] / wrong["input_gradient"][1]), rel=1e-6)


def test_a_matmul_with_both_operands_unquantized_is_left_out():
    """rowwise_with_gw_hp leaves both weight-gradient operands unquantized: that matmul
    has no figure; one operand quantized is enough for a figure; fwd_weight unquantized
    leaves out the weight codes (and the norm bias, measured with that spec)."""
    x, dy = torch.randn(32, 64), torch.randn(32, 32)
    hp = build_recipe("rowwise_with_gw_hp")
    model = _two_linears(hp)
    got = _step(_monitor(model, ["0", "1"], hp), model, x, dy)
    assert {"numerics/quant/forward/noise_ratio", "numerics/quant/input_gradient/noise_ratio"} <= got.keys()
    assert not any("weight_gradient" in k for k in got)
    half = build_recipe("custom", {**hp.specs, "wgrad_input": "e4m3/row/ue8m0-rceil/nearest", "fwd_weight": "none"})
    model = _two_linears(half)
    mon = _monitor(model, ["0", "1"], half)
    got = [_step(mon, model, x, dy, step) for step in (0, 1)][-1]
    assert math.isfinite(got["numerics/quant/weight_gradient/noise_ratio"])
    assert not any(k.startswith(("numerics/quant/weight_flips", "numerics/quant/norm_bias")) for k in got)


def test_the_measurement_leaves_the_generators_as_they_were():
    """nvfp4 rounds both gradient operands stochastically and draws from the default
    generator: the measurement does draw (called bare, it moves the generator), yet a
    monitored step leaves the generator, and the gradients the step computes, exactly
    as the same step unmonitored leaves them."""
    recipe = build_recipe("nvfp4")
    assert recipe.op("dgrad_grad_output").stochastic
    x, dy = torch.randn(32, 64), torch.randn(32, 32)
    state = torch.get_rng_state()
    gemm_noise("input gradient", dy, torch.randn(32, 32), recipe)
    assert not torch.equal(torch.get_rng_state(), state)  # it draws: forking the generators is needed

    def step(monitored: bool):
        model = _two_linears(recipe)
        torch.manual_seed(7)
        if monitored:
            _step(_monitor(model, ["0", "1"], recipe), model, x, dy)
        else:
            model(x).backward(dy)
        return [p.grad.clone() for p in model.parameters()], torch.get_rng_state()

    (plain, plain_state), (watched, watched_state) = step(False), step(True)
    assert torch.equal(plain_state, watched_state)
    assert all(torch.equal(a, b) for a, b in zip(plain, watched, strict=True))


def _planted_weight() -> torch.Tensor:
    """A 32 x 64 weight on E2M1's grid whose every 16 x 16 tile holds a 6: under nvfp4's
    two-level scale (tensor 6 / (448 x 6), tile 448, exact in E4M3) each code is the value itself."""
    g = torch.Generator().manual_seed(3)
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0])
    w = grid[torch.randint(0, len(grid), (32, 64), generator=g)] * (torch.randint(0, 2, (32, 64), generator=g) * 2 - 1)
    w[::16, ::16] = 6.0
    return w


def test_weight_flips_count_the_codes_that_changed():
    """Absent at the first monitored step; then the share of elements whose code moved:
    five codes moved to another grid value, seven values nudged within their code's
    rounding interval (no flip), the tiles' scales untouched: 5 of 2048."""
    recipe = build_recipe("nvfp4")
    w = _planted_weight()
    assert torch.equal(weight_codes(w, recipe.op("fwd_weight")).float(), w)  # the planted codes
    lin = nn.Linear(64, 32, bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    model = nn.Sequential(LabLinear.from_linear(lin, recipe))
    mon = _monitor(model, ["0"], recipe)
    x, dy = torch.randn(16, 64), torch.randn(16, 32)
    first = _step(mon, model, x, dy, 0)
    assert "numerics/quant/weight_flips" not in first and "numerics/quant/forward/noise_ratio" in first
    with torch.no_grad():
        wt = model[0].weight
        for r, c in ((1, 1), (2, 5), (20, 33), (31, 63), (17, 40)):
            wt[r, c] = 3.0 if wt[r, c] != 3.0 else -3.0
        for r, c in ((3, 3), (4, 7), (5, 18), (9, 50), (25, 2), (26, 30), (30, 60)):
            wt[r, c] += 0.1  # the grid's values are 0.5 apart or more: 0.1 stays within the code's interval
    got = _step(mon, model, x, dy, 1)
    assert got["numerics/quant/weight_flips"] == 5 / 2048
    assert _step(mon, model, x, dy, 2)["numerics/quant/weight_flips"] == 0.0  # nothing moved since


def test_the_kept_codes_are_exact_in_bf16_for_every_element():
    """weight_codes keeps each code in bf16 (2 bytes): exact for every element format the
    lab has (at most 6 mantissa bits, exponents well inside bf16's range)."""
    w = torch.randn(32, 64) * torch.logspace(-3, 3, 64)
    for el in all_formats():
        op = lab.parse(f"{el.name}/1x16/fp32/nearest")
        q = statistic_cast(w, op).q.reshape(32, 64)
        assert torch.equal(weight_codes(w, op).float(), q), el.name


class _Normed(nn.Module):
    """Two norms around one linear, named as the models name their norms (ln_1, ln_f)."""

    def __init__(self, recipe):
        super().__init__()
        self.ln_1 = LayerNorm(64, bias=False)
        self.fc = LabLinear(64, 32, recipe, bias=False)
        self.ln_f = LayerNorm(32, bias=False)

    def forward(self, x):
        return self.ln_f(self.fc(self.ln_1(x)))


def test_norm_bias_of_weights_on_the_e2m1_grid():
    """mxfp4's weight spec (E2M1 in blocks of 32, power-of-two scales 2^(floor(log2 amax) - 2)):
    ln_1 is 1.0 but for 1.2 -> 1.0, 1.1 -> 1.0, 0.7 -> 0.75 (its block's scale 1/4: 4.8 -> 4,
    4.4 -> 4, 2.8 -> 3) and 1.3 -> 1.5 (5.2 -> 6); ln_f is 2.0 but for 2.6 -> 3.0 (scale 1/2:
    5.2 -> 6). Signed shifts -0.05 and +0.4, over sums of |gamma| 64.3 and 64.6."""
    recipe = build_recipe("mxfp4")
    model = _Normed(recipe)
    with torch.no_grad():
        g1, gf = model.ln_1.weight, model.ln_f.weight
        g1[3], g1[5], g1[41], g1[40] = 1.2, 1.1, 0.7, 1.3
        gf.fill_(2.0)
        gf[0] = 2.6
    got = _step(_monitor(model, ["fc"], recipe), model, torch.randn(32, 64), torch.randn(32, 32))
    shift1, shiftf = -0.2 - 0.1 + 0.05 + 0.2, 0.4
    abs1, absf = 64 + 0.2 + 0.1 - 0.3 + 0.3, 62 + 2.6
    assert got["numerics/quant/norm_bias"] == pytest.approx((shift1 + shiftf) / (abs1 + absf), rel=1e-6)
    assert got["numerics/quant/norm_bias_max"] == pytest.approx(shiftf / absf, rel=1e-6)
    with torch.no_grad():
        g1.fill_(1.0)
        gf.fill_(1.0)
    got = _step(_monitor(model, ["fc"], recipe), model, torch.randn(32, 64), torch.randn(32, 32))
    assert got["numerics/quant/norm_bias"] == 0 and got["numerics/quant/norm_bias_max"] == 0  # 1.0 is on the grid


def test_the_norm_weights_are_read_inside_any_wrapper():
    """A wrapper repeats a norm's name (FSDP1 wraps each norm, and reshards its weight
    before the wrapper's own hooks): the bias is read from the module inside, whose
    forward multiplies by the weight, and from one module per name."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from mptrain.observe.stability import norm_modules

    model = _Normed(build_recipe("mxfp4"))
    inner = [model.ln_1, model.ln_f]
    model.ln_1, model.ln_f = checkpoint_wrapper(model.ln_1), checkpoint_wrapper(model.ln_f)

    def ids(mods) -> set[int]:
        return {id(m) for m in mods}

    outer = [m for mods in norm_modules(model).values() for m in mods]
    assert ids(outer) == ids([model.ln_1, model.ln_f])  # the stability monitor's choice stays the outermost
    assert ids(m for mods in norm_modules(model, innermost=True).values() for m in mods) == ids(inner)
    assert ids(_monitor(model, ["fc"], build_recipe("mxfp4")).fp8.signals.norms) == ids(inner)


@pytest.fixture(scope="module")
def nvfp4_runs(tmp_path_factory):
    """A tiny nvfp4 run (gpt-nano: width 64, 2 layers, 64 tokens a sequence), monitored
    at every step, and the same run with the monitor off: their metrics rows."""
    root = tmp_path_factory.mktemp("phase-signals")
    base = ["precision=nvfp4", "train.max_steps=3"]
    _, on = train(root / "on", *base, "monitor.every=1")
    _, off = train(root / "off", *base, "monitor.enabled=false")
    return on, off


def test_a_tiny_nvfp4_run_logs_the_signals(nvfp4_runs):
    on, _ = nvfp4_runs
    assert [r["step"] for r in on] == [1, 2, 3]
    wanted = [f"numerics/quant/{g}/noise_ratio" for g in GEMMS] + ["numerics/quant/norm_bias",
                                                                   "numerics/quant/norm_bias_max"]
    for r in on:
        assert all(math.isfinite(r[k]) for k in wanted), r
        assert "numerics/quant.block0.mlp.fc/weight_gradient/noise_ratio" in r
        assert "numerics/quant.block1.mlp.fc/forward/noise_ratio" not in r  # kept in bf16 by the recipe
        assert {"fp8/worst/saturate", "fp8/worst/flush"} <= r.keys()  # the other two signals
    assert "numerics/quant/weight_flips" not in on[0]
    assert all(0 < r["numerics/quant/weight_flips"] < 1 for r in on[1:])


def test_the_monitor_changes_nothing_in_a_stochastic_run(nvfp4_runs):
    """nvfp4 rounds its gradients stochastically; the monitor's casts draw too, from a
    fork of the generators: the run trains bit for bit as with the monitor off."""
    on, off = nvfp4_runs
    for key in ("train/loss", "train/grad_norm"):
        assert [r[key] for r in on] == [r[key] for r in off], key
