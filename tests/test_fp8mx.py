"""MXFP8 training through torchao (emulated on this CPU), and NVFP4's refusal where it cannot run."""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn

from mptrain.precision import fp8mx, lab
from mptrain.core.errors import ConfigError
from mptrain.precision.fp8casts import cast_counts, summarize
from mptrain.model.gpt import GPT, GPTShape
from mptrain.distributed.parallel import materialize

pytestmark = pytest.mark.skipif(fp8mx.problem("mxfp8", "cpu") is not None, reason="no MXFP8 training here")

SHAPE = GPTShape(vocab_size=256, n_layer=2, n_head=2, d_model=64, block_size=64, dropout=0.0, bias=True)
NANO_LINEARS = [f"blocks.{i}.{n}" for i in range(2) for n in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")]
SPEC = {"rceil": "e4m3/1x32/ue8m0-rceil/nearest", "floor": "e4m3/1x32/ue8m0/nearest"}
"""torchao's two MX scale rules as lab specs (``rceil``: the recipe mxfp8's)."""


@pytest.fixture(autouse=True)
def _one_thread():
    # The emulated casts are dozens of tiny ops; on a 2-core host shared with other
    # jobs, a second OpenMP thread makes each several times slower, not faster.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def no_head(mod: nn.Module, fqn: str) -> bool:
    return fqn != "lm_head"


def sqnr_db(ref: torch.Tensor, test: torch.Tensor) -> float:
    ref, test = ref.double(), test.double()
    return 10 * math.log10(ref.pow(2).sum().item() / (ref - test).pow(2).sum().item())


def test_mxfp8_trains_a_tiny_gpt_under_bf16_autocast():
    torch.manual_seed(0)
    model = GPT(SHAPE)
    keys = list(model.state_dict())
    report = fp8mx.convert(model, "mxfp8", "cpu", no_head)
    assert report["converted"] == NANO_LINEARS and report["excluded"] == {}
    assert report["kernel"] == "EMULATED" and report["block_size"] == 32 and report["scale_rounding"] == "rceil"
    assert type(model.blocks[0].mlp.fc).__name__ == "MXLinear" and type(model.lm_head) is nn.Linear
    # Checkpoints see plain fp32 tensors under nn.Linear's keys, as with any other precision.
    sd = model.state_dict()
    assert list(sd) == keys and all(type(v) is torch.Tensor and v.dtype == torch.float32 for v in sd.values())

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    idx, tgt = torch.randint(0, 256, (2, 64)), torch.randint(0, 256, (2, 64))
    losses = []
    for step in range(10):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits, loss = model(idx, tgt)
        loss.backward()
        if step == 0:
            fc = model.blocks[0].mlp.fc
            assert fc(torch.zeros(64, 64)).dtype == torch.float32  # fp32 outside autocast
            assert logits.dtype == torch.bfloat16
            # torchao's own quantize_ path drops linear biases; these must learn
            assert all(model.get_submodule(n).bias.grad.abs().sum() > 0 for n in NANO_LINEARS)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.8, losses


def mx_roundtrip(t: torch.Tensor, rounding: str) -> torch.Tensor:
    """Quantize-dequantize ``t`` in blocks of 32 along its last dimension, with the lab's cast."""
    return lab.fake_quantize(t, lab.parse(SPEC[rounding]))


@pytest.mark.parametrize("rounding", ["rceil", "floor"])
def test_mx_linear_is_three_matmuls_blocked_along_their_contraction(rounding):
    """The converted layer's output and both gradients equal matmuls of operands
    cast as the lab's MX specs say along the axes the module docstring names."""
    torch.manual_seed(0)
    x = torch.randn(64, 128) * torch.exp(torch.randn(128))  # tokens x in, channels of differing scale
    x[3, 5] = 80.0
    gy = torch.randn(64, 96)
    lin = nn.Linear(128, 96)
    model = nn.Sequential(lin)
    w, b = lin.weight.detach().clone(), lin.bias.detach().clone()
    fp8mx.convert(model, "mxfp8", "cpu", mx_rounding=rounding)
    xi = x.clone().requires_grad_()
    y = model(xi)
    y.backward(gy)

    q = lambda t: mx_roundtrip(t.contiguous(), rounding)  # noqa: E731
    close = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y, q(x) @ q(w).t() + b, **close)                 # along in_features
    torch.testing.assert_close(xi.grad, q(gy) @ q(w.t()).t(), **close)           # along out_features
    torch.testing.assert_close(lin.weight.grad, q(gy.t()) @ q(x.t()).t(), **close)  # along tokens
    torch.testing.assert_close(lin.bias.grad, gy.sum(0))
    # blocks along features instead of tokens would give another weight gradient
    assert not torch.allclose(lin.weight.grad, q(gy).t() @ q(x), **close)


@pytest.mark.parametrize("rounding", ["rceil", "floor"])
def test_torchao_mx_cast_equals_the_cast_statistics(rounding):
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import MXTensor

    g = torch.Generator().manual_seed(1)
    t = torch.randn(64, 256, generator=g)
    rows, cols = torch.randint(0, 64, (6,), generator=g), torch.randint(0, 256, (6,), generator=g)
    t[rows, cols] = 200.0 * torch.rand(6, generator=g) + 20  # outliers of assorted sizes
    mx = MXTensor.to_mx(t, torch.float8_e4m3fn, 32, scaling_mode=ScaleCalculationMode(rounding))
    back = mx.dequantize(torch.float32)
    ours = summarize(*cast_counts(t, lab.parse(SPEC[rounding])))
    assert ours["sqnr_db"] == pytest.approx(sqnr_db(t, back), rel=1e-9)
    ao_scale = mx.scale.float()  # E8M0: what torchao multiplies the elements by to dequantize
    assert ours["scale_max"] == pytest.approx(1 / ao_scale.min().item(), rel=1e-9)
    assert ours["scale_min"] == pytest.approx(1 / ao_scale.max().item(), rel=1e-9)
    other = summarize(*cast_counts(t, lab.parse(SPEC["floor" if rounding == "rceil" else "rceil"])))
    assert abs(other["sqnr_db"] - ours["sqnr_db"]) > 0.05  # the two rules really differ on this tensor


def test_mx_linear_sqnr_against_tensorwise_float8():
    """A 128->256 linear (GPT's N(0, 0.02) weights) on activations with
    differing channel scales and a few outliers, against fp32. Both cast
    activations and weights to E4M3, whose range is wide enough that one scale
    per tensor loses almost nothing, so the output is about as accurate: up to
    about 0.5 dB below tensorwise (0.5 here), since tensorwise puts the tensor's
    largest value exactly on 448 and MX rounds each block's largest like any
    other element. MXFP8 gains in the backward: E4M3 gradients in blocks,
    where tensorwise needs E5M2 for their range (+3.5 to 4.5 dB here)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 128, generator=g) * torch.exp(0.5 * torch.randn(128, generator=g))
    rows, cols = torch.randperm(256, generator=g)[:4], torch.randint(0, 128, (4,), generator=g)
    x[rows, cols] = 30 * (1 + torch.rand(4, generator=g))
    gy = torch.randn(256, 256, generator=g) * 10 ** (-2 * torch.rand(256, 1, generator=g))  # tokens' grads differ
    ref = nn.Sequential(nn.Linear(128, 256))
    with torch.no_grad():
        ref[0].weight.normal_(0.0, 0.02, generator=g)
        ref[0].bias.zero_()
    xr = x.clone().requires_grad_()
    y_ref = ref(xr)
    y_ref.backward(gy)

    def sqnrs(convert) -> list[float]:
        m = copy.deepcopy(ref)
        m.zero_grad()
        convert(m)
        xi = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = m(xi)
        y.float().backward(gy)
        return [sqnr_db(y_ref, y.float()), sqnr_db(xr.grad, xi.grad), sqnr_db(ref[0].weight.grad, m[0].weight.grad)]

    mx = sqnrs(lambda m: fp8mx.convert(m, "mxfp8", "cpu"))
    tw = sqnrs(lambda m: convert_to_float8_training(m, config=Float8LinearConfig.from_recipe_name("tensorwise")))
    assert mx[0] >= tw[0] - 1.0 and mx[0] < 35, (mx, tw)  # output: about as accurate, and really low precision
    assert mx[1] >= tw[1] + 2 and mx[2] >= tw[2] + 2, (mx, tw)  # input and weight gradients


def test_meta_device_convert_then_materialize_and_token_blocks():
    with torch.device("meta"):
        model = GPT(SHAPE)
    report = fp8mx.convert(model, "mxfp8", "cpu", no_head)
    assert report["converted"] == NANO_LINEARS and model.blocks[0].attn.qkv.weight.is_meta
    materialize(model, torch.device("cpu"), seed=0)
    ref = GPT(SHAPE)
    ref.reset_parameters(torch.Generator().manual_seed(0))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref.state_dict().values(), strict=True))
    idx = torch.randint(0, 256, (1, 20))  # 20 tokens: no block of 32 along tokens for the weight gradient
    with torch.no_grad():
        model(idx)  # sampling and evaluation are not limited
    with pytest.raises(RuntimeError, match="multiple of 32"):
        model(idx)


def test_nvfp4_here_and_refusals():
    why = fp8mx.problem("nvfp4", "cpu")
    if why is None:  # a machine where torchao's NVFP4 training runs: train a little
        model = GPT(GPTShape(256, 1, 2, 128, 128, 0.0, True))
        assert fp8mx.convert(model, "nvfp4", "cpu", no_head)["converted"]
        idx = torch.randint(0, 256, (1, 128))
        model(idx, idx)[1].backward()
    else:
        assert why.endswith(".") and "Blackwell" in why and "mxfp8" in why, why
        with pytest.raises(ConfigError, match="nvfp4 training cannot run"):
            fp8mx.convert(nn.Sequential(nn.Linear(128, 128)), "nvfp4", "cpu")
    assert fp8mx.problem("mxfp8", "cpu") is None
    # the trial a Blackwell GPU gets before a yes, run here: it passes emulated, leaves the RNG alone,
    # and turns a kernel failure into a sentence
    rng = torch.random.get_rng_state()
    assert fp8mx._trial("mxfp8", torch.device("cpu")) is None and torch.equal(rng, torch.random.get_rng_state())
    assert "nvfp4 test matmul failed" in fp8mx._trial("nvfp4", torch.device("cpu"))
    assert "one of mxfp8, nvfp4" in fp8mx.problem("mxfp4", "cpu")
    with pytest.raises(ConfigError, match="mx_rounding"):
        fp8mx.convert(nn.Sequential(nn.Linear(64, 64)), "mxfp8", "cpu", mx_rounding="even")
    odd = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 64))
    report = fp8mx.convert(odd, "mxfp8", "cpu")
    assert report["converted"] == [] and "not multiples of 32" in report["excluded"]["0"]
