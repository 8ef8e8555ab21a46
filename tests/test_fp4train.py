"""4-bit training linears (mptrain/precision/labtrain.py, the lab's recipes nvfp4 and mxfp4): each matmul is its
definition on fake-quantized operands, stochastic rounding keeps the
gradients unbiased, and through the trainer nvfp4 and mxfp4 learn, report
what they converted, audit as E2M1 and resume bit for bit (the stochastic
rounding's draws included). The quantizers themselves are checked against
torchao in test_fp4.py; 2-rank FSDP2 is a job of the shared fsdp launch."""
from __future__ import annotations

import json

import pytest
import torch
import yaml
import torch.nn as nn

from mptrain.core.errors import ConfigError
from types import SimpleNamespace

from mptrain.config.schema import Fp4Format
from mptrain.precision import lab
from mptrain.precision.labtrain import LabLinear
from mptrain.precision.recipe import Recipe, fp4_recipe, precision_plan

from .aids import fp4_round_trip, fp4_scales, without_wall_clock
from .conftest import make_cfg, read_rows, train

# The rest of the model in fp32: these tests are about the 4-bit linears, and CPU bf16
# is 10-100x slower than fp32 on CPUs without avx512_bf16.
FP32_REST = ["precision.compute_dtype=fp32", "precision.param_dtype=fp32"]


def Fp4Recipe(fmt: str, hadamard: bool, stochastic: bool, two_d: bool) -> Recipe:
    """The lab recipe ``precision.fp4`` makes with these switches (as a run builds it)."""
    return fp4_recipe(SimpleNamespace(format=Fp4Format(fmt), hadamard=hadamard,
                                      stochastic_rounding=stochastic, weight_2d=two_d))


def _layer(recipe: Recipe, n_in: int = 64, n_out: int = 32) -> LabLinear:
    torch.manual_seed(0)
    return LabLinear.from_linear(nn.Linear(n_in, n_out), recipe)


@pytest.mark.parametrize("fmt,two_d,hadamard", [("nvfp4", True, True), ("nvfp4", False, False),
                                                 ("mxfp4", False, True)])
def test_each_matmul_is_its_definition_on_quantized_operands(fmt, two_d, hadamard):
    """Forward, input gradient and weight gradient equal the three products of
    fake-quantized operands, blocked along each product's contraction
    dimension, exactly (nearest rounding: nothing random)."""
    layer = _layer(Fp4Recipe(fmt, hadamard, False, two_d))
    x = torch.randn(64, 64, requires_grad=True)
    g = torch.randn(64, 32)
    y = layer(x)
    y.backward(g)
    w = layer.weight.detach()
    wq = fp4_round_trip(w, fmt, two_d=two_d)
    assert torch.equal(y.detach(), fp4_round_trip(x.detach(), fmt) @ wq.t() + layer.bias.detach())
    w_dgrad = wq if two_d else fp4_round_trip(w.t().contiguous(), fmt).t()
    assert torch.equal(x.grad, fp4_round_trip(g, fmt) @ w_dgrad)
    a, b = g.t().contiguous(), x.detach().t().contiguous()
    if hadamard:
        a, b = lab.hadamard(a, lab.fixed_signs(a.device)), lab.hadamard(b, lab.fixed_signs(b.device))
    assert torch.equal(layer.weight.grad, fp4_round_trip(a, fmt) @ fp4_round_trip(b, fmt).t())
    assert torch.equal(layer.bias.grad, g.sum(0))
    # and all of it is a 4-bit approximation of the real products, not something else
    exact = g.t() @ x.detach()
    rel = (layer.weight.grad - exact).norm() / exact.norm()
    assert 0 < rel < 0.5, rel


def test_stochastic_rounding_keeps_the_input_gradient_unbiased():
    """With stochastic rounding the input gradient is a random variable whose
    mean is the product with the unrounded output gradient (the weight is
    deterministic, and the gradient is taken within the format's range): the
    mean of many backward passes converges to it, where nearest rounding's
    error stays."""
    layer = _layer(Fp4Recipe("nvfp4", False, True, True), 32, 32)
    x = torch.randn(16, 32)
    g = torch.randn(16, 32)
    torch.manual_seed(1)
    draws = []
    for _ in range(400):
        xi = x.clone().requires_grad_()
        layer(xi).backward(g)
        draws.append(xi.grad)
    d = torch.stack(draws)
    # Unbiased within the format's range: a block's scale is rounded to E4M3, so its largest
    # element can land a little past 6 and saturate (the recipe's one deterministic bias).
    # The expectation is the gradient with each block clamped to +-6 x its scale.
    lim = 6 * fp4_scales(g, "nvfp4")[..., None]
    g_in_range = torch.maximum(torch.minimum(g.reshape(16, 2, 16), lim), -lim).reshape(16, 32)
    target = g_in_range @ fp4_round_trip(layer.weight.detach(), "nvfp4", two_d=True)
    err = (d.mean(0) - target).abs()
    se = d.std(0) / len(draws) ** 0.5
    assert bool((err <= 5 * se + 1e-6).all()), float((err / (se + 1e-12)).max())
    assert float(d.std(0).mean()) > 0  # it is random: nearest rounding would give one value
    # nearest rounding is biased on the same data: its error is many standard errors
    near = _layer(Fp4Recipe("nvfp4", False, False, True), 32, 32)
    xi = x.clone().requires_grad_()
    near(xi).backward(g)
    assert float(((xi.grad - target).abs() / (se + 1e-12)).max()) > 10


@pytest.fixture(scope="module")
def nvfp4_run(tmp_path_factory):
    """One nvfp4 run as the preset makes it (bf16 autocast around the 4-bit
    linears), audited at step 1, cast statistics every 5 steps."""
    run = tmp_path_factory.mktemp("nvfp4") / "run"
    summary, rows = train(run, "precision=nvfp4", "train.max_steps=12", "train.audit=true", "monitor.every=5")
    return run, summary, rows


def test_nvfp4_preset_trains_and_says_what_it_converted(nvfp4_run):
    run, s, rows = nvfp4_run
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert len(losses) == 12 and all(map(torch.isfinite, torch.tensor(losses)))
    assert losses[-1] < losses[0] - 0.3
    r = s["fp4"]
    # gpt-nano: 2 blocks; the recipe's 15% keeps the last one (ceil) and the head in bf16
    assert r["recipe"] == "nvfp4" and r["bf16_last_blocks"] == 1
    assert r["converted"] == ["blocks.0.attn.qkv", "blocks.0.attn.proj", "blocks.0.mlp.fc", "blocks.0.mlp.proj"]
    assert "bf16_last_blocks=1 (null: the recipe's 15% of 2 blocks, rounded up)" in r["excluded"]["blocks.1.mlp.fc"]
    assert r["hadamard"] and r["stochastic_rounding"] and r["weight_2d"] and r["matmul"] == "emulated"
    assert "fp8" not in s
    assert s["dtypes"]["fp4_linears"].startswith("nvfp4: forward E2M1")
    info = yaml.safe_load((run / "config.yaml").read_text())["run_info"]
    assert info["fp4"]["converted"] == r["converted"] and "fp8" not in info


def test_the_dtype_audit_reports_e2m1_and_flags_nothing(nvfp4_run):
    run, s, _ = nvfp4_run
    audit = json.loads((run / "audit.json").read_text())
    assert audit["modules"]["blocks.0.mlp.fc"]["matmul"] == "e2m1 (nvfp4, fp32 products)"
    assert audit["modules"]["blocks.1.mlp.fc"]["matmul"] == "bf16"  # kept by the recipe's 15%
    assert not [f for f in audit["flags"] if "autocast" in f["problem"]], audit["flags"]


def test_cast_statistics_of_a_4bit_run(nvfp4_run):
    _, s, rows = nvfp4_run
    monitored = [r for r in rows if "fp8/worst/flush" in r]
    assert monitored, "no cast statistics"
    first = monitored[0]
    # E2M1 with 16-element blocks: about 20 dB on Gaussian-like data, far below e4m3's ~30
    assert 10 < first["fp8.block0.mlp.fc/input/sqnr_db"] < 30
    assert "fp8.block1.mlp.fc/input/sqnr_db" not in first  # kept in bf16: not cast, not measured
    assert s["fp8_casts"]["recipe"] == "nvfp4"


def test_mxfp4_preset_trains(tmp_path):
    s, rows = train(tmp_path / "run", "precision=mxfp4", *FP32_REST, "train.max_steps=12")
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert losses[-1] < losses[0] - 0.3
    r = s["fp4"]
    assert r["recipe"] == "mxfp4" and r["block_size"] == 32
    assert not (r["hadamard"] or r["stochastic_rounding"] or r["weight_2d"])


def test_resume_is_exact_with_stochastic_rounding(tmp_path, monkeypatch):
    """The rounding draws come from torch's generator, whose state the checkpoint
    saves: a run stopped at step 5 and resumed repeats the straight run bit for bit.
    And the draws matter: the same run with another seed for the rounding alone
    starts from the same loss and then leaves the straight run's curve, so a resume
    that lost the generator's state could not have repeated it."""
    base = ["precision=nvfp4", *FP32_REST, "train.max_steps=10", "monitor.every=5"]
    _, straight = train(tmp_path / "straight", *base)
    s1, _ = train(tmp_path / "resumed", *base, "train.stop_after=5")
    assert s1["steps"] == 5
    s2, resumed = train(tmp_path / "resumed", *base)
    assert s2["resumed_from"].endswith("step-5")
    # The weight codes the flips are counted against travel in each rank's checkpoint file
    # (parts-rank<R>.pt): the resumed launch's first monitored step, 10, counts the same flips.
    flips = "numerics/quant/weight_flips"
    assert resumed[9][flips] == straight[9][flips]
    assert without_wall_clock(resumed) == without_wall_clock(straight)
    losses = [r["train/loss"] for r in straight if "train/loss" in r]
    assert len(set(losses)) > 5
    # Another seed for the rounding alone: its uniforms (the E2M1 rounding's torch.rand_like,
    # the only draw a 4-bit step makes) from a private generator; the weights, the
    # batches and every other draw as in the straight run. The first 3 steps of the
    # same schedule (stop_after keeps max_steps' learning rates).
    other_seed = torch.Generator().manual_seed(12345)
    monkeypatch.setattr(torch, "rand_like", lambda a: torch.rand(a.shape, generator=other_seed, dtype=a.dtype,
                                                                 device=a.device))
    _, other = train(tmp_path / "other-seed", *base, "train.stop_after=3")
    other_losses = [r["train/loss"] for r in other if "train/loss" in r]
    assert other_losses[0] == losses[0]  # step 1's forward: nearest rounding only, nothing drawn yet
    assert all(a != b for a, b in zip(other_losses[1:], losses[1:3], strict=True)), (other_losses, losses)


@pytest.mark.parametrize("overrides,match", [
    (["precision=nvfp4", "train.global_batch_size=1", "model.block_size=24"], "divisible by 16"),
    (["precision=mxfp4", "precision.fp4.weight_2d=true"], "weight_2d=true applies to nvfp4"),
    (["precision=nvfp4", "precision.fp8.enabled=true"], "one low-precision recipe"),
    (["precision=nvfp4", "precision.fp4.bf16_last_blocks=2"], "keep all 2 blocks out of 4-bit"),
])
def test_bad_settings_are_one_line_errors(tmp_path, overrides, match):
    with pytest.raises(ConfigError, match=match):
        train(tmp_path / "run", *overrides, "train.max_steps=1")


def test_two_rank_fsdp2(two_rank_jobs):
    """nvfp4 under 2-rank FSDP2 (a job of the fsdp launch): the linears are gathered
    in bf16, the very values the single-process run casts its weights to; both
    ranks hold the same finite weights and agree on every logged figure."""
    run_dir = two_rank_jobs("fsdp")["nvfp4"]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["dist/replicas_identical"] is True and s["fp4"]["recipe"] == "nvfp4"
    rows = [r for r in read_rows(run_dir) if "train/loss" in r]
    assert all(r["dist/rank_mismatch"] == 0 for r in rows)
    assert rows[-1]["train/loss"] < rows[0]["train/loss"] - 0.2


@pytest.mark.parametrize("preset,two_d,stochastic", [("nvfp4", True, True), ("mxfp4", False, False)])
def test_the_config_says_what_each_preset_is(preset, two_d, stochastic):
    """What each preset's file says, and what the precision policy then builds from it:
    bf16 autocast around linears whose forward is the format's fake-quantized product
    (2-D weight tiles for nvfp4 only) and whose input gradient is random (stochastic
    rounding) for nvfp4 only; the products checked here against the lab's casts."""
    from mptrain.model.families import build
    from mptrain.precision.policy import PrecisionPolicy

    cfg = make_cfg(f"precision={preset}")
    f = cfg.precision.fp4
    assert f.enabled and f.format.value == preset and not cfg.precision.fp8.enabled
    assert f.hadamard == f.stochastic_rounding == f.weight_2d == (preset == "nvfp4")
    assert cfg.precision.compute_dtype.value == "bfloat16"
    policy = PrecisionPolicy(precision_plan(cfg.precision), torch.device("cpu"))
    assert policy.autocast_enabled and policy.compute_dtype == torch.bfloat16
    torch.manual_seed(0)
    model = policy.convert_model(build(cfg.model, 320))
    layer = model.blocks[0].mlp.fc
    assert isinstance(layer, LabLinear)
    x = torch.randn(32, layer.in_features)
    w = layer.weight.detach()
    expected = fp4_round_trip(x, preset) @ fp4_round_trip(w, preset, two_d=two_d).t() + layer.bias.detach()
    assert torch.equal(layer(x).detach(), expected)  # fp32 in, autocast off: the casts' own values
    grads = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        xi = x.clone().requires_grad_()
        layer(xi).backward(torch.randn(32, layer.out_features, generator=torch.Generator().manual_seed(3)))
        grads.append(xi.grad)
    assert torch.equal(grads[0], grads[1]) != stochastic  # two seeds, two draws: only with stochastic rounding
