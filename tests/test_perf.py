"""FLOPs per token, the device peak table, MFU (the memory estimator: tests/test_memory.py)."""
from __future__ import annotations

import pytest
import torch

from mptrain.model.gpt import GPT, GPTShape
from mptrain.observe.perf import PEAK_TFLOPS, device_key, flops_per_token, matmul_kind, peak_flops

from .aids import param_count
from .conftest import train


def test_flops_formula_against_a_hand_count():
    s = GPTShape(vocab_size=8, n_layer=1, n_head=1, d_model=4, block_size=2)
    m = GPT(s)
    # by hand: block = 12*d^2 weights + 9d linear biases + 2d LN biases + 2d LN weights = 192+36+8+8 = 244;
    # wte 8*4 = 32 (tied head, counted once); ln_f 2*4 = 8; wpe 2*4 = 8 is left out of N.
    assert m.num_params() == 244 + 32 + 8 == 284
    assert param_count(1, 4, 8, 2) == 284 + 8  # the estimator's count includes wpe
    # 6N + 12 * layers * d * T = 6*284 + 12*1*4*2
    assert flops_per_token(m.num_params(), 1, 4, 2) == 1704 + 96


def test_flops_formula_against_torch_flop_counter():
    """The formula vs the matmul FLOPs torch counts for a real forward+backward."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    s = GPTShape(vocab_size=512, n_layer=2, n_head=4, d_model=128, block_size=64)
    m = GPT(s)
    x = torch.randint(0, 512, (2, 64))
    # the math backend spells attention as bmm, which the counter sees (the fused CPU kernel it does not)
    with FlopCounterMode(display=False) as fc, sdpa_kernel(SDPBackend.MATH):
        _, loss = m(x, x)
        loss.backward()
    counted = fc.get_total_flops() / x.numel()
    formula = flops_per_token(m.num_params(), 2, 128, 64)
    # the formula also counts bias and norm parameters as if they were matmul weights (~1%)
    assert counted == pytest.approx(formula, rel=0.03), (counted, formula)


@pytest.mark.parametrize("name,key", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM"), ("NVIDIA H100 PCIe", "H100 PCIe"), ("NVIDIA H200", "H200"),
    ("NVIDIA A100-SXM4-80GB", "A100"), ("Tesla V100-SXM2-16GB", "V100"), ("NVIDIA L40S", "L40S"),
    ("NVIDIA L4", "L4"), ("NVIDIA B200", "B200"), ("NVIDIA GeForce RTX 3090", None), ("cpu", None),
])
def test_peak_table_lookup(name, key):
    assert device_key(name) == key


def test_peaks_and_kinds():
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989.4e12
    assert peak_flops("NVIDIA H200", "fp8") == 1978.9e12
    assert peak_flops("Tesla V100-SXM2-16GB", "bf16") is None  # V100 has no bf16 tensor cores
    assert peak_flops("cpu", "fp32") is None and peak_flops("cpu", "fp32", override_tflops=2.0) == 2e12
    assert matmul_kind("bf16", fp8=True, tf32=False) == "fp8"
    assert matmul_kind("fp32", fp8=False, tf32=True) == "tf32"
    for dev in ("V100", "A100", "H100 SXM", "H100 PCIe", "H200", "B200", "L40S"):
        assert dev in PEAK_TFLOPS


def test_mfu_logged_when_the_peak_is_known(tmp_path):
    s, rows = train(tmp_path / "run", "train.max_steps=3", "train.peak_tflops=0.5")
    for r in rows:
        assert r["perf/mfu"] == pytest.approx(r["perf/tokens_per_s"] * s["flops_per_token"] / 0.5e12)
    assert s["mem/estimate_gib"] > 0 and "mem/peak_rss_gib" in s


def _fake_speeds(**slower: float):
    """A matmul_seconds stand-in: fp32 at 1 ms, the named kinds that many times slower
    (the real probe is timing, which differs by CPU; the rule around it is what is tested)."""
    def seconds(device_str, m, k, n, reps=3, kinds=()):
        return {kind: 1e-3 * slower.get(kind, 1.0) for kind in kinds}
    return seconds


def test_banner_predicts_a_slow_run_and_names_the_faster_one(tmp_path, monkeypatch, capsys):
    from mptrain.observe import perf

    monkeypatch.setattr(perf, "matmul_seconds", _fake_speeds(bf16=40.0))
    train(tmp_path / "bf16", "precision=bf16", "train.max_steps=2")
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if "predicted" in ln)
    assert line.startswith("WARNING: this run's matmuls are predicted 40x slower than fp32's here")
    assert "bf16 matmuls measured 40x fp32's time" in line and "for 2 steps" in line
    assert line.endswith("Faster: precision=fp32.")
    # float8 whose torch._scaled_mm is the slow part: the same casts, emulated, come first
    monkeypatch.setattr(perf, "matmul_seconds", _fake_speeds(fp8_scaled_mm=400.0))
    train(tmp_path / "fp8", "precision=fp8", "precision.fp8.matmul=scaled_mm", "train.max_steps=1")
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "predicted" in ln)
    assert "float8 torch._scaled_mm matmuls measured 400x" in line
    assert "Faster: precision.fp8.matmul=emulated (the same float8 casts), or precision=fp32." in line
    # fp32, and a half precision as fast as fp32: no prediction at all
    monkeypatch.setattr(perf, "matmul_seconds", _fake_speeds())
    for p in ("fp32", "bf16"):
        train(tmp_path / p / "again", f"precision={p}", "train.max_steps=1")
        assert "predicted" not in capsys.readouterr().out


def test_pace_weights_each_dtype_by_its_flops(monkeypatch):
    from mptrain.observe import perf

    monkeypatch.setattr(perf, "matmul_seconds", _fake_speeds(bf16=10.0))
    p = perf.predict_pace("cpu", {"bf16": 3.0, "fp8_emulated": 1.0}, 512, 64)
    assert p.slowdown == pytest.approx((3 * 10 + 1) / 4)
    assert p.fp32_seconds_per_token == pytest.approx(4.0 / (2 * 512 * 64 * 256 / 1e-3))
    assert "bf16 matmuls measured 10x" in p.slowest
