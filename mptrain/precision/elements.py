"""Element formats of 4 to 8 bits, any of them: their values and their rounding.

One :class:`Element` describes a number format by its fields, so that the
format lab (:mod:`mptrain.precision.lab`) can cast to formats no hardware has
yet. Names (:func:`element`):

- ``eXmY``: a sign bit, ``X`` exponent bits, ``Y`` mantissa bits (``X >= 1``,
  ``1 + X + Y`` from 4 to 8), exponent bias ``2**(X-1) - 1``. The bare name
  follows the convention the OCP and NVIDIA formats give it: ``e4m3`` is OCP's
  E4M3 (no infinity, NaN only where every exponent and mantissa bit is 1:
  torch's ``float8_e4m3fn``), ``e5m2`` and the other 8-bit names are IEEE-like
  (the top exponent holds infinity and NaN: torch's ``float8_e5m2``,
  ``ml_dtypes.float8_e3m4``), and every name under 8 bits is finite (every code
  a number, as OCP's E2M1, E2M3 and E3M2 are).
- a suffix picks another convention: ``ieee`` (top exponent reserved),
  ``fn`` (no infinity; the all-ones code is NaN, like ``float8_e4m3fn``),
  ``fin`` (every code finite). ``e4m3ieee`` is ``ml_dtypes.float8_e4m3``.
- ``intN`` (N from 2 to 8): two's-complement integers; casts are symmetric,
  so a scale maps a block's largest magnitude to ``2**(N-1) - 1`` and the
  code ``-2**(N-1)`` is never produced.

Rounding (:meth:`Element.round`) saturates first (a magnitude above the
largest finite value becomes it, as the hardware's ``satfinite`` conversions
and torchao's clamped casts do), then rounds to nearest, ties to the even code,
or stochastically (up or down to the two neighbours, up with probability the
distance from the lower one over their gap: the mean of the result is the
input). NaN stays NaN. Both work on fp32 with exact operations: dividing by a
power of two and ``torch.round`` (ties to even) on the quotient.
"""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass

import torch

CONVENTIONS = ("ieee", "fn", "fin", "int")
_NAME = re.compile(r"^(?:e(\d)m(\d)(ieee|fn|fin)?|int(\d))$")


def overflow_threshold(top: float, spacing: float) -> float:
    """The first overflow of a format whose largest finite value is ``top`` and
    whose values just below it are ``spacing`` apart: the smallest fp32 magnitude
    that rounding to nearest would carry past ``top`` if a clamp did not stop it.
    That is the midpoint between ``top`` and the next value the grid would have,
    ``top + spacing``; a tie there rounds up when ``top``'s code is odd, else only
    the next fp32 value up does. E2M1: 7; E4M3: 464.00003; fp16: 65520; int8: 127.5.
    Every first overflow (the numerics monitor's thresholds, the cast statistics'
    saturation count) is this one."""
    mid = top + spacing / 2
    if int(top / spacing) % 2:
        return mid
    return torch.nextafter(torch.tensor(mid, dtype=torch.float32),
                           torch.tensor(math.inf, dtype=torch.float32)).item()


@dataclass(frozen=True)
class Element:
    """One element format: its fields and the figures that follow from them."""

    name: str
    bits: int
    exponent: int
    """Exponent bits (0 for integers)."""
    mantissa: int
    """Mantissa bits (for integers, the magnitude bits: ``bits - 1``)."""
    convention: str
    """``ieee``, ``fn``, ``fin`` or ``int`` (the module docstring)."""

    @property
    def bias(self) -> int:
        return 2 ** (self.exponent - 1) - 1 if self.exponent else 0

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal value."""
        return 1 - self.bias

    @property
    def max(self) -> float:
        """The largest finite value."""
        if self.convention == "int":
            return float(2 ** (self.bits - 1) - 1)
        top = 2 ** self.exponent - 1 - self.bias  # the all-ones exponent's value
        if self.convention == "ieee":
            return 2.0 ** (top - 1) * (2 - 2.0 ** -self.mantissa)
        if self.convention == "fn":  # the all-ones mantissa of the top exponent is NaN
            if self.mantissa == 0:  # then the whole top exponent is NaN
                return 2.0 ** (top - 1)
            return 2.0 ** top * (2 - 2.0 ** (1 - self.mantissa))
        return 2.0 ** top * (2 - 2.0 ** -self.mantissa)

    @property
    def emax(self) -> int:
        """floor(log2(max)): the exponent an OCP MX scale subtracts."""
        return math.floor(math.log2(self.max))

    @property
    def min_normal(self) -> float:
        return 1.0 if self.convention == "int" else 2.0 ** self.emin

    @property
    def first_overflow(self) -> float:
        """The smallest magnitude rounding would carry past ``max`` without the clamp
        (:func:`overflow_threshold`): a scaled value this large was clamped, not
        merely rounded to ``max``."""
        return overflow_threshold(self.max, 1.0 if self.convention == "int" else 2.0 ** (self.emax - self.mantissa))

    @property
    def min_subnormal(self) -> float:
        return 1.0 if self.convention == "int" else 2.0 ** (self.emin - self.mantissa)

    @property
    def has_inf(self) -> bool:
        return self.convention == "ieee"

    @property
    def has_nan(self) -> bool:
        return self.convention in ("ieee", "fn")

    def decode(self, code: int) -> float:
        """The value of one ``bits``-wide code (sign bit first), NaN and +-inf included."""
        if self.convention == "int":
            return float(code - (1 << self.bits) if code >> (self.bits - 1) else code)
        sign = -1.0 if code >> (self.bits - 1) else 1.0
        e = (code >> self.mantissa) & ((1 << self.exponent) - 1)
        m = code & ((1 << self.mantissa) - 1)
        top_e = (1 << self.exponent) - 1
        if self.convention == "ieee" and e == top_e:
            return sign * math.inf if m == 0 else math.nan
        if self.convention == "fn" and e == top_e and m == (1 << self.mantissa) - 1:
            return math.nan
        if e == 0:
            return sign * m * 2.0 ** (self.emin - self.mantissa)
        return sign * (1 + m * 2.0 ** -self.mantissa) * 2.0 ** (e - self.bias)

    def values(self) -> list[float]:
        """Every finite non-negative value, increasing (each once: +0 and -0 are 0)."""
        vals = {self.decode(c) for c in range(1 << self.bits)}
        return sorted(v for v in vals if math.isfinite(v) and v >= 0)

    def _spacing(self, a: torch.Tensor) -> torch.Tensor:
        """The gap between neighbouring values around magnitudes ``a`` (fp32,
        ``0 <= a <= max``): ``2**(e - mantissa)`` with ``e`` the exponent of
        ``a``'s binade, at least ``emin``; read off fp32's exponent bits (exact).
        Each binade's ends are grid values, so rounding within it skips none."""
        if self.convention == "int":
            return torch.ones_like(a)
        lo = 2.0 ** self.emin
        p = (a.clamp(min=lo).view(torch.int32) & 0x7F800000).view(torch.float32)
        return p * 2.0 ** -self.mantissa

    def round(self, x: torch.Tensor, stochastic: bool = False) -> torch.Tensor:
        """fp32 ``x`` (already scaled) saturated to +-``max`` and rounded to this
        format's values, as fp32 (the module docstring). A negative value that
        rounds to 0 keeps its sign. ``stochastic`` draws from ``torch.rand_like``:
        the default generator of ``x``'s device, whose state checkpoints save."""
        x = x.float()
        a = x.abs().clamp(max=self.max)
        s = self._spacing(a)
        # a / s is exact (s is a power of two); within one binade the grid is the
        # multiples of s and their parity is the code's: torch.round's ties-to-even
        # on a / s is the format's ties-to-even.
        if stochastic:
            lo = torch.floor(a / s) * s
            q = lo + s * (torch.rand_like(a) < (a - lo) / s)
        else:
            q = torch.round(a / s) * s
            if self.mantissa == 0 and self.convention != "int":
                # one value per binade, so a / s is 1 or 2 and its parity is not the code's:
                # a tie (1.5 s) goes to the even exponent field, s's or 2 s's
                field = ((s.view(torch.int32) >> 23) & 0xFF) - 127 + self.bias
                q = torch.where(a == 1.5 * s, torch.where(field % 2 == 0, s, 2 * s), q)
        return torch.copysign(q, x)

    def describe(self) -> str:
        """One line: the fields and the convention in words."""
        if self.convention == "int":
            return f"{self.bits}-bit integer, symmetric: +-{self.max:g}"
        words = {"ieee": "IEEE-like: the top exponent holds inf and NaN",
                 "fn": "no inf; the all-ones code is NaN",
                 "fin": "every code a finite number"}[self.convention]
        return f"1 sign, {self.exponent} exponent, {self.mantissa} mantissa bits, bias {self.bias}; {words}"


def _default_convention(exponent: int, mantissa: int) -> str:
    bits = 1 + exponent + mantissa
    if bits < 8 or exponent < 2:
        return "fin"
    return "fn" if (exponent, mantissa) == (4, 3) else "ieee"


@functools.lru_cache(maxsize=None)
def element(name: str) -> Element:
    """The element format ``name`` names (the module docstring), or ValueError
    with one sentence saying what is wrong and what is accepted."""
    m = _NAME.match(str(name).strip().lower())
    if not m:
        raise ValueError(f"element format {name!r} is not a name the lab knows: write eXmY (e4m3, e2m1, e3m2), "
                         "optionally with a suffix ieee, fn or fin (e4m3ieee), or intN (int8, int4).")
    if m.group(4):
        bits = int(m.group(4))
        if not 2 <= bits <= 8:
            raise ValueError(f"element format {name!r}: integers from int2 to int8 only (8 bits at most).")
        return Element(f"int{bits}", bits, 0, bits - 1, "int")
    e, mant = int(m.group(1)), int(m.group(2))
    bits = 1 + e + mant
    if e < 1 or not 4 <= bits <= 8:
        raise ValueError(f"element format {name!r} has {bits} bits (1 sign + {e} exponent + {mant} mantissa): "
                         "the lab casts to formats of 4 to 8 bits with at least one exponent bit.")
    conv = m.group(3) or _default_convention(e, mant)
    if conv == "ieee" and e < 2:
        raise ValueError(f"element format {name!r}: an IEEE-like format needs 2 or more exponent bits "
                         "(its top exponent is reserved for inf and NaN).")
    canonical = f"e{e}m{mant}" + ("" if conv == _default_convention(e, mant) else conv)
    return Element(canonical, bits, e, mant, conv)


def all_formats() -> list[Element]:
    """Every element format the lab takes, in its default convention, widest
    first, then the integers: what ``python -m mptrain.formats --lab`` lists."""
    out = []
    for bits in range(8, 3, -1):
        for e in range(bits - 1, 0, -1):
            out.append(element(f"e{e}m{bits - 1 - e}"))
    return out + [element("int8"), element("int4")]
