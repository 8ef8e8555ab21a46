"""Plain-text output shared by every layer: durations, numbers, tables, and a
log callback that says nothing."""
from __future__ import annotations

from typing import Optional


def duration(seconds: float) -> str:
    """``42s``, ``3m05s``, ``1h02m``: elapsed and remaining times on progress lines."""
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    return f"{s // 60}m{s % 60:02d}s" if s < 3600 else f"{s // 3600}h{s % 3600 // 60:02d}m"


def fmt(x: Optional[float], spec: str = ".4f") -> str:
    """``x`` in ``spec``; ``n/a`` only for None (nothing measured). A non-finite
    value keeps its name (``nan``, ``inf``, ``-inf``): a NaN loss is a result to
    see, not a missing one."""
    return "n/a" if x is None else format(x, spec)


def text_table(head: list[str], rows: list[list[str]]) -> list[str]:
    """``head`` and ``rows`` as left-aligned columns separated by `` | ``, with a
    ``-+-`` rule under the head: the console tables (dtype audit, float8 casts)."""
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]

    def line(cells: list[str]) -> str:
        return " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    return [line(head), "-+-".join("-" * w for w in widths), *(line(r) for r in rows)]


def quiet(*_a, **_k) -> None:
    """A ``log``/``say`` callback that prints nothing: for the ranks that must not
    speak and for checks whose findings the caller reports itself."""


HELP_FLAGS = ("-h", "--help")


def wants_help(argv: list[str]) -> bool:
    """Whether a command line asks for a command's usage (``-h`` / ``--help``
    anywhere in it): a command prints its usage and exits 0 then, without
    doing its work or handing the flag to Hydra (which cannot parse it)."""
    return any(a in HELP_FLAGS for a in argv)

