"""Float8 and 4-bit casts layer by layer: ``fp8_layers.png`` (each layer's flushed and
saturated shares and SQNR over the steps, and every what-if recipe's SQNR at the last
monitored step) and ``fp8_layers.md``."""
from __future__ import annotations

import math
import textwrap
from typing import Optional

from mptrain.compare.figure import coincidences, min_span, plain_axes, plain_number, style
from mptrain.compare.runs import Run
from mptrain.config.checks import RENAMED_RECIPES
from mptrain.config.schema import MonitorConfig
from mptrain.observe.fp8watch import kind_of

# metrics.jsonl keys: fp8.<layer>/<operand>/<stat> for the run's own casts and
# fp8.<layer>/<operand>/<recipe>/<stat> for what the same tensor would give under
# another recipe; summary.json's fp8_casts holds the last monitored step in one tree.
FP8_PREFIX = "fp8."
FP8_STATS = ("flush", "saturate", "sqnr_db")
OPERANDS = ("input", "weight", "grad_output")
WHATIF_RECIPES = tuple(MonitorConfig().fp8_whatif)  # the default what-ifs, in their order
# An operand's line style in the per-layer panels (the run keeps its colour and marker).
OPERAND_LINESTYLES = {"input": "-", "weight": "--", "grad_output": ":"}
# Beyond these the per-layer figure stops being readable: the rest are left out, and named.
FP8_MAX_LAYERS, FP8_MAX_RUNS = 12, 8
# The per-layer figure's longest side in pixels: past it a page of panels is scrolled, not read.
MOST_PIXELS = 2400


def _fp8_key(key: str) -> Optional[tuple[str, str, Optional[str], str]]:
    """``(layer, operand, what-if recipe or None, stat)`` of a per-layer cast metric, else None."""
    if not key.startswith(FP8_PREFIX):
        return None
    parts = key[len(FP8_PREFIX):].split("/")
    if len(parts) == 3:
        return parts[0], parts[1], None, parts[2]
    if len(parts) == 4:
        return parts[0], parts[1], parts[2], parts[3]
    return None


def fp8_casts(run: Run) -> Optional[dict]:
    """The run's float8 casts at its last monitored step, shaped as summary.json's
    ``fp8_casts`` (``{"recipe", "step", "source", "layers": {layer: {operand: {stat: v,
    "whatif": {recipe: {stat: v}}}}}}``): from summary.json when it has them, else
    from the last metrics row that does; None for a run without them."""
    prec = run.config.get("precision") or {}
    fp4, lab = prec.get("fp4") or {}, prec.get("lab") or {}
    # a 4-bit or lab run's casts are measured by the same statistics, under its format's or recipe's name
    recipe = (fp4.get("format") if fp4.get("enabled") else lab.get("recipe") if lab.get("enabled")
              else (prec.get("fp8") or {}).get("recipe"))
    got = run.summary.get("fp8_casts")
    if isinstance(got, dict) and got.get("layers"):
        return _renamed({**got, "recipe": got.get("recipe") or recipe, "source": "summary.json"})
    for row in reversed(run.rows):
        layers: dict = {}
        for k, v in row.items():
            parsed = _fp8_key(k)
            if parsed is None or not isinstance(v, (int, float)):
                continue
            layer, op, whatif, stat = parsed
            entry = layers.setdefault(layer, {}).setdefault(op, {})
            (entry.setdefault("whatif", {}).setdefault(whatif, {}) if whatif else entry)[stat] = v
        if layers:
            return _renamed({"recipe": recipe, "step": row.get("step"), "source": "metrics.jsonl", "layers": layers})
    return None


def _renamed(casts: dict) -> dict:
    """``casts`` with a run's recipe names as they are now: a run recorded before every
    recipe had one name everywhere (its ``block1x32`` what-if is mxfp8's cast, its lab
    ``fp8_tensorwise`` is tensorwise) reads as one recorded since."""
    new = lambda n: RENAMED_RECIPES.get(n, n)  # noqa: E731
    for ops in casts["layers"].values():
        for entry in ops.values():
            if entry.get("whatif"):
                entry["whatif"] = {new(n): w for n, w in entry["whatif"].items()}
    return {**casts, "recipe": new(casts["recipe"]) if casts.get("recipe") else casts.get("recipe")}


def _sqnr_key(v) -> float:
    """An SQNR to rank by: a missing or NaN one ranks below every other."""
    return -math.inf if not isinstance(v, (int, float)) or math.isnan(v) else v


def best_whatif(entry: dict, recipe: Optional[str] = None) -> Optional[tuple[str, dict]]:
    """The what-if recipe with the highest SQNR for one operand's casts (the first
    listed on a tie), with its figures; None when there is none. Only recipes of
    the run's own width compete: float8 ones for a float8 run, 4-bit ones for a
    4-bit run (``recipe`` nvfp4, mxfp4, ...: ``fp8watch.kind_of``), where any float8
    recipe would win by its 4 more bits and say nothing about the choice of 4-bit scales."""
    whatif = entry.get("whatif") or {}
    four = kind_of(recipe or "") == "4-bit"
    whatif = {n: w for n, w in whatif.items() if (kind_of(n) == "4-bit") == four}
    if not whatif:
        return None
    name = max(whatif, key=lambda n: _sqnr_key(whatif[n].get("sqnr_db")))
    return name, whatif[name]


def _pct(v) -> str:
    """A share (0..1) as a percentage with 3 significant digits, written out."""
    return "n/a" if not isinstance(v, (int, float)) or math.isnan(v) else plain_number(100 * v, sig=3)


def _db(v) -> str:
    """An SQNR in dB to one decimal; +inf (no rounding error at all) as ``inf (exact)``."""
    if not isinstance(v, (int, float)) or math.isnan(v):
        return "n/a"
    return "inf (exact)" if v == math.inf else f"{v:.1f}"


def _gain(best, own) -> str:
    """The best what-if's SQNR less the run's, in dB (``+inf``: it would be exact, the run's is not)."""
    if not all(isinstance(v, (int, float)) and not math.isnan(v) for v in (best, own)):
        return "n/a"
    if math.isinf(best) or math.isinf(own):
        return "0" if best == own else ("+inf" if best > own else "-inf")
    return f"{best - own:+.1f}"


def fp8_runs(runs: list[Run]) -> list[tuple[Run, dict]]:
    """The runs with float8 cast statistics, each with :func:`fp8_casts`."""
    return [(r, c) for r in runs if (c := fp8_casts(r)) is not None]


def fp8_layer_table(runs: list[Run]) -> str:
    """Per run, the last monitored step's casts of each layer and operand (flush %,
    saturate %, SQNR) and the what-if recipe of the run's width (float8 or 4-bit)
    with the best SQNR; runs numbered as in fp8_layers.png."""
    with_casts = fp8_runs(runs)
    head = ["layer", "operand", "flush %", "saturate %", "SQNR dB", "best what-if", "its flush %",
            "its saturate %", "its SQNR dB", "SQNR gain dB"]
    parts = []
    for i, (r, c) in enumerate(with_casts):
        lines = [f"[{i + 1}] {r.label}: recipe {c.get('recipe') or 'n/a'}, step {c.get('step')} "
                 f"(from {c['source']})", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for layer, ops in c["layers"].items():
            for op, e in ops.items():
                best = best_whatif(e, c.get("recipe"))
                name, w = best if best else ("n/a", {})
                lines.append("| " + " | ".join([
                    layer, op, _pct(e.get("flush")), _pct(e.get("saturate")), _db(e.get("sqnr_db")),
                    name, _pct(w.get("flush")), _pct(w.get("saturate")), _db(w.get("sqnr_db")),
                    _gain(w.get("sqnr_db"), e.get("sqnr_db")),
                ]) + " |")
        parts.append("\n".join(lines))
    without = [r.label for r in runs if all(r is not x for x, _ in with_casts)]
    if without:
        parts.append(f"No float8 or 4-bit cast statistics: {', '.join(without)}.")
    return "\n\n".join(parts)


def _fp8_selection(with_casts: list[tuple[Run, dict]]) -> tuple[list, list[str], list[str], list[str]]:
    """What fp8_layers.png draws: (runs, layers in model order, layers left out, runs left out).
    Past FP8_MAX_LAYERS, the layers kept are those with the lowest SQNR of any run's casts."""
    shown, dropped_runs = with_casts[:FP8_MAX_RUNS], [r.label for r, _ in with_casts[FP8_MAX_RUNS:]]
    layers = list(dict.fromkeys(layer for _, c in shown for layer in c["layers"]))
    if len(layers) <= FP8_MAX_LAYERS:
        return shown, layers, [], dropped_runs

    def lowest(layer: str) -> float:  # a missing or NaN SQNR says nothing: it ranks as exact
        return min((v for _, c in shown for e in (c["layers"].get(layer) or {}).values()
                    if isinstance(v := e.get("sqnr_db"), (int, float)) and not math.isnan(v)), default=math.inf)

    worst = {layer: lowest(layer) for layer in layers}
    kept = set(sorted(layers, key=lambda layer: worst[layer])[:FP8_MAX_LAYERS])
    return shown, [x for x in layers if x in kept], [x for x in layers if x not in kept], dropped_runs


def _fp8_operands(shown: list[tuple[Run, dict]], layer: str) -> list[str]:
    """The operands any shown run has casts of in ``layer``: the usual three in their order, then others."""
    seen = {op for _, c in shown for op in (c["layers"].get(layer) or {})}
    return [op for op in OPERANDS if op in seen] + sorted(seen - set(OPERANDS))


def _fp8_notes(layer: str, ops: list[str], stat: str, same: dict) -> list[str]:
    """The lines naming a per-layer panel's coinciding curves (``same``: :func:`coincidences`),
    one clause per group of runs with the operands where they coincide."""
    by_group: dict[str, list[str]] = {}
    for op in ops:
        for g in same.get(f"{layer} {op} {stat}", []):
            by_group.setdefault(" = ".join(g), []).append(op)
    return [line for g, where in by_group.items()
            for line in textwrap.wrap(f"same curve, {', '.join(where)}: {g}", 60)]


def _fp8_line_panel(ax, runs: list[Run], layer: str, ops: list[str], stat: str, same: dict) -> None:
    """One layer's ``stat`` over the steps: a line per (run, operand), the run's colour and
    marker, the operand's line style; shares in percent; +inf SQNR (an exact cast) as a
    triangle on the panel's top edge."""
    title = {"flush": "flushed to 0 (% of non-zeros)", "saturate": "saturated (% of non-zeros)",
             "sqnr_db": "SQNR (dB)"}[stat]
    values, exact = [], []
    for i, r in enumerate(runs):
        for op in ops:
            xs, ys = r.series(f"{FP8_PREFIX}{layer}/{op}/{stat}", "step")
            if not xs:
                continue
            look = {**style(i, len(xs), len(runs)), "linestyle": OPERAND_LINESTYLES.get(op, "-.")}
            ys = [100 * y for y in ys] if stat != "sqnr_db" else ys
            ax.plot(xs, [y if math.isfinite(y) else math.nan for y in ys], zorder=2 + i, **look)
            values += ys
            exact += [(x, look["color"]) for x, y in zip(xs, ys, strict=True) if y == math.inf]
    notes = _fp8_notes(layer, ops, stat, same)
    ax.set_title("\n".join([f"{layer}: {title}", *notes]), fontsize=9 if notes else 10)
    ax.set_xlabel("step")
    min_span(ax, values)
    if stat != "sqnr_db" and ax.get_ylim()[0] < 0:
        ax.set_ylim(bottom=0)  # shares are never negative
    if exact:
        top = ax.get_ylim()[1]
        ax.set_ylim(ax.get_ylim())  # the triangles sit on the edge without moving it
        for x, color in exact:
            ax.plot([x], [top], marker="^", color=color, markersize=7, clip_on=False, zorder=10)
    plain_axes(ax, "step", "linear")
    ax.grid(alpha=0.3)


def _gain_db(v: Optional[float], own: Optional[float]) -> float:
    """How many dB ``v`` is above the run's own SQNR ``own`` (NaN when either is missing or
    NaN; +-inf when just one of them is exact)."""
    if v is None or own is None or math.isnan(v) or math.isnan(own):
        return math.nan
    return 0.0 if v == own else v - own


def _fp8_recipe_panel(ax, shown: list[tuple[Run, dict]], layer: str, recipes: list[str], norm, cmap) -> None:
    """One layer's SQNR at each run's last monitored step under every recipe: a row per
    (run, operand), a column per recipe, the SQNR written in each cell and coloured by
    how far it is above or below the run's own casts (boxed); each row's best in bold."""
    from matplotlib.patches import Rectangle

    rows, labels, own_cols = [], [], []
    for i, (r, c) in enumerate(shown):
        for op, e in (c["layers"].get(layer) or {}).items():
            own = c.get("recipe") or "run's own"
            row = [((e.get("whatif") or {}).get(name) or {}).get("sqnr_db") for name in recipes]
            row[recipes.index(own)] = e.get("sqnr_db")
            rows.append([v if isinstance(v, (int, float)) else None for v in row])  # None: not logged
            labels.append(f"[{i + 1}] {op}")
            own_cols.append(recipes.index(own))
    # Colour by the gain over the row's own cast, so that a recipe worth switching to stands
    # out whatever the operand's format (E5M2 gradients sit several dB below E4M3 inputs).
    gains = [[_gain_db(v, row[j]) for v in row] for row, j in zip(rows, own_cols, strict=True)]
    ax.imshow([[max(min(g, norm.vmax), norm.vmin) if not math.isnan(g) else g for g in row] for row in gains],
              cmap=cmap, norm=norm, aspect="auto", interpolation="nearest")
    for y, row in enumerate(rows):
        best = max(range(len(row)), key=lambda j: _sqnr_key(row[j]))
        for x, v in enumerate(row):
            if v is None:
                continue
            g = gains[y][x]
            dark = not math.isnan(g) and abs(norm(max(min(g, norm.vmax), norm.vmin)) - 0.5) > 0.35
            ax.text(x, y, "exact" if v == math.inf else f"{v:.1f}", ha="center", va="center", fontsize=7,
                    color="white" if dark else "black", fontweight="bold" if x == best else "normal")
        ax.add_patch(Rectangle((own_cols[y] - 0.5, y - 0.5), 1, 1, fill=False, edgecolor="black", linewidth=1.5))
    ax.set_xticks(range(len(recipes)), recipes, rotation=30, ha="right", fontsize=8)
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.set_title(f"{layer}: SQNR (dB) by recipe, last monitored step", fontsize=10)


def one_step_only(with_casts: list[tuple[Run, dict]]) -> bool:
    """Whether every run's per-layer casts were logged at one step at most (a short run's
    single monitor sample): no curve to draw, the table says it all."""
    return all(len({row.get("step") for row in r.rows if any(k.startswith(FP8_PREFIX) for k in row)}) <= 1
               for r, _ in with_casts)


def dpi_for(fig, most_px: int = MOST_PIXELS, dpi: int = 110) -> float:
    """The resolution to save ``fig`` at: ``dpi``, lowered so that neither side passes ``most_px``."""
    return min(dpi, most_px / max(fig.get_size_inches()))


def build_fp8_figure(runs: list[Run]):
    """The per-layer float8 figure (a ``matplotlib.figure.Figure``), or None when no run
    has float8 cast statistics. A row per layer: its share of flushed and of saturated
    elements and its SQNR over the steps, one line per run and operand (the runs' own
    casts), then a grid of every recipe's SQNR at the last monitored step.

    The what-if recipes are that grid rather than more lines: five recipes for
    each of three operands and each run are up to 120 more curves per panel,
    whereas a grid with the numbers written in stays readable for 8 runs and
    puts the recipes side by side. SQNR stands for them because flushing and
    saturation both show up in it as noise; fp8_layers.md has their flush and
    saturate figures. None too when every run was monitored at one step only: panels of
    single points say nothing fp8_layers.md does not (:func:`one_step_only`)."""
    from matplotlib import colormaps
    from matplotlib.colors import Normalize

    with_casts = fp8_runs(runs)
    if not with_casts or one_step_only(with_casts):
        return None
    shown, layers, dropped_layers, dropped_runs = _fp8_selection(with_casts)
    shown_runs = [r for r, _ in shown]
    ops = {layer: _fp8_operands(shown, layer) for layer in layers}
    specs = [(f"{layer} {op} {stat}", f"{FP8_PREFIX}{layer}/{op}/{stat}", "step", "linear")
             for layer in layers for op in ops[layer] for stat in FP8_STATS]
    same = coincidences(shown_runs, specs)
    recipes = list(WHATIF_RECIPES)
    recipes += list(dict.fromkeys(c.get("recipe") or "run's own" for _, c in shown
                                  if (c.get("recipe") or "run's own") not in recipes))
    gains = [_gain_db(w.get("sqnr_db"), e.get("sqnr_db")) for _, c in shown for layer in layers
             for e in (c["layers"].get(layer) or {}).values() for w in (e.get("whatif") or {}).values()
             if isinstance(w.get("sqnr_db"), (int, float)) and isinstance(e.get("sqnr_db"), (int, float))]
    reach = max([abs(g) for g in gains if math.isfinite(g)] + [1.0])  # one scale for every layer, >= 1 dB
    norm = Normalize(-reach, reach)
    cmap = colormaps["RdBu"].with_extremes(bad="#f0f0f0")  # red: below the run's own casts, blue: above

    fig, axes = _fp8_axes(shown, layers, ops, same)
    for row, layer in zip(axes, layers, strict=True):
        for ax, stat in zip(row[:3], FP8_STATS, strict=True):
            _fp8_line_panel(ax, shown_runs, layer, ops[layer], stat, same)
        _fp8_recipe_panel(row[3], shown, layer, recipes, norm, cmap)
    _fp8_titles(fig, shown, layers, ops, dropped_layers, dropped_runs)
    return fig


def _fp8_axes(shown: list, layers: list[str], ops: dict, same: dict):
    """The per-layer figure and its axes (a row per layer: three line panels and the recipe grid)."""
    from matplotlib.figure import Figure

    # Margins in inches, set here rather than by tight_layout, which costs as much as drawing the figure
    # again: titles (with the coinciding curves) above each row, tick labels and the grid's rotated
    # recipe names below, the grid's row labels between the columns.
    heat_rows = max(sum(len(c["layers"].get(layer) or {}) for _, c in shown) for layer in layers)
    title_h = 0.17 * (1 + max(len(_fp8_notes(layer, ops[layer], stat, same)) for layer in layers
                              for stat in FP8_STATS))
    n_labels = len(shown) + len(dict.fromkeys(op for layer in layers for op in ops[layer]))
    suptitle, legend_h = 0.2 * 3 + 0.15, 0.22 * math.ceil(n_labels / 4) + 0.15
    axes_h, gap_h = max(2.2, 0.2 * heat_rows + 0.4), 0.75 + title_h
    top, bottom = suptitle + title_h, 0.7 + legend_h
    width, left, right, gap_w = 21.0, 0.8, 0.2, 1.3
    height = top + bottom + len(layers) * axes_h + (len(layers) - 1) * gap_h
    fig = Figure(figsize=(width, height))
    axes = fig.subplots(len(layers), 4, squeeze=False, gridspec_kw=dict(
        width_ratios=[1, 1, 1, 1.2], left=left / width, right=1 - right / width, top=1 - top / height,
        bottom=bottom / height, hspace=gap_h / axes_h, wspace=gap_w / ((width - left - right - 3 * gap_w) / 4)))
    return fig, axes


def _fp8_titles(fig, shown: list, layers: list[str], ops: dict, dropped_layers: list, dropped_runs: list) -> None:
    """The per-layer figure's legend (runs by colour, operands by line style) and its title."""
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], **{k: v for k, v in style(i, 2, len(shown)).items() if k != "markevery"})
               for i in range(len(shown))]
    labels = [f"[{i + 1}] {r.label} ({c.get('recipe') or 'recipe n/a'})" for i, (r, c) in enumerate(shown)]
    all_ops = list(dict.fromkeys(op for layer in layers for op in ops[layer]))
    handles += [Line2D([], [], color="grey", linestyle=OPERAND_LINESTYLES.get(op, "-.")) for op in all_ops]
    labels += all_ops
    fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), fontsize=9, frameon=False)
    left_out = ([f"layers {', '.join(dropped_layers)} (kept: the {FP8_MAX_LAYERS} with the lowest SQNR)"]
                if dropped_layers else []) + ([f"runs {', '.join(dropped_runs)}"] if dropped_runs else [])
    fig.suptitle(textwrap.fill(
        "float8 casts per layer: lines are the runs' own casts (colour: run, line style: operand; "
        "a triangle on the top edge: an exact cast, +inf dB); right: SQNR under each recipe at each "
        "run's last monitored step, the run's own casts boxed, the row's best in bold, coloured blue where "
        "better than the run's own and red where worse"
        + (f". Left out: {'; '.join(left_out)}" if left_out else ""), 200), fontsize=10,
        y=1 - 0.1 / fig.get_figheight(), va="top")
