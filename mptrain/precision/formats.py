"""Facts about the floating-point formats a mixed-precision run touches.

fp32, bf16, fp16 and the two OCP float8 formats (E4M3 "fn": no infinities,
one NaN pattern; E5M2: IEEE-like, with inf). Every number here is derived
from ``torch.finfo`` of the torch dtype, never typed in, so the table is
whatever the installed torch says a cast does. ``mptrain.observe.numerics`` builds its
underflow / subnormal / overflow thresholds from these facts.

``python -m mptrain.formats`` prints the table, and after it the format lab's
element formats (:func:`lab_table`: figures from their fields, in
:mod:`mptrain.precision.elements`).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from mptrain.precision.elements import Element, all_formats, element, overflow_threshold

FORMATS: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "e4m3": torch.float8_e4m3fn,
    "e5m2": torch.float8_e5m2,
}
"""Short name (as used in configs and metric names) -> torch dtype."""
FLOAT8 = ("e4m3", "e5m2")
"""The float8 formats of :data:`FORMATS`: what float8 linears cast to."""


@dataclass(frozen=True)
class FormatInfo:
    """What one format can hold. Values are Python floats (doubles), which
    represent every one of them exactly."""

    name: str
    """Short name, a key of :data:`FORMATS`."""
    dtype: torch.dtype
    """The torch dtype."""
    bits: int
    """Storage width: sign + exponent + mantissa."""
    exponent_bits: int
    """Width of the exponent field (``bits - 1 - mantissa_bits``)."""
    mantissa_bits: int
    """Explicitly stored fraction bits (the implicit leading 1 not counted)."""
    max: float
    """Largest finite value."""
    smallest_normal: float
    """Smallest positive normal value (``finfo.smallest_normal``)."""
    smallest_subnormal: float
    """Smallest positive subnormal value: one unit in the last place at the
    bottom of the exponent range (``smallest_normal * eps``)."""
    eps: float
    """Distance from 1.0 to the next larger value (``2**-mantissa_bits``)."""
    dynamic_range_binades: float
    """``log2(max / smallest_subnormal)``: how many powers of two fit between
    the smallest and the largest non-zero magnitude."""

    @property
    def ulp_of_max(self) -> float:
        """Spacing of representable values just below ``max`` (exact: a power of two)."""
        return 2.0 ** math.floor(math.log2(self.max)) * self.eps


def _derive(name: str) -> FormatInfo:
    dtype = FORMATS[name]
    fi = torch.finfo(dtype)
    eps = float(fi.eps)
    # eps = 2**-m exactly for a binary format with m stored fraction bits.
    mantissa = round(-math.log2(eps))
    assert 2.0 ** -mantissa == eps, f"{name}: finfo.eps={eps} is not a power of two"
    smallest_normal = float(fi.smallest_normal)
    # Subnormals are spaced by one ulp of the smallest binade: smallest_normal * eps.
    smallest_subnormal = smallest_normal * eps
    return FormatInfo(
        name=name,
        dtype=dtype,
        bits=int(fi.bits),
        exponent_bits=int(fi.bits) - 1 - mantissa,  # 1 bit is the sign
        mantissa_bits=mantissa,
        max=float(fi.max),
        smallest_normal=smallest_normal,
        smallest_subnormal=smallest_subnormal,
        eps=eps,
        dynamic_range_binades=math.log2(float(fi.max) / smallest_subnormal),
    )


@functools.lru_cache(maxsize=None)
def info(name: str) -> FormatInfo:
    """The :class:`FormatInfo` of format ``name`` (one of :data:`FORMATS`); cached."""
    if name not in FORMATS:
        raise KeyError(f"unknown format '{name}'; valid formats: {', '.join(FORMATS)}")
    return _derive(name)


def table() -> list[FormatInfo]:
    """Every format, in the order of :data:`FORMATS` (widest first)."""
    return [info(n) for n in FORMATS]


def _num(x: float, spec: str = ".4g") -> str:
    """A compact number; powers of two also as ``2^k``, which is how one thinks of them."""
    k = math.log2(x)
    if k == int(k):
        return f"{x:{spec}} (2^{int(k)})"
    return f"{x:{spec}}"


def _aligned(head: list[str], rows: list[list[str]], left: int, last_left: bool = False) -> str:
    """``rows`` under ``head``: the first ``left`` columns (and the last, with
    ``last_left``) left-aligned, numbers right-aligned so magnitudes line up."""
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i < left or (last_left and i == len(cells) - 1) else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True))).rstrip()
    return "\n".join([line(head), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def format_table() -> str:
    """The table as aligned text, one row per format."""
    head = ["format", "dtype", "bits", "exp", "mant", "max", "smallest normal",
            "smallest subnormal", "eps", "range (binades)"]
    rows = [[f.name, str(f.dtype).replace("torch.", ""), str(f.bits), str(f.exponent_bits),
             str(f.mantissa_bits), _num(f.max, ".6g"), _num(f.smallest_normal), _num(f.smallest_subnormal),
             _num(f.eps), f"{f.dynamic_range_binades:.1f}"] for f in table()]
    return _aligned(head, rows, 2)


# ----------------------------------------------------------------- the format lab's elements
LIBRARY_TYPES: dict[str, str] = {
    "e4m3": "torch.float8_e4m3fn, ml_dtypes.float8_e4m3fn",
    "e5m2": "torch.float8_e5m2, ml_dtypes.float8_e5m2",
    "e3m4": "ml_dtypes.float8_e3m4",
    "e4m3ieee": "ml_dtypes.float8_e4m3",
    "e2m3": "ml_dtypes.float6_e2m3fn",
    "e3m2": "ml_dtypes.float6_e3m2fn",
    "e2m1": "ml_dtypes.float4_e2m1fn (torch.float4_e2m1fn_x2 packs two a byte)",
}
"""Lab element -> the library types it equals bit for bit, every code and every
rounding: what tests/test_lab.py compares (its ``REFERENCES``; tests/test_formats.py
checks that the two lists agree). torch's float4 has no CPU conversion in torch
2.13, so E2M1 is compared with ml_dtypes' and with torchao's E2M1 kernels."""


def finite_values(el: Element) -> int:
    """How many distinct finite values a cast to ``el`` can give: each positive
    value with both signs, and zero once (an integer's ``-2**(N-1)`` is never
    produced: the lab's integer casts are symmetric)."""
    return 2 * len(el.values()) - 1


def lab_table() -> str:
    """The format lab's element formats (:func:`~mptrain.precision.elements.all_formats`,
    each in its default convention, and ``e4m3ieee``, the one other convention a
    library has) as aligned text: fields, convention, range, how many values, and
    the library type each equals."""
    els = all_formats()
    els.insert([e.name for e in els].index("e4m3") + 1, element("e4m3ieee"))
    head = ["element", "conv", "bits", "exp", "mant", "max", "smallest normal", "smallest subnormal",
            "finite values", "equals"]
    rows = [[e.name, e.convention, str(e.bits), *((str(e.exponent), str(e.mantissa)) if e.exponent else "--"),
             _num(e.max, ".6g"), _num(e.min_normal), _num(e.min_subnormal), str(finite_values(e)),
             LIBRARY_TYPES.get(e.name, "-")] for e in els]
    return _aligned(head, rows, 2, last_left=True)



# ----------------------------------------------------------------- thresholds
@dataclass(frozen=True)
class CastThresholds:
    """Magnitudes (fp32 values) where a cast to one format changes behaviour.

    All three are exactly representable in fp32, so comparing an fp32 tensor
    with them is exact (checked when they are built)."""

    name: str
    last_underflow: float
    """Largest |x| that rounds to 0: half the smallest subnormal."""
    first_normal: float
    """Smallest |x| that rounds to a normal value: ``smallest_normal - smallest_subnormal / 2``."""
    first_overflow: float
    """Smallest fp32 |x| that rounds beyond ``max`` (:func:`~mptrain.precision.elements.overflow_threshold`)."""


def _fp32_exact(x: float) -> bool:
    return torch.tensor(x, dtype=torch.float32).item() == x


@functools.lru_cache(maxsize=None)
def thresholds(name: str) -> CastThresholds:
    """The :class:`CastThresholds` of format ``name``, derived from :func:`info`."""
    f = info(name)
    if name == "fp32":
        # Its own thresholds are not fp32 numbers (2^-150...), and an fp32 value
        # cast to fp32 never changes: there is nothing to monitor.
        raise ValueError("thresholds are defined for formats narrower than fp32")
    half_sub = f.smallest_subnormal / 2
    th = CastThresholds(name, last_underflow=half_sub, first_normal=f.smallest_normal - half_sub,
                        first_overflow=overflow_threshold(f.max, f.ulp_of_max))
    for v in (th.last_underflow, th.first_normal, th.first_overflow):
        assert _fp32_exact(v), f"{name}: threshold {v!r} is not an fp32 number"
    return th


def dtype_name(dt: torch.dtype) -> str:
    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    if hasattr(torch, "float8_e4m3fn"):
        names.update({torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"})
    return names.get(dt, str(dt).replace("torch.", ""))
