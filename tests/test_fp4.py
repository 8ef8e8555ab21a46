"""The 4-bit casts, NVFP4 and MXFP4, as the format lab makes them (mptrain/precision/lab.py,
the specs of the recipes nvfp4 and mxfp4): bit for bit torchao's NVFP4 and MXFP4 round
trips, the 16 x 16 weight tiles, the error for a dimension that is not a multiple of the
block, the random Hadamard transform, and stochastic rounding that is unbiased."""
from __future__ import annotations

import math

import pytest
import torch

from mptrain.precision import lab
from mptrain.precision.elements import element

from .aids import FP4_BLOCK as BLOCK
from .aids import fp4_round_trip as fake_quantize
from .aids import fp4_scales as block_scales

nvfp4_tensor = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
ao_kernels = pytest.importorskip("torchao.prototype.mx_formats.kernels")

SHAPES = [(32, 64), (64, 128), (2, 32, 64)]
E2M1 = element("e2m1")
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""The non-negative E2M1 values, in increasing order: the grid written out."""


def bits(t: torch.Tensor) -> torch.Tensor:
    """fp32 ``t`` as its bit patterns: equality of these is bit-for-bit equality,
    telling -0.0 from 0.0 (NaN from NaN too, which ``torch.equal`` would not)."""
    return t.float().contiguous().view(torch.int32)


def torchao_e2m1(x: torch.Tensor) -> torch.Tensor:
    """torchao's own rounding of fp32 ``x`` (clamped first, as its casts do) to E2M1 values."""
    return ao_kernels.f4_unpacked_to_f32(ao_kernels.f32_to_f4_unpacked(x.float().clamp(-6.0, 6.0)))


def torchao_nvfp4(x: torch.Tensor, pts: torch.Tensor | None = None) -> torch.Tensor:
    """torchao's NVFP4 round trip with a per-tensor scale (NVIDIA's two-level recipe),
    the scale from the tensor's amax as torchao's dynamic per-tensor path computes it."""
    if pts is None:
        pts = nvfp4_tensor.per_tensor_amax_to_scale(torch.max(torch.abs(x)))
    return nvfp4_tensor.NVFP4Tensor.to_nvfp4(x, per_tensor_scale=pts).dequantize(torch.float32)


def torchao_mxfp4(x: torch.Tensor) -> torch.Tensor:
    """torchao's MXFP4 round trip with its default scale rule (FLOOR)."""
    return mx_tensor.MXTensor.to_mx(x, torch.float4_e2m1fn_x2, 32).dequantize(torch.float32)


def sample(kind: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Test tensors: normal; normal with a few outliers 1e3-1e4 x the rest and a row of
    zeros; normal scaled to an amax of 1e-30; columns spread over six decades."""
    g = torch.Generator().manual_seed(sum(shape) + len(kind))
    x = torch.randn(shape, generator=g)
    if kind == "outliers":
        flat = x.view(-1)
        idx = torch.randint(0, flat.numel(), (5,), generator=g)
        flat[idx] = torch.logspace(3, 4, 5) * torch.sign(torch.randn(5, generator=g))
        x.view(-1, shape[-1])[1] = 0.0
    elif kind == "tiny":
        x = x / x.abs().max() * 1e-30
    elif kind == "decades":
        x = x * torch.logspace(-3, 3, shape[-1])
    return x.to(dtype)


KINDS = ["normal", "outliers", "tiny", "decades"]


# ------------------------------------------------------------------ torchao equality
def test_rounding_is_torchaos_ties_included():
    """Every multiple of 2**-8 in [-8, 8] (every tie of the grid among them), the
    ties written out, values beyond 6, tiny and signed zeros: the same bits as
    torchao's bit-level conversion."""
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    x = torch.cat([torch.arange(-8 * 256, 8 * 256 + 1) / 256.0, ties, -ties,
                   torch.tensor([6.5, 7.0, 1e6, -1e6, 1e-40, -1e-40, 0.0, -0.0])])
    assert torch.equal(bits(E2M1.round(x)), bits(torchao_e2m1(x)))
    # the ties themselves, as torchao breaks them (to the even code)
    assert E2M1.round(ties).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    # random fp32 values, every binade of the grid
    r = torch.randn(100_000, generator=torch.Generator().manual_seed(1)) * 3
    assert torch.equal(bits(E2M1.round(r)), bits(torchao_e2m1(r)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", KINDS)
def test_nvfp4_equals_torchao_bit_for_bit(kind, shape, dtype):
    x = sample(kind, shape, dtype)
    ours = fake_quantize(x, "nvfp4")
    assert ours.dtype == torch.float32 and ours.shape == x.shape
    assert torch.equal(bits(ours), bits(torchao_nvfp4(x)))
    # the scales, as torchao reports them (block scale x per-tensor scale)
    pts = nvfp4_tensor.per_tensor_amax_to_scale(torch.max(torch.abs(x)))
    theirs = nvfp4_tensor.NVFP4Tensor.to_nvfp4(x, per_tensor_scale=pts).get_hp_scales()
    assert torch.equal(bits(block_scales(x, "nvfp4")), bits(theirs.reshape(-1, shape[-1] // 16)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", KINDS)
def test_mxfp4_equals_torchao_bit_for_bit(kind, shape, dtype):
    x = sample(kind, shape, dtype)
    ours = fake_quantize(x, "mxfp4")
    assert ours.dtype == torch.float32 and ours.shape == x.shape
    assert torch.equal(bits(ours), bits(torchao_mxfp4(x)))
    # torchao's E8M0 scales, except that a block it scales by 2**-127 (amax below 2**-124,
    # the zero row) it divides by 2**-126 (its divisor's floor): what block_scales reports
    theirs = mx_tensor.get_fp_scale(mx_tensor.MXTensor.to_mx(x, torch.float4_e2m1fn_x2, 32).scale)
    theirs = theirs.clamp(min=2.0 ** -126).reshape(-1, shape[-1] // 32)
    assert torch.equal(bits(block_scales(x, "mxfp4")), bits(theirs))


def test_mxfp4_bottom_of_the_exponent_range_as_torchao():
    """A block of amax below 2**-124: torchao divides by 2**-126 but multiplies back by
    2**-127 (its E8M0 floor); the round trip keeps that, bit for bit."""
    x = sample("normal", (4, 64), torch.float32)
    x = x / x.abs().max() * 1e-38
    assert torch.equal(bits(fake_quantize(x, "mxfp4")), bits(torchao_mxfp4(x)))


@pytest.mark.parametrize("factor", [1.0, 0.25, 3.0])
def test_nvfp4_given_per_tensor_scale_equals_torchao(factor):
    """The per_tensor_scale= path (a calibrated or stale scale): the same bits as
    torchao given the same scale; a scale too small for the tensor saturates."""
    x = sample("outliers", (32, 64), torch.float32)
    pts = nvfp4_tensor.per_tensor_amax_to_scale(torch.max(torch.abs(x))) * factor
    ours = fake_quantize(x, "nvfp4", per_tensor_scale=pts)
    assert torch.equal(bits(ours), bits(torchao_nvfp4(x, pts)))
    assert torch.equal(bits(block_scales(x, "nvfp4", per_tensor_scale=pts)),
                       bits(nvfp4_tensor.NVFP4Tensor.to_nvfp4(x, per_tensor_scale=pts).get_hp_scales()))
    if factor < 1:  # block scales capped at 448: the largest values clamp at 6 x scale
        assert ours.abs().max() < x.abs().max() / 2


def test_nvfp4_all_zero_tensor_is_zero_where_torchao_is_nan():
    """The one deliberate difference: torchao's per-tensor scale of an all-zero tensor
    is 0 and its round trip NaN; the floored scale here gives zeros."""
    z = torch.zeros(16, 32)
    assert torchao_nvfp4(z).isnan().all()
    assert torch.equal(bits(fake_quantize(z, "nvfp4")), bits(z))
    assert torch.isfinite(fake_quantize(z, "mxfp4")).all()


def _tiles_direct(x: torch.Tensor) -> torch.Tensor:
    """The 16 x 16 rule written out on its own: each tile's amax sets one E4M3 scale
    (under the per-tensor scale, torchao's formulas), torchao rounds the elements."""
    r, c = x.shape
    t = x.float().reshape(r // 16, 16, c // 16, 16)
    pts = nvfp4_tensor.per_tensor_amax_to_scale(torch.max(torch.abs(x)))
    amax = t.abs().amax(dim=(1, 3), keepdim=True)
    s8 = torch.clamp(amax / 6.0 / pts, min=2.0 ** -6, max=448.0).to(torch.float8_e4m3fn).float()
    q = torchao_e2m1(t * ((1.0 / pts) / s8))
    return (q * (pts * s8)).reshape(r, c)


@pytest.mark.parametrize("kind", KINDS)
def test_nvfp4_two_d_tiles(kind):
    """torchao 0.18's 16 x 16 weight quantization is a Triton kernel for Blackwell only
    (``triton_quantize_2d_weight``: TMA and cvt.rn.satfinite.e2m1x2), not runnable
    here; two_d is checked against the rule written out instead, and for what the
    rule is for: a tensor and its transpose quantize to the same values."""
    x = sample(kind, (64, 128), torch.float32)
    ours = fake_quantize(x, "nvfp4", two_d=True)
    assert torch.equal(bits(ours), bits(_tiles_direct(x)))
    assert torch.equal(bits(fake_quantize(x.t().contiguous(), "nvfp4", two_d=True)), bits(ours.t()))
    assert not torch.equal(ours, fake_quantize(x, "nvfp4"))  # tiles are not 1 x 16 blocks
    # when each tile's rows share the tile's amax, tiles and 1 x 16 blocks agree
    y = x.clone().reshape(4, 16, 8, 16)
    y[:, :, :, 0] = y.abs().amax(dim=(1, 3), keepdim=True)[..., 0]
    y = y.reshape(64, 128)
    assert torch.equal(bits(fake_quantize(y, "nvfp4", two_d=True)), bits(fake_quantize(y, "nvfp4")))
    assert block_scales(x, "nvfp4", two_d=True).shape == (4, 8)


def test_mxfp4_two_d_tiles_are_transpose_consistent():
    x = sample("decades", (64, 96), torch.float32)
    ours = fake_quantize(x, "mxfp4", two_d=True)
    assert torch.equal(bits(fake_quantize(x.t().contiguous(), "mxfp4", two_d=True)), bits(ours.t()))
    assert block_scales(x, "mxfp4", two_d=True).shape == (2, 3)


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize("fmt,shape,two_d,message", [
    ("nvfp4", (4, 40), False, "a 4 x 40 operand does not split into 1x16 blocks"),
    ("mxfp4", (4, 48), False, "a 4 x 48 operand does not split into 1x32 blocks"),
    ("nvfp4", (20, 32), True, "a 20 x 32 operand does not split into 16x16 blocks"),
])
def test_a_dimension_that_is_not_a_multiple_is_refused(fmt, shape, two_d, message):
    with pytest.raises(ValueError, match=message) as e:
        fake_quantize(torch.ones(shape), fmt, two_d=two_d)
    assert str(e.value).count(". ") == 0 and str(e.value).endswith(".")  # one sentence
    with pytest.raises(ValueError, match=message):
        block_scales(torch.ones(shape), fmt, two_d=two_d)


# ------------------------------------------------------------------ Hadamard
def test_hadamard_is_orthonormal_and_torchaos():
    from torchao.prototype.moe_training.nvfp4_training.hadamard_utils import get_hadamard_matrix

    h = lab.hadamard_matrix(16)
    assert h.dtype == torch.float32 and torch.equal(h @ h.T, torch.eye(16))  # entries +-1/4: exact
    assert torch.equal(h, get_hadamard_matrix(16, "cpu", torch.float32))
    assert torch.equal(lab.hadamard_matrix(4) * 2, torch.tensor([[1., 1, 1, 1], [1, -1, 1, -1],
                                                                 [1, 1, -1, -1], [1, -1, -1, 1]]))
    with pytest.raises(ValueError, match="power of two"):
        lab.hadamard_matrix(12)


def test_rht_is_orthogonal_and_keeps_matmuls():
    g = torch.Generator().manual_seed(3)
    signs = lab.random_signs(16, g)
    assert set(signs.tolist()) == {-1.0, 1.0} and signs.dtype == torch.float32
    a = torch.randn(2, 32, 64, generator=g) * torch.logspace(-2, 2, 64)
    b = torch.randn(48, 64, generator=g)
    back = lab.hadamard_inverse(lab.hadamard(a, signs), signs)
    assert torch.allclose(back, a, rtol=1e-6, atol=1e-6 * a.abs().max().item())
    ra, rb = lab.hadamard(a, signs), lab.hadamard(b, signs)
    assert not torch.allclose(ra, a)
    ref = (a.double() @ b.double().T)
    assert torch.allclose((ra @ rb.T).double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    # each block of 16 on its own: a one-hot block becomes one row of diag(signs) @ H
    e = torch.zeros(1, 32)
    e[0, 17] = 1.0
    assert torch.equal(lab.hadamard(e, signs)[0, 16:], signs[1] * lab.hadamard_matrix(16)[1])
    assert torch.equal(lab.hadamard(e, signs)[0, :16], torch.zeros(16))
    with pytest.raises(ValueError, match="multiple of 16"):
        lab.hadamard(torch.ones(3, 20), signs)


# ------------------------------------------------------------------ stochastic rounding
DRAWS = 2000


def neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The grid values just below and above |x| (equal when |x| is on the grid), from
    the table E2M1_VALUES: an independent statement of the grid."""
    grid = torch.tensor(E2M1_VALUES)
    a = x.abs().clamp(max=6.0)
    i = torch.searchsorted(grid, a, right=True) - 1
    lo = grid[i]
    hi = torch.where(lo == a, lo, grid[(i + 1).clamp(max=len(grid) - 1)])
    return lo, hi


def assert_unbiased(draws: torch.Tensor, x: torch.Tensor, spacing: torch.Tensor) -> None:
    """The mean of the draws (dim 0) within 5 standard errors of ``x``, per element. One
    draw is ``lo`` or ``lo + spacing``: its standard deviation is at most ``spacing / 2``;
    the fp32 mean of the draws adds at most a few ulps."""
    mean = draws.double().mean(dim=0)
    bound = 5 * (spacing.double() / 2) / math.sqrt(draws.shape[0]) + 1e-6 * x.abs().double()
    assert ((mean - x.double()).abs() <= bound).all(), (mean - x.double()).abs().max()


def test_stochastic_rounding_is_unbiased_between_neighbours():
    torch.manual_seed(0)
    # values spread over the whole grid, both signs, off and on grid points
    x = torch.cat([torch.linspace(-6, 6, 97), torch.tensor(E2M1_VALUES), torch.tensor([0.1, 4.9, 5.99])])
    draws = E2M1.round(x.expand(DRAWS, -1), stochastic=True)
    lo, hi = neighbours(x)
    sign = torch.where(x < 0, -1.0, 1.0)
    on_lo, on_hi = draws == sign * lo, draws == sign * hi
    assert (on_lo | on_hi).all()  # only ever the two neighbours
    between = lo != hi
    assert on_lo[:, between].any(dim=0).all() and on_hi[:, between].any(dim=0).all()  # both happen
    assert_unbiased(draws, x, hi - lo)
    # on-grid values are returned as they are, every time
    assert (draws[:, ~between] == x[~between]).all()


def test_values_beyond_six_saturate():
    x = torch.tensor([6.0, 6.5, 7.0, 100.0, math.inf, -7.0, -math.inf])
    want = torch.tensor([6.0, 6.0, 6.0, 6.0, 6.0, -6.0, -6.0])
    assert torch.equal(E2M1.round(x), want)
    torch.manual_seed(0)
    assert torch.equal(E2M1.round(x.expand(100, -1), stochastic=True), want.expand(100, -1))


def test_stochastic_draws_follow_the_default_generator():
    """The uniforms come from torch's default generator: restoring its state (as a
    resumed run does) repeats the draws; another state draws differently."""
    x = torch.rand(4096) * 6
    state = torch.get_rng_state()
    a = E2M1.round(x, stochastic=True)
    b = E2M1.round(x, stochastic=True)
    torch.set_rng_state(state)
    assert torch.equal(E2M1.round(x, stochastic=True), a) and not torch.equal(a, b)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fake_quantize_stochastic_is_unbiased(fmt):
    """With scales that are exact powers of two (each block's largest magnitude 6 x 2**k;
    nvfp4 with a per-tensor scale of 1), the round trip's mean over draws is the input:
    only the elements are rounded stochastically, the scales are the nearest ones."""
    torch.manual_seed(0)
    b = BLOCK[fmt]
    x = (torch.rand(1, 4 * b) * 2 - 1) * 6
    x[0, ::b] = 6.0  # each block's amax
    x = x * torch.tensor([2.0 ** k for k in (-3, 0, 2, 5)]).repeat_interleave(b)
    pts = torch.tensor(1.0) if fmt == "nvfp4" else None
    draws = fake_quantize(x.expand(DRAWS, -1).contiguous(), fmt, stochastic=True, per_tensor_scale=pts)
    scale = block_scales(x, fmt, per_tensor_scale=pts).repeat_interleave(b, dim=1)
    lo, hi = neighbours(x / scale)
    assert_unbiased(draws, x[0], ((hi - lo) * scale)[0])
    # the nearest round trip sits on one of the two stochastic values
    near = fake_quantize(x, fmt, per_tensor_scale=pts)
    assert ((near == (lo * scale).copysign(x)) | (near == (hi * scale).copysign(x))).all()
    assert not torch.equal(draws[0], draws[1])  # rows are independent draws
