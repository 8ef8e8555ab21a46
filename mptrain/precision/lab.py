"""The format lab's casts: an operand spec, parsed and applied to a tensor.

An operand spec is ``<element>/<block>/<scale>/<rounding>[/<transform>]``
(docs/formats.md), for one operand of one matmul, laid out as that matmul
contracts it: a 2-D ``(rows, K)`` tensor whose last dimension is the
contraction dimension (:mod:`mptrain.precision.labtrain` transposes operands
to that layout before it casts them).

- element: any :func:`~mptrain.precision.elements.element` name (``e4m3``,
  ``e2m1``, ``e3m2``, ``int8``, ...).
- block, the elements that share one scale: ``tensor`` (all), ``row`` (one
  row: along K), ``column`` (one column, across rows), ``1xN`` (N consecutive
  elements of a row), ``NxN`` (an N x N tile).
- scale, the format of each block's scale:

  - ``fp32``: ``max / amax`` exactly as torchao's tensorwise float8 scales are
    computed (fp64, amax floored at 1e-12, then fp32: :func:`fp32_scale`); the
    elements are multiplied by it and the products divided by it again;
  - ``ue8m0``: a power of two, the OCP MX rule: ``2**(floor(log2 amax) -
    emax)`` with ``emax`` the exponent of the element's largest value, which
    can clamp a block's largest values (by up to 2x for E2M1); ``ue8m0-rceil``
    rounds up instead, the smallest power of two with which the block's
    largest value fits (torchao's MXFP8 and rowwise float8 rule);
  - any other 8-bit-or-narrower float (``e4m3``, ``ue5m3``: a scale is
    positive, so ``u`` only frees the sign bit for the exponent or mantissa):
    NVIDIA's two-level rule: one fp32 scale per tensor, ``amax / (scale max *
    element max)``, and per block ``amax / element max / per-tensor``,
    clamped to the scale format's normal range and rounded to it (ties to
    even). ``e4m3`` over ``e2m1`` in blocks of 16 is NVFP4 bit for bit.
- rounding: ``nearest`` (ties to even) or ``stochastic``.
- transform (optional): ``hadamard`` (a 16 x 16 Hadamard transform of each
  block of 16 along K with one fixed sign vector, the one NVFP4 uses),
  ``hadamard-plain`` (no signs: deterministic), ``hadamard-random`` (signs
  drawn anew at each matmul from the default generator, one vector for both
  operands of that matmul). The transform must be on both operands of a
  matmul: then the product is unchanged in exact arithmetic.

``4over6`` after the scale (``e4m3-4over6``; two-level float scales over
E2M1 only) picks per block the scale that maps the block's largest value to
4 or to 6, whichever gives the smaller error (arXiv 2512.02010); the error
measure is :data:`FOUR_OVER_SIX_ERRORS`.

:func:`cast` returns the pieces (:class:`LabCast`) the statistics need;
:func:`fake_quantize` the round trip. For the named formats they equal
torchao's casts bit for bit: tests/test_fp4.py checks E2M1 in NVFP4 and MXFP4
against torchao, and tests/test_lab.py E4M3 tensorwise, rowwise and MXFP8
against torchao's own casts. They are the one cast engine: training
(:mod:`mptrain.precision.labtrain`) and the cast statistics
(:mod:`mptrain.precision.fp8casts`) both cast with :func:`cast`.
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch

from mptrain.precision.elements import Element, element

ROUNDINGS = ("nearest", "stochastic")
TRANSFORMS = ("hadamard", "hadamard-plain", "hadamard-random")
HADAMARD_SIZE = 16
FOUR_OVER_SIX_ERRORS = ("mse", "l1", "max")
"""How 4over6 compares a block's two candidate casts: summed squared error,
summed absolute error, or the largest absolute error."""
EPS = 1e-12
"""The amax floor of every fp32 scale (torchao's): an all-zero block gets a finite scale."""
F32_TINY = float(torch.finfo(torch.float32).tiny)
_BLOCK = re.compile(r"^(tensor|row|column|1x(\d+)|(\d+)x(\d+))$")


class SpecError(ValueError):
    """An operand spec that does not parse or cannot work; the message is one sentence."""


@dataclass(frozen=True)
class Scale:
    """A block scale's format and rule."""

    kind: str
    """``fp32``, ``pow2`` (ue8m0) or ``float`` (a two-level minifloat scale)."""
    rule: str = ""
    """pow2: ``floor`` or ``rceil``; float: ``""`` or ``4over6``."""
    fmt: Optional[Element] = None
    """float: the scale's own format (unsigned: its sign bit given to the fields)."""
    name: str = ""


@dataclass(frozen=True)
class Operand:
    """One parsed operand spec (the module docstring)."""

    element: Element
    block: tuple[int, int]
    """``(rows, cols)`` of one block; 0 means the whole dimension."""
    block_name: str
    scale: Scale
    rounding: str
    transform: str = ""

    @property
    def spec(self) -> str:
        parts = [self.element.name, self.block_name, self.scale.name, self.rounding]
        return "/".join(parts + ([self.transform] if self.transform else []))

    @property
    def stochastic(self) -> bool:
        return self.rounding == "stochastic"

    def contraction_multiple(self) -> int:
        """What K must be a multiple of (the block's columns, the transform's 16)."""
        m = self.block[1] or 1
        return math.lcm(m, HADAMARD_SIZE) if self.transform else m

    def row_multiple(self) -> int:
        return self.block[0] or 1


def _scale(text: str, el: Element) -> Scale:
    name = text
    base, _, rule = text.partition("-")
    if base == "fp32" and not rule:
        return Scale("fp32", name=name)
    if base == "ue8m0":
        if rule not in ("", "rceil"):
            raise SpecError(f"scale {text!r}: ue8m0 takes the OCP rule (ue8m0) or ue8m0-rceil.")
        return Scale("pow2", rule or "floor", name=name)
    m = re.match(r"^(u?)e(\d)m(\d)$", base)
    if not m or rule not in ("", "4over6"):
        raise SpecError(f"scale {text!r} is not a scale format: write fp32, ue8m0, ue8m0-rceil, or a float such as "
                        "e4m3 or ue5m3 (optionally -4over6).")
    e, mant = int(m.group(2)), int(m.group(3))
    signed = 0 if m.group(1) else 1
    if signed + e + mant > 8 or e < 2:
        raise SpecError(f"scale {text!r}: a float scale has 2 or more exponent bits and 8 bits at most.")
    conv = "fn" if (e, mant) in ((4, 3), (5, 3)) else "fin"
    # built from its fields: an unsigned scale's fields may fill all 8 bits (ue5m3), wider
    # than element() takes for an element; only its range and rounding are used
    fmt = Element(base, 1 + e + mant, e, mant, conv)
    if rule == "4over6" and el.name != "e2m1":
        raise SpecError(f"scale {text!r}: 4over6 chooses between mapping a block's maximum to 4 or to 6, "
                        f"values of e2m1 only, not of {el.name}.")
    # A two-level scale covers the tensor's range with its per-tensor level; its block level
    # must still cover the range inside a block the elements can hold, or blocks within
    # that range of the largest one flush to zero while the elements would have kept them.
    if fmt.max / fmt.min_normal < el.max / el.min_normal:
        raise SpecError(f"scale {text!r} spans a factor of {fmt.max / fmt.min_normal:g} between its smallest "
                        f"normal and largest value, less than the {el.max / el.min_normal:g} of {el.name}'s own "
                        "normal range: it cannot hold the scales of the blocks the elements could; use a scale "
                        "with more exponent bits (ue8m0, e4m3, ue5m3).")
    return Scale("float", rule, fmt, name=name)


def _block(text: str) -> tuple[int, int]:
    m = _BLOCK.match(text)
    if not m:
        raise SpecError(f"block {text!r} is not a block: write tensor, row, column, 1xN or NxN (1x32, 16x16).")
    if text == "tensor":
        return (0, 0)
    if text == "row":
        return (1, 0)
    if text == "column":
        return (0, 1)
    r, c = (1, int(m.group(2))) if m.group(2) else (int(m.group(3)), int(m.group(4)))
    if r < 1 or c < 2:
        raise SpecError(f"block {text!r}: a block needs 2 or more elements along a row.")
    return (r, c)


def parse(spec: str) -> Operand:
    """One operand spec parsed, or :class:`SpecError` naming what is wrong."""
    parts = str(spec).strip().split("/")
    if len(parts) not in (4, 5):
        raise SpecError(f"operand spec {spec!r} has {len(parts)} part(s): write "
                        "<element>/<block>/<scale>/<rounding>[/hadamard], e.g. e2m1/1x16/e4m3/nearest.")
    try:
        el = element(parts[0])
    except ValueError as e:
        raise SpecError(f"operand spec {spec!r}: {e}") from None
    block = _block(parts[1])
    scale = _scale(parts[2], el)
    if parts[3] not in ROUNDINGS:
        raise SpecError(f"operand spec {spec!r}: rounding {parts[3]!r} is not one of {', '.join(ROUNDINGS)}.")
    transform = parts[4] if len(parts) == 5 else ""
    if transform and transform not in TRANSFORMS:
        raise SpecError(f"operand spec {spec!r}: transform {transform!r} is not one of {', '.join(TRANSFORMS)}.")
    if block[0] > 1 and block[1] == 0:
        raise SpecError(f"operand spec {spec!r}: block {parts[1]!r} is not a block.")
    return Operand(el, block, parts[1], scale, parts[3], transform)


# ------------------------------------------------------------------ the cast
class LabCast(NamedTuple):
    """One cast in pieces, blocks shaped ``(groups, block rows, blocks, block cols)``
    and per-block numbers ``(groups, 1, blocks, 1)``."""

    blocks: torch.Tensor
    amax: torch.Tensor
    scaled: torch.Tensor
    """The elements scaled for the cast, before saturation."""
    q: torch.Tensor
    """Their values in the element format (fp32)."""
    multiplier: torch.Tensor
    """What each block was multiplied by before rounding."""
    decode: torch.Tensor
    """What the element values are multiplied by to come back."""


def _grouped(x2: torch.Tensor, op: Operand) -> torch.Tensor:
    """``(rows, K)`` as ``(groups, block rows, blocks, block cols)``; a copy only for ``column``."""
    r, c = x2.shape
    br, bc = op.block
    br, bc = (br or r), (bc or c)
    if r % br or c % bc:
        raise SpecError(f"{op.spec}: a {r} x {c} operand does not split into {op.block_name} blocks "
                        f"({br} x {bc}).")
    return x2.reshape(r // br, br, c // bc, bc)


def _two_level(amax: torch.Tensor, op: Operand, per_tensor: Optional[torch.Tensor], top: Optional[float] = None):
    """(multiplier, decode) of a float block scale under an fp32 per-tensor scale:
    torchao's NVFP4 order of fp32 operations for E4M3 over E2M1, for any pair. Each
    block's maximum is mapped to ``top`` (default the element's largest value; 4over6
    asks for 4), while the per-tensor scale always maps to the largest value."""
    s, el = op.scale.fmt, op.element
    floor = 2.0 ** -126 / s.min_normal  # keeps (1 / per-tensor) / smallest scale finite
    if per_tensor is None:
        per_tensor = amax.max() / (s.max * el.max)
    pts = torch.as_tensor(per_tensor, dtype=torch.float32, device=amax.device).clamp(min=floor)
    sb = s.round(torch.clamp(amax / (top or el.max) / pts, min=s.min_normal, max=s.max))
    decode = pts * sb
    return (1.0 / pts) / sb, decode


def _pow2(amax: torch.Tensor, op: Operand):
    """(multiplier, decode, divisor) of a power-of-two (E8M0) scale."""
    if op.scale.rule == "rceil" and op.block[1] >= 2:
        # Blocks (1xN, NxN): torchao's MX RCEIL, in fp32: 2**ceil(log2(amax / max)) clamped to
        # E8M0's +-127, no amax floor; its quirk kept: a biased exponent of 0 (amax below
        # about 2**-127 x max, zero included) multiplies by 1, not 2**127.
        e = torch.ceil(torch.log2(amax / op.element.max)).clamp(min=-127, max=127)
        mult = torch.where(e == -127, 1.0, torch.exp2(-e))
        mult = torch.where(torch.isnan(amax), math.nan, mult)
        return mult, 1.0 / mult, 1.0 / mult
    if op.scale.rule == "rceil":  # tensor/row/column: torchao's rowwise float8 rule (fp64, amax floored)
        mult = torch.exp2(torch.floor(torch.log2(op.element.max / amax.double().clamp(min=EPS)))).float()
        return mult, 1.0 / mult, 1.0 / mult
    # OCP: 2**(exponent field of amax - emax), E8M0's range; torchao divides by it floored
    # at 2**-126 but multiplies back by the unfloored one (2**-127 at the very bottom).
    e = ((amax.detach().view(torch.int32) >> 23) & 0xFF) - 127 - op.element.emax
    biased = (e.clamp(min=-127, max=128) + 127).to(torch.int32)
    pow2 = torch.where(biased == 0, 0x00400000, biased << 23).view(torch.float32)
    pow2 = torch.where(torch.isnan(amax), math.nan, pow2)
    divisor = pow2.clamp(min=F32_TINY)
    return 1.0 / divisor, pow2, divisor


def fp32_scale(amax: torch.Tensor, top: float, margin: int = 0) -> torch.Tensor:
    """The fp32 scale rule: ``top / (amax * 2**margin)`` computed in fp64 from the
    amax floored at :data:`EPS`, then rounded to fp32, the way torchao computes its
    tensorwise float8 scales (with ``margin`` 0 the same bits). Every fp32 scale is
    this one: the lab's ``fp32`` blocks and the delayed-scaling float8 linears'."""
    return (top / (amax.double().clamp(min=EPS) * 2.0 ** margin)).float()


def _scaled(blocks: torch.Tensor, amax: torch.Tensor, op: Operand, per_tensor, given=None):
    """(multiplier, decode, scaled elements). ``given``: fp32 multipliers instead of the rule's."""
    kind = op.scale.kind
    if kind == "fp32":
        mult = fp32_scale(amax, op.element.max) if given is None else given
        return mult, 1.0 / mult, blocks * mult
    if kind == "pow2":
        mult, decode, divisor = _pow2(amax, op)
        # torchao divides by the MX power of two (the same value as multiplying by its reciprocal)
        return mult, decode, blocks / divisor
    mult, decode = _two_level(amax, op, per_tensor)
    return mult, decode, blocks * mult


@dataclass(frozen=True)
class Split:
    """An operand that is one rank's part of a tensor split over tensor-parallel
    ranks: along its rows (``dim`` 0) or its contraction dimension (``dim`` 1).
    ``reduce_max`` all-reduces a tensor with MAX over those ranks."""

    dim: int
    reduce_max: Callable[[torch.Tensor], torch.Tensor]


def cast(x: torch.Tensor, op: Operand, *, per_tensor: Optional[torch.Tensor] = None,
         signs: Optional[torch.Tensor] = None, error: str = "mse", split: Optional[Split] = None,
         scale: Optional[torch.Tensor] = None) -> LabCast:
    """``x`` (its last dimension the contraction dimension; leading ones flattened
    into rows) cast as ``op`` says, in pieces. ``signs``: the Hadamard sign vector
    when ``op`` has a transform (the caller draws it, so both operands of a matmul
    share one). ``per_tensor``: a two-level scale's fp32 per-tensor scale instead
    of the tensor's own. ``error``: 4over6's measure. ``split``: ``x`` is a part
    of the tensor one process would cast; its scales are then the whole tensor's
    (blocks must not straddle the parts: the config checks refuse those).
    ``scale``: an ``fp32`` scale's multipliers given instead of computed, one per
    block in block order (or one for all): the stale scales of delayed scaling, or
    those a float8 all-gather cast with."""
    x2 = x.detach().float().reshape(-1, x.shape[-1]) if x.dim() else x.detach().float().reshape(1, 1)
    if op.transform:
        x2 = hadamard(x2, transform_signs(op, x2.device) if signs is None else signs)
    blocks = _grouped(x2, op)
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True)
    if split is not None:
        amax, per_tensor = _whole(amax, op, per_tensor, split)
    given = None
    if scale is not None:
        if op.scale.kind != "fp32":
            raise SpecError(f"{op.spec}: given scales are fp32 multipliers; {op.scale.name} scales follow their rule.")
        given = scale.detach().float().reshape(-1).expand(amax.numel()).reshape(amax.shape)
    mult, decode, scaled = _scaled(blocks, amax, op, per_tensor, given)
    q = op.element.round(scaled, op.stochastic)
    if op.scale.rule == "4over6":
        mult, decode, scaled, q = _four_over_six(blocks, amax, op, per_tensor, error, (mult, decode, scaled, q))
    return LabCast(blocks, amax, scaled, q, mult, decode)


def _whole(amax: torch.Tensor, op: Operand, per_tensor: Optional[torch.Tensor], split: Split):
    """The block amaxes and the per-tensor scale of a split tensor's part made the
    whole tensor's: a block that spans the split dimension (a tensor, row or
    column scale) takes the MAX over the parts, and so does the amax a two-level
    per-tensor scale is taken from. Blocks within a part are already whole."""
    if op.block[split.dim] == 0:
        amax = split.reduce_max(amax)
    if per_tensor is None and op.scale.kind not in ("fp32", "pow2"):
        per_tensor = split.reduce_max(amax.max()) / (op.scale.fmt.max * op.element.max)
    return amax, per_tensor


def _four_over_six(blocks, amax, op: Operand, per_tensor, error: str, six):
    """Per block, the cast whose scale maps the block maximum to 4 where that errs
    less (by ``error``) than ``six``, the standard cast that maps it to 6; ties keep 6.
    The per-tensor scale is the standard one (amax / (scale max * 6)), so a block
    whose maximum-to-4 scale would pass the scale format's largest value clamps
    there, errs more, and keeps 6."""
    mult4, decode4 = _two_level(amax, op, per_tensor, top=4.0)
    scaled4 = blocks * mult4
    q4 = op.element.round(scaled4, op.stochastic)
    e6, e4 = blocks - six[3] * six[1], blocks - q4 * decode4
    if error == "mse":
        m6, m4 = e6.square().sum((1, 3), keepdim=True), e4.square().sum((1, 3), keepdim=True)
    elif error == "l1":
        m6, m4 = e6.abs().sum((1, 3), keepdim=True), e4.abs().sum((1, 3), keepdim=True)
    else:
        m6, m4 = e6.abs().amax((1, 3), keepdim=True), e4.abs().amax((1, 3), keepdim=True)
    use4 = m4 < m6
    return tuple(torch.where(use4, a, b) for a, b in zip((mult4, decode4, scaled4, q4), six))


def fake_quantize(x: torch.Tensor, op: Operand, *, per_tensor: Optional[torch.Tensor] = None,
                  signs: Optional[torch.Tensor] = None, error: str = "mse", split: Optional[Split] = None
                  ) -> torch.Tensor:
    """The round trip of :func:`cast` (values in the element format times their
    scales) as fp32 of ``x``'s shape; with a transform, still in the transformed
    basis (the matmul contracts it there)."""
    c = cast(x, op, per_tensor=per_tensor, signs=signs, error=error, split=split)
    return round_trip(c, op).reshape(x.shape)


def round_trip(c: LabCast, op: Operand) -> torch.Tensor:
    """The element values of cast ``c`` brought back to the input's scale, in blocks:
    what a matmul multiplies and what the cast statistics measure the error of."""
    # An fp32 scale is divided out, as torchao's float8 dequantization does (data / scale);
    # times its rounded reciprocal would differ in the last bit.
    return c.q / c.multiplier if op.scale.kind == "fp32" else c.q * c.decode


# ------------------------------------------------------------------ Hadamard
def hadamard_matrix(n: int = HADAMARD_SIZE) -> torch.Tensor:
    """The ``n x n`` Hadamard matrix of Sylvester's construction (``n`` a power
    of two; entry ``(i, j)`` is ``(-1)**popcount(i & j)``, the order torchao's
    table uses), divided by ``sqrt(n)``: orthonormal and symmetric, fp32."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Sylvester Hadamard matrix needs a power of two; got n={n}.")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def random_signs(n: int, generator: Optional[torch.Generator] = None, device=None) -> torch.Tensor:
    """``n`` independent fair +-1 signs (fp32) drawn from ``generator`` (default:
    the default generator of ``device``)."""
    dev = generator.device if generator is not None else device
    return torch.randint(0, 2, (n,), generator=generator, device=dev).float() * 2 - 1


@functools.lru_cache(maxsize=None)
def fixed_signs(device: torch.device, n: int = HADAMARD_SIZE) -> torch.Tensor:
    """The one Hadamard sign vector mptrain uses wherever signs are fixed (NVFP4's
    weight-gradient transform, the ``hadamard`` transform, the cast statistics):
    drawn from a private generator seeded 0, so it is the same for every layer,
    rank and run and draws nothing from the run's generators; never written to."""
    return random_signs(n, torch.Generator().manual_seed(0)).to(device)


@functools.lru_cache(maxsize=None)
def _hadamard_on(n: int, device: torch.device) -> torch.Tensor:
    """:func:`hadamard_matrix` on ``device``, built once (never written to)."""
    return hadamard_matrix(n).to(device)


def transform_matrix(signs: Optional[torch.Tensor], x: torch.Tensor, n: int = HADAMARD_SIZE) -> torch.Tensor:
    """``diag(signs) @ H`` (``H`` alone for ``signs`` None) in fp32 on ``x``'s
    device, after checking that ``x``'s last dimension splits into blocks of n."""
    n = signs.numel() if signs is not None else n
    if x.dim() == 0 or x.shape[-1] % n:
        raise ValueError(f"a Hadamard transform in blocks of {n} needs a last dimension that is a "
                         f"multiple of {n}; got shape {tuple(x.shape)}.")
    h = _hadamard_on(n, x.device)
    return h if signs is None else signs.to(device=x.device, dtype=torch.float32).reshape(-1, 1) * h


def blockwise(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Each block of ``len(m)`` of ``x``'s last dimension times ``m``, in fp32
    whatever autocast says (inside a bf16 autocast region the matmul would
    otherwise run in bf16 and round the transform). A small matmul: 4x faster
    here than the fast Walsh-Hadamard transform's stages in eager ops."""
    n = m.shape[0]
    with torch.autocast(x.device.type, enabled=False):
        return (x.float().reshape(*x.shape[:-1], -1, n) @ m).reshape(x.shape)


def transform_signs(op: Operand, device) -> Optional[torch.Tensor]:
    """The sign vector of ``op``'s transform: the fixed one (``hadamard``), none
    (``hadamard-plain``) or a new draw from ``device``'s default generator
    (``hadamard-random``: draw once per matmul and hand it to both operands)."""
    if op.transform == "hadamard":
        return fixed_signs(torch.device(device))
    if op.transform == "hadamard-random":
        return random_signs(HADAMARD_SIZE, device=device)
    return None


def hadamard(x: torch.Tensor, signs: Optional[torch.Tensor]) -> torch.Tensor:
    """Each block of 16 of ``x``'s last dimension times ``diag(signs) @ H``
    (``signs`` None: ``H`` alone), as fp32 of ``x``'s shape. Orthogonal: for two
    matrices contracted along their last dimension, ``hadamard(a) @
    hadamard(b).T == a @ b.T`` up to rounding."""
    return blockwise(x, transform_matrix(signs, x))


def hadamard_inverse(y: torch.Tensor, signs: Optional[torch.Tensor]) -> torch.Tensor:
    """The inverse of :func:`hadamard`: each block times the transpose."""
    return blockwise(y, transform_matrix(signs, y).T)
