"""Learning-rate sweeps: final loss against ``optim.lr`` per setting (``lr_sensitivity.png``
and a table)."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

from mptrain.compare.figure import plain_axes, style
from mptrain.compare.runs import Run, _flat

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
