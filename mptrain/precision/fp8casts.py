"""What a float8 cast does to a tensor, for each way of choosing its scales.

A float8 cast multiplies a tensor by a scale, clamps it to the format's
largest value and rounds it to float8. Each recipe chooses the scales
differently:

- ``tensorwise``: one scale for the tensor, ``max / amax`` (torchao's
  tensorwise recipe);
- ``rowwise``: one per row of the tensor's last dimension, rounded down to a
  power of two (torchao's rowwise recipes);
- ``block1x32``: one per 32 consecutive elements of a row, a power of two as
  in the OCP MX formats (E8M0 scales). ``mx_rounding`` picks the exponent:
  ``rceil`` rounds ``amax / max`` up, so nothing saturates (torchao's MXFP8
  training recipes); ``floor`` is the spec's rule, which can clamp a block's
  largest values by up to 2x;
- ``block1x128`` and ``block128x128``: one fp32 scale, ``max / amax``, per 128
  consecutive elements of a row, or per 128 x 128 tile (DeepSeek-V3's
  activation and weight blocks).

Three 4-bit recipes cast to E2M1 instead (``fmt="e2m1"``, the only format
they take), with the scales of :mod:`mptrain.precision.fp4`, rounding to
nearest (never stochastically: a statistic must not draw from the run's
random numbers):

- ``nvfp4``: blocks of 16 with E4M3 block scales under an fp32 per-tensor
  scale (``fp4.fake_quantize(t, "nvfp4")``);
- ``nvfp4_rht``: the same after a random Hadamard transform of each block of
  16 (``fp4.rht``, one fixed sign vector), as NVIDIA's recipe treats the
  operands of the weight-gradient matmul;
- ``mxfp4``: blocks of 32 with power-of-two (E8M0) scales, the OCP rule.

A last dimension that is not a multiple of the block is padded with zeros,
as the float8 blocks are. The 4-bit recipes are the format lab's casts
(:data:`FP4_SPECS`, through :func:`lab_counts`).

Any named recipe of the format lab (:data:`LAB_RECIPES`, the names
``precision.lab.recipe`` takes besides ``nvfp4`` and ``mxfp4``, which keep
the meaning above) and a lab run's own recipe are measured through
:func:`lab_counts`, the lab's own :func:`~mptrain.precision.lab.cast`: each
operand with the spec of the matmul it enters first, laid out with its
contraction dimension last as it arrives (:data:`STAT_ROLES`: the input with
``fwd_input``'s spec, the weight with ``fwd_weight``'s, the output gradient
with ``dgrad_grad_output``'s). Not modelled: the input gradient's transposed
weight (``dgrad_weight``) and the weight gradient's operands (``wgrad_*``),
blocked along the tokens. Rounding is to nearest, a Hadamard transform uses
the fixed sign vector, and rows or columns a block does not divide are
padded with zeros.

:func:`cast_counts` returns, for one tensor and one recipe, the sums a
statistic needs, so that shards can be added up (and amaxes maxed) before
anything is read back. :func:`summarize` turns them into figures:

- ``flush``: the share of non-zero elements that become 0;
- ``saturate``: the share that the clamp to the format's largest value
  changed (beyond rounding to it: the numerics monitor's overflow threshold;
  for E2M1, a scaled magnitude of 7 or more, ``fp4.E2M1_FIRST_OVERFLOW``: up
  to 7 a value would round to 6 without the clamp; any lab element's is
  :func:`first_overflow`);
- ``sqnr_db``: the signal-to-quantization-noise ratio of the round trip
  (x cast, then divided by its scale), in dB;
- ``scale_min`` / ``scale_max``: the smallest and largest scale used: the
  multiplier a group is cast with (for nvfp4 the per-tensor and block scales
  together, ``1 / fp4.block_scales``);
- ``amax``: the largest magnitude seen.

Everything stays on the device: no host sync.

:class:`CastWatch` applies this to a run: on the numerics monitor's steps it
hooks every float8 linear and measures the casts of its three float8
operands, with the run's own scales and with the other recipes' (what-if),
from the same tensors.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Union

import torch

from mptrain.precision import fp4, lab, labtrain
from mptrain.precision.elements import Element
from mptrain.precision.formats import thresholds
from mptrain.precision.fp8delayed import EPS, scale_from_amax  # noqa: F401  EPS: the amax floor of every recipe here

FP8_RECIPES = ("tensorwise", "rowwise", "block1x32", "block1x128", "block128x128")
FP4_RECIPES = ("nvfp4", "nvfp4_rht", "mxfp4")
RECIPES = FP8_RECIPES + FP4_RECIPES
FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
"""The float8 element formats; the 4-bit recipes' is :data:`FP4_FORMAT`."""
FP4_FORMAT = "e2m1"

# [n_nonzero, n_flush, n_saturate, signal (sum x^2), noise (sum (x - x~)^2)]; then maxima
# [amax, scale_max, -scale_min] (scale_min negated so that every maximum reduces with max).
SUMS = ("nonzero", "flush", "saturate", "signal", "noise")
MAXES = ("amax", "scale_max", "neg_scale_min")


def _groups(x: torch.Tensor, recipe: str) -> torch.Tensor:
    """``x`` (2-D) viewed as ``(groups, elements)``: each row of the result
    shares one scale. Rows (or tile rows and columns) that do not divide evenly
    are padded with zeros, which change no amax and count as no element."""
    r, c = x.shape
    if recipe == "tensorwise":
        return x.reshape(1, -1)
    if recipe == "rowwise":
        return x
    if recipe in ("block1x32", "block1x128"):
        b = 32 if recipe == "block1x32" else 128
        x = torch.nn.functional.pad(x, (0, (-c) % b))
        return x.reshape(-1, b)
    if recipe == "block128x128":
        x = torch.nn.functional.pad(x, (0, (-c) % 128, 0, (-r) % 128))
        rr, cc = x.shape
        return x.reshape(rr // 128, 128, cc // 128, 128).permute(0, 2, 1, 3).reshape(-1, 128 * 128)
    raise ValueError(f"unknown recipe {recipe!r}; one of {', '.join(RECIPES)}")


def scales(amax: torch.Tensor, recipe: str, fmt: str = "e4m3", mx_rounding: str = "rceil") -> torch.Tensor:
    """The multiplier each group is cast with, from its ``amax`` (fp32)."""
    top = torch.finfo(FORMATS[fmt]).max
    amax = amax.double().clamp(min=EPS)
    if recipe == "block1x32":
        if mx_rounding == "rceil":  # smallest power of two with amax * s <= max
            return torch.exp2(torch.floor(torch.log2(top / amax))).float()
        if mx_rounding == "floor":  # OCP MX: shared exponent floor(log2 amax) - emax of the element format
            emax = math.floor(math.log2(top))
            return torch.exp2(emax - torch.floor(torch.log2(amax))).float()
        raise ValueError(f"mx_rounding={mx_rounding!r}: one of rceil, floor")
    s = scale_from_amax(amax, FORMATS[fmt])  # max / amax, computed as torchao computes it
    if recipe == "rowwise":
        s = torch.exp2(torch.floor(torch.log2(s)))  # torchao rounds rowwise scales down to a power of two
    return s


def element_format(recipe: str, run_format: str) -> str:
    """The element format ``recipe`` casts an operand to when the run itself
    casts it to ``run_format``: E2M1 for the 4-bit recipes; the run's float8
    format for the float8 ones, and E4M3 when the run's is E2M1 (a 4-bit run
    asks what float8 with these scales would do: E4M3 is the float8 format of
    rowwise and MX recipes for every operand, so the comparison is about scales)."""
    if recipe in FP4_RECIPES:
        return FP4_FORMAT
    return run_format if run_format in FORMATS else "e4m3"


def cast_counts(t: torch.Tensor, recipe: Union[str, lab.Operand], fmt: str | None = None,
                mx_rounding: str = "rceil", scale: torch.Tensor | None = None,
                error: str = "mse") -> tuple[torch.Tensor, torch.Tensor]:
    """``(sums, maxima)`` of casting ``t`` to ``fmt`` with ``recipe``'s scales
    (fp64 ``SUMS`` and fp32 ``MAXES``, see the module docstring). The last
    dimension is the row; leading dimensions are flattened into rows.
    ``fmt``: a float8 format (default ``e4m3``) for the float8 recipes,
    ``e2m1`` (the default) for the 4-bit ones; any other pairing raises
    ValueError. ``scale``: use these scales instead of computing them from
    ``t`` (shaped as the groups: one per group), as a recipe with stale scales
    would (float8 recipes only). ``recipe`` may be a lab operand
    (:func:`lab_operand`): then :func:`lab_counts` (``fmt`` None or its element)."""
    if isinstance(recipe, lab.Operand):
        if fmt not in (None, recipe.element.name) or scale is not None:
            raise ValueError(f"lab operand {recipe.spec} casts to {recipe.element.name} with its own scales; "
                             f"got fmt={fmt!r} and {'a' if scale is not None else 'no'} given scale.")
        return lab_counts(t, recipe, error)
    if recipe in LAB_RECIPES:
        raise ValueError(f"recipe {recipe} is a lab recipe with a spec per operand: measure each operand "
                         "with lab_operand(recipe, operand).")
    x = t.detach().float()
    x = x.reshape(1, -1) if x.dim() < 2 else x.reshape(-1, x.shape[-1])
    if recipe in FP4_RECIPES:
        return _fp4_counts(x, recipe, fmt, scale)
    fmt = "e4m3" if fmt is None else fmt
    if fmt not in FORMATS:
        raise ValueError(f"recipe {recipe} casts to float8 ({', '.join(FORMATS)}), not {fmt!r}; "
                         f"E2M1 goes with {', '.join(FP4_RECIPES)}.")
    g = _groups(x, recipe)
    amax = g.abs().amax(dim=1)
    s = scales(amax, recipe, fmt, mx_rounding) if scale is None else scale.float().reshape(-1)
    top = torch.finfo(FORMATS[fmt]).max
    # Clamped means: would not have rounded to the largest value without the clamp (the
    # numerics monitor's overflow threshold), not merely a product a rounding above it.
    overflow = thresholds(fmt).first_overflow
    scaled = g * s[:, None]
    q = scaled.clamp(-top, top).to(FORMATS[fmt]).float()
    # The round trip's error in fp32 is exact: a value cast within a factor of 2 of itself
    # subtracts exactly (Sterbenz), and a flushed one leaves itself. Sums of squares
    # accumulate in fp64 (vector_norm's dtype; it upcasts a temporary fp64 copy of
    # the tensor, 8 bytes per value, one tensor at a time: measured on torch 2.13 CPU).
    err = g - q / s[:, None]
    s_live = s.expand_as(amax) if s.numel() == 1 else s
    return _stack(g, g != 0, q == 0, scaled.abs() >= overflow, err, amax, s_live)


def _stack(g: torch.Tensor, nonzero: torch.Tensor, zero: torch.Tensor, clamped: torch.Tensor, err: torch.Tensor,
           amax: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sums, maxima)`` in the layout of :data:`SUMS` and :data:`MAXES`, from the
    elements ``g``, which of them are non-zero, cast to zero and clamped, the
    round trip's error, and each group's amax and scale (same shapes as each other)."""
    sums = torch.stack([
        nonzero.sum().double(),
        (nonzero & zero).sum().double(),
        clamped.sum().double(),
        torch.linalg.vector_norm(g, dtype=torch.float64).square(),
        torch.linalg.vector_norm(err, dtype=torch.float64).square(),
    ])
    # The scale range over groups holding a non-zero value: an all-zero group's scale
    # (from the EPS floor, ~1e14) scales nothing and would hide the real range.
    live = amax > 0
    maxes = torch.stack([amax.max(), torch.where(live, s, 0.0).max(), -torch.where(live, s, math.inf).min()])
    return sums, maxes


RHT_SIGNS = fp4.fixed_signs(torch.device("cpu"))
"""The one sign vector of every ``nvfp4_rht`` statistic (``fp4.fixed_signs``: a private
seed-0 generator, nothing drawn from the run's, the same on every step and rank)."""

FP4_SPECS = {**fp4.SPECS, "nvfp4_rht": fp4.SPECS["nvfp4"] + "/hadamard"}
"""The 4-bit statistics' casts as lab operand specs, the same for every operand (the
weight too: in blocks of 16 along a row, not NVFP4 training's 16 x 16 tiles)."""
LAB_RECIPES = tuple(n for n in labtrain.NAMED if n not in RECIPES)
"""The named lab recipes the statistics take besides :data:`RECIPES` (``nvfp4`` and
``mxfp4`` are both: they keep the meaning above, which for their input and output
gradient is the lab recipe's cast with nearest rounding)."""
WHATIFS = RECIPES + LAB_RECIPES
STAT_ROLES = labtrain.STAT_ROLES
"""Which lab operand measures each tensor (:data:`mptrain.precision.labtrain.STAT_ROLES`)."""


def first_overflow(el: Element) -> float:
    """The smallest magnitude that rounding ``el`` to nearest would carry past its
    largest value if the clamp did not stop it: the midpoint between ``max`` and
    the next value the grid would have, ``max + spacing``; a tie there rounds up
    when ``max``'s code is odd, else only values above it do (the next fp32 up).
    E2M1: 7 (:data:`fp4.E2M1_FIRST_OVERFLOW`); E4M3: 464.00003; int8: 127.5."""
    step = 1.0 if el.convention == "int" else 2.0 ** (el.emax - el.mantissa)
    mid = el.max + step / 2
    if int(el.max / step) % 2:
        return mid
    return torch.nextafter(torch.tensor(mid), torch.tensor(math.inf)).item()


def lab_operand(recipe: Union[str, labtrain.LabRecipe], operand: str) -> Optional[lab.Operand]:
    """The lab cast that measures ``operand`` (input, weight, grad_output) for
    ``recipe`` (a name of :data:`LAB_RECIPES`, or a run's own recipe), rounding
    to nearest; None where the recipe leaves that operand unquantized."""
    specs = labtrain.NAMED[recipe] if isinstance(recipe, str) else recipe.specs
    spec = specs[STAT_ROLES[operand]]
    if spec == labtrain.NONE:
        return None
    return lab.parse(spec.replace("/stochastic", "/nearest"))


def lab_counts(t: torch.Tensor, op: lab.Operand, error: str = "mse") -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`cast_counts` of one lab operand cast (:func:`mptrain.precision.lab.cast`,
    the training casts' own code). ``t``'s last dimension is the contraction
    dimension; leading ones are flattened into rows. Rounding is to nearest
    whatever ``op`` says (a statistic draws nothing from the run's generators), and
    a Hadamard transform uses the fixed sign vector (``hadamard-plain``: none).
    Rows and columns that do not divide the block are padded with zeros (no amax,
    no element). Measured on the transformed tensor (see :func:`_fp4_counts`).
    ``error``: 4over6's measure."""
    if op.stochastic:
        op = dataclasses.replace(op, rounding="nearest")
    x = t.detach().float()
    x = x.reshape(1, -1) if x.dim() < 2 else x.reshape(-1, x.shape[-1])
    pad_c, pad_r = (-x.shape[1]) % op.contraction_multiple(), (-x.shape[0]) % op.row_multiple()
    if pad_c or pad_r:
        x = torch.nn.functional.pad(x, (0, pad_c, 0, pad_r))
    signs = None if op.transform in ("", "hadamard-plain") else lab.fixed_signs(x.device)
    c = lab.cast(x, op, signs=signs, error=error)
    # The error is exact in fp32 (Sterbenz): a value not flushed comes back within a
    # factor of 2 of itself; a clamped one from at most 2x the largest value.
    err = c.blocks - lab.round_trip(c, op)
    amax, mult = torch.broadcast_tensors(c.amax, c.multiplier)
    clamped = c.scaled.abs() >= first_overflow(op.element)
    return _stack(c.blocks, c.blocks != 0, c.q == 0, clamped, err, amax, mult)


def _fp4_counts(x: torch.Tensor, recipe: str, fmt: str | None,
                scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`cast_counts` of a 4-bit recipe, for ``x`` fp32 ``(rows, cols)``: the lab
    cast of :data:`FP4_SPECS`. ``nvfp4_rht`` is measured on the transformed tensor,
    not transformed back: the format holds the transformed values (their flush and
    saturation are the cast's), the matmul contracts them as they are
    (rht(a) @ rht(b).T = a @ b.T), and the transform is orthogonal, so the noise
    energy, hence the SQNR, is the same either side."""
    if fmt not in (None, FP4_FORMAT):
        raise ValueError(f"recipe {recipe} casts to {FP4_FORMAT}, not {fmt!r}.")
    if scale is not None:
        raise ValueError(f"recipe {recipe}: given (stale) scales are modelled for the float8 recipes only.")
    return lab_counts(x, lab.parse(FP4_SPECS[recipe]))


def summarize(sums: torch.Tensor, maxes: torch.Tensor) -> dict[str, float]:
    """The figures of (possibly reduced) :func:`cast_counts` results, read back once."""
    n, flush, sat, signal, noise = sums.tolist()
    amax, smax, neg_smin = maxes.tolist()
    if noise > 0:
        sqnr = 10 * math.log10(signal / noise) if signal > 0 else -math.inf
    else:
        sqnr = math.inf
    return {"flush": flush / n if n else 0.0, "saturate": sat / n if n else 0.0, "sqnr_db": sqnr,
            "amax": amax, "scale_min": -neg_smin, "scale_max": smax}


