"""Exact emulation of the 4-bit block-scaled casts: NVFP4 and MXFP4.

Both store E2M1 elements (1 sign, 2 exponent, 1 mantissa bit: magnitudes 0,
0.5, 1, 1.5, 2, 3, 4, 6; no infinity, no NaN) in blocks along a tensor's last
dimension, each block with one shared scale:

- ``nvfp4``: blocks of 16, an E4M3 block scale, and one fp32 per-tensor scale
  on top (NVIDIA's two-level recipe). The per-tensor scale is
  ``amax / (448 * 6)``, so that the block holding the tensor's largest value
  gets the largest E4M3 scale, 448. ``two_d=True`` gives every 16 x 16 tile of
  the last two dimensions one block scale (NVIDIA's rule for weights: the
  tensor and its transpose then quantize to the same values).
- ``mxfp4``: blocks of 32 (OCP MX), a power-of-two (E8M0) scale and no
  per-tensor scale. The exponent is ``floor(log2 amax) - 2`` (2 = the exponent
  of E2M1's largest value, 6 = 1.5 * 2**2): the spec's rule, torchao's default
  (``ScaleCalculationMode.FLOOR``). It can put a block's largest values up to
  ``8 - ulp`` after scaling, where they clamp to 6.

Everything here reproduces torchao 0.18's eager casts (``NVFP4Tensor.to_nvfp4``
with a per-tensor scale, ``MXTensor.to_mx`` to ``float4_e2m1fn_x2``) bit for
bit: the same fp32 operations in the same order, so the same roundings.
:func:`fake_quantize` returns the round trip (cast, then multiplied back by
the scales) as fp32; :func:`block_scales` the scales it used. Two inputs are
treated differently from torchao, where torchao returns NaN or infinities: an
nvfp4 per-tensor scale is floored at ``2**-120`` (torchao divides by a zero
scale for an all-zero tensor, and overflows for any per-tensor scale whose
reciprocal divided by E4M3's smallest normal scale, ``2**-6``, exceeds fp32:
an amax below about ``2e-33``); and NaN inputs give NaN, not torchao's
arbitrary codes.

Rounding to E2M1 (:func:`round_e2m1`) is to nearest, ties to the value whose
code is even (0, 1, 2, 4: mantissa bit 0), as torchao's bit-level conversion
and the hardware's ``cvt.rn.satfinite`` do; or stochastic, up or down to the
two neighbouring grid values so that the mean of the result is the input
(what NVIDIA's recipe uses for gradients).

The random Hadamard transform (:func:`rht`) mixes each block of 16 with an
orthonormal matrix times random signs before an nvfp4 cast, so that one
outlier is spread over its block instead of crushing its neighbours to zero.
The transform is orthogonal: a matmul whose two operands are transformed the
same way along the contraction dimension is unchanged.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import torch

FP4_FORMATS = ("nvfp4", "mxfp4")
BLOCK = {"nvfp4": 16, "mxfp4": 32}
"""Elements per scale block along the last dimension."""
E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""The non-negative E2M1 values, in increasing order."""
E2M1_FIRST_OVERFLOW = 7.0
"""The smallest magnitude that rounding to nearest would carry past 6 if the
clamp did not stop it: the midpoint between 6 and the next value the exponent
would give, 8 (6's mantissa bit is odd, so the tie rounds up to 8). A scaled
value this large was changed by the clamp, not merely rounded to 6."""

E4M3_MAX = 448.0
E4M3_TINY = float(torch.finfo(torch.float8_e4m3fn).tiny)  # 2**-6: torchao never uses a subnormal block scale
F32_TINY = float(torch.finfo(torch.float32).tiny)  # 2**-126: torchao's floor of an MX divisor
PER_TENSOR_FLOOR = 2.0 ** -120  # see the module docstring: keeps (1 / scale) / 2**-6 finite


# ------------------------------------------------------------------ elements
def _spacing(a: torch.Tensor) -> torch.Tensor:
    """The distance between neighbouring E2M1 values around magnitude ``a``
    (fp32, non-negative): 0.5 below 2 (the subnormal 0.5 and the binade [1, 2)),
    1 in [2, 4), 2 from 4. Each range's ends are grid values, so rounding within
    it never skips one. It is the power of two of ``a / 2`` clamped to [0.5, 2],
    read off the exponent bits: three cheap ops, where nested ``torch.where``s
    with scalars cost several times more on CPU (measured, torch 2.13)."""
    return (torch.clamp(a.detach() * 0.5, 0.5, 2.0).view(torch.int32) & 0x7F800000).view(torch.float32)


def round_e2m1(x: torch.Tensor, stochastic: bool = False) -> torch.Tensor:
    """fp32 ``x`` (already divided by its scale) rounded to E2M1 values,
    returned as fp32, saturating at +-6.

    Nearest: ties go to the even code, exactly as torchao's conversion
    (``f32_to_f4_unpacked``) breaks them: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1,
    1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4; a negative value that rounds to 0
    keeps its sign (-0.0), as torchao's sign bit does. ``stochastic``: up or
    down to the two neighbouring grid values, up with probability
    ``(|x| - lo) / (hi - lo)``, so that ``E[result] = x`` for ``|x| <= 6``;
    the uniforms come from ``torch.rand_like``, i.e. the default generator of
    ``x``'s device, so that a resumed run that restores the RNG state repeats
    the draws. NaN stays NaN."""
    x = x.float()
    a = x.abs().clamp(max=E2M1_MAX)
    s = _spacing(a)
    # a / s is exact (s is a power of two), and within one range the grid is the
    # multiples of s, whose parity is the code's parity: torch.round's ties-to-even
    # on a / s is the format's ties-to-even.
    if stochastic:
        lo = torch.floor(a / s) * s
        up = torch.rand_like(a) < (a - lo) / s  # a - lo is exact: both lie in one binade or lo is 0
        q = lo + s * up
    else:
        q = torch.round(a / s) * s
    return torch.copysign(q, x)


# ------------------------------------------------------------------ scales
def _rows(x: torch.Tensor, fmt: str, two_d: bool) -> torch.Tensor:
    """``x`` as fp32 ``(rows, last dim)``, checked against ``fmt``'s block."""
    if fmt not in BLOCK:
        raise ValueError(f"unknown 4-bit format {fmt!r}; one of {', '.join(FP4_FORMATS)}")
    b = BLOCK[fmt]
    if x.dim() == 0 or x.shape[-1] % b:
        size = x.shape[-1] if x.dim() else "none (a 0-d tensor)"
        raise ValueError(f"{fmt} needs a last dimension that is a multiple of {b}, got {size} "
                         f"(shape {tuple(x.shape)}).")
    if two_d and (x.dim() < 2 or x.shape[-2] % b):
        size = x.shape[-2] if x.dim() >= 2 else "none (a 1-d tensor)"
        raise ValueError(f"{fmt} with two_d needs a second-to-last dimension that is a multiple of {b}, "
                         f"got {size} (shape {tuple(x.shape)}).")
    return x.float().reshape(-1, x.shape[-1])


def _blocks(x2: torch.Tensor, b: int, two_d: bool) -> torch.Tensor:
    """``(rows, cols)`` as ``(row groups, 1 or b rows, col blocks, b)``: the
    elements of one scale block share indices 0 and 2. A view, no copy."""
    r, c = x2.shape
    return x2.reshape(r // b, b, c // b, b) if two_d else x2.reshape(r, 1, c // b, b)


def _per_tensor(amax: torch.Tensor) -> torch.Tensor:
    """The per-tensor scale from the tensor's amax, torchao's formula, floored."""
    return (amax.to(torch.float32) / (E4M3_MAX * E2M1_MAX)).clamp(min=PER_TENSOR_FLOOR)


def per_tensor_scale_of(x: torch.Tensor) -> torch.Tensor:
    """nvfp4's per-tensor scale of ``x`` as torchao computes it
    (``per_tensor_amax_to_scale(torch.max(torch.abs(x)))``: amax / (448 * 6),
    fp32), floored at ``2**-120`` (see the module docstring)."""
    return _per_tensor(torch.max(torch.abs(x.detach())))


def _scales(amax: torch.Tensor, fmt: str,
            per_tensor_scale: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(multiplier, decode, divisor)`` per block from each block's ``amax``
    (fp32, ``(groups, 1, blocks, 1)``), shaped likewise (see :class:`Fp4Cast`;
    ``divisor`` is what :func:`block_scales` reports). nvfp4 without a given
    per-tensor scale takes it from the largest amax (the tensor's, exactly)."""
    if fmt == "nvfp4":
        if per_tensor_scale is None:
            pts = _per_tensor(amax.max())
        else:
            pts = torch.as_tensor(per_tensor_scale, dtype=torch.float32, device=amax.device).clamp(min=PER_TENSOR_FLOOR)
        # torchao's order of operations, each an fp32 rounding: amax / 6, then / pts,
        # clamped to E4M3's normal range and cast (round to nearest even); the
        # elements are multiplied by (1 / pts) / s8 (the reciprocal form of its CUDA
        # kernel), the rounded elements by pts * s8.
        s8 = torch.clamp(amax / E2M1_MAX / pts, min=E4M3_TINY, max=E4M3_MAX).to(torch.float8_e4m3fn).float()
        decode = pts * s8
        return (1.0 / pts) / s8, decode, decode
    # mxfp4: the exponent field of amax (the bits, as torchao reads them: a subnormal amax
    # reads -127) minus 2, clamped to E8M0's range. torchao divides by that power of two
    # floored at 2**-126 but multiplies back by the unfloored one (2**-127 at the bottom):
    # kept, so that a block of amax below 2**-124 round-trips as torchao's does.
    e = ((amax.detach().view(torch.int32) >> 23) & 0xFF) - 127 - 2
    biased = (e.clamp(min=-127, max=128) + 127).to(torch.int32)
    pow2 = torch.where(biased == 0, 0x00400000, biased << 23).view(torch.float32)  # 2**-127 is subnormal
    # NaN in the block: E8M0's NaN (255), as torchao marks it; the products are then NaN.
    pow2 = torch.where(torch.isnan(amax), math.nan, pow2)
    divisor = pow2.clamp(min=F32_TINY)
    return 1.0 / divisor, pow2, divisor


class Fp4Cast(NamedTuple):
    """The pieces of one 4-bit cast, in blocks: ``(groups, 1 or b rows, blocks, b)``
    for the elements, ``(groups, 1, blocks, 1)`` for the per-block numbers."""

    blocks: torch.Tensor
    """The input as fp32, viewed in blocks (rows flattened as :func:`fake_quantize` says)."""
    amax: torch.Tensor
    """Each block's largest magnitude."""
    scaled: torch.Tensor
    """The elements scaled for the cast, before the clamp to +-6: where saturation shows."""
    q: torch.Tensor
    """Their E2M1 values (fp32)."""
    multiplier: torch.Tensor
    """What each block's elements were multiplied by before rounding (nvfp4:
    ``(1 / per-tensor) / block``; mxfp4: the reciprocal of the power of two
    they are divided by, the same number exactly)."""
    decode: torch.Tensor
    """What the E2M1 values are multiplied by to come back (nvfp4: per-tensor x block)."""


def quantize_blocks(x: torch.Tensor, fmt: str, *, two_d: bool = False, stochastic: bool = False,
                    per_tensor_scale: Optional[torch.Tensor] = None) -> Fp4Cast:
    """The cast of :func:`fake_quantize` (same arguments, same checks), in
    pieces (:class:`Fp4Cast`), for statistics that need more than the result:
    ``(q * decode)`` is the round trip, ``scaled`` what the clamp acted on."""
    if fmt == "mxfp4" and per_tensor_scale is not None:
        raise ValueError("mxfp4 has no per-tensor scale; per_tensor_scale is for nvfp4 only.")
    blocks = _blocks(_rows(x, fmt, two_d), BLOCK[fmt], two_d)
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True)
    multiplier, decode, divisor = _scales(amax, fmt, per_tensor_scale)
    # torchao multiplies by the nvfp4 reciprocal but divides by the MX power of two (the
    # same value either way for a power of two, but kept as it is written).
    scaled = blocks * multiplier if fmt == "nvfp4" else blocks / divisor
    return Fp4Cast(blocks, amax, scaled, round_e2m1(scaled, stochastic), multiplier, decode)


def fake_quantize(x: torch.Tensor, fmt: str, *, two_d: bool = False, stochastic: bool = False,
                  per_tensor_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x`` quantized to ``fmt`` along its last dimension in blocks of
    ``BLOCK[fmt]`` and dequantized again, as fp32 of ``x``'s shape (leading
    dimensions flattened into rows).

    nvfp4: one fp32 per-tensor scale (:func:`per_tensor_scale_of`, unless
    ``per_tensor_scale`` is given: a 0-d tensor, floored likewise), E4M3 block
    scales, E2M1 elements; equal bit for bit to torchao's
    ``NVFP4Tensor.to_nvfp4(x, per_tensor_scale=...).dequantize(torch.float32)``.
    ``two_d=True``: each ``b x b`` tile of the last two dimensions shares one
    block scale (16 x 16 for nvfp4, NVIDIA's weight rule; 32 x 32 for mxfp4)
    instead of each ``1 x b`` block. mxfp4: E8M0 scales per 32 with torchao's
    default rule (``ScaleCalculationMode.FLOOR``), E2M1 elements; equal to
    ``MXTensor.to_mx(x, torch.float4_e2m1fn_x2, 32).dequantize(torch.float32)``.
    ``stochastic`` rounds the elements only (the scales are computed as
    usual), drawing from the default generator of ``x``'s device. A last
    dimension (or, for ``two_d``, second-to-last) that is not a multiple of the
    block raises ValueError."""
    c = quantize_blocks(x, fmt, two_d=two_d, stochastic=stochastic, per_tensor_scale=per_tensor_scale)
    return (c.q * c.decode).reshape(x.shape)


def block_scales(x: torch.Tensor, fmt: str, *, two_d: bool = False,
                 per_tensor_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The effective fp32 number each block's elements were divided by, one per
    block: ``(rows, blocks)``, or ``(rows / b, blocks)`` tiles for ``two_d``;
    rows are the leading dimensions flattened. nvfp4: block scale x per-tensor
    scale (what the rounded elements are multiplied back by); mxfp4: the power
    of two (floored at ``2**-126``, as torchao divides). For scale-range
    statistics."""
    if fmt == "mxfp4" and per_tensor_scale is not None:
        raise ValueError("mxfp4 has no per-tensor scale; per_tensor_scale is for nvfp4 only.")
    blocks = _blocks(_rows(x, fmt, two_d), BLOCK[fmt], two_d)
    _, _, divisor = _scales(blocks.abs().amax(dim=(1, 3), keepdim=True), fmt, per_tensor_scale)
    return divisor.reshape(divisor.shape[0], divisor.shape[2])


# ------------------------------------------------------------------ Hadamard
def hadamard_matrix(n: int = 16) -> torch.Tensor:
    """The ``n x n`` Hadamard matrix of Sylvester's construction (``n`` a power
    of two; entry ``(i, j)`` is ``(-1)**popcount(i & j)``, the order torchao's
    table uses), divided by ``sqrt(n)``: orthonormal and symmetric, fp32."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Sylvester Hadamard matrix needs a power of two; got n={n}.")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def random_signs(n: int, generator: torch.Generator) -> torch.Tensor:
    """``n`` independent fair +-1 signs (fp32) drawn from ``generator``, on its device."""
    return torch.randint(0, 2, (n,), generator=generator, device=generator.device).float() * 2 - 1


@functools.lru_cache(maxsize=None)
def fixed_signs(device: torch.device, n: int = 16) -> torch.Tensor:
    """The one Hadamard sign vector mptrain uses everywhere (the 4-bit layers'
    weight-gradient transform and the ``nvfp4_rht`` cast statistics): drawn
    from a private generator seeded 0, so it is the same for every layer, rank
    and run and draws nothing from the run's generators; made once per device,
    never written to."""
    return random_signs(n, torch.Generator().manual_seed(0)).to(device)


def _rht_matrix(signs: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``diag(signs) @ H`` in fp32 on ``x``'s device, after checking that ``x``'s
    last dimension splits into blocks of ``len(signs)``."""
    n = signs.numel()
    if x.dim() == 0 or x.shape[-1] % n:
        raise ValueError(f"a random Hadamard transform in blocks of {n} needs a last dimension that is a "
                         f"multiple of {n}; got shape {tuple(x.shape)}.")
    return signs.to(device=x.device, dtype=torch.float32).reshape(-1, 1) * _hadamard_on(n, x.device)


@functools.lru_cache(maxsize=None)
def _hadamard_on(n: int, device: torch.device) -> torch.Tensor:
    """:func:`hadamard_matrix` on ``device``, built and copied there once (never
    written to: every caller multiplies it into a new tensor)."""
    return hadamard_matrix(n).to(device)


def _blockwise(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Each block of ``len(m)`` of ``x``'s last dimension times ``m``, in fp32
    whatever autocast says: called inside a bf16 autocast region (a layer's
    forward, or the cast statistics in a forward hook), the matmul would
    otherwise run in bf16 and round the transform. A small matmul, 4x faster
    here than the fast Walsh-Hadamard transform's stages in eager ops."""
    n = m.shape[0]
    with torch.autocast(x.device.type, enabled=False):
        return (x.float().reshape(*x.shape[:-1], -1, n) @ m).reshape(x.shape)


def rht(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """Random Hadamard transform of ``x``'s last dimension in blocks of
    ``len(signs)`` (16): each block, a row vector, multiplied by
    ``diag(signs) @ H`` (torchao's convention), as fp32 of ``x``'s shape.
    Orthogonal: ``rht_inverse(rht(x)) == x`` to fp32 rounding, and for two
    matrices whose contraction dimension is the last one,
    ``rht(a) @ rht(b).T == a @ b.T`` to rounding."""
    return _blockwise(x, _rht_matrix(signs, x))


def rht_inverse(y: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`rht`: each block multiplied by the transpose,
    ``H.T @ diag(signs)``, as fp32 of ``y``'s shape."""
    return _blockwise(y, _rht_matrix(signs, y).T)
