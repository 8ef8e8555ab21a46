"""A mixture's experts under recipes blocked along the tokens (mxfp8, nvfp4, mxfp4, the
lab's block recipes): each expert's tokens padded with zero rows to its converted linears'
``token_multiple``, the padded outputs dropped (``mptrain/model/moe.py``, ``_padded``).

What is checked: such runs train, close to bf16; the padding is exact where it can be
(the real rows' outputs and the weight gradient bit for bit those of the same tokens in a
longer batch whose blocks align the same way, zero rows adding exactly nothing); with a
Hadamard transform along the tokens, exact in exact arithmetic only (the transform spreads
the real rows over the padded ones, and the cast then rounds the mixed values); and one
expert's outlier leaves every other expert's casts and results unchanged."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from mptrain.model.moe import MoEFeedForward, MoEShape, token_multiple
from mptrain.precision import lab
from mptrain.precision.fp8mx import MX_BLOCK, problem
from mptrain.precision.labtrain import LabLinear
from mptrain.precision.recipe import NAMED, build_recipe

from .conftest import train

NANO = ["model=moe-nano", "monitor.enabled=false", "train.threads=1", "train.max_steps=2"]
MX = problem("mxfp8", "cpu") is None
needs_mx = pytest.mark.skipif(not MX, reason="torchao's MXFP8 training linear is not importable here")


def _mx_linear(lin: nn.Linear) -> nn.Module:
    """``lin`` as precision=mxfp8 converts it (torchao's emulated MX matmul), sharing its weight."""
    from mptrain.precision.fp8mx import convert

    holder = nn.Sequential(lin)
    convert(holder, "mxfp8", "cpu", matmul="emulated")
    return holder[0]


def _lab_linear(lin: nn.Linear, name: str) -> LabLinear:
    return LabLinear.from_linear(lin, build_recipe(name))


# ------------------------------------------------------------------ (a) every block recipe trains
@pytest.mark.parametrize("precision", [["precision=mxfp8"], ["precision=nvfp4"],
                                       ["precision=lab", "precision.lab.recipe=mxfp4",
                                        "precision.lab.bf16_last_blocks=0"]],
                         ids=["mxfp8", "nvfp4", "lab-mxfp4"])
def test_a_block_recipe_trains_the_experts_close_to_bf16(tmp_path, precision):
    """Once refused for model.family=moe; now each expert pads its tokens, and two steps'
    losses are finite and within the formats' reach of bf16's (same seed, same data)."""
    if precision == ["precision=mxfp8"] and not MX:
        pytest.skip("torchao's MXFP8 training linear is not importable here")
    _, ref = train(tmp_path / "bf16", *NANO, "precision=bf16")
    _, rows = train(tmp_path / "run", *NANO, *precision)
    got, want = [r["train/loss"] for r in rows], [r["train/loss"] for r in ref]
    assert len(got) == len(want) == 2 and all(math.isfinite(v) for v in got)
    assert got == pytest.approx(want, abs=0.05)


def test_the_converted_linears_say_what_their_tokens_must_be_a_multiple_of():
    """The precision layer marks what it converts; the model reads the mark (plain: 1)."""
    lin = nn.Linear(64, 32, bias=False)
    assert token_multiple(nn.Sequential(lin)) == 1
    assert _lab_linear(lin, "tensorwise").token_multiple == 1  # one scale per tensor: nothing of the tokens
    assert _lab_linear(lin, "rowwise").token_multiple == 1
    assert _lab_linear(lin, "mxfp4").token_multiple == 32
    assert _lab_linear(lin, "nvfp4").token_multiple == 16  # 1x16 blocks after a 16-token Hadamard transform
    assert token_multiple(nn.Sequential(_lab_linear(lin, "nvfp4"), _lab_linear(lin, "mxfp4"))) == 32
    if MX:
        assert _mx_linear(nn.Linear(64, 32, bias=False)).token_multiple == MX_BLOCK


# ------------------------------------------------------------------ (b) the padding is exact where it can be
def _run(layer: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``layer``'s output, input gradient and weight gradient on ``x`` with upstream ``dy``."""
    layer.zero_grad()
    x = x.detach().requires_grad_(True)
    y = layer(x)
    y.backward(dy)
    return y.detach(), x.grad, layer.weight.grad.clone()


@pytest.mark.parametrize("kind", ["mxfp8", "lab-mxfp8", "lab-mxfp4"])
def test_padded_tokens_give_the_bits_of_the_same_tokens_in_an_aligned_longer_batch(kind):
    """37 real tokens padded to 64 against the same 37 at the start of a 128-token batch
    whose rows 37..63 are zero and 64..127 are other tokens with a zero upstream gradient
    (blocks of 32 along the tokens align the same way). Equal bit for bit: the output and
    input gradient rows (blocks along features, row by row), and the weight gradient (the
    other tokens' blocks are their own, and zero rows and zero gradients add exactly 0).
    The weight gradient is also within MX's error of fp32's, and one more all-zero block
    of padding changes no bit of it."""
    if kind == "mxfp8" and not MX:
        pytest.skip("torchao's MXFP8 training linear is not importable here")
    torch.manual_seed(0)
    lin = nn.Linear(64, 32, bias=False)
    layer = _mx_linear(lin) if kind == "mxfp8" else _lab_linear(lin, kind.removeprefix("lab-"))
    n, m = 37, 64
    x, dy = torch.randn(n, 64), torch.randn(n, 32)
    y_pad, dx_pad, dw_pad = _run(layer, F.pad(x, (0, 0, 0, m - n)), F.pad(dy, (0, 0, 0, m - n)))
    other = 10 * torch.randn(64, 64)  # large: any leak into the real tokens' blocks would show
    y_long, dx_long, dw_long = _run(layer, torch.cat([F.pad(x, (0, 0, 0, m - n)), other]),
                                    F.pad(dy, (0, 0, 0, 128 - n)))
    assert torch.equal(y_pad[:n], y_long[:n]) and torch.equal(dx_pad[:n], dx_long[:n])
    assert torch.equal(dw_pad, dw_long)
    assert not dx_pad[n:].any()  # the padded rows' gradient is exactly zero: nothing flows back into them
    *_, dw_more = _run(layer, F.pad(x, (0, 0, 0, m + 32 - n)), F.pad(dy, (0, 0, 0, m + 32 - n)))
    assert torch.equal(dw_pad, dw_more)
    exact = dy.double().t() @ x.double()
    err = (dw_pad.double() - exact).norm() / exact.norm()
    assert err < (0.05 if kind.endswith("mxfp8") else 0.3)


def test_a_hadamard_transform_along_the_tokens_is_exact_only_before_rounding():
    """nvfp4's weight-gradient operands are transformed in blocks of 16 tokens. On 21 real
    tokens padded to 32 the transform fills the padded positions with mixtures of the real
    ones (so zero rows do not stay zero, and the cast rounds the mixed values), yet the
    transformed product is the exact one up to fp32 rounding: orthogonality, not zeros,
    makes the padding harmless there. The cast result is an estimate within fp4's error."""
    torch.manual_seed(0)
    n, m = 21, 32
    dy, x = F.pad(torch.randn(n, 32), (0, 0, 0, m - n)), F.pad(torch.randn(n, 64), (0, 0, 0, m - n))
    signs = lab.fixed_signs(torch.device("cpu"))
    hdy, hx = lab.hadamard(dy.t(), signs), lab.hadamard(x.t(), signs)  # the tokens last, as the casts see them
    assert hdy[:, n:].abs().amax() > 0.1 and hx[:, n:].abs().amax() > 0.1
    torch.testing.assert_close(hdy @ hx.t(), dy.t() @ x, rtol=0, atol=1e-5)
    layer = _lab_linear(nn.Linear(64, 32, bias=False), "nvfp4")
    assert layer.recipe.op("wgrad_input").transform == "hadamard"
    *_, dw = _run(layer, x, dy)
    exact = dy.double().t() @ x.double()
    assert (dw.double() - exact).norm() / exact.norm() < 0.35


# ------------------------------------------------------------------ (c) no scale spans two experts
def _converted_layer(kind: str) -> MoEFeedForward:
    s = MoEShape(vocab_size=64, n_layer=1, n_head=4, d_model=64, block_size=16, n_kv_head=2, ffn_hidden=96,
                 n_experts=4, top_k=2, expert_hidden=32)
    torch.manual_seed(0)
    ff = MoEFeedForward(s)
    for e in ff.experts:
        for name in ("gate", "up", "down"):
            lin = getattr(e, name)
            nn.init.normal_(lin.weight, std=0.1)
            setattr(e, name, _mx_linear(lin) if kind == "mxfp8" else _lab_linear(lin, kind.removeprefix("lab-")))
    return ff


def _expert_results(ff: MoEFeedForward, x: torch.Tensor, sizes: list[int], g: torch.Tensor):
    for p in ff.parameters():
        p.grad = None
    x = x.detach().requires_grad_(True)
    torch.manual_seed(2)  # nvfp4 rounds gradients stochastically: the same draws in both runs
    y = ff._experts(x, torch.tensor(sizes))
    y.backward(g)
    grads = [[getattr(e, n).weight.grad.clone() for n in ("gate", "up", "down")] for e in ff.experts]
    return y.detach(), x.grad, grads


@pytest.mark.parametrize("kind", ["mxfp8", "lab-nvfp4", "lab-mxfp4"])
@pytest.mark.parametrize("where", ["token", "weight"])
def test_an_outlier_in_one_expert_leaves_every_other_experts_casts_unchanged(kind, where):
    """Tokens grouped 5/7/3/9 over four experts (one 32-token block would hold all 24); an
    outlier planted in expert 1's tokens or weights changes expert 1's results and no bit
    of the others': outputs, input gradients and all three weight gradients."""
    if kind == "mxfp8" and not MX:
        pytest.skip("torchao's MXFP8 training linear is not importable here")
    ff = _converted_layer(kind)
    assert ff.gemm_choice(torch.device("cpu"), torch.float32)[0] == "looped"
    sizes = [5, 7, 3, 9]
    torch.manual_seed(1)
    x, g = torch.randn(24, 64), torch.randn(24, 64)
    before = _expert_results(ff, x, sizes, g)
    if where == "token":
        x = x.clone()
        x[7, 3] = 300.0  # row 7: expert 1's third token
    else:
        with torch.no_grad():
            ff.experts[1].up.weight[5, 3] = 30.0
    after = _expert_results(ff, x, sizes, g)
    rows = {0: slice(0, 5), 1: slice(5, 12), 2: slice(12, 15), 3: slice(15, 24)}
    for e, r in rows.items():
        same = (torch.equal(before[0][r], after[0][r]) and torch.equal(before[1][r], after[1][r])
                and all(torch.equal(a, b) for a, b in zip(before[2][e], after[2][e])))
        assert same == (e != 1), f"expert {e}"


@pytest.mark.parametrize("precision", ["fp8", "fp8-delayed"])
def test_float8_on_scaled_mm_pads_the_experts_tokens_to_16(precision):
    """CUDA's ``torch._scaled_mm`` takes inner dimensions in multiples of 16, and the weight
    gradient's is the tokens: converted for scaled_mm, each float8 linear says 16 and the
    experts pad to it (one step runs here, on the CPU's scaled_mm); emulated, nothing."""
    from mptrain.model.families import build as build_family
    from mptrain.precision.policy import PrecisionPolicy
    from mptrain.precision.recipe import precision_plan

    from .conftest import make_cfg

    for matmul, want in (("emulated", 1), ("scaled_mm", 16)):
        cfg = make_cfg(*NANO, f"precision={precision}", f"precision.fp8.matmul={matmul}", "model.vocab_size=320")
        torch.manual_seed(0)
        model = PrecisionPolicy(precision_plan(cfg.precision), torch.device("cpu")).convert_model(
            build_family(cfg.model, 320))
        layers = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
        assert {token_multiple(e) for lay in layers for e in lay.experts} == {want}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, loss = model(torch.randint(0, 320, (2, 9)), torch.randint(0, 320, (2, 9)))
    loss.backward()
    assert math.isfinite(loss.item())
    used = [e for lay in layers for e, n in zip(lay.experts, lay.counts.tolist()) if n]  # 18 tokens, 4 experts
    assert used and all(e.gate.weight.grad is not None for e in used)


@pytest.mark.parametrize("name", ["mxfp8", "nvfp4", "mxfp4", "tensorwise", "rowwise"])
def test_the_cast_statistics_do_not_see_the_padded_rows(name):
    """The monitor's hooks on an expert's linears see its padded input and output gradient;
    zeros count in no sum (shares are of non-zero values) and set no scale (all-zero
    blocks are left out of the range), so the figures are those of the real rows, bit for bit."""
    from mptrain.precision.fp8casts import cast_counts, measured

    torch.manual_seed(0)
    x = torch.randn(37, 64)
    for op in (o for o in measured(name).values() if o is not None):
        (s, m), (s_pad, m_pad) = cast_counts(x, op), cast_counts(F.pad(x, (0, 0, 0, 27)), op)
        assert torch.equal(s, s_pad) and torch.equal(m, m_pad)
