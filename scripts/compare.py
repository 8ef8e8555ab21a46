"""Compare runs: one figure of curves and one table, from run directories.

    python scripts/compare.py multirun/2026-11-30/12-00-00          # a sweep: every job inside
    python scripts/compare.py outputs/a outputs/b --out report/      # any run directories

    python scripts/compare.py multirun/... --reference precision=bf16 --target-loss 3.2 --effect 0.005

Writes ``comparison.png`` and ``comparison.md`` (into the sweep directory, the
runs' common parent, or ``--out``) and prints the tables (the code is the
``mptrain/compare`` layer; this file is its command line).

Runs are grouped into settings: the runs that agree on every config key but
``train.seed`` (and the schema's harmless keys). The tables lead with the speed
at matched quality: each setting's tokens and training time (the sum of
``perf/step_time_s``) until its ``val/loss`` first reaches a target (the
reference's mean final ``val/loss``, or ``--target-loss``), interpolated
between evaluations, with the speed-up against the reference next to the raw
tokens/s ratio. Then the final validation loss over seeds (the whole val split
where every run has it): each setting's mean and spread, and its paired
difference from the reference (seed k with seed k), with the 95% CI, p-value
and verdict (resolved, or not resolved with the seeds that would resolve it;
``--effect`` sets the size asked about). The reference is the fp32 setting
(else bf16, else the first), or ``--reference <label or key=value>``. Settings
over several seeds are drawn as mean curves with a band (the range over
seeds); the figure leads with the loss against training time and the target,
and with the loss minus the reference's, seed by seed. Below: the per-run
figure and table, which one seed per setting still gets. The figure's title
says what was compared (``precision: fp32 vs fp16 vs bf16 · gpt-nano · 200
steps``); the legend sits under it, above the panels, which fill their grid. Each run is labelled by
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
Panels whose metric no run logged are left out (comparison.md says which,
but not of the metrics only some configurations have: float8 casts, the
routing of a mixture of experts, ``moe/load_cv`` and ``moe/flip_share_bf16``).
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
next to the best what-if recipe (printed too); no figure when every run was
monitored at one step only, and never more than 2400 pixels a side.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (``compare: error: ...``) and exit status 2."""

    def error(self, message):
        print(f"compare: error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def arguments() -> _Parser:
    """The command line's parser. Defined before any heavy import (matplotlib, torch), so
    that ``--help`` answers without loading them."""
    ap = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", type=Path, help="a sweep directory or run directories")
    ap.add_argument("--out", type=Path, help="where comparison.png/.md go (default: next to the runs)")
    ap.add_argument("--reference", metavar="LABEL|KEY=VALUE",
                    help="the setting every other is compared with, by its label or key=value[,key=value] "
                         "(default: the fp32 setting, else bf16, else the first)")
    ap.add_argument("--target-loss", type=float, metavar="NATS",
                    help="the validation loss the speed at matched quality is measured to "
                         "(default: the reference's mean final val/loss)")
    ap.add_argument("--effect", type=float, metavar="NATS",
                    help="estimate the seeds needed to resolve a difference of this size (default: the observed one)")
    return ap


if __name__ == "__main__":
    arguments().parse_known_args()  # --help answered here, before torch's import (20 s when busy)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mptrain.compare.figure import figure, single_points_md  # noqa: E402
from mptrain.compare.fp8 import build_fp8_figure, dpi_for, fp8_layer_table, fp8_runs  # noqa: E402
from mptrain.compare.lr import lr_figure, lr_settings, lr_table  # noqa: E402
from mptrain.compare.seedfig import build_seed_figure  # noqa: E402
from mptrain.compare.runs import find_runs, label_runs, references, table  # noqa: E402
from mptrain.compare.seeds import SpecError, matched_md, report, seeds_md  # noqa: E402


def _parse(argv: list[str]) -> argparse.Namespace:
    """The command line, checked: a wrong flag or value is one error line and exit status 2."""
    ap = arguments()
    a = ap.parse_args(argv)
    if a.effect is not None and not a.effect > 0:
        ap.error(f"--effect must be a positive number of nats, got {a.effect}")
    if a.target_loss is not None and not math.isfinite(a.target_loss):
        ap.error(f"--target-loss must be a finite loss, got {a.target_loss}")
    return a


def main(argv: list[str]) -> int:
    """Compare the runs under the paths: write comparison.png/.md (and the float8 and
    learning-rate figures where they apply) and print the tables; 2 on a usage error."""
    try:
        a = _parse(argv)
    except SystemExit as e:  # argparse's exits (--help: 0, an error: 2), as a status for callers of main
        return int(e.code or 0)
    for p in a.paths:
        if not p.exists():
            print(f"compare: {p} does not exist", file=sys.stderr)
            return 2
    runs = find_runs(a.paths)
    if not runs:
        print(f"compare: no runs (no metrics.jsonl) under {', '.join(map(str, a.paths))}", file=sys.stderr)
        return 2
    label_runs(runs)
    try:
        rep = report(runs, a.reference, a.target_loss, a.effect)
    except SpecError as e:
        print(f"compare: error: {e}", file=sys.stderr)
        return 2
    out = a.out or (a.paths[0] if len(a.paths) == 1 and a.paths[0].is_dir() and len(runs) > 1
                    else Path(os.path.commonpath([str(r.path.parent) for r in runs])))
    out.mkdir(parents=True, exist_ok=True)
    md = f"{matched_md(rep)}\n\n{seeds_md(rep)}\n\n### Each run\n\n{table(runs)}"
    missing, same = figure(build_seed_figure(runs, rep), runs, out / "comparison.png")
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
    fp8_md = fp8_layer_table(runs) if fp8_runs(runs) else None
    written = [out / "comparison.png", out / "comparison.md"]
    if fp8_md is not None:  # float8 runs: their casts layer by layer, in their own figure and table
        head = "![float8 casts per layer](fp8_layers.png)" if fp8_fig is not None else (
            "One monitored step per run: no curves to draw (no fp8_layers.png); the casts are the table below.")
        if fp8_fig is not None:
            fp8_fig.savefig(out / "fp8_layers.png", dpi=dpi_for(fp8_fig))
            written.append(out / "fp8_layers.png")
        (out / "fp8_layers.md").write_text(f"{head}\n\n{fp8_md}\n")
        note += "\n\nFloat8 casts per layer: [fp8_layers.md](fp8_layers.md)."
        written.append(out / "fp8_layers.md")
    (out / "comparison.md").write_text(f"![comparison](comparison.png)\n\n{md}{note}\n")
    print(md + note)
    if fp8_md is not None:
        print(f"\nFloat8 casts per layer, last monitored step:\n\n{fp8_md}")
    print(f"\nwrote {', '.join(map(str, written))}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
