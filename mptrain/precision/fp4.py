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

from typing import Optional

import torch

from mptrain.precision import lab
from mptrain.precision.elements import element

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
PER_TENSOR_FLOOR = 2.0 ** -120  # see the module docstring: keeps (1 / scale) / 2**-6 finite

_E2M1 = element("e2m1")
SPECS = {"nvfp4": "e2m1/1x16/e4m3/nearest", "mxfp4": "e2m1/1x32/ue8m0/nearest"}
"""Each format as the format lab writes it (:mod:`mptrain.precision.lab`): the one
implementation of these casts; ``two_d`` makes the block square (16x16, 32x32)."""


def round_e2m1(x: torch.Tensor, stochastic: bool = False) -> torch.Tensor:
    """fp32 ``x`` (already divided by its scale) rounded to E2M1 values,
    returned as fp32, saturating at +-6 (``elements.element("e2m1").round``).

    Nearest: ties go to the even code, exactly as torchao's conversion
    (``f32_to_f4_unpacked``) breaks them: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1,
    1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4; a negative value that rounds to 0
    keeps its sign (-0.0), as torchao's sign bit does. ``stochastic``: up or
    down to the two neighbouring grid values, up with probability
    ``(|x| - lo) / (hi - lo)``, so that ``E[result] = x`` for ``|x| <= 6``;
    the uniforms come from ``torch.rand_like``, i.e. the default generator of
    ``x``'s device, so that a resumed run that restores the RNG state repeats
    the draws. NaN stays NaN."""
    return _E2M1.round(x, stochastic)


def _operand(x: torch.Tensor, fmt: str, two_d: bool, stochastic: bool) -> lab.Operand:
    """``fmt``'s lab operand, after checking ``x`` against its block."""
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
    spec = SPECS[fmt].replace("1x", f"{b}x") if two_d else SPECS[fmt]
    return lab.parse(spec.replace("nearest", "stochastic") if stochastic else spec)


def per_tensor_scale_of(x: torch.Tensor) -> torch.Tensor:
    """nvfp4's per-tensor scale of ``x`` as torchao computes it
    (``per_tensor_amax_to_scale(torch.max(torch.abs(x)))``: amax / (448 * 6),
    fp32), floored at ``2**-120`` (see the module docstring)."""
    return (torch.max(torch.abs(x.detach())).float() / (E4M3_MAX * E2M1_MAX)).clamp(min=PER_TENSOR_FLOOR)


Fp4Cast = lab.LabCast
"""The pieces of one 4-bit cast (:class:`mptrain.precision.lab.LabCast`)."""


def quantize_blocks(x: torch.Tensor, fmt: str, *, two_d: bool = False, stochastic: bool = False,
                    per_tensor_scale: Optional[torch.Tensor] = None) -> Fp4Cast:
    """The cast of :func:`fake_quantize` (same arguments, same checks), in
    pieces, for statistics that need more than the result: ``(q * decode)`` is
    the round trip, ``scaled`` what the clamp acted on."""
    if fmt == "mxfp4" and per_tensor_scale is not None:
        raise ValueError("mxfp4 has no per-tensor scale; per_tensor_scale is for nvfp4 only.")
    return lab.cast(x, _operand(x, fmt, two_d, stochastic), per_tensor=per_tensor_scale)


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
    c = quantize_blocks(x, fmt, two_d=two_d, per_tensor_scale=per_tensor_scale)
    d = c.decode if fmt == "nvfp4" else 1.0 / c.multiplier
    return d.reshape(d.shape[0], d.shape[2])


# The Hadamard transform lives with the lab's casts; these names stay for their callers.
hadamard_matrix = lab.hadamard_matrix
fixed_signs = lab.fixed_signs


def random_signs(n: int, generator: torch.Generator) -> torch.Tensor:
    """``n`` independent fair +-1 signs (fp32) drawn from ``generator``, on its device."""
    return lab.random_signs(n, generator)


def rht(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """Random Hadamard transform of ``x``'s last dimension in blocks of
    ``len(signs)`` (16): each block, a row vector, multiplied by
    ``diag(signs) @ H`` (torchao's convention), as fp32 of ``x``'s shape.
    Orthogonal: ``rht_inverse(rht(x)) == x`` to fp32 rounding, and for two
    matrices whose contraction dimension is the last one,
    ``rht(a) @ rht(b).T == a @ b.T`` to rounding."""
    return lab.blockwise(x, lab.transform_matrix(signs, x))


def rht_inverse(y: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`rht`: each block multiplied by the transpose,
    ``H.T @ diag(signs)``, as fp32 of ``y``'s shape."""
    return lab.blockwise(y, lab.transform_matrix(signs, y).T)
