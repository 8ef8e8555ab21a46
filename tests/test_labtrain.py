"""Training through the format lab (mptrain/precision/labtrain.py, precision=lab): every named
recipe converts a model and yields finite gradients; each of a layer's three matmuls is its
definition on lab-quantized operands (float8 tensorwise against torchao's own dequantization,
MX with weight tiles, the MXFP8/NVFP4 hybrid with its stochastic draws); Hadamard transforms
share one sign vector per matmul; precision=lab trains, says every operand's spec and audits
clean; precision=lab's nvfp4 and mxfp4 train bit for bit as precision=nvfp4 and mxfp4 (one
implementation); its float8 recipes cast as torchao's emulated float8 linears; bad specs are
one-sentence errors before any work. The 4-bit specifics (unbiased stochastic rounding, resume
with the draws) are test_fp4train.py's; the casts themselves test_lab.py's."""
from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
import torch.nn as nn
import yaml

from mptrain.core.errors import ConfigError
from mptrain.model.families import build
from mptrain.precision import lab
from mptrain.plan.build import build_plan
from mptrain.precision.labtrain import LabLinear, LabLinears, with_specs
from mptrain.precision.recipe import NAMED, build_recipe, fp4_recipe, lab_recipe, rules_of

from .aids import without_wall_clock
from .conftest import make_cfg, run_cli, train

FP32_REST = ["precision.compute_dtype=fp32", "precision.param_dtype=fp32"]  # fast on CPUs without native bf16
# The MXFP8 recipe with its weights in 32x32 tiles (one scale per tile, the same tiles both ways).
MX_TILES = {r: "e4m3/32x32/ue8m0-rceil/nearest" for r in ("fwd_weight", "dgrad_weight")}


def _layer(recipe, n_in: int = 64, n_out: int = 32) -> LabLinear:
    torch.manual_seed(0)
    return LabLinear.from_linear(nn.Linear(n_in, n_out), recipe)


@pytest.fixture(scope="module")
def tiny_model():
    cfg = make_cfg("precision=lab", *FP32_REST)
    torch.manual_seed(0)
    return cfg, build(cfg.model, 320)


@pytest.mark.parametrize("name", list(NAMED))
def test_every_named_recipe_converts_a_model_and_has_gradients(tiny_model, name):
    """Converted as a run converts it (block 0's four linears; block 1 and the head kept),
    one forward and backward on 64 tokens: a finite loss, and every converted weight's
    gradient finite and not zero. DeepSeek-V3's blocks of 128 fit none of a 64-wide
    model's linears: each stays out, saying why."""
    cfg, base = tiny_model
    model = copy.deepcopy(base)
    linears = LabLinears(build_recipe(name), rules_of(cfg.precision))
    linears.convert(model)
    if name in ("block1x128", "block128x128"):
        assert linears.report["converted"] == []
        assert "in multiples of 128" in linears.report["excluded"]["blocks.0.attn.qkv"]
        return
    assert linears.report["converted"] == ["blocks.0.attn.qkv", "blocks.0.attn.proj", "blocks.0.mlp.fc",
                                           "blocks.0.mlp.proj"]
    assert linears.report["operands"] == NAMED[name]
    idx = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(2)
    _, loss = model(idx, idx)
    loss.backward()
    assert torch.isfinite(loss)
    for fqn in linears.report["converted"]:
        g = model.get_submodule(fqn).weight.grad
        assert bool(torch.isfinite(g).all()) and float(g.abs().max()) > 0, (name, fqn)


def test_none_operands_are_left_exact():
    """A custom recipe whose forward operands are ``none`` multiplies the layer's own
    values: the forward is x W^T + b exactly, while the backward still quantizes."""
    specs = {**NAMED["mxfp4"], "fwd_input": "none", "fwd_weight": "none"}
    layer = _layer(build_recipe("custom", specs))
    x = torch.randn(64, 64, requires_grad=True)
    y = layer(x)
    assert torch.equal(y.detach(), x.detach() @ layer.weight.detach().t() + layer.bias.detach())
    g = torch.randn(64, 32)
    y.backward(g)
    assert not torch.equal(x.grad, g @ layer.weight.detach())  # the input gradient's operands are E2M1


def _torchao_dequantized(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """torchao's tensorwise float8 cast of ``t``, dequantized its way (values / scale)."""
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig

    return hp_tensor_to_float8_dynamic(t, dtype, LinearMMConfig()).to_original_precision()


def _operand(x: torch.Tensor, op, signs=None) -> torch.Tensor:
    """One operand as its definition says: torchao's dequantized cast for an fp32 tensor
    scale (the torchao recipe the lab's float8 tensorwise reproduces), else the lab's
    round trip."""
    if op.scale.kind == "fp32":
        assert op.block_name == "tensor"
        return _torchao_dequantized(x, torch.float8_e4m3fn if op.element.name == "e4m3" else torch.float8_e5m2)
    return lab.fake_quantize(x, op, signs=signs)


@pytest.mark.parametrize("recipe", ["tensorwise", "mxfp8_tiles", "hybrid_mxfp8_nvfp4"])
def test_each_matmul_is_its_definition_on_quantized_operands(recipe):
    """Forward, input gradient and weight gradient of a layer equal the three products of
    the operands cast as the recipe says, each blocked along its product's contraction
    dimension, exactly. The hybrid's stochastic output gradients draw from the default
    generator, the input gradient's first: the same seed and order repeat them.
    (test_fp4train.py's first test does this for nvfp4 and mxfp4.)"""
    r = with_specs(build_recipe("mxfp8"), **MX_TILES) if recipe == "mxfp8_tiles" else build_recipe(recipe)
    layer = _layer(r)
    x = torch.randn(64, 64, requires_grad=True)
    g = torch.randn(64, 32)
    y = layer(x)
    torch.manual_seed(5)
    y.backward(g)
    w, xd = layer.weight.detach(), x.detach()
    assert torch.equal(y.detach(), _operand(xd, r.op("fwd_input")) @ _operand(w, r.op("fwd_weight")).t()
                       + layer.bias.detach())
    torch.manual_seed(5)
    wd = r.op("dgrad_weight")
    w_dgrad = _operand(w, wd) if wd.block[0] == wd.block[1] else _operand(w.t().contiguous(), wd).t()
    assert torch.equal(x.grad, _operand(g, r.op("dgrad_grad_output")) @ w_dgrad)
    a_op, b_op = r.op("wgrad_grad_output"), r.op("wgrad_input")
    signs = lab.fixed_signs(g.device) if a_op.transform else None
    dw = _operand(g.t().contiguous(), a_op, signs) @ _operand(xd.t().contiguous(), b_op, signs).t()
    assert torch.equal(layer.weight.grad, dw)
    exact = g.t() @ xd
    rel = float((layer.weight.grad - exact).norm() / exact.norm())
    assert 0 < rel < (0.5 if "nvfp4" in recipe else 0.1), rel  # an approximation of the real product


def _wgrad(recipe, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    layer = _layer(recipe)
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(3), requires_grad=True)
    g = torch.randn(64, 32, generator=torch.Generator().manual_seed(4))
    torch.manual_seed(seed)
    layer(x).backward(g)
    return layer.weight.grad, g, x.detach()


def test_random_hadamard_shares_one_draw_per_matmul_and_plain_is_deterministic():
    """hadamard-random: each backward draws one 16-sign vector from the default generator
    and transforms both weight-gradient operands with it (the product is then the exact
    one's approximation; two vectors would scramble it), so a seed repeats it and another
    seed changes it. hadamard-plain draws nothing."""
    base = with_specs(build_recipe("nvfp4"), dgrad_grad_output="e2m1/1x16/e4m3/nearest")
    rand = with_specs(base, wgrad_grad_output="e2m1/1x16/e4m3/nearest/hadamard-random",
                      wgrad_input="e2m1/1x16/e4m3/nearest/hadamard-random")
    dw, g, x = _wgrad(rand, seed=7)
    torch.manual_seed(7)
    signs = lab.random_signs(lab.HADAMARD_SIZE)
    a_op, b_op = rand.op("wgrad_grad_output"), rand.op("wgrad_input")
    expected = (lab.fake_quantize(g.t().contiguous(), a_op, signs=signs)
                @ lab.fake_quantize(x.t().contiguous(), b_op, signs=signs).t())
    assert torch.equal(dw, expected)
    exact = g.t() @ x
    assert float((dw - exact).norm() / exact.norm()) < 0.5
    assert torch.equal(_wgrad(rand, seed=7)[0], dw)
    assert not torch.equal(_wgrad(rand, seed=8)[0], dw)
    plain = with_specs(base, wgrad_grad_output="e2m1/1x16/e4m3/nearest/hadamard-plain",
                       wgrad_input="e2m1/1x16/e4m3/nearest/hadamard-plain")
    dp = _wgrad(plain, seed=7)[0]
    assert torch.equal(dp, _wgrad(plain, seed=8)[0])
    assert torch.equal(dp, lab.fake_quantize(g.t().contiguous(), plain.op("wgrad_grad_output"), signs=None)
                       @ lab.fake_quantize(x.t().contiguous(), plain.op("wgrad_input"), signs=None).t())


def test_random_hadamard_shares_one_draw_in_the_forward_and_input_gradient_matmuls_too():
    """The same rule for the other two matmuls: with hadamard-random on both operands of the
    forward and of the input-gradient matmul (E4M3, so the casts themselves err ~3%), the
    output and the input gradient stay close to the exact products. Two independent draws
    would scramble them (a relative error near 1.4)."""
    spec = "e4m3/1x16/e4m3/nearest/hadamard-random"
    r = build_recipe("custom", {"fwd_input": spec, "fwd_weight": spec, "dgrad_grad_output": spec,
                                "dgrad_weight": spec, "wgrad_grad_output": "none", "wgrad_input": "none"})
    torch.manual_seed(0)
    layer = LabLinear.from_linear(nn.Linear(64, 32, bias=False), r)
    x = torch.randn(32, 64, requires_grad=True)
    g = torch.randn(32, 32)
    y = layer(x)
    y.backward(g)
    w = layer.weight.detach()
    for got, exact in ((y.detach(), x.detach() @ w.t()), (x.grad, g @ w)):
        assert float((got - exact).norm() / exact.norm()) < 0.1


@pytest.mark.parametrize("name", ["tensorwise", "rowwise"])
def test_float8_recipes_are_torchaos_emulated_linears(name):
    """The lab's float8 recipes against torchao's Float8Linear with its emulated matmul
    (what precision=fp8 precision.fp8.matmul=emulated runs): torchao dequantizes the float8
    values (values / scale) and multiplies them in fp32, as the lab does, so the three
    products agree. The operands are equal exactly (above, and test_lab.py's casts); the
    products are compared to fp32 rounding here because the weight gradient's operands
    are laid out differently for the two fp32 matmuls (a kernel may then sum in another
    order). On the 2-core AMD EPYC dev VM they are bit for bit equal, and so are whole runs
    (docs/fp4.md)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    cfg = Float8LinearConfig.from_recipe_name(name)
    if name == "tensorwise":  # precision=fp8's E5M2 output gradients (precision.fp8.grad_dtype)
        e5m2 = {k: dataclasses.replace(getattr(cfg, k), target_dtype=torch.float8_e5m2)
                for k in ("cast_config_grad_output", "cast_config_grad_output_for_grad_weight")}
        cfg = dataclasses.replace(cfg, **e5m2)
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(64, 256))
    ao = convert_to_float8_training(copy.deepcopy(base), config=dataclasses.replace(cfg, emulate=True))
    ours_layer = LabLinear.from_linear(copy.deepcopy(base)[0], build_recipe(name))
    x, g = torch.randn(128, 64), torch.randn(128, 256)
    got = []
    for m, w in ((ao, ao[0].weight), (ours_layer, ours_layer.weight)):
        xi = x.clone().requires_grad_()
        y = m(xi)
        y.backward(g)
        got.append((y.detach(), xi.grad, w.grad))
    for a, b in zip(*got, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)


# --- through the trainer ----------------------------------------------------------------
SR = "e2m1/1x32/ue8m0/stochastic"
LAB_MXFP4_SR = ["precision=lab", "precision.lab.recipe=mxfp4", f"precision.lab.dgrad_grad_output={SR}",
                f"precision.lab.wgrad_grad_output={SR}"]
"""precision=lab's mxfp4 with stochastic output gradients: precision=mxfp4
precision.fp4.stochastic_rounding=true as lab keys."""
RUN = [*FP32_REST, "train.max_steps=8", "monitor.enabled=false"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """precision=lab's nvfp4 and mxfp4 (stochastic) recipes and the 4-bit presets, the rest
    of the model in fp32, 8 steps each, the lab's nvfp4 audited at step 1."""
    out = {}
    for name, overrides in (("lab-nvfp4", ["precision=lab", "precision.lab.recipe=nvfp4", "train.audit=true"]),
                            ("nvfp4", ["precision=nvfp4"]),
                            ("lab-mxfp4", LAB_MXFP4_SR),
                            ("mxfp4", ["precision=mxfp4", "precision.fp4.stochastic_rounding=true"])):
        run = tmp_path_factory.mktemp(name) / "run"
        s, rows = train(run, *overrides, *RUN)
        out[name] = (run, s, [r["train/loss"] for r in rows if "train/loss" in r], rows)
    return out


def test_a_lab_run_learns_and_says_every_operand(runs):
    run, s, losses, _ = runs["lab-nvfp4"]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.3
    key = "lab" if "lab" in s else "fp4"  # precision=lab's own key since 615e32c; fp4 before it
    r = s[key]
    assert r["recipe"] == "nvfp4" and r["operands"] == NAMED["nvfp4"] and r["matmul"] == "emulated"
    assert r["converted"] == ["blocks.0.attn.qkv", "blocks.0.attn.proj", "blocks.0.mlp.fc", "blocks.0.mlp.proj"]
    info = yaml.safe_load((run / "config.yaml").read_text())["run_info"]
    assert info[key]["operands"] == NAMED["nvfp4"] and "fp8" not in info
    banner = (run / "train.log").read_text()  # the banner names each operand's spec
    for spec in set(NAMED["nvfp4"].values()):
        assert spec in r["forward"] + r["backward"]
    assert f"{key}: 4 linears converted (" in banner and f"{r['forward']}; {r['backward']})" in banner
    assert info["dtypes"][f"{key}_linears"].startswith("nvfp4: forward E2M1, backward E2M1")
    audit = json.loads((run / "audit.json").read_text())
    assert audit["modules"]["blocks.0.mlp.fc"]["matmul"] == "e2m1 (nvfp4, fp32 products)"
    assert audit["modules"]["blocks.1.mlp.fc"]["matmul"] != audit["modules"]["blocks.0.mlp.fc"]["matmul"]
    assert not audit["flags"], audit["flags"]


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_the_4bit_presets_are_the_labs_named_recipes(runs, fmt):
    """One implementation: precision=nvfp4 (mxfp4, its stochastic switch on) and precision=lab
    with the named recipe (and the same specs) build the same recipe and train bit for bit
    alike, stochastic draws included."""
    lab_keys = ["precision=lab", "precision.lab.recipe=nvfp4"] if fmt == "nvfp4" else LAB_MXFP4_SR
    preset = [f"precision={fmt}"] + ([] if fmt == "nvfp4" else ["precision.fp4.stochastic_rounding=true"])
    assert lab_recipe(make_cfg(*lab_keys).precision.lab).ops == fp4_recipe(make_cfg(*preset).precision.fp4).ops
    lab_losses, preset_losses = runs[f"lab-{fmt}"][2], runs[fmt][2]
    assert lab_losses == preset_losses and len(set(lab_losses)) > 4


# --- bad input ----------------------------------------------------------------------------
L = "precision.lab."
BAD = [
    ([f"{L}fwd_input=e2m1/1x16/e4m3"], r"has 3 part\(s\)"),
    ([f"{L}fwd_input=e5m3/1x32/ue8m0/nearest"], "has 9 bits"),
    ([f"{L}fwd_input=e4m3/1x48/ue8m0/nearest"], "contraction dimension in multiples of 48"),
    (["model.block_size=24", "train.global_batch_size=1"], "is 24"),  # nvfp4's 1x16 along 24 tokens
    ([f"{L}fwd_input=e4m3/1x32/e2m1/nearest"], "cannot hold the scales"),
    ([f"{L}fwd_input=e2m1/1x16/e4m3/stochastic"], "rounds a forward operand stochastically"),
    ([f"{L}recipe=custom", f"{L}fwd_input=e2m1/1x16/e4m3/nearest"], "recipe=custom needs every operand"),
    ([f"{L}wgrad_input=e2m1/1x16/e4m3/nearest"], "only when both operands take the same one"),
    # the lab's float8 recipes took the presets' names (one name for a recipe everywhere)
    ([f"{L}recipe=fp8_rowwise"], r"precision.lab.recipe=fp8_rowwise is now called rowwise.*recipe=rowwise\.$"),
]


@pytest.mark.parametrize("overrides,match", BAD)
def test_bad_specs_are_one_sentence(overrides, match):
    with pytest.raises(ConfigError, match=match) as e:
        build_plan(make_cfg("precision=lab", *overrides))
    msg = str(e.value)
    assert "\n" not in msg and msg.endswith((".", ")")), msg


def test_stochastic_forward_is_allowed_when_asked():
    build_plan(make_cfg("precision=lab", f"{L}fwd_input=e2m1/1x16/e4m3/stochastic", f"{L}allow_forward_stochastic=true"))


def test_a_bad_spec_exits_2_before_any_work(tmp_path):
    """As a user types it: exit 2, one line, and no run directory (so no checkpoint)."""
    run = tmp_path / "run"
    r = run_cli("model=gpt-nano", "data.tokenizer=byte", "precision=lab", f"{L}fwd_weight=e4m3/1x32/e2m1/nearest",
                f"hydra.run.dir={run}", cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().count("\n") == 0 and "precision.lab.fwd_weight" in r.stderr, r.stderr
    assert not run.exists() and list(tmp_path.iterdir()) == []


def test_resume_is_exact_with_a_stochastic_lab_recipe(runs, tmp_path):
    """precision=lab's mxfp4 with stochastic output gradients, stopped at step 4 and
    resumed, repeats the straight run (the fixture's) bit for bit: the draws come from
    the default generator, which the checkpoint saves (test_fp4train.py shows for nvfp4
    that other draws would change the losses)."""
    train(tmp_path / "run", *LAB_MXFP4_SR, *RUN, "train.stop_after=4")
    s, resumed = train(tmp_path / "run", *LAB_MXFP4_SR, *RUN)
    assert s["resumed_from"].endswith("step-4")
    assert without_wall_clock(resumed) == without_wall_clock(runs["lab-mxfp4"][3])
