"""The comparison figure of settings over seeds: it leads with the speed at matched
quality (validation loss against training time, the target drawn, each setting's time
to it written in) and the loss against the reference seed by seed (near-coinciding
curves apart), then every metric's mean curve per setting with a band over its seeds.
One seed per setting keeps the per-run figure (:func:`figure.build_figure`) with the
same two lead panels, and says that one seed cannot judge the noise."""
from __future__ import annotations

import statistics
from typing import Callable, Optional

from mptrain.compare.figure import (FROM_ZERO, THRESHOLDS, build_figure, frame, label_axes, panels_with_data,
                                    percent, plain_axes, threshold)
from mptrain.compare.runs import Run, compared
from mptrain.compare.seeds import SEED_KEY, Report, mean_curve, short_text

BAND = "band: range (lowest to highest) over {n} seeds"
ONE_SEED = "one seed per setting: the noise between seeds cannot be judged"


def _color(i: int) -> str:
    return f"C{i % 10}"


def _band(ax, xs: list, per_seed: list[list[float]], color: str, label: Optional[str] = None, **line) -> None:
    """The mean over seeds of ``per_seed`` (a list per seed, aligned with ``xs``) as a line,
    and, for two seeds or more, the range over them as a band (a ``PolyCollection``)."""
    means = [statistics.fmean(col) for col in zip(*per_seed, strict=True)]
    ax.plot(xs, means, color=color, label=label, linewidth=1.5, **line)
    if len(per_seed) > 1:
        lo = [min(col) for col in zip(*per_seed, strict=True)]
        hi = [max(col) for col in zip(*per_seed, strict=True)]
        ax.fill_between(xs, lo, hi, color=color, alpha=0.2, linewidth=0)


def _matched_panel(ax, rep: Report) -> None:
    """Validation loss against training time, each setting's mean curve (and band), the
    target dashed, a dot where each mean curve reaches it, and each setting's time to
    target and speed-up written in the panel."""
    lines = []
    for i, s in enumerate(rep.settings):
        steps, _, _, times = mean_curve(s)
        curves = [dict(zip(*r.series("val/loss", "step"), strict=True)) for r in s.runs]
        if steps:
            _band(ax, times, [[c[k] for k in steps] for c in curves], _color(i), marker="o", markersize=3)
        m, ref = rep.means.get(id(s)), rep.refs.get(id(s))
        theirs = rep.means.get(id(ref)) if ref is not None else None
        if m is None:
            continue
        if m.reached:
            ax.plot([m.time_s], [rep.targets[id(s)]], "o", color=_color(i), markersize=8, markerfacecolor="none")
            up = f", {theirs.time_s / m.time_s:.2f}x" if theirs is not None and theirs.reached and m.time_s else ""
            lines.append((f"{s.label}: {m.time_s:.3g} s, {m.tokens:,.0f} tokens{up}", _color(i)))
        else:
            lines.append((f"{s.label}: never, short by {short_text(m.short_by)}", _color(i)))
    targets = {t for t in rep.targets.values() if t is not None}
    for t in targets:
        ax.axhline(t, color="black", linestyle="--", linewidth=1)
    for k, (text, color) in enumerate(lines):
        ax.text(0.98, 0.97 - 0.07 * k, text, transform=ax.transAxes, ha="right", va="top", fontsize=8, color=color)
    t_text = f"target {next(iter(targets)):.4f}" if len(targets) == 1 else "targets"
    ax.set_title(f"speed at matched quality: val loss vs training time\n{t_text} (dashed); "
                 "time to target (mean curve), speed-up vs reference", fontsize=10)
    ax.set_xlabel("training time (s, step time only)")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)


def _versus_panel(ax, rep: Report) -> None:
    """Each setting's validation loss minus its reference's, seed k with seed k, at every
    step both evaluated: the mean over seeds and the band; zero is the reference. Curves
    that lie on each other in the loss panel are told apart here."""
    ax.axhline(0.0, color="black", linewidth=1)
    drawn = False
    for i, s in enumerate(rep.settings):
        ref = rep.refs.get(id(s))
        if ref is None or ref is s:
            continue
        theirs = ref.by_seed()
        pairs = [(r, theirs[k]) for k, r in s.by_seed().items() if k in theirs]
        if not pairs:
            continue
        curves = [(dict(zip(*a.series("val/loss", "step"), strict=True)),
                   dict(zip(*b.series("val/loss", "step"), strict=True))) for a, b in pairs]
        steps = sorted(set.intersection(*(set(a) & set(b) for a, b in curves)))
        if steps:
            _band(ax, steps, [[a[k] - b[k] for k in steps] for a, b in curves], _color(i), marker="o", markersize=3)
            drawn = True
    ax.set_title("val loss - reference, paired by seed (0: the reference)", fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel("difference (nats/token)")
    if not drawn:
        ax.text(0.5, 0.5, "no setting has a reference to subtract", transform=ax.transAxes, ha="center")
    plain_axes(ax, "step", "linear")
    ax.grid(alpha=0.3)


def lead_panels(rep: Report) -> tuple[Callable, ...]:
    """The panels every comparison figure starts with (where there is a val/loss curve)."""
    if not any(rep.means.values()):
        return ()
    return (lambda ax: _matched_panel(ax, rep), lambda ax: _versus_panel(ax, rep))


def _metric_panel(ax, rep: Report, spec: tuple) -> None:
    """One metric's mean curve per setting over its seeds, at the x values every seed
    logged, with the band; axes as the per-run panels draw them."""
    title, metric, x, scale, unit = spec
    k = 100.0 if percent(unit) else 1.0
    for i, s in enumerate(rep.settings):
        curves = [dict(zip(*r.series(metric, x), strict=True)) for r in s.runs]
        xs = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
        if xs:
            _band(ax, xs, [[k * c[v] for v in xs] for c in curves], _color(i))
    ax.set_title(title, fontsize=10)
    label_axes(ax, x, scale, unit)
    if metric in FROM_ZERO:
        ax.set_ylim(bottom=0)
    plain_axes(ax, x, scale)  # (a log axis gets its 1-2-5 ticks there)
    if metric in THRESHOLDS:  # the line a signal is read against, in view however far the curves are
        threshold(ax, *THRESHOLDS[metric])
    ax.grid(alpha=0.3)


def build_seed_figure(runs: list[Run], rep: Report):
    """The comparison figure for ``rep``: over seeds (mean lines and bands) when some
    setting has two seeds or more, else the per-run figure; both lead with the speed at
    matched quality."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    lead = lead_panels(rep)
    if rep.one_seed:
        return build_figure(runs, lead, ONE_SEED)
    panels, _ = panels_with_data(runs)
    n = max(len(s.runs) for s in rep.settings)
    firsts = [s.runs[0] for s in rep.settings]
    seeds = sorted({str(r.config.get("train", {}).get("seed", "")) for r in runs})
    title = (f"{_what(firsts)} · settings over seeds {','.join(seeds)} · lines: mean over seeds, "
             f"{BAND.format(n=n)}")
    handles = [Line2D([], [], color=_color(i), linewidth=1.5) for i in range(len(rep.settings))]
    labels = [f"{s.label} ({len(s.runs)} seed{'s' if len(s.runs) > 1 else ''})" for s in rep.settings]
    handles.append(Patch(color="grey", alpha=0.3))
    labels.append(BAND.format(n=n))
    fig, axes, _, top = frame(len(lead) + len(panels), 0, title, handles, labels)
    for ax, draw in zip(axes, lead, strict=False):
        draw(ax)
    for ax, spec in zip(axes[len(lead):], panels, strict=True):
        _metric_panel(ax, rep, spec)
    fig.tight_layout(rect=(0, 0, 1, 1 - top))
    return fig


def _what(firsts: list[Run]) -> str:
    """The title's "what was compared", the seed left out (every setting has several)."""
    text = compared(firsts)
    return " · ".join(p for p in text.split(" · ") if not p.startswith(f"{SEED_KEY}:"))

