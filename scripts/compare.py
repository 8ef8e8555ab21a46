"""Compare runs: one figure of curves and one table, from run directories.

    python scripts/compare.py multirun/2026-11-30/12-00-00          # a sweep: every job inside
    python scripts/compare.py outputs/a outputs/b --out report/      # any run directories

Writes ``comparison.png`` and ``comparison.md`` (into the sweep directory, the
runs' common parent, or ``--out``) and prints the table. Each line of the
figure is one run, labelled by what differs between the runs' configs, with
its own colour, line style and hollow marker (a lone point is a marker), so a
curve drawn over an identical one leaves it visible. Runs whose curves
coincide on a panel (equal within COINCIDE_RTOL at every common step) are
named in that panel's title and in a note after the table. Tick labels are
plain numbers (no offset or shared multiplier), and a linear y axis spans at
least MIN_REL_SPAN of its values, so rounding-level differences never fill a
panel. Panels whose metric no run logged are left out (the figure says which).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import textwrap
from pathlib import Path
from typing import Optional

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
    ("updates the stored weights did not take", "numerics/update_lost", "step", "linear"),
    ("stochastic rounding: updates lost in expectation", "numerics/update_lost_expected", "step", "linear"),
    ("Kahan buffer: pending update / this step's", "numerics/kahan_held_over_update", "step", "linear"),
    ("largest attention logit (all layers)", "stability/attn_logit_max", "step", "log"),
    ("output logits: mean log Z", "stability/output_log_z", "step", "linear"),
]
# Metrics only some configurations have (stochastic rounding, Kahan summation): a
# sweep without those is not missing them, so their absence is not reported.
ONLY_WHERE_THEY_APPLY = {"numerics/update_lost_expected", "numerics/kahan_held_over_update"}
IGNORED_KEYS = ("run_info", "log.", "debug.", "hydra")
# Each run's look in every panel; runs differ in all three, so identical curves stay visible.
LINESTYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "*")
# Curves equal within this at every common step are named as coinciding: same-seed
# reruns and runs a setting does not affect are equal to the last bit; real
# precision effects on a loss are 1e-5 relative and more.
COINCIDE_RTOL, COINCIDE_ATOL = 1e-6, 1e-12
# A linear y axis spans at least this fraction of its largest |value|.
MIN_REL_SPAN = 1e-3


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
    head = ["run", "final train loss", "final val loss", "val loss - fp32", "state bytes/param", "tokens/s",
            "skipped steps", "peak memory (GiB)", "wall time (s)"]
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
            f(s.get("mem/bytes_per_param"), ".2f"),  # weights, gradients, optimizer state (memory.py)
            f(s.get("perf/tokens_per_s"), ",.0f"), "n/a" if skipped is None else str(skipped),
            f(mem, ".2f"), f(s.get("wall_time_s"), ".1f"),
        ]) + " |")
    return "\n".join(lines)


def panels_with_data(runs: list[Run]) -> tuple[list[tuple], list[str]]:
    """The panels some run has data for, and the metrics no run logged."""
    panels = [p for p in PANELS if any(r.series(p[1], p[2])[0] for r in runs)]
    return panels, sorted({p[1] for p in PANELS} - {p[1] for p in panels} - ONLY_WHERE_THEY_APPLY)


def _equal(a: float, b: float) -> bool:
    """Equal within COINCIDE_RTOL/ATOL; two NaNs (or two equal infinities) count as equal."""
    return a == b or (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=COINCIDE_RTOL,
                                                                         abs_tol=COINCIDE_ATOL)


def coinciding(runs: list[Run], metric: str, x: str) -> list[list[Run]]:
    """Groups of two or more runs whose curves of ``metric`` over ``x`` are equal
    (within a tiny tolerance) at every x they share: drawn alone, the one on top
    would hide the others. Runs sharing no x never coincide."""
    groups: list[list[tuple[Run, dict]]] = []
    for r in runs:
        points = dict(zip(*r.series(metric, x)))
        if not points:
            continue
        for g in groups:
            first = g[0][1]
            common = first.keys() & points.keys()
            if common and all(_equal(first[k], points[k]) for k in common):
                g.append((r, points))
                break
        else:
            groups.append([(r, points)])
    return [[r for r, _ in g] for g in groups if len(g) > 1]


def coincidences(runs: list[Run], panels: list[tuple]) -> dict[str, list[list[str]]]:
    """Panel title -> the labels of each group of coinciding curves on it (panels without any left out)."""
    out = {}
    for title, metric, x, _ in panels:
        groups = coinciding(runs, metric, x)
        if len(runs) > 2 and len(groups) == 1 and len(groups[0]) == len(runs):
            out[title] = [[f"all {len(runs)} runs"]]  # naming each of a whole sweep says less
        elif groups:
            out[title] = [[r.label for r in g] for g in groups]
    return out


def coincide_note(same: dict[str, list[list[str]]]) -> str:
    """The coinciding curves in words, one clause per group of runs with the panels where they coincide."""
    by_group: dict[str, list[str]] = {}
    for title, groups in same.items():
        for g in groups:
            by_group.setdefault(" = ".join(g), []).append(title)
    if not by_group:
        return ""
    clauses = "; ".join(f"{g} (in: {', '.join(titles)})" for g, titles in by_group.items())
    return (f"Curves that coincide (equal within {COINCIDE_RTOL:g} relative at every common step; "
            f"told apart by line style and marker): {clauses}.")


def style(i: int, n_points: int, n_runs: int) -> dict:
    """Run ``i``'s look, the same in every panel: colour, line style and hollow marker
    all vary with the run, so a curve drawn over an identical one leaves it visible
    (the dashes show the line below; the markers sit at different points)."""
    every = max(1, n_points // 8)
    return dict(color=f"C{i % 10}", linestyle=LINESTYLES[i % len(LINESTYLES)], marker=MARKERS[i % len(MARKERS)],
                markevery=((i * every) // max(1, n_runs), every), markersize=8 if n_points == 1 else 5,
                markerfacecolor="none", markeredgewidth=1.2, linewidth=1.3)


def plain_number(v: float, _pos=None) -> str:
    """``v`` written out in positions, up to 6 significant digits: 0.00012, 3.6, 65536."""
    if v == 0 or not math.isfinite(v):
        return f"{v:g}"
    digits = max(0, 5 - math.floor(math.log10(abs(v))))
    return f"{v:.{digits}f}".rstrip("0").rstrip(".")


def plain_axes(ax, x: str, scale: str) -> None:
    """Tick labels that read as the values themselves: no offset ("+7.521"), no
    shared multiplier ("1e-5") and no powers ("3.6x10^0"), which make rounding-level
    differences look large or hide the value; whole steps on a step axis."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator, NullFormatter, ScalarFormatter

    axes = [ax.xaxis] + ([ax.yaxis] if scale == "linear" else [])
    for axis in axes:
        f = ScalarFormatter(useOffset=False)
        f.set_scientific(False)
        axis.set_major_formatter(f)
    if scale != "linear":
        lo, hi = ax.get_ylim()
        ax.yaxis.set_major_formatter(FuncFormatter(plain_number))
        # Within one power of the base the major ticks are too few to read: label the minor ones too.
        narrow = lo > 0 and hi / lo < (2 if scale == "log2" else 10)
        ax.yaxis.set_minor_formatter(FuncFormatter(plain_number) if narrow else NullFormatter())
    if x == "step":
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))  # also for one step


def min_span(ax, values: list[float]) -> None:
    """Widen a linear y axis to at least MIN_REL_SPAN of its largest value, so that
    differences at the level of rounding (one point per run, flat curves) do not
    fill the panel."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return
    lo, hi = min(finite), max(finite)
    need = MIN_REL_SPAN * max(abs(lo), abs(hi))
    if hi - lo < need:
        mid = (lo + hi) / 2
        ax.set_ylim(mid - need / 2, mid + need / 2)


def _panel(ax, runs: list[Run], spec: tuple, same: list[list[str]]) -> None:
    """One panel: every run with data in its own style, the axes plain, the coinciding runs named in the title."""
    title, metric, x, scale = spec
    values: list[float] = []
    for i, r in enumerate(runs):
        xs, ys = r.series(metric, x)
        if xs:  # a run keeps its look in every panel, also where others are missing
            ax.plot(xs, ys, label=r.label, zorder=2 + i, **style(i, len(xs), len(runs)))
            values += ys
    notes = [f"same curve: {' = '.join(g)}" for g in same]
    ax.set_title("\n".join([title, *(textwrap.fill(n, 70) for n in notes)]), fontsize=10 if notes else None)
    ax.set_xlabel("tokens" if x == "train/tokens" else "step")
    if scale == "log2":
        ax.set_yscale("log", base=2)
    elif scale == "log":
        ax.set_yscale("log")
    else:
        min_span(ax, values)
    plain_axes(ax, x, scale)
    ax.grid(alpha=0.3)


def build_figure(runs: list[Run]):
    """The comparison figure (a ``matplotlib.figure.Figure``, not yet saved): one
    panel per metric some run logged, one line per run."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    panels, missing = panels_with_data(runs)
    same = coincidences(runs, panels)
    cols = 3
    rows = max(1, math.ceil(len(panels) / cols))
    fig = Figure(figsize=(6 * cols, 3.8 * rows + 0.4))
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax, spec in zip(axes.flat, panels):
        _panel(ax, runs, spec, same.get(spec[0], []))
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    handles = [Line2D([], [], **{k: v for k, v in style(i, 2, len(runs)).items() if k != "markevery"})
               for i in range(len(runs))]
    labels = [r.label for r in runs]
    fig.legend(handles, labels, loc="lower center", ncol=min(3, len(labels)), fontsize=9, frameon=False)
    note = f"not logged by any run: {', '.join(missing)}" if missing else ""
    fig.suptitle(f"{len(runs)} run(s)" + (f" — {note}" if note else ""), fontsize=10)
    fig.tight_layout(rect=(0, 0.04 + 0.02 * math.ceil(len(labels) / 3), 1, 0.97))
    return fig


def figure(runs: list[Run], out: Path) -> tuple[list[str], str]:
    """Write the figure to ``out``; returns the metrics no run logged and the note on coinciding curves."""
    build_figure(runs).savefig(out, dpi=110)  # a bare Figure renders with Agg: no pyplot, no display
    panels, missing = panels_with_data(runs)
    return missing, coincide_note(coincidences(runs, panels))


# ------------------------------------------------------------ learning-rate sweeps
LR_KEY = "optim.lr"


def _flat(run: Run) -> dict:
    return {k: v for k, v in flatten(run.config).items() if not k.startswith(IGNORED_KEYS)}


def lr_settings(runs: list[Run]) -> Optional[dict[str, list[Run]]]:
    """For a sweep over ``optim.lr`` (3 or more values): the runs grouped by every
    other setting that differs (one curve of final loss against the learning
    rate per group, sorted by learning rate); None for any other set of runs."""
    flats = [_flat(r) for r in runs]
    if len({f.get(LR_KEY) for f in flats}) < 3:
        return None
    keys = sorted({k for f in flats for k in f} - {LR_KEY, "train.seed"})
    differing = [k for k in keys if len({json.dumps(f.get(k), sort_keys=True) for f in flats}) > 1]
    groups: dict[str, list[Run]] = {}
    for r, f in zip(runs, flats):
        name = ", ".join(f"{k}={f.get(k)}" for k in differing) or "all runs"
        groups.setdefault(name, []).append(r)
    return {g: sorted(rs, key=lambda r: _flat(r)[LR_KEY]) for g, rs in groups.items()}


def final_loss(run: Run) -> float:
    """The run's final validation loss (train loss when it never validated); inf when it diverged."""
    v = run.summary.get("final/val_loss", run.last("val/loss"))
    v = run.summary.get("final/train_loss", run.last("train/loss")) if v is None else v
    return math.inf if v is None or not math.isfinite(v) else float(v)


def lr_table(groups: dict[str, list[Run]]) -> str:
    """Final loss per learning rate (rows) and setting (columns)."""
    lrs = sorted({_flat(r)[LR_KEY] for rs in groups.values() for r in rs})
    lines = ["| optim.lr | " + " | ".join(groups) + " |", "|" + "---|" * (len(groups) + 1)]
    for lr in lrs:
        cells = []
        for rs in groups.values():
            hit = [final_loss(r) for r in rs if _flat(r)[LR_KEY] == lr]
            cells.append("n/a" if not hit else ("diverged" if math.isinf(hit[0]) else f"{hit[0]:.4f}"))
        lines.append(f"| {lr:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def lr_figure(groups: dict[str, list[Run]], out: Path) -> None:
    """Final loss against the learning rate, one line per setting (a diverged run is
    drawn as an x above the others), and the largest attention logit over the steps
    of each setting's highest-learning-rate run."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(13, 4.8))
    ax_loss, ax_logit = fig.subplots(1, 2)
    finite = [final_loss(r) for rs in groups.values() for r in rs if math.isfinite(final_loss(r))]
    ceiling = (max(finite) * 1.05) if finite else 1.0
    for i, (name, rs) in enumerate(groups.items()):
        look = {k: v for k, v in style(i, len(rs), len(groups)).items() if k != "markevery"}
        lrs = [_flat(r)[LR_KEY] for r in rs]
        losses = [final_loss(r) for r in rs]
        ax_loss.plot(lrs, [v if math.isfinite(v) else math.nan for v in losses], label=name, **look)
        bad = [lr for lr, v in zip(lrs, losses) if not math.isfinite(v)]
        if bad:
            ax_loss.scatter(bad, [ceiling] * len(bad), marker="x", color=look["color"], s=60, zorder=5)
        top = rs[-1]
        xs, ys = top.series("stability/attn_logit_max", "step")
        if xs:
            ax_logit.plot(xs, ys, label=f"{name} (lr {_flat(top)[LR_KEY]:g})", **look)
    ax_loss.set_xscale("log")
    ax_loss.set_xlabel("optim.lr")
    ax_loss.set_ylabel("final loss (x: diverged)")
    ax_loss.set_title("final loss against learning rate")
    ax_logit.set_yscale("log")
    ax_logit.set_xlabel("step")
    ax_logit.set_title("largest attention logit, highest learning rate of each setting")
    for ax in (ax_loss, ax_logit):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    plain_axes(ax_logit, "step", "log")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


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
    missing, same = figure(runs, out / "comparison.png")
    note = f"\n\nNot logged by any run (panels left out): {', '.join(missing)}." if missing else ""
    note += f"\n\n{same}" if same else ""
    groups = lr_settings(runs)
    if groups:  # a learning-rate sweep: its own figure and table
        lr_figure(groups, out / "lr_sensitivity.png")
        note += f"\n\n![lr sensitivity](lr_sensitivity.png)\n\nFinal loss by learning rate:\n\n{lr_table(groups)}"
    (out / "comparison.md").write_text(f"![comparison](comparison.png)\n\n{md}{note}\n")
    print(md + note)
    print(f"\nwrote {out / 'comparison.png'} and {out / 'comparison.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
