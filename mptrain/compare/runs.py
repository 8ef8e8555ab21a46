"""The runs a comparison reads: run directories and their metrics, summaries and configs;
the config keys that tell runs apart (labels, the figure's title), and which run each
one's loss gap is taken against (:func:`references`)."""
from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Optional

import yaml
from omegaconf import OmegaConf

from mptrain.checkpoint.checkpointer import flatten
from mptrain.config.checks import CONFIG_DIR
from mptrain.config.schema import HARMLESS, Config, on_resume

IGNORED_KEYS = ("run_info", "log.", "debug.", "hydra")
# A PANELS metric ending in this is per block (``<name>/block0``, ``<name>/block1``, ...):
# the panel shows the largest over the blocks, the layer where an outlier is worst.
OVER_BLOCKS = "/block*"
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


def differing_keys(runs: list[Run], skip: tuple[str, ...] = ()) -> list[str]:
    """The config keys whose values differ between the runs, as labels show them: a
    group's name (``precision.name``) says more than its fields, so the fields it
    explains are left out. A key a run does not have counts at its default; keys in
    ``skip`` never count (the seed, when runs are grouped over seeds)."""
    keys = sorted({k for r in runs for k in _flat(r)} - set(skip))
    differing = [k for k in keys if not _same(_value(r, k) for r in runs)]
    names = [k for k in differing if k.endswith(".name")]
    return names + [k for k in differing if not any(k.startswith(n[: -len("name")]) for n in names)]


def _show(key: str, value) -> str:
    return f"{key[: -len('.name')]}={value}" if key.endswith(".name") else f"{key}={value}"


def label_runs(runs: list[Run]) -> list[str]:
    """Label each run (``run.label``) by :func:`labels_of`."""
    labels = labels_of(runs)
    for r, lab in zip(runs, labels, strict=True):
        r.label = lab
    return labels


def labels_of(runs: list[Run], skip: tuple[str, ...] = ()) -> list[str]:
    """A label per run from the config values that differ between runs, leaving out a key
    where this run has it at its default (``train.audit=False`` next to a run that set
    it True): the label names what was changed. A run whose differing keys are all at
    their defaults, and a group's name (the preset chosen), keep theirs. Keys in
    ``skip`` are never shown (the seed, when labelling settings over seeds)."""
    shown = differing_keys(runs, skip)
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

