"""precision.fp8.matmul: the float8 casts are the run's own either way; only the
kernel that multiplies them changes (torch._scaled_mm, or the fp32 emulation).

Tolerance, stated once: the two kernels accumulate the same fp32 products in a
different order, and the bf16 outputs then round to the same value or to a
neighbour, one bf16 step (2^-8 relative) apart. So outputs and gradients agree
elementwise within 2^-7 of the tensor's largest magnitude, and a short run's
losses within 1e-3 relative.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from mptrain.core.errors import ConfigError
from mptrain.precision import support
from mptrain.precision.policy import PrecisionPolicy
from mptrain.precision.recipe import precision_plan

from .conftest import make_cfg, train

RECIPES = ["tensorwise", "rowwise", "rowwise_with_gw_hp", "delayed"]
CLOSE = 2.0 ** -7


def _no_scaled_mm(*args, **kwargs):
    raise AssertionError("the emulated path called torch._scaled_mm")


def _layer_step(recipe: str, matmul: str) -> tuple[list[torch.Tensor], PrecisionPolicy]:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(128, 256))
    x = torch.randn(64, 128, requires_grad=True)
    gy = torch.randn(64, 256)
    policy = PrecisionPolicy(precision_plan(make_cfg("precision=fp8", f"precision.fp8.recipe={recipe}",
                                                     f"precision.fp8.matmul={matmul}").precision), torch.device("cpu"))
    model = policy.convert_model(ref)
    with policy.autocast():
        y = model(x)
    y.float().backward(gy)
    return [y.detach().float(), x.grad, model[0].weight.grad], policy


@pytest.mark.parametrize("recipe", RECIPES)
def test_emulated_matmul_matches_scaled_mm_without_calling_it(recipe, monkeypatch):
    native, p_native = _layer_step(recipe, "scaled_mm")
    monkeypatch.setattr(torch, "_scaled_mm", _no_scaled_mm)
    emulated, p_emulated = _layer_step(recipe, "emulated")
    assert p_native.fp8.matmul == "scaled_mm" and p_emulated.fp8.matmul == "emulated"
    for name, a, b in zip(("output", "grad_input", "grad_weight"), native, emulated, strict=True):
        err = (a - b).abs().max().item() / a.abs().max().item()
        assert err <= CLOSE, (recipe, name, err)
    # rowwise_with_gw_hp keeps its weight gradient out of float8: that one is the same matmul
    if recipe == "rowwise_with_gw_hp":
        assert torch.equal(native[2], emulated[2])


def test_auto_follows_the_measurement_and_keeps_it_per_machine(monkeypatch, tmp_path):
    cpu = torch.device("cpu")
    # the measurement itself: three positive timings on this machine
    m = support.measure_fp8_matmul("cpu", n=64, reps=1)
    assert min(m.scaled_mm, m.emulated, m.fp32) > 0 and m.slowdown > 0
    slow = support.Fp8MatmulSpeed(256, scaled_mm=0.2, emulated=0.002, fp32=0.001)
    fast = support.Fp8MatmulSpeed(256, scaled_mm=0.003, emulated=0.004, fp32=0.001)
    monkeypatch.setenv("MPTRAIN_CACHE", str(tmp_path))  # a machine that has measured nothing yet
    support.kept_fp8_path.cache_clear()
    try:
        monkeypatch.setattr(support, "measure_fp8_matmul", lambda *a, **k: slow)
        path, why = support.choose_fp8_matmul("auto", cpu)
        assert path == "emulated" and "measured 100x the fp32 emulation's time at 256x256" in why
        kept = tmp_path / "kernels"
        assert [p.name.endswith("-256x256x256.json") for p in kept.iterdir()] == [True] and "kept in" in why
        # a later process whose timing says the other path (a busy host, the paths close) keeps the machine's
        # choice: the two accumulate in another order, and a resume or another rank must compute in the same bits
        monkeypatch.setattr(support, "measure_fp8_matmul", lambda *a, **k: fast)
        support.kept_fp8_path.cache_clear()
        assert support.choose_fp8_matmul("auto", cpu)[0] == "emulated"
        # each size is its own choice; deleting the files measures again
        assert support.choose_fp8_matmul("auto", cpu, (64, 32, 128))[0] == "scaled_mm"
        for p in kept.iterdir():
            p.unlink()
        support.kept_fp8_path.cache_clear()
        assert support.choose_fp8_matmul("auto", cpu)[0] == "scaled_mm"
    finally:
        support.kept_fp8_path.cache_clear()  # the session's runs take their own machine's choice again
    assert support.choose_fp8_matmul("emulated", cpu) == ("emulated", "precision.fp8.matmul=emulated")
    # on a GPU auto is the float8 tensor cores, never a CPU timing
    assert support.choose_fp8_matmul("auto", torch.device("cuda"))[0] == "scaled_mm"


def test_mx_recipes_map_the_setting_to_their_kernel():
    from mptrain.precision import fp8mx

    assert fp8mx.kernel("mxfp8", "cpu", "auto") == "EMULATED"
    assert fp8mx.matmul_path("mxfp8", "cpu", "emulated")[0] == "emulated"
    with pytest.raises(ConfigError, match="needs a Blackwell GPU"):
        PrecisionPolicy(precision_plan(make_cfg("precision=mxfp8", "precision.fp8.matmul=scaled_mm").precision),
                        torch.device("cpu"))
    assert "no emulated matmul" in fp8mx.problem("nvfp4", "cpu", "emulated")


def test_a_run_says_its_matmul_and_keeps_the_casts(tmp_path, monkeypatch):
    """Through the trainer: the cast statistics of step 1 (taken before any matmul
    of that step feeds a later layer's cast... except through the layers below)
    agree, and six steps' losses stay within 1e-3; the summary and the dtype
    table name the kernel."""
    common = ["precision=fp8", "train.max_steps=6", "train.global_batch_size=4"]
    s_native, r_native = train(tmp_path / "native", *common, "precision.fp8.matmul=scaled_mm")
    monkeypatch.setattr(torch, "_scaled_mm", _no_scaled_mm)
    s_emul, r_emul = train(tmp_path / "emulated", *common, "precision.fp8.matmul=emulated")
    assert s_native["fp8"]["matmul"] == "scaled_mm" and s_emul["fp8"]["matmul"] == "emulated"
    assert s_emul["dtypes"]["fp8_linears"].endswith("matmul emulated")
    for a, b in zip(r_native, r_emul, strict=True):
        assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-3)
    la, lb = s_native["fp8_casts"]["layers"], s_emul["fp8_casts"]["layers"]
    assert la.keys() == lb.keys()
    # The first layer's input and weight are cast before any matmul ran: identical.
    assert la["block0.attn.qkv"]["input"] == lb["block0.attn.qkv"]["input"]
    assert la["block0.attn.qkv"]["weight"] == lb["block0.attn.qkv"]["weight"]
    for layer in la:
        for op in la[layer]:
            a, b = la[layer][op], lb[layer][op]
            assert b["sqnr_db"] == pytest.approx(a["sqnr_db"], abs=0.1), (layer, op)
            assert b["amax"] == pytest.approx(a["amax"], rel=2e-2), (layer, op)
    assert "matmul emulated" in (tmp_path / "emulated" / "train.log").read_text()
