"""The comparison figure: a panel per metric with a curve, one look per run (colour,
line style, hollow marker) so identical curves stay visible, the curves that coincide
named, plain tick labels, and the metrics logged at one step only as a table."""
from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Optional

from mptrain.compare.runs import Run, _flat, compared
from mptrain.observe.quant import SQRT3

# (panel title, metric, x axis, y scale, y axis label with its unit). A "what-if: " title is a
# counterfactual the monitor computes on the run's own tensors (what a cast to that format
# would do), not something that happened in the run. A label starting with "%" is a share
# drawn in percent (the value times 100), as the table shows its shares.
PANELS = [
    ("train loss", "train/loss", "step", "linear", "loss (nats/token)"),
    ("train loss vs tokens", "train/loss", "train/tokens", "linear", "loss (nats/token)"),
    ("validation loss", "val/loss", "step", "linear", "loss (nats/token)"),
    ("throughput (all ranks)", "perf/tokens_per_s", "step", "linear", "tokens/s"),
    ("loss scale", "amp/loss_scale", "step", "log2", "loss scale (multiplier)"),
    ("cumulative skip rate", "amp/skip_rate", "step", "linear", "% of steps skipped"),
    ("gradient norm (unscaled, before clipping)", "train/grad_norm", "step", "log",
     "L2 norm (nats/token per unit weight)"),
    *((f"what-if: gradients that would underflow in {f}", f"numerics/grad_underflow/{f}", "step", "linear",
       "% of non-zero gradients") for f in ("fp16", "bf16", "e4m3", "e5m2")),
    ("what-if: updates lost if the weights were stored in bf16", "numerics/update_underflow/bf16", "step",
     "linear", "% of parameters"),
    ("updates the stored weights did not take", "numerics/update_lost", "step", "linear",
     "% of elements the update meant to move"),
    ("stochastic rounding: updates lost in expectation", "numerics/update_lost_expected", "step", "linear",
     "% of elements the update meant to move"),
    ("Kahan buffer: pending update / this step's", "numerics/kahan_held_over_update", "step", "linear",
     "ratio (x)"),
    ("largest attention logit (all layers)", "stability/attn_logit_max", "step", "log", "logit (nats)"),
    ("output logits: mean log Z", "stability/output_log_z", "step", "linear", "log Z (nats)"),
    ("down-projection input max/RMS (largest over blocks)", "stability/down_in_max_over_rms/block*", "step", "log",
     "ratio (x)"),
    ("massive activation ratio, max/median |x| (largest over blocks)", "stability/massive_ratio/block*", "step",
     "log", "ratio (x)"),
    ("fp8 casts: largest share of non-zeros flushed to 0 (any layer)", "fp8/worst/flush", "step", "linear",
     "% of non-zero elements"),
    ("fp8 casts: largest share of non-zeros saturated (any layer)", "fp8/worst/saturate", "step", "linear",
     "% of non-zero elements"),
    ("fp8 casts: lowest SQNR of any layer", "fp8/worst/sqnr_db", "step", "linear", "SQNR (dB)"),
    # the signals that say when (docs/numerics.md): a product over its quantization noise, per matmul
    *((f"{gemm.replace('_', ' ')}: product over its quantization noise", f"numerics/quant/{gemm}/noise_ratio",
       "step", "log", "ratio (x)") for gemm in ("weight_gradient", "forward", "input_gradient")),
    ("weight codes changed since the last monitored step", "numerics/quant/weight_flips", "step", "linear",
     "% of converted weight elements"),
    ("what-if: mean shift of the norm weights, quantized", "numerics/quant/norm_bias", "step", "linear",
     "% of the norm weights' sum |gamma|"),
    # a mixture-of-experts model's routing (observe/moe.py), each the worst routed layer
    ("MoE load imbalance: CV of tokens per expert (worst layer)", "moe/load_cv", "step", "linear",
     "coefficient of variation (x)"),
    ("what-if: tokens whose top-k experts a bf16 router would change (worst layer)", "moe/flip_share_bf16", "step",
     "linear", "% of tokens"),
    ("MoE: token choices dropped over capacity (largest over blocks)", "moe/dropped_share/block*", "step", "linear",
     "% of token choices"),
    ("MoE balancing bias: largest |bias| (largest over blocks)", "moe/bias_absmax/block*", "step", "linear",
     "bias (gate-score units)"),
]
# Metrics only some configurations have (stochastic rounding, Kahan summation, float8 or 4-bit
# linears, a mixture of experts): a sweep without those is not missing them, so their absence is not reported.
ONLY_WHERE_THEY_APPLY = {"numerics/update_lost_expected", "numerics/kahan_held_over_update",
                         "fp8/worst/flush", "fp8/worst/saturate", "fp8/worst/sqnr_db",
                         *(p[1] for p in PANELS if p[1].startswith(("numerics/quant/", "moe/")))}
# Horizontal lines drawn dashed on a metric's panel, at (value, label): a threshold the curves are read against.
THRESHOLDS = {"numerics/quant/weight_gradient/noise_ratio":
              (SQRT3, "sqrt(3): below it, quantized training stops making progress")}
# Metrics read as ratios between runs (fp8 at 0.4x fp32's tokens/s): their y axis starts at
# zero, so a run twice as fast sits twice as high instead of at the other edge of a zoomed axis.
FROM_ZERO = {"perf/tokens_per_s"}
# Each run's look in every panel; runs differ in all three, so identical curves stay visible.
LINESTYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "*")
# Curves equal within this at every common step are named as coinciding: same-seed
# reruns and runs a setting does not affect are equal to the last bit; real
# precision effects on a loss are 1e-5 relative and more.
COINCIDE_RTOL, COINCIDE_ATOL = 1e-6, 1e-12
# A linear y axis spans at least this fraction of its largest |value|, so that two
# losses 4e-5 apart sit on each other instead of at the panel's edges.
MIN_REL_SPAN = 1e-3
# A run's series is drawn as points only (no connecting line, which would suggest a
# measured trend between samples) when it has fewer than SPARSE_POINTS points, or
# SPARSE_RATIO times fewer than the run's train loss (the monitor's every 50 steps
# next to a loss logged every 10).
SPARSE_POINTS, SPARSE_RATIO = 12, 4
# Metrics counted on the gradients as the run holds them: under loss scaling (fp16),
# times the loss scale, so they are not what the unscaled gradients would give.
AS_HELD = "numerics/grad_underflow/"


def panels_with_data(runs: list[Run]) -> tuple[list[tuple], list[str]]:
    """The panels with a curve (two or more points in some run), and the metrics no run logged.
    A metric every run logged at one step at most is not drawn: :func:`single_points`."""
    panels = [p for p in PANELS if any(len(r.series(p[1], p[2])[0]) >= 2 for r in runs)]
    logged = {p[1] for p in PANELS if any(r.series(p[1], p[2])[0] for r in runs)}
    return panels, sorted({p[1] for p in PANELS} - logged - ONLY_WHERE_THEY_APPLY)


def percent(unit: str) -> bool:
    """Whether a panel's values are shares shown in percent (its unit starts with "%")."""
    return unit.startswith("%")


def single_points(runs: list[Run]) -> tuple[list[str], list[list[str]]]:
    """The metrics some run logged but none at two steps or more (a short run's monitor
    samples, a validation loss taken once), as a table instead of panels of lone
    points: the head (metric, unit, step, one column per run) and a row per metric,
    shares in percent as the panels and the table of final figures show them."""
    head = ["metric", "unit", "step", *(r.label for r in runs)]
    rows = []
    for title, metric, x, _, unit in PANELS:
        if x != "step":  # the loss over tokens is the loss over steps again
            continue
        series = [r.series(metric, x) for r in runs]
        if not any(xs for xs, _ in series) or any(len(xs) >= 2 for xs, _ in series):
            continue
        steps = sorted({xs[0] for xs, _ in series if xs})
        scale = 100.0 if percent(unit) else 1.0
        rows.append([title, unit, "/".join(map(str, steps)),
                     *(plain_number(ys[0] * scale) if ys else "n/a" for _, ys in series)])
    return head, rows


def single_points_md(runs: list[Run]) -> str:
    """:func:`single_points` as markdown for comparison.md ("" when every metric has a curve)."""
    head, rows = single_points(runs)
    if not rows:
        return ""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
             *("| " + " | ".join(row) + " |" for row in rows)]
    return ("Logged at one step only (no curve to draw; in the figure as a table, not as panels):\n\n"
            + "\n".join(lines))


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
        points = dict(zip(*r.series(metric, x), strict=True))
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
    for title, metric, x, *_ in panels:
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


def style(i: int, n_points: int, n_runs: int, sparse: bool = False) -> dict:
    """Run ``i``'s look, the same in every panel: colour, line style and hollow marker
    all vary with the run, so a curve drawn over an identical one leaves it visible
    (the dashes show the line below; the markers sit at different points). A
    ``sparse`` series (:func:`is_sparse`) is its markers alone, one at every sample."""
    every = max(1, n_points // 8)
    if sparse:
        return dict(color=f"C{i % 10}", linestyle="none", marker=MARKERS[i % len(MARKERS)],
                    markersize=8 if n_points == 1 else 6, markerfacecolor="none", markeredgewidth=1.2)
    return dict(color=f"C{i % 10}", linestyle=LINESTYLES[i % len(LINESTYLES)], marker=MARKERS[i % len(MARKERS)],
                markevery=((i * every) // max(1, n_runs), every), markersize=8 if n_points == 1 else 5,
                markerfacecolor="none", markeredgewidth=1.2, linewidth=1.3)


def is_sparse(run: Run, xs: list, x: str = "step") -> bool:
    """Whether the run's series with points at ``xs`` is samples too far apart to join by a
    line: fewer than SPARSE_POINTS points, or SPARSE_RATIO times fewer than its train loss."""
    return len(xs) < SPARSE_POINTS or len(xs) * SPARSE_RATIO <= len(run.series("train/loss", x)[0])


def _interval(xs: list) -> Optional[int]:
    """The usual step between samples (the median gap; the first monitored step is step 1)."""
    gaps = sorted(b - a for a, b in zip(xs, xs[1:], strict=False))  # neighbours: one pair fewer than points
    return round(gaps[len(gaps) // 2]) if gaps else None


def loss_scaled(run: Run) -> bool:
    """Whether the run's gradients carried a loss scale (other than 1) on some logged step."""
    return any(v != 1 for v in run.series("amp/loss_scale", "step")[1])


def scaled_note(runs: list[Run]) -> str:
    """For the panels of :data:`AS_HELD` metrics: which runs' counts are of the loss-scaled
    gradients (the monitor counts the gradients as held; only those are logged)."""
    names = list(dict.fromkeys(str(_flat(r).get("precision.name", r.label)) for r in runs if loss_scaled(r)))
    return f"{'/'.join(names)} runs: measured after loss scaling" if names else ""


def plain_number(v: float, _pos=None, sig: int = 6) -> str:
    """``v`` written out in positions, up to ``sig`` significant digits: 0.00012, 3.6, 65536."""
    if v == 0 or not math.isfinite(v):
        return f"{v:g}"
    digits = max(0, sig - 1 - math.floor(math.log10(abs(v))))
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
    if scale == "log":
        log_ticks(ax)
    elif scale != "linear":
        lo, hi = ax.get_ylim()
        ax.yaxis.set_major_formatter(FuncFormatter(plain_number))
        # Within one power of the base the major ticks are too few to read: label the minor ones too.
        narrow = lo > 0 and hi / lo < 2
        ax.yaxis.set_minor_formatter(FuncFormatter(plain_number) if narrow else NullFormatter())
    if x == "step":
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))  # also for one step


def _nice(v: float, up: bool) -> float:
    """The nearest 1, 2 or 5 times a power of ten at or above (``up``) or below ``v`` (> 0)."""
    e = math.floor(math.log10(v))
    steps = [m * 10.0 ** k for k in (e - 1, e, e + 1) for m in (1, 2, 5)]
    return min(x for x in steps if x >= v * (1 - 1e-12)) if up else max(x for x in steps if x <= v * (1 + 1e-12))


def log_ticks(ax) -> None:
    """A base-10 log y axis whose limits are ticks: from the 1-2-5 value at or below the
    data to the one at or above it, every 1, 2 and 5 labelled, so the largest point
    (a gradient norm of 1.378) always has a labelled tick above it (2)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    lo, hi = ax.dataLim.intervaly
    if not (lo > 0 and math.isfinite(lo) and math.isfinite(hi)):
        return
    ax.set_ylim(_nice(lo, up=False), _nice(hi, up=True))
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0), numticks=15))
    ax.yaxis.set_major_formatter(FuncFormatter(plain_number))
    ax.yaxis.set_minor_formatter(NullFormatter())


def min_span(ax, values: list[float], rel: float = MIN_REL_SPAN) -> None:
    """Widen a linear y axis to at least ``rel`` of its largest value, so that
    differences at the level of rounding (one point per run, flat curves) do not
    fill the panel; a log axis to a ratio of at least ``1 + rel``."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return
    lo, hi = min(finite), max(finite)
    if ax.get_yscale() == "log":
        if lo > 0 and hi / lo < 1 + rel:
            mid = math.sqrt(lo * hi)
            ax.set_ylim(mid / math.sqrt(1 + rel), mid * math.sqrt(1 + rel))
        return
    need = rel * max(abs(lo), abs(hi))
    if hi - lo < need:
        mid = (lo + hi) / 2
        ax.set_ylim(mid - need / 2, mid + need / 2)


def label_axes(ax, x: str, scale: str, unit: str) -> None:
    """A panel's axis labels (the x axis's name, the y axis's unit) and its y scale."""
    ax.set_xlabel("tokens" if x == "train/tokens" else "step")
    ax.set_ylabel(unit)
    if scale == "log2":
        ax.set_yscale("log", base=2)
    elif scale == "log":
        ax.set_yscale("log")


def _panel(ax, runs: list[Run], spec: tuple, same: list[list[str]]) -> None:
    """One panel: every run with data in its own style (sparse samples as points), the
    axes plain and labelled with their units (shares in percent), the title saying how
    the figures were taken (after loss scaling, sampled every N steps) and naming the
    coinciding runs."""
    title, metric, x, scale, unit = spec
    scale_by = 100.0 if percent(unit) else 1.0
    values: list[float] = []
    gaps = []
    for i, r in enumerate(runs):
        xs, ys = r.series(metric, x)
        ys = [y * scale_by for y in ys]
        if xs:  # a run keeps its look in every panel, also where others are missing
            sparse = is_sparse(r, xs, x)
            ax.plot(xs, ys, label=r.label, zorder=2 + i, **style(i, len(xs), len(runs), sparse))
            values += ys
            if sparse and x == "step" and _interval(xs):
                gaps.append(_interval(xs))
    notes = [scaled_note(runs)] if metric.startswith(AS_HELD) else []
    if gaps:
        every = sorted(set(gaps))
        notes.append("points: sampled every step" if every == [1] else
                     f"points: sampled every {'/'.join(map(str, every))} steps")
    notes = [n for n in notes if n] + [f"same curve: {' = '.join(g)}" for g in same]
    ax.set_title("\n".join([title, *(textwrap.fill(n, 70) for n in notes)]), fontsize=10 if notes else None)
    label_axes(ax, x, scale, unit)
    if metric in FROM_ZERO:
        ax.set_ylim(0, max(values, default=1.0) * 1.05)
    elif scale != "log2":  # (the loss scale's powers of 2 keep matplotlib's own, wider, axis)
        min_span(ax, values)
    plain_axes(ax, x, scale)
    if metric in THRESHOLDS:  # last: the axis limits above are the curves'; the line widens them
        threshold(ax, *THRESHOLDS[metric])
    ax.grid(alpha=0.3)


def threshold(ax, value: float, label: str) -> None:
    """A dashed black line across the panel at ``value``, its ``label`` written just
    above it at the left; the y axis then spans it, whatever the curves do."""
    lo, hi = ax.get_ylim()
    if not lo <= value <= hi:  # curves far from the threshold: how far is the point, so show both
        ax.set_ylim(min(lo, value * 0.8 if value > 0 else value), max(hi, value * 1.2 if value > 0 else value))
    ax.axhline(value, color="black", linestyle="--", linewidth=1.0, zorder=1)
    ax.text(0.01, value, f"{label} ({plain_number(value, sig=3)})", transform=ax.get_yaxis_transform(),
            va="bottom", ha="left", fontsize=8)


def _single_points_table(ax, runs: list[Run]) -> None:
    """The metrics logged at one step only (:func:`single_points`) as a table in the figure."""
    head, rows = single_points(runs)
    ax.axis("off")
    ax.set_title("logged at one step only (no curve to draw): the value at that step")
    t = ax.table(cellText=rows, colLabels=head, loc="upper center", cellLoc="left")
    t.auto_set_font_size(False)
    t.set_fontsize(8)
    t.auto_set_column_width(list(range(len(head))))


def build_figure(runs: list[Run], lead: tuple = (), note: str = ""):
    """The comparison figure (a ``matplotlib.figure.Figure``, not yet saved): the ``lead``
    panels first (callables drawing on an axes: the speed at matched quality, the loss
    against the reference), then one panel per metric with a curve (two or more points
    in some run), one line (or set of points) per run, and under the panels a table of
    the metrics logged at one step only; the title says what was compared (and
    ``note``), the legend sits under it, above the panels."""
    from matplotlib.lines import Line2D

    panels, _ = panels_with_data(runs)
    n_single = len(single_points(runs)[1])
    same = coincidences(runs, panels)
    title = compared(runs) + (f" · {note}" if note else "")
    handles = [Line2D([], [], **{k: v for k, v in style(i, 2, len(runs)).items() if k != "markevery"})
               for i in range(len(runs))]
    fig, axes, table_ax, top = frame(len(lead) + len(panels), n_single, title, handles, [r.label for r in runs])
    for ax, draw in zip(axes, lead, strict=False):
        draw(ax)
    for ax, spec in zip(axes[len(lead):], panels, strict=True):
        _panel(ax, runs, spec, same.get(spec[0], []))
    if table_ax is not None:
        _single_points_table(table_ax, runs)
    fig.tight_layout(rect=(0, 0, 1, 1 - top))
    return fig


def frame(n_panels: int, n_single: int, title: str, handles: list, labels: list[str]):
    """A figure for ``n_panels`` panels with no empty slot: three to a row (fewer when there
    are fewer), the last row's panels widened to fill it; under them a table of
    ``n_single`` rows; the title and the legend above. Returns the figure, the panels'
    axes in order, the table's axes (None without a table) and the share of the height
    the title and legend take (for ``tight_layout``'s rect)."""
    from matplotlib.figure import Figure

    cols = max(1, min(3, n_panels))
    rows = math.ceil(n_panels / cols)
    ncol = min(4, len(labels))
    title = textwrap.fill(title, 150)
    # Inches above the panels: the title's lines, then the legend's rows; under them, the table's rows.
    title_h, legend_h = 0.22 * (title.count("\n") + 1) + 0.1, 0.24 * math.ceil(len(labels) / ncol) + 0.05
    table_h = 0.25 * (n_single + 1) + 0.6 if n_single else 0.0
    height = 3.8 * rows + table_h + title_h + legend_h
    fig = Figure(figsize=(6 * cols, height))
    # Six grid columns: a full row's panels take 6 / cols each, the last row's 6 / (panels left).
    grid = fig.add_gridspec(max(1, rows + (1 if n_single else 0)), 6,
                            height_ratios=[3.8] * rows + ([table_h] if n_single else []) or [1])
    axes = []
    for i in range(n_panels):
        row, first = divmod(i, cols)
        in_row = cols if row < rows - 1 else n_panels - cols * (rows - 1)
        span = 6 // in_row
        axes.append(fig.add_subplot(grid[row, first * span:(first + 1) * span]))
    table_ax = fig.add_subplot(grid[rows, :]) if n_single else None
    fig.suptitle(title, fontsize=11, y=1 - 0.08 / height, va="top")
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 1 - title_h / height), ncol=ncol,
               fontsize=10, frameon=False)
    return fig, axes, table_ax, (title_h + legend_h) / height


def figure(fig, runs: list[Run], out: Path) -> tuple[list[str], str]:
    """Write ``fig`` to ``out``; returns the metrics no run logged and the note on coinciding curves."""
    fig.savefig(out, dpi=110)  # a bare Figure renders with Agg: no pyplot, no display
    panels, missing = panels_with_data(runs)
    return missing, coincide_note(coincidences(runs, panels))
