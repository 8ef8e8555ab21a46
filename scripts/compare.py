"""Compare runs: one figure of curves and one table, from run directories.

    python scripts/compare.py multirun/2026-11-30/12-00-00          # a sweep: every job inside
    python scripts/compare.py outputs/a outputs/b --out report/      # any run directories

Writes ``comparison.png`` and ``comparison.md`` (into the sweep directory, the
runs' common parent, or ``--out``) and prints the table. The figure's title
says what was compared (``precision: fp32 vs fp16 vs bf16 · gpt-nano · 200
steps``); the legend sits under it, above the panels. Each run is labelled by
the config values that differ between the runs, leaving out a key where the
run has it at its default (``train.audit=False``), and drawn with its own
colour, line style and hollow marker, so a curve drawn over an identical one
leaves it visible. A panel is drawn only for a metric with a curve (two or
more points in some run); the metrics every run logged at one step at most
(a short run's monitor samples, a validation loss taken once) are a table
under the panels and in comparison.md instead. Every y axis names its unit,
shares are drawn in percent (as the tables give them), a "what-if: " title
marks what a cast would do (the monitor's counterfactuals on the run's own
tensors) apart from what the run did, and the throughput panel (tokens/s)
starts at zero. A series with fewer than SPARSE_POINTS points, or
SPARSE_RATIO times fewer than the run's train loss (monitor samples, the
validation loss), is drawn as points, not joined by a line, and its panel says
how often it was sampled. Gradient underflow is counted on the gradients as
held: a loss-scaled (fp16) run's panel says they were measured after loss
scaling. Runs whose curves coincide on a panel (equal within COINCIDE_RTOL at
every common step) are named in that panel's title and in a note after the
table. Tick labels are plain numbers (no offset or shared multiplier), and a y
axis spans at least MIN_REL_SPAN of its values, so rounding-level differences
never fill a panel.
Panels whose metric no run logged are left out (the figure says which).
A metric ending in ``/block*`` is per block: its panel draws, at each step, the
largest value over the run's blocks (``stability/massive_ratio/block*``).

The table's "val loss - fp32" gap is taken only between runs that agree on
everything but the precision, the optimizer state's storage and the seed
(settings the schema marks harmless aside); a run without such an fp32 (else
bf16) run gets n/a, and a line after the table says what it differs in.

Runs with float8 or 4-bit cast statistics (``precision=fp8``, ``mxfp8``,
``nvfp4``, ``mxfp4``, ...) also get
``fp8_layers.png``, their casts layer by layer, and ``fp8_layers.md``, a
table per run of each layer's and operand's casts at the last monitored step
next to the best what-if recipe (printed too).
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import textwrap
from pathlib import Path
from typing import Optional

import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from omegaconf import OmegaConf  # noqa: E402

from mptrain.checkpoint.checkpointer import flatten  # noqa: E402
from mptrain.config.checks import CONFIG_DIR, RENAMED_RECIPES  # noqa: E402
from mptrain.config.schema import Config, MonitorConfig  # noqa: E402
from mptrain.observe.fp8watch import kind_of  # noqa: E402

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
]
# Metrics only some configurations have (stochastic rounding, Kahan summation, float8
# linears): a sweep without those is not missing them, so their absence is not reported.
ONLY_WHERE_THEY_APPLY = {"numerics/update_lost_expected", "numerics/kahan_held_over_update",
                         "fp8/worst/flush", "fp8/worst/saturate", "fp8/worst/sqnr_db"}
# Metrics read as ratios between runs (fp8 at 0.4x fp32's tokens/s): their y axis starts at
# zero, so a run twice as fast sits twice as high instead of at the other edge of a zoomed axis.
FROM_ZERO = {"perf/tokens_per_s"}
IGNORED_KEYS = ("run_info", "log.", "debug.", "hydra")
# A PANELS metric ending in this is per block (``<name>/block0``, ``<name>/block1``, ...):
# the panel shows the largest over the blocks, the layer where an outlier is worst.
OVER_BLOCKS = "/block*"
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
# Keys a "val loss - fp32" gap may differ in: the precision, the storage of the optimizer's
# moments (the optimizer_precision study), and the seed (a second fp32 seed: the noise the
# gaps are read against). A run is paired with a reference that agrees on every other key
# that can change training (the schema's harmless keys cannot); other runs get none.
PAIRED_ACROSS = ("precision.", "optim.state_dtype", "train.seed")
CONFIGS = Path(CONFIG_DIR)
# The config groups and the key that names each one's preset (mptrain/configs/<group>/<value>.yaml).
GROUP_KEYS = {"model": "name", "precision": "name", "parallel": "name", "data": "kind"}


class Run:
    def __init__(self, path: Path):
        self.path = path
        self.rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines() if line.strip()]
        self.summary = json.loads((path / "summary.json").read_text()) if (path / "summary.json").exists() else {}
        cfg_file = path / "config.yaml"
        self.config = yaml.safe_load(cfg_file.read_text()) if cfg_file.exists() else {}
        self.label = path.name

    def series(self, metric: str, x: str) -> tuple[list[float], list[float]]:
        """``(xs, ys)`` of the rows that have ``metric`` and ``x``; a metric ending
        in :data:`OVER_BLOCKS`: its largest value over the row's blocks (NaN if any is NaN)."""
        xs, ys = [], []
        for r in self.rows:
            y = _over_blocks(r, metric) if metric.endswith(OVER_BLOCKS) else r.get(metric)
            if x in r and isinstance(y, (int, float)):
                xs.append(r[x])
                ys.append(y)
        return xs, ys

    def last(self, metric: str):
        for r in reversed(self.rows):
            if metric in r:
                return r[metric]
        return None


def _over_blocks(row: dict, metric: str) -> Optional[float]:
    """The largest of ``row``'s ``<name>/block<N>`` values for ``metric`` = ``<name>/block*``;
    None when the row has none."""
    prefix = metric[:-1]  # ".../block"
    values = [v for k, v in row.items() if k.startswith(prefix) and k[len(prefix):].isdigit()
              and isinstance(v, (int, float))]
    if not values:
        return None
    return math.nan if any(math.isnan(v) for v in values) else max(values)


def find_runs(paths: list[Path]) -> list[Run]:
    dirs: list[Path] = []
    for p in paths:
        if (p / "metrics.jsonl").exists():
            dirs.append(p)
        elif p.is_dir():
            dirs += sorted({m.parent for m in p.rglob("metrics.jsonl")},
                           key=lambda d: (len(d.parts), [int(x) if x.isdigit() else x for x in d.parts]))
    return [Run(d) for d in dict.fromkeys(dirs)]


def _flat(run: Run) -> dict:
    """The run's config keys, dotted, less IGNORED_KEYS (read once per run)."""
    if getattr(run, "_flat", None) is None:
        run._flat = {k: v for k, v in flatten(run.config).items() if not k.startswith(IGNORED_KEYS)}
    return run._flat


@functools.cache
def _schema_defaults() -> dict:
    """Every key's default in the schema (``mptrain/config/schema.py``), dotted."""
    return flatten(OmegaConf.to_container(OmegaConf.structured(Config), enum_to_str=True))


@functools.cache
def _preset(group: str, name) -> dict:
    """``mptrain/configs/<group>/<name>.yaml`` with the presets it builds on, dotted under ``group``;
    empty for a name without a file."""
    path = CONFIGS / group / f"{name}.yaml"
    if not isinstance(name, str) or "/" in name or not path.is_file():
        return {}
    y = yaml.safe_load(path.read_text()) or {}
    out: dict = {}
    for base in y.pop("defaults", None) or []:
        if isinstance(base, str) and base != "_self_":
            out.update(_preset(group, base))
    return {**out, **flatten(y, f"{group}.")}


def defaults_of(run: Run) -> dict:
    """What each key of ``run`` would be had nobody set it: the schema's default, or the
    value the run's preset of that group gives it (``model.n_layer`` is 2 in gpt-nano)."""
    if getattr(run, "_defaults", None) is None:
        flat = _flat(run)
        run._defaults = dict(_schema_defaults())
        for group, key in GROUP_KEYS.items():
            run._defaults.update(_preset(group, flat.get(f"{group}.{key}")))
    return run._defaults


def _value(run: Run, key: str):
    """``key`` in the run's config, its default where the config does not have it (an older run)."""
    flat = _flat(run)
    return flat[key] if key in flat else defaults_of(run).get(key)


def _same(values) -> bool:
    return len({json.dumps(v, sort_keys=True, default=str) for v in values}) <= 1


def differing_keys(runs: list[Run]) -> list[str]:
    """The config keys whose values differ between the runs, as labels show them: a
    group's name (``precision.name``) says more than its fields, so the fields it
    explains are left out. A key a run does not have counts at its default."""
    keys = sorted({k for r in runs for k in _flat(r)})
    differing = [k for k in keys if not _same(_value(r, k) for r in runs)]
    names = [k for k in differing if k.endswith(".name")]
    return names + [k for k in differing if not any(k.startswith(n[: -len("name")]) for n in names)]


def _show(key: str, value) -> str:
    return f"{key[: -len('.name')]}={value}" if key.endswith(".name") else f"{key}={value}"


def label_runs(runs: list[Run]) -> list[str]:
    """Label each run by the config values that differ between runs, leaving out a key
    where this run has it at its default (``train.audit=False`` next to a run that set
    it True): the label names what was changed. A run whose differing keys are all at
    their defaults, and a group's name (the preset chosen), keep theirs."""
    shown = differing_keys(runs)
    labels = []
    for r in runs:
        if len(runs) == 1 or not shown:
            labels.append(f"{_flat(r).get('precision.name', r.path.name)}")
            continue
        defaults = defaults_of(r)
        changed = [k for k in shown if k.endswith(".name") or not _same([_value(r, k), defaults.get(k)])]
        labels.append(", ".join(_show(k, _value(r, k)) for k in (changed or shown)[:4]))
    if len(set(labels)) < len(labels):  # still ambiguous: add the directory
        labels = [f"{lab} ({r.path.name})" for lab, r in zip(labels, runs, strict=True)]
    for r, lab in zip(runs, labels, strict=True):
        r.label = lab
    return labels


def compared(runs: list[Run]) -> str:
    """The figure's title: what was compared (each differing key with its values, in
    the runs' order) and what the runs share (the model, the steps)."""
    shown = differing_keys(runs) if len(runs) > 1 else []
    parts = []
    for k in shown[:4]:
        values = list(dict.fromkeys(str(_value(r, k)) for r in runs))
        parts.append(f"{k[: -len('.name')] if k.endswith('.name') else k}: {' vs '.join(values)}")
    common = []  # the model only where every run's config names the same one (no guessing a default)
    models = {_flat(r).get("model.name") for r in runs}
    if len(models) == 1 and None not in models:
        common.append(str(models.pop()))
    last = {max((row["step"] for row in r.rows if "step" in row), default=None) for r in runs}
    if len(last) == 1 and None not in last:
        common.append(f"{last.pop()} steps")
    what = (" · ".join(parts) if parts else
            runs[0].label if len(runs) == 1 else f"{len(runs)} runs of the same config")
    return " · ".join([what, *common])


def _harmless() -> set[str]:
    """The keys the schema marks harmless: they change what is reported or kept, not what is trained."""
    from mptrain.config.schema import HARMLESS, on_resume

    return {k for k, (kind, _) in on_resume().items() if kind == HARMLESS}


def _pairing_keys(runs: list[Run]) -> list[str]:
    """The keys two runs must agree on for one's loss to be subtracted from the other's."""
    harmless = _harmless()
    return [k for k in sorted({k for r in runs for k in _flat(r)})
            if not k.startswith(PAIRED_ACROSS) and k not in harmless]


def _reference(runs: list[Run]) -> tuple[Optional[Run], str]:
    """The run the loss gaps are taken against: the fp32 one, else (a float8 study) the bf16 one."""
    for name in ("fp32", "bf16"):
        ref = next((r for r in runs if (r.config.get("precision") or {}).get("name") == name), None)
        if ref is not None:
            return ref, name
    return None, "fp32"


def references(runs: list[Run]) -> tuple[dict[int, Optional[Run]], list[str], list[str]]:
    """Each run's reference for the loss gap (by ``id``), taken within the runs that agree
    with it on everything but the precision (:data:`PAIRED_ACROSS`): the fp32 one, else
    the bf16 one. Returns the references, the reference precisions used, and one line per
    group of runs left without one while others have one (another model, say), naming
    the keys it differs in."""
    keys = _pairing_keys(runs)
    groups: dict[str, list[Run]] = {}
    for r in runs:
        groups.setdefault(json.dumps([_value(r, k) for k in keys], default=str), []).append(r)
    refs, names = {}, []
    for members in groups.values():
        ref, name = _reference(members)
        refs.update({id(m): ref for m in members})
        if ref is not None and name not in names:
            names.append(name)
    refused = []
    with_ref = [r for r in runs if refs[id(r)] is not None]
    for members in groups.values():
        if refs[id(members[0])] is not None or not with_ref:
            continue
        apart = [k for k in keys if not _same([_value(members[0], k), *(_value(r, k) for r in with_ref)])]
        refused.append(f"No val loss - {'/'.join(names)} for {', '.join(m.label for m in members)}: no "
                       f"{' or '.join(names)} run agrees with it on everything but precision "
                       f"(it differs in {', '.join(apart[:4])}{', ...' if len(apart) > 4 else ''}).")
    return refs, names, refused


def fp8_worst(run: Run) -> Optional[tuple[float, float, float]]:
    """The run's worst float8 casts over all its monitored steps: the largest flushed
    and saturated shares and the lowest SQNR of any layer and operand; None without
    cast statistics."""
    rows = [r for r in run.rows if "fp8/worst/flush" in r]
    if not rows:
        return None
    return (max(r["fp8/worst/flush"] for r in rows), max(r["fp8/worst/saturate"] for r in rows),
            min(r["fp8/worst/sqnr_db"] for r in rows))


def _val(run: Run):
    return run.summary.get("final/val_loss", run.last("val/loss"))


def table(runs: list[Run]) -> str:
    """The runs' final figures, a row per run; the val-loss gap is taken against the
    run's own reference (:func:`references`), n/a without one."""
    refs, names, _ = references(runs)
    casts = any(fp8_worst(r) for r in runs)
    head = ["run", "final train loss", "final val loss", f"val loss - {'/'.join(names) or 'fp32'}",
            "state bytes/param", "tokens/s",
            "skipped steps", "peak memory (GiB)", "wall time (s)",
            *(["worst flush", "worst saturate", "worst SQNR (dB)"] if casts else [])]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def f(x, spec=".4f"):
        return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)

    def worst(r):  # float8 casts over the run (fp8_worst); "n/a" for runs without float8 linears
        w = fp8_worst(r)
        return [] if not casts else ["n/a"] * 3 if w is None else [f"{100 * w[0]:.3g}%", f"{100 * w[1]:.3g}%",
                                                                    f"{w[2]:.1f}"]

    for r in runs:
        s = r.summary
        val, ref = _val(r), refs[id(r)]
        ref_val = _val(ref) if ref is not None else None
        delta = None if ref_val is None or val is None else val - ref_val
        mem = s.get("mem/peak_gib", s.get("mem/peak_rss_gib"))
        skipped = s.get("amp/skipped_steps", s.get("train/nonfinite_skipped"))
        lines.append("| " + " | ".join([
            r.label, f(s.get("final/train_loss", r.last("train/loss"))), f(val),
            ("+" if delta is not None and delta >= 0 else "") + f(delta) if delta is not None else "n/a",
            f(s.get("mem/bytes_per_param"), ".2f"),  # weights, gradients, optimizer state (memory.py)
            f(s.get("perf/tokens_per_s"), ",.0f"), "n/a" if skipped is None else str(skipped),
            f(mem, ".2f"), f(s.get("wall_time_s"), ".1f"), *worst(r),
        ]) + " |")
    return "\n".join(lines)


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
    if scale != "linear":
        lo, hi = ax.get_ylim()
        ax.yaxis.set_major_formatter(FuncFormatter(plain_number))
        # Within one power of the base the major ticks are too few to read: label the minor ones too.
        narrow = lo > 0 and hi / lo < (2 if scale == "log2" else 10)
        ax.yaxis.set_minor_formatter(FuncFormatter(plain_number) if narrow else NullFormatter())
    if x == "step":
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))  # also for one step


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
    ax.set_xlabel("tokens" if x == "train/tokens" else "step")
    ax.set_ylabel(unit)
    if scale == "log2":
        ax.set_yscale("log", base=2)
    elif scale == "log":
        ax.set_yscale("log")
    if metric in FROM_ZERO:
        ax.set_ylim(0, max(values, default=1.0) * 1.05)
    elif scale != "log2":  # (the loss scale's powers of 2 keep matplotlib's own, wider, axis)
        min_span(ax, values)
    plain_axes(ax, x, scale)
    ax.grid(alpha=0.3)


def _single_points_table(ax, runs: list[Run]) -> None:
    """The metrics logged at one step only (:func:`single_points`) as a table in the figure."""
    head, rows = single_points(runs)
    ax.axis("off")
    ax.set_title("logged at one step only (no curve to draw): the value at that step")
    t = ax.table(cellText=rows, colLabels=head, loc="upper center", cellLoc="left")
    t.auto_set_font_size(False)
    t.set_fontsize(8)
    t.auto_set_column_width(list(range(len(head))))


def build_figure(runs: list[Run]):
    """The comparison figure (a ``matplotlib.figure.Figure``, not yet saved): one
    panel per metric with a curve (two or more points in some run), one line (or set
    of points) per run, and under the panels a table of the metrics logged at one
    step only; the title says what was compared, the legend sits under it, above
    the panels."""
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    panels, missing = panels_with_data(runs)
    n_single = len(single_points(runs)[1])
    same = coincidences(runs, panels)
    cols = 3
    rows = max(0 if n_single else 1, math.ceil(len(panels) / cols))
    labels = [r.label for r in runs]
    ncol = min(4, len(labels))
    title = textwrap.fill(compared(runs), 150)
    if missing:
        title += "\n" + textwrap.fill(f"not logged by any run: {', '.join(missing)}", 170)
    # Inches above the panels: the title's lines, then the legend's rows; under them, the table's rows.
    title_h, legend_h = 0.22 * (title.count("\n") + 1) + 0.15, 0.24 * math.ceil(len(labels) / ncol) + 0.1
    table_h = 0.25 * (n_single + 1) + 0.6 if n_single else 0.0
    height = 3.8 * rows + table_h + title_h + legend_h
    fig = Figure(figsize=(6 * cols, height))
    grid = fig.add_gridspec(rows + (1 if n_single else 0), cols,
                            height_ratios=[3.8] * rows + ([table_h] if n_single else []))
    for i, spec in enumerate(panels):
        _panel(fig.add_subplot(grid[i // cols, i % cols]), runs, spec, same.get(spec[0], []))
    if n_single:
        _single_points_table(fig.add_subplot(grid[rows, :]), runs)
    handles = [Line2D([], [], **{k: v for k, v in style(i, 2, len(runs)).items() if k != "markevery"})
               for i in range(len(runs))]
    fig.suptitle(title, fontsize=11, y=1 - 0.08 / height, va="top")
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 1 - title_h / height), ncol=ncol,
               fontsize=10, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - (title_h + legend_h) / height))
    return fig


def figure(runs: list[Run], out: Path) -> tuple[list[str], str]:
    """Write the figure to ``out``; returns the metrics no run logged and the note on coinciding curves."""
    build_figure(runs).savefig(out, dpi=110)  # a bare Figure renders with Agg: no pyplot, no display
    panels, missing = panels_with_data(runs)
    return missing, coincide_note(coincidences(runs, panels))


# ------------------------------------------------------------ float8 casts per layer
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
    saturate figures."""
    from matplotlib import colormaps
    from matplotlib.colors import Normalize

    with_casts = fp8_runs(runs)
    if not with_casts:
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


# ------------------------------------------------------------ learning-rate sweeps
LR_KEY = "optim.lr"


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
    for r, f in zip(runs, flats, strict=True):
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
        bad = [lr for lr, v in zip(lrs, losses, strict=True) if not math.isfinite(v)]
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
    note = "".join(f"\n\n{line}" for line in references(runs)[2])
    note += f"\n\nNot logged by any run (panels left out): {', '.join(missing)}." if missing else ""
    single = single_points_md(runs)
    note += f"\n\n{single}" if single else ""
    note += f"\n\n{same}" if same else ""
    groups = lr_settings(runs)
    if groups:  # a learning-rate sweep: its own figure and table
        lr_figure(groups, out / "lr_sensitivity.png")
        note += f"\n\n![lr sensitivity](lr_sensitivity.png)\n\nFinal loss by learning rate:\n\n{lr_table(groups)}"
    fp8_fig = build_fp8_figure(runs)
    written = [out / "comparison.png", out / "comparison.md"]
    if fp8_fig is not None:  # float8 runs: their casts layer by layer, in their own figure and table
        fp8_fig.savefig(out / "fp8_layers.png", dpi=110)
        fp8_md = fp8_layer_table(runs)
        (out / "fp8_layers.md").write_text(f"![float8 casts per layer](fp8_layers.png)\n\n{fp8_md}\n")
        note += "\n\nFloat8 casts per layer: [fp8_layers.md](fp8_layers.md)."
        written += [out / "fp8_layers.png", out / "fp8_layers.md"]
    (out / "comparison.md").write_text(f"![comparison](comparison.png)\n\n{md}{note}\n")
    print(md + note)
    if fp8_fig is not None:
        print(f"\nFloat8 casts per layer, last monitored step:\n\n{fp8_md}")
    print(f"\nwrote {', '.join(map(str, written))}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
