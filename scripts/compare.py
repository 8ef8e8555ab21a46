"""Compare runs: one figure of curves and one table, from run directories.

    python scripts/compare.py multirun/2026-11-30/12-00-00          # a sweep: every job inside
    python scripts/compare.py outputs/a outputs/b --out report/      # any run directories

Writes ``comparison.png`` and ``comparison.md`` (into the sweep directory, the
runs' common parent, or ``--out``) and prints the table. Each line of the
figure is one run, labelled by what differs between the runs' configs.
Panels whose metric no run logged are left out (the figure says which).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mptrain.checkpoint import flatten  # noqa: E402

# (panel title, metric, x axis, y scale)
PANELS = [
    ("train loss", "train/loss", "step", "linear"),
    ("train loss vs tokens", "train/loss", "train/tokens", "linear"),
    ("validation loss", "val/loss", "step", "linear"),
    ("loss scale", "amp/loss_scale", "step", "log2"),
    ("cumulative skip rate", "amp/skip_rate", "step", "linear"),
    ("gradient norm (unscaled, before clipping)", "train/grad_norm", "step", "log"),
    ("grad underflow in fp16", "numerics/grad_underflow/fp16", "step", "linear"),
    ("grad underflow in bf16", "numerics/grad_underflow/bf16", "step", "linear"),
    ("grad underflow in e4m3", "numerics/grad_underflow/e4m3", "step", "linear"),
    ("grad underflow in e5m2", "numerics/grad_underflow/e5m2", "step", "linear"),
    ("update underflow if stored in bf16", "numerics/update_underflow/bf16", "step", "linear"),
]
IGNORED_KEYS = ("run_info", "log.", "debug.", "hydra")


class Run:
    def __init__(self, path: Path):
        self.path = path
        self.rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines() if line.strip()]
        self.summary = json.loads((path / "summary.json").read_text()) if (path / "summary.json").exists() else {}
        cfg_file = path / "config.yaml"
        self.config = yaml.safe_load(cfg_file.read_text()) if cfg_file.exists() else {}
        self.label = path.name

    def series(self, metric: str, x: str) -> tuple[list[float], list[float]]:
        xs, ys = [], []
        for r in self.rows:
            if metric in r and x in r and isinstance(r[metric], (int, float)):
                xs.append(r[x])
                ys.append(r[metric])
        return xs, ys

    def last(self, metric: str):
        for r in reversed(self.rows):
            if metric in r:
                return r[metric]
        return None


def find_runs(paths: list[Path]) -> list[Run]:
    dirs: list[Path] = []
    for p in paths:
        if (p / "metrics.jsonl").exists():
            dirs.append(p)
        elif p.is_dir():
            dirs += sorted({m.parent for m in p.rglob("metrics.jsonl")},
                           key=lambda d: (len(d.parts), [int(x) if x.isdigit() else x for x in d.parts]))
    return [Run(d) for d in dict.fromkeys(dirs)]


def label_runs(runs: list[Run]) -> list[str]:
    """Label each run by the config values that differ between runs."""
    flats = [{k: v for k, v in flatten(r.config).items() if not k.startswith(IGNORED_KEYS)} for r in runs]
    keys = sorted({k for f in flats for k in f})
    differing = [k for k in keys if len({json.dumps(f.get(k), sort_keys=True) for f in flats}) > 1]
    # a group's name (precision.name=...) says more than its fields; keep the fields it does not explain
    names = [k for k in differing if k.endswith(".name")]
    shown = names + [k for k in differing if not any(k.startswith(n[: -len("name")]) for n in names)]
    labels = []
    for r, f in zip(runs, flats):
        if len(runs) == 1 or not shown:
            lab = f"{f.get('precision.name', r.path.name)}"
        else:
            lab = ", ".join(f"{k.replace('.name', '')}={f.get(k)}" if k.endswith(".name") else f"{k}={f.get(k)}"
                            for k in shown[:4])
        labels.append(lab)
    if len(set(labels)) < len(labels):  # still ambiguous: add the directory
        labels = [f"{lab} ({r.path.name})" for lab, r in zip(labels, runs)]
    for r, lab in zip(runs, labels):
        r.label = lab
    return labels


def table(runs: list[Run]) -> str:
    ref = next((r for r in runs if (r.config.get("precision") or {}).get("name") == "fp32"), None)
    ref_val = ref.summary.get("final/val_loss") if ref else None
    head = ["run", "final train loss", "final val loss", "val loss - fp32", "tokens/s", "skipped steps",
            "peak memory (GiB)", "wall time (s)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def f(x, spec=".4f"):
        return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)

    for r in runs:
        s = r.summary
        val = s.get("final/val_loss", r.last("val/loss"))
        delta = None if ref_val is None or val is None else val - ref_val
        mem = s.get("mem/peak_gib", s.get("mem/peak_rss_gib"))
        skipped = s.get("amp/skipped_steps", s.get("train/nonfinite_skipped"))
        lines.append("| " + " | ".join([
            r.label, f(s.get("final/train_loss", r.last("train/loss"))), f(val),
            ("+" if delta is not None and delta >= 0 else "") + f(delta) if delta is not None else "n/a",
            f(s.get("perf/tokens_per_s"), ",.0f"), "n/a" if skipped is None else str(skipped),
            f(mem, ".2f"), f(s.get("wall_time_s"), ".1f"),
        ]) + " |")
    return "\n".join(lines)


def figure(runs: list[Run], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in PANELS if any(r.series(p[1], p[2])[0] for r in runs)]
    missing = sorted({p[1] for p in PANELS} - {p[1] for p in panels})
    cols = 3
    rows = max(1, math.ceil(len(panels) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.8 * rows), squeeze=False)
    for ax, (title, metric, x, scale) in zip(axes.flat, panels):
        for i, r in enumerate(runs):
            xs, ys = r.series(metric, x)
            if xs:  # a run keeps its colour in every panel, also where others are missing
                ax.plot(xs, ys, label=r.label, color=f"C{i % 10}", marker="." if len(xs) < 30 else None,
                        linewidth=1.2)
        ax.set_title(title)
        ax.set_xlabel("tokens" if x == "train/tokens" else "step")
        if scale == "log2":
            ax.set_yscale("log", base=2)
        elif scale == "log":
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=f"C{i % 10}") for i in range(len(runs))]
    labels = [r.label for r in runs]
    fig.legend(handles, labels, loc="lower center", ncol=min(3, len(labels)), fontsize=9, frameon=False)
    note = f"not logged by any run: {', '.join(missing)}" if missing else ""
    fig.suptitle(f"{len(runs)} run(s)" + (f" — {note}" if note else ""), fontsize=10)
    fig.tight_layout(rect=(0, 0.04 + 0.02 * math.ceil(len(labels) / 3), 1, 0.97))
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return missing


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", type=Path, help="a sweep directory or run directories")
    ap.add_argument("--out", type=Path, help="where comparison.png/.md go (default: next to the runs)")
    a = ap.parse_args(argv)
    for p in a.paths:
        if not p.exists():
            print(f"compare: {p} does not exist", file=sys.stderr)
            return 2
    runs = find_runs(a.paths)
    if not runs:
        print(f"compare: no runs (no metrics.jsonl) under {', '.join(map(str, a.paths))}", file=sys.stderr)
        return 2
    out = a.out or (a.paths[0] if len(a.paths) == 1 and a.paths[0].is_dir() and len(runs) > 1
                    else Path(os.path.commonpath([str(r.path.parent) for r in runs])))
    out.mkdir(parents=True, exist_ok=True)
    label_runs(runs)
    md = table(runs)
    missing = figure(runs, out / "comparison.png")
    note = f"\n\nNot logged by any run (panels left out): {', '.join(missing)}." if missing else ""
    (out / "comparison.md").write_text(f"![comparison](comparison.png)\n\n{md}{note}\n")
    print(md + note)
    print(f"\nwrote {out / 'comparison.png'} and {out / 'comparison.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
