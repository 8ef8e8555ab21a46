"""``python -m mptrain.formats``: the facts of every format a mixed-precision run touches, as a table.

    python -m mptrain.formats

One row per format (fp32, bf16, fp16, the float8 formats): bits, exponent and
mantissa bits, largest value, smallest normal and subnormal, machine epsilon,
and the dynamic range in binades, all read from ``torch.finfo``. Takes no
arguments; ``--help`` prints this.
"""
from __future__ import annotations

import sys

import torch

from mptrain.core.process_exit import run_then_leave
from mptrain.core.text import wants_help
from mptrain.precision.formats import format_table


def main(argv: list[str]) -> int:
    """``python -m mptrain.formats``: print the table (``--help``: the usage)."""
    if wants_help(argv):
        print(__doc__.strip())
        return 0
    if argv:
        print(f"mptrain.formats: takes no arguments (got {' '.join(argv)}); run python -m mptrain.formats.",
              file=sys.stderr)
        return 2
    print(f"Floating-point formats (from torch.finfo, torch {torch.__version__})")
    print(format_table())
    return 0


if __name__ == "__main__":
    run_then_leave(main, sys.argv[1:])
