"""``python -m mptrain.formats``: the facts of every format a mixed-precision run touches, as tables.

    python -m mptrain.formats              # both tables below
    python -m mptrain.formats --torch      # only torch's formats
    python -m mptrain.formats --lab        # only the format lab's element formats
    python -m mptrain.formats --recipes    # every named recipe, operand by operand

The first table has one row per torch format a run computes or stores in
(fp32, bf16, fp16, the float8 formats): bits, exponent and mantissa bits,
largest value, smallest normal and subnormal, machine epsilon, and the dynamic
range in binades, all read from ``torch.finfo``.

The second lists every element format the format lab casts to (``precision=lab``,
docs/formats.md): each sign + exponent + mantissa split of 4 to 8 bits in its
default convention (ieee: the top exponent holds inf and NaN; fn: no inf, the
all-ones code is NaN; fin: every code a number), plus ``e4m3ieee``, and int8 and
int4: largest value, smallest normal and subnormal, how many distinct finite
values a cast gives, and the torch or ml_dtypes type it equals bit for bit where
one exists (tests/test_lab.py checks every code and every rounding).

``--recipes`` prints each named recipe (the one vocabulary of
``precision.fp8.recipe``, ``precision.fp4.format``, ``precision.lab.recipe`` and
``monitor.fp8_whatif``) with what it is for and the operand spec of each of the
six operands of a linear's three matmuls (forward, input gradient, weight
gradient). The flags combine.
"""
from __future__ import annotations

from mptrain.core.usage import answer_help

answer_help(__name__, __doc__)  # --help before the imports below load torch (seconds; 20 s on a busy machine)

import sys

import torch

from mptrain.core.process_exit import run_then_leave
from mptrain.core.text import wants_help
from mptrain.precision.formats import format_table, lab_table
from mptrain.precision.recipe import NAMED, NAMED_WHY, ROLES

FLAGS = ("--torch", "--lab", "--recipes")


def recipes_text() -> str:
    """Every named recipe: its name and purpose, then its six operand specs."""
    width = max(len(r) for r in ROLES)
    out = []
    for name, specs in NAMED.items():
        out.append(f"{name}: {NAMED_WHY[name]}")
        out.extend(f"  {role.ljust(width)}  {specs[role]}" for role in ROLES)
    return "\n".join(out)


def main(argv: list[str]) -> int:
    """``python -m mptrain.formats [--torch] [--lab] [--recipes]``: print the
    tables asked for, both format tables without flags (``--help``: the usage)."""
    if wants_help(argv):
        print(__doc__.strip())
        return 0
    bad = [a for a in argv if a not in FLAGS]
    if bad:
        print(f"mptrain.formats: unknown argument {' '.join(bad)}; it takes {', '.join(FLAGS)} or nothing "
              "(python -m mptrain.formats --help).", file=sys.stderr)
        return 2
    want = set(argv) or {"--torch", "--lab"}
    parts = []
    if "--torch" in want:
        parts.append(f"Floating-point formats (from torch.finfo, torch {torch.__version__})\n{format_table()}")
    if "--lab" in want:
        parts.append("The format lab's element formats (from their fields; docs/formats.md)\n" + lab_table())
    if "--recipes" in want:
        parts.append("The named recipes (precision.fp8.recipe, precision.fp4.format, precision.lab.recipe, "
                     "monitor.fp8_whatif; docs/formats.md)\n" + recipes_text())
    print("\n\n".join(parts))
    return 0


if __name__ == "__main__":
    run_then_leave(main, sys.argv[1:])
