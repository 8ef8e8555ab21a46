"""How far rotary embeddings are from exact when their angle tables are bf16, by position.

    python scripts/rope_error.py [--out docs/llama_rope_error.png] [--theta 500000] [--head-dim 128]

Rotates random vectors with ``model.rope_dtype=bf16`` tables, with the fp32
tables mptrain builds by default, and exactly (float64), at every position up
to 8192 and in windows up to 131072 (``mptrain.model.llama.rope_error_by_position``),
then prints the mean relative error per window and draws both curves on a
log-log figure. Llama 3's base (500000) and head size (128) by default.
"""
from __future__ import annotations

import argparse
import os
import sys


def arguments() -> argparse.ArgumentParser:
    """The command line's parser. Defined before any heavy import, so that ``--help``
    answers without loading torch."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--out", default=None, help="where to save the figure (PNG); none: print only")
    ap.add_argument("--theta", type=float, default=500000.0, help="the rotary base (model.rope_theta)")
    ap.add_argument("--head-dim", type=int, default=128, help="the head size (d_model / n_head)")
    return ap


if __name__ == "__main__":
    arguments().parse_known_args()  # --help answered here, before torch's import (20 s when busy)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mptrain.model.llama import rope_error_by_position  # noqa: E402

# every position to 8K in windows of 256; beyond, windows of 256 positions around each power of two to 128K
NEAR = [(0, 8192, 256)]
FAR = [2 ** k for k in range(14, 18)]


def measure(theta: float, head_dim: int) -> list[tuple[int, int, float, float]]:
    """(first, last position, bf16 error, fp32 error) per window."""
    out = []
    r = rope_error_by_position(range(0, 8192), theta, head_dim, bucket=256, samples=8)
    out += list(zip(r["first"], r["last"], r["bf16"], r["fp32"], strict=True))
    for p in FAR:
        r = rope_error_by_position(range(p - 256, p), theta, head_dim, bucket=256, samples=8)
        out += list(zip(r["first"], r["last"], r["bf16"], r["fp32"], strict=True))
    return out


def main(argv: list[str]) -> int:
    a = arguments().parse_args(argv)
    rows = measure(a.theta, a.head_dim)
    print(f"rotary error, mean |rotated - exact| / |x| (theta {a.theta:g}, head size {a.head_dim})")
    print(f"{'positions':>15} | {'bf16 tables':>11} | {'fp32 tables':>11}")
    for first, last, b, f in rows:
        print(f"{first:>7}-{last:<7} | {b:11.3e} | {f:11.3e}")
    if a.out:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        mid = [(f + la) / 2 + 1 for f, la, _, _ in rows]
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(mid, [r[2] for r in rows], "o-", ms=3, label="rope_dtype=bf16")
        ax.plot(mid, [r[3] for r in rows], "o-", ms=3, label="rope_dtype=fp32 (default)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("position (mean over windows of 256)")
        ax.set_ylabel("relative error of the rotated vector")
        ax.set_title(f"Rotary embedding error against float64 (theta {a.theta:g}, head size {a.head_dim})")
        ax.axvline(8192, color="grey", lw=0.5, ls=":")
        ax.legend(loc="upper left")
        ax.grid(True, which="both", lw=0.3)
        fig.tight_layout()
        fig.savefig(a.out, dpi=120)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
