"""``python -m mptrain.formats``: the facts of every format a mixed-precision run touches, as a table."""
from __future__ import annotations

import torch

from mptrain.precision.formats import format_table


def main() -> None:
    """``python -m mptrain.formats``: print the table."""
    print(f"Floating-point formats (from torch.finfo, torch {torch.__version__})")
    print(format_table())


if __name__ == "__main__":
    main()
