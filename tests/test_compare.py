"""scripts/compare.py on real run directories, and W&B grouping of a sweep."""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from mptrain.compare.figure import MIN_REL_SPAN, build_figure, coincidences, is_sparse, min_span, panels_with_data
from mptrain.compare.fp8 import _fp8_selection, build_fp8_figure, fp8_casts
from mptrain.compare.runs import find_runs, label_runs

from .conftest import ROOT, TINY, load_script, read_rows, run_cli, train


def _compare(*args):
    """``python scripts/compare.py ...`` as a user runs it."""
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "compare.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=300)


def _compare_here(capsys, *args) -> tuple[int, str, str]:
    """compare.py's ``main`` in this process: (exit status, stdout, stderr). The CLI
    itself is run by test_compare_a_sweep; here a new process would only add its
    start-up (torch, imported through mptrain) to the same code."""
    main = load_script("compare").main
    capsys.readouterr()  # only what main prints
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def _each_run(md: str) -> list[str]:
    """The lines of comparison.md's per-run table (after the settings' tables)."""
    return md.split("### Each run", 1)[1].splitlines()


def test_compare_a_sweep(tmp_path):
    sweep = tmp_path / "sweep"
    for i, p in enumerate(["fp32", "bf16", "fp16"]):
        train(sweep / str(i), f"precision={p}", "train.max_steps=6", "train.eval_every=3", "monitor.every=3")
    r = _compare(sweep)
    assert r.returncode == 0, r.stderr
    png, md = sweep / "comparison.png", sweep / "comparison.md"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    text = md.read_text()
    assert "precision=fp32" in text and "precision=bf16" in text and "precision=fp16" in text
    rows = {line.split("|")[1].strip(): line for line in _each_run(text) if line.startswith("| precision=")}
    assert "| +0.0000 |" in rows["precision=fp32"]  # the reference run
    assert rows["precision=fp16"].split("|")[7].strip() == "0"  # skipped steps, from summary.json
    assert rows["precision=fp32"].split("|")[5].strip() == "16.00"  # state bytes per parameter
    assert "val loss - fp32" in r.stdout  # the table is printed too
    assert "Not logged" not in text  # every panel had data (fp16 brings the loss scale)


@pytest.fixture(scope="module")
def short_runs(tmp_path_factory) -> Path:
    """Three runs without the monitor, shared by the tests below: ``a`` and ``b``
    the same one-step run (one point per panel, identical curves), ``run`` three
    steps from another seed (a curve that coincides with neither)."""
    root = tmp_path_factory.mktemp("short-runs")
    for name in ("a", "b"):
        train(root / name, "train.max_steps=1", "monitor.enabled=false")
    train(root / "run", "train.max_steps=3", "train.seed=1", "monitor.enabled=false")
    return root


def test_compare_single_run_with_missing_metrics(short_runs, tmp_path, capsys):
    code, _, err = _compare_here(capsys, short_runs / "run", "--out", tmp_path / "report")
    assert code == 0, err
    assert (tmp_path / "report" / "comparison.png").exists()
    note = (tmp_path / "report" / "comparison.md").read_text()
    assert "Not logged by any run (panels left out)" in note and "amp/loss_scale" in note and "val/loss" in note


def test_compare_without_runs_fails_clearly(tmp_path, capsys):
    code, _, err = _compare_here(capsys, tmp_path)
    assert code == 2 and "no runs (no metrics.jsonl)" in err
    code, _, err = _compare_here(capsys, tmp_path / "nope")
    assert code == 2 and "does not exist" in err


def test_sweep_groups_the_seeds_of_each_setting(tmp_path):
    """``precision=fp32,bf16 train.seed=0,1``: four jobs in two W&B groups, one per
    precision, each holding both seeds; run names keep the seed; every job tagged with
    the sweep; TensorBoard's own reader finds the group and the seed in each run's
    event file (an hparams session start, no subdirectory)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import metadata

    tiny = [o for o in TINY if not o.startswith("log.tensorboard=")]
    r = run_cli("-m", *tiny, "train.max_steps=2", "precision=fp32,bf16", "train.seed=0,1", "log.wandb.enabled=true",
                "log.tensorboard=true", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    jobs = sorted((p for p in (tmp_path / "multirun").glob("*/*/*") if p.is_dir() and p.name.isdigit()),
                  key=lambda p: int(p.name))
    assert len(jobs) == 4
    cfgs = [yaml.safe_load((j / "config.yaml").read_text()) for j in jobs]
    sweep = "_".join(jobs[0].parent.relative_to(tmp_path).parts)  # multirun_<date>_<time>
    groups: dict = {}
    for c in cfgs:
        w, seed = c["log"]["wandb"], c["train"]["seed"]
        assert f"train.seed={seed}" in c["run_info"]["run_name"].split(",")  # the name keeps every override
        assert f"sweep:{sweep}" in w["tags"]
        groups.setdefault(w["group"], set()).add((c["precision"]["name"], seed))
    assert sorted(map(sorted, groups.values())) == [[("bf16", 0), ("bf16", 1)], [("fp32", 0), ("fp32", 1)]]
    for g in groups:
        assert g.startswith(f"sweep-{sweep}/") and len(g) <= 128 and "train.seed" not in g
    for j, c in zip(jobs, cfgs, strict=True):
        assert len(list((j / "wandb").glob("offline-run-*"))) == 1
        assert not [p for p in (j / "tensorboard").iterdir() if p.is_dir()]  # one run, not a run and a subrun
        events = EventAccumulator(str(j / "tensorboard"))
        events.Reload()
        start = metadata.parse_session_start_info_plugin_data(
            events.PluginTagToContent(metadata.PLUGIN_NAME)[metadata.SESSION_START_INFO_TAG])
        assert start.group_name == start.hparams["group"].string_value == c["log"]["wandb"]["group"]
        assert start.hparams["seed"].number_value == c["train"]["seed"]
        assert start.hparams["precision"].string_value == c["precision"]["name"]
        assert "run/group/text_summary" in events.Tags()["tensors"]


def _plain_labels(fig, only=lambda title: True) -> dict:
    """Panel title -> its axes, after checking that every tick label of every panel
    (whose title ``only`` accepts) is a number written out: no offset ("+7.521"), no
    multiplier ("1e-5"), no powers."""
    fig.draw_without_rendering()  # tick labels and offsets are decided at draw time
    panels = {ax.get_title().split("\n")[0]: ax for ax in fig.axes if ax.get_title() and only(ax.get_title())}
    for title, ax in panels.items():
        for axis in (ax.xaxis, ax.yaxis):
            assert axis.get_major_formatter().get_offset() == "", title
            labels = [t.get_text() for t in axis.get_ticklabels() + axis.get_ticklabels(minor=True) if t.get_text()]
            assert labels and all(re.fullmatch(r"[-\u2212]?\d+(\.\d+)?", t) for t in labels), (title, labels)
    return panels


def test_figure_of_one_point_runs_and_identical_curves(short_runs, tmp_path, capsys):
    """Two identical one-point runs and a third that differs: the axes read
    plainly, a lone point is a visible marker, the identical pair is drawn in two
    styles and named, on the figure and in the printed output; the third run is not."""
    runs = find_runs([short_runs])
    a, b, c = label_runs(runs)
    assert a.endswith("(a)") and b.endswith("(b)") and c.endswith("(run)")  # same config: named by directory
    alone = build_figure(runs[:2])  # one point each: no curve, so a table and no panel
    assert [ax.get_title() for ax in alone.axes] == [SINGLE_TITLE]
    cells = _table_rows(alone)
    assert cells["train loss"][1] == "1" and cells["train loss"][2] == cells["train loss"][3]
    # (the throughput is timed: two runs of one configuration differ there)
    panels = _plain_labels(build_figure(runs), only=lambda t: t != SINGLE_TITLE and "throughput" not in t)
    assert {"train loss", "gradient norm (unscaled, before clipping)"} <= set(panels)
    for title, ax in panels.items():
        la, lb, _ = ax.get_lines()  # beside the third run's curve
        for line in (la, lb):  # a lone point is a marker one can see, not a pixel
            assert len(line.get_xdata()) == 1, title
            assert line.get_marker() not in ("", "None", None, ",", ".") and line.get_markersize() >= 6, title
        assert la.get_marker() != lb.get_marker(), title  # a lone point is a sample: no line to tell apart
        assert la.get_linestyle() == lb.get_linestyle() == "None", title
        assert f"same curve: {a} = {b}" in ax.get_title().replace("\n", " "), title
    from matplotlib.figure import Figure

    ax = Figure().subplots()  # two losses 1e-4 apart do not stretch over a whole panel
    ax.plot([1, 1], [7.5213, 7.5214])
    min_span(ax, [7.5213, 7.5214])
    assert ax.get_ylim()[1] - ax.get_ylim()[0] >= 0.99 * MIN_REL_SPAN * 7.5214
    title = _plain_labels(build_figure(runs))["train loss"].get_title().replace("\n", " ")
    assert f"same curve: {a} = {b}" in title and c not in title
    code, out, err = _compare_here(capsys, short_runs, "--out", tmp_path / "report")
    assert code == 0, err
    note = next(line for line in out.splitlines() if line.startswith("Curves that coincide"))
    assert f"{a} = {b} (in: train loss, train loss vs tokens, " in note and c not in note
    assert note in (tmp_path / "report" / "comparison.md").read_text()


def test_a_whole_sweep_coinciding_is_named_once(tmp_path):
    """A panel where every run of a sweep draws the same curve (a metric no setting
    touches) says so in three words instead of listing every run."""
    for i in range(3):
        (tmp_path / str(i)).mkdir()
        (tmp_path / str(i) / "metrics.jsonl").write_text(
            "".join(json.dumps({"step": s, "train/loss": 3.0 + i - s / 10, "train/lr": 1e-3}) + "\n" for s in (1, 2)))
    runs = find_runs([tmp_path])
    label_runs(runs)
    panels = [("train loss", "train/loss", "step", "linear"), ("lr", "train/lr", "step", "linear")]
    assert coincidences(runs, panels) == {"lr": [["all 3 runs"]]}


# ------------------------------------------------------------ what the figure tells at a glance
NANO = {"name": "gpt-nano", "n_layer": 2, "n_head": 2, "d_model": 64, "block_size": 64}


def _sweep_of(root: Path, runs: dict) -> Path:
    """Run directories under ``root`` as the trainer writes them, 40 steps each: the loss
    logged every step, the monitor's metrics at step 1 and every 10 steps, the validation
    loss once, at the end. ``runs``: name -> (config, final val loss); fp16 ones (loss
    scaling on in their preset) log the loss scale and count no fp16 underflow."""
    for name, (cfg, val) in runs.items():
        path = root / name
        path.mkdir(parents=True)
        scaled = cfg["precision"]["name"] == "fp16"
        rows = []
        for step in range(1, 41):
            row = {"step": step, "train/loss": 5.0 - step / 20, "train/tokens": 512 * step}
            if scaled:
                row["amp/loss_scale"] = 65536.0
            if step == 1 or step % 10 == 0:
                row.update({"numerics/grad_underflow/fp16": 0.0 if scaled else 0.001 * step,
                            "stability/output_log_z": 5.8 - step / 100})
            if step == 40:
                row["val/loss"] = val
            rows.append(row)
        path.joinpath("metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        path.joinpath("summary.json").write_text(json.dumps({"final/val_loss": val}))
        path.joinpath("config.yaml").write_text(yaml.safe_dump({"model": NANO, **cfg}))
    return root


def _three_precisions(root: Path) -> Path:
    """fp32, fp16 and bf16 on gpt-nano; bf16 also audited (a harmless setting: it trains the same)."""
    return _sweep_of(root, {
        "0": ({"precision": {"name": "fp32"}, "train": {"audit": False, "max_steps": 40}}, 7.2911),
        "1": ({"precision": {"name": "fp16"}, "train": {"audit": False, "max_steps": 40}}, 7.2911),
        "2": ({"precision": {"name": "bf16"}, "train": {"audit": True, "max_steps": 40}}, 7.2908)})


def _axes(fig) -> dict:
    return {ax.get_title().split("\n")[0]: ax for ax in fig.axes if ax.get_title()}


def test_labels_leave_out_keys_at_their_defaults(tmp_path):
    """A key one run set and the others have at its default (``train.audit``) is in the label of
    the run that set it only; a key a run's config lacks counts at its default, not as a difference."""
    sweep = _three_precisions(tmp_path)
    runs = find_runs([sweep])
    assert label_runs(runs) == ["precision=fp32", "precision=fp16", "precision=bf16, train.audit=True"]
    for name in ("0", "1"):  # older runs without the key: the same as False
        cfg = yaml.safe_load((sweep / name / "config.yaml").read_text())
        del cfg["train"]["audit"]
        (sweep / name / "config.yaml").write_text(yaml.safe_dump(cfg))
    runs = find_runs([sweep])
    assert label_runs(runs) == ["precision=fp32", "precision=fp16", "precision=bf16, train.audit=True"]


def test_figure_title_says_what_was_compared_and_legend_is_on_top(tmp_path):
    """The title names the compared values and what the runs share; the legend, one entry
    per run, sits above every panel (under the title), not below the last row."""
    runs = find_runs([_three_precisions(tmp_path)])
    label_runs(runs)
    fig = build_figure(runs)
    fig.draw_without_rendering()
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == [r.label for r in runs]
    assert legend.get_window_extent().y0 >= max(ax.get_window_extent().y1 for ax in fig.axes if ax.get_title())
    assert fig.get_suptitle().splitlines()[0] == (
        "precision: fp32 vs fp16 vs bf16 · train.audit: False vs True · gpt-nano · 40 steps")


def test_sparse_samples_are_points_not_lines(tmp_path):
    """Monitor samples (every 10 steps next to a loss logged every step) are drawn as points,
    not joined by lines, and their panels say how often they were taken; the loss keeps its line."""
    runs = find_runs([_three_precisions(tmp_path)])
    label_runs(runs)
    panels = _axes(build_figure(runs))
    for line in panels["train loss"].get_lines():
        assert line.get_linestyle() not in ("None", "", " ", "none")
    for title in ("output logits: mean log Z", "what-if: gradients that would underflow in fp16"):
        ax = panels[title]
        for line in ax.get_lines():
            assert line.get_linestyle() == "None" and line.get_marker() not in ("", "None", None)
            assert list(line.get_xdata()) == [1, 10, 20, 30, 40]
        assert "points: sampled every 10 steps" in ax.get_title()
    assert not is_sparse(runs[0], list(range(1, 41, 3)))  # 14 points, a third of the loss's: a line
    assert is_sparse(runs[0], list(range(1, 41, 4)))  # 10 points: too few to join


def test_underflow_panels_say_they_are_after_loss_scaling(tmp_path):
    """fp16 runs' gradients are counted as held, times the loss scale: the underflow panels
    say so, and say nothing of the kind in a sweep without loss scaling."""
    runs = find_runs([_three_precisions(tmp_path / "with")])
    label_runs(runs)
    title = _axes(build_figure(runs))["what-if: gradients that would underflow in fp16"].get_title()
    assert "fp16 runs: measured after loss scaling" in title.replace("\n", " ")
    assert "loss scaling" not in _axes(build_figure(runs))["output logits: mean log Z"].get_title()
    unscaled = [r for r in runs if r.config["precision"]["name"] != "fp16"]
    assert "loss scaling" not in _axes(build_figure(unscaled))[
        "what-if: gradients that would underflow in fp16"].get_title()


def test_one_point_metric_is_a_table_row_not_a_panel(tmp_path):
    """Validation losses of one point per run, 0.0003 apart at 7.29: no panel of lone points on
    an axis zoomed to their gap, but a row of the table under the panels, each run's value."""
    runs = find_runs([_three_precisions(tmp_path)])
    label_runs(runs)
    fig = build_figure(runs)
    assert "validation loss" not in _axes(fig)
    assert _table_rows(fig)["validation loss"] == ["loss (nats/token)", "40", "7.2911", "7.2911", "7.2908"]


SINGLE_TITLE = "logged at one step only (no curve to draw): the value at that step"


def _table_rows(fig) -> dict:
    """The figure's table of metrics logged at one step only: metric -> its other cells."""
    (ax,) = [ax for ax in fig.axes if ax.get_title() == SINGLE_TITLE]
    (t,) = ax.tables
    cells = t.get_celld()
    n_rows, n_cols = max(r for r, _ in cells) + 1, max(c for _, c in cells) + 1
    text = [[cells[r, c].get_text().get_text() for c in range(n_cols)] for r in range(n_rows)]
    assert text[0][:3] == ["metric", "unit", "step"]
    return {row[0]: row[1:] for row in text[1:]}


def _short_sweep(root: Path) -> Path:
    """fp32, bf16 and fp8 for 6 steps as a short sweep logs them: the loss, tokens and
    tokens/s every step (fp8 at 1/2.4 of fp32's), the monitor's figures at step 1 only (e4m3
    would flush 84% of the unscaled gradients; fp8's own casts flushed 0.0547%), the
    validation loss once, at the end."""
    for i, (name, tps) in enumerate((("fp32", 24000.0), ("bf16", 20000.0), ("fp8", 10000.0))):
        path = root / str(i)
        path.mkdir(parents=True)
        rows = [{"step": s, "train/loss": 5.0 - s / 20 - i / 100, "train/tokens": 512 * s,
                 "perf/tokens_per_s": tps + s} for s in range(1, 7)]
        rows[0].update({"numerics/grad_underflow/e4m3": 0.84, "stability/output_log_z": 5.8})
        if name == "fp8":
            rows[0].update({"fp8/worst/flush": 0.000547, "fp8/worst/saturate": 0.0, "fp8/worst/sqnr_db": 29.5})
        rows[-1]["val/loss"] = 4.7 + i / 100
        path.joinpath("metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        path.joinpath("summary.json").write_text(json.dumps({"final/val_loss": 4.7 + i / 100}))
        path.joinpath("config.yaml").write_text(yaml.safe_dump({"model": NANO, "precision": {"name": name}}))
    return root


def test_a_short_sweeps_figure_tells_the_truth_at_a_glance(tmp_path, capsys):
    """Panels only where a curve is (the single-point metrics in a table, in the figure and in
    comparison.md), what-ifs titled as such and shares in percent as the table has them, a unit
    on every axis, and a tokens/s panel."""
    runs = find_runs([_short_sweep(tmp_path / "sweep")])
    label_runs(runs)
    fig = build_figure(runs)
    panels = _axes(fig)
    assert set(panels) == {"train loss", "train loss vs tokens", "throughput (all ranks)", SINGLE_TITLE}
    for title, ax in panels.items():
        if title != SINGLE_TITLE:
            assert ax.get_xlabel() in ("step", "tokens") and ax.get_ylabel(), title
            assert max(len(line.get_xdata()) for line in ax.get_lines()) >= 2, title  # a curve, not a lone point
    assert panels["train loss"].get_ylabel() == "loss (nats/token)"
    tps = panels["throughput (all ranks)"]
    assert tps.get_ylabel() == "tokens/s"
    assert [line.get_ydata()[0] for line in tps.get_lines()] == [24001.0, 20001.0, 10001.0]
    assert tps.get_ylim()[0] == 0  # from zero: fp8's 0.4x of fp32's speed looks it
    rows = _table_rows(fig)
    e4m3 = rows["what-if: gradients that would underflow in e4m3"]
    flush = rows["fp8 casts: largest share of non-zeros flushed to 0 (any layer)"]
    assert e4m3 == ["% of non-zero gradients", "1", "84", "84", "84"]
    assert flush == ["% of non-zero elements", "1", "n/a", "n/a", "0.0547"]  # 0.0547%, not 84%
    assert rows["validation loss"][:2] == ["loss (nats/token)", "6"]
    assert all(not t.startswith("grad underflow") for t in rows)  # every what-if says it is one
    code, _, err = _compare_here(capsys, tmp_path / "sweep")
    assert code == 0, err
    md = (tmp_path / "sweep" / "comparison.md").read_text()
    assert "Logged at one step only" in md and "| what-if: gradients that would underflow in e4m3 | % of " in md
    assert "| 84 | 84 | 84 |" in md and "| n/a | n/a | 0.0547 |" in md


def test_shares_are_drawn_in_percent(tmp_path):
    """A share on a panel is in percent, as in the tables: 0.04 of the gradients is drawn at 4 (%)."""
    runs = find_runs([_three_precisions(tmp_path)])
    label_runs(runs)
    ax = _axes(build_figure(runs))["what-if: gradients that would underflow in fp16"]
    assert ax.get_ylabel() == "% of non-zero gradients"
    assert max(max(line.get_ydata()) for line in ax.get_lines()) == 0.001 * 40 * 100


def test_loss_gap_only_between_runs_of_the_same_config(tmp_path, capsys):
    """A run of another model is not given the fp32 run's loss as its reference: its gap is
    n/a and one line says why; a second fp32 seed (the noise) and an audited run (a harmless
    setting) keep theirs."""
    root = _sweep_of(tmp_path / "sweep", {
        "0": ({"precision": {"name": "fp32"}, "train": {"seed": 1337}}, 3.3271),
        "1": ({"precision": {"name": "fp32"}, "train": {"seed": 4321}}, 3.3216),
        "2": ({"precision": {"name": "bf16"}, "train": {"audit": True}}, 3.3285),
        "3": ({"precision": {"name": "fp16"}, "model": {**NANO, "d_model": 32}}, 4.0221)})
    code, out, err = _compare_here(capsys, root)
    assert code == 0, err
    gaps = [line.split("|")[4].strip()
            for line in _each_run((root / "comparison.md").read_text()) if line.startswith("| precision=")]
    assert gaps == ["+0.0000", "-0.0055", "+0.0014", "n/a"]  # runs 0..3 in order
    (refusal,) = [line for line in out.splitlines() if line.startswith("No val loss - fp32 for")]
    assert refusal.startswith("No val loss - fp32 for precision=fp16, model.d_model=32:")
    assert refusal.endswith("(it differs in model.d_model).") and refusal in (root / "comparison.md").read_text()


# ------------------------------------------------------------ float8 casts per layer
FP8_LAYERS = ("block0.attn.qkv", "block1.mlp.fc")
FP8_OPS = ("input", "weight", "grad_output")
# SQNR of each what-if recipe relative to the run's own casts, per run recipe: the best is
# mxfp8 for the tensorwise run and block1x128 for the rowwise one, a run recorded before
# every recipe had one name (its mxfp8 what-if under the old name block1x32).
FP8_WHATIF_DB = {"tensorwise": {"rowwise": 2.0, "mxfp8": 5.0, "block1x128": 4.0, "block128x128": 1.0},
                 "rowwise": {"tensorwise": -3.0, "block1x32": 1.0, "block1x128": 6.0, "block128x128": -1.0}}


def _fp8_casts(recipe: str, step: int, exact: bool) -> dict:
    """summary.json's fp8_casts at ``step``: figures made up from the recipe, layer, operand
    and step; ``exact``: block1.mlp.fc's weight casts are exact (SQNR +inf)."""
    layers, m = {}, 1 if recipe == "tensorwise" else 2
    for li, layer in enumerate(FP8_LAYERS):
        for oi, op in enumerate(FP8_OPS):
            db = 30.0 + m - 2 * li - oi + step / 10
            own = math.inf if exact and (layer, op) == ("block1.mlp.fc", "weight") else db
            layers.setdefault(layer, {})[op] = {
                "flush": 0.001 * m * (li + 1) * (oi + 1) * step, "saturate": 0.0005 * (oi + 1), "sqnr_db": own,
                "amax": 2.0 + li, "scale_min": 100.0, "scale_max": 200.0,
                "whatif": {r: {"flush": 0.0001 * (j + 1), "saturate": 0.0, "sqnr_db": db + d}
                           for j, (r, d) in enumerate(FP8_WHATIF_DB[recipe].items())}}
    return {"recipe": recipe, "step": step, "layers": layers}


def _fp8_row(casts: dict) -> dict:
    """The metrics.jsonl keys of one monitored step with ``casts``, the whole-run worst figures too."""
    row = {}
    for layer, ops in casts["layers"].items():
        for op, e in ops.items():
            row.update({f"fp8.{layer}/{op}/{k}": v for k, v in e.items() if k != "whatif"})
            for r, w in e["whatif"].items():
                row.update({f"fp8.{layer}/{op}/{r}/{k}": v for k, v in w.items()})
    own = [e for ops in casts["layers"].values() for e in ops.values()]
    row.update({"fp8/worst/flush": max(e["flush"] for e in own), "fp8/worst/saturate": max(e["saturate"] for e in own),
                "fp8/worst/sqnr_db": min(e["sqnr_db"] for e in own)})
    return row


def _signals_row(step: int) -> dict:
    """The numerics/quant keys of a monitored ``step``: made-up ratios far above sqrt(3),
    falling; weight flips from the second monitored step on (the first has nothing to compare)."""
    row = {"numerics/quant/weight_gradient/noise_ratio": 40.0 / step, "numerics/quant/forward/noise_ratio": 7.0 - step / 10,
           "numerics/quant/input_gradient/noise_ratio": 6.0, "numerics/quant/norm_bias": -0.001 * step,
           "numerics/quant/norm_bias_max": 0.002 * step}
    return row if step == 1 else {**row, "numerics/quant/weight_flips": 0.2 / step}


def _synthetic_run(path: Path, precision: str, recipe: str = "", summary_casts: bool = False,
                   signals: bool = False) -> None:
    """A run directory as the trainer writes it, 4 steps, float8 casts monitored at steps 2
    and 4 when ``recipe`` is given (in summary.json too when ``summary_casts``), the
    quantization signals at every step with ``signals``."""
    path.mkdir(parents=True)
    rows = []
    for step in range(1, 5):
        row = {"step": step, "train/loss": 5.0 - step / 10 - {"tensorwise": 0.01, "rowwise": 0.02}.get(recipe, 0)}
        if recipe and step % 2 == 0:
            row.update(_fp8_row(_fp8_casts(recipe, step, exact=recipe == "rowwise" and step == 4)))
        if signals:
            row.update(_signals_row(step))
        rows.append(row)
    path.joinpath("metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))  # inf: Infinity
    summary = {"final/train_loss": rows[-1]["train/loss"]}
    if summary_casts:
        summary["fp8_casts"] = _fp8_casts(recipe, 4, exact=False)
    path.joinpath("summary.json").write_text(json.dumps(summary, indent=2))
    cfg = {"precision": {"name": precision, **({"fp8": {"enabled": True, "recipe": recipe}} if recipe else {})}}
    path.joinpath("config.yaml").write_text(yaml.safe_dump(cfg))


def _md_rows(section: str) -> dict:
    """(layer, operand) -> the cells of that row of an fp8_layers.md table."""
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in section.splitlines()
             if line.startswith("| block")]
    return {(c[0], c[1]): c[2:] for c in cells}


def test_fp8_layers_figure_and_table(tmp_path, capsys):
    """Two float8 runs (tensorwise with fp8_casts in summary.json, rowwise without: read from
    its last monitored row) and an fp32 run: the main figure gains the worst-cast panels, and
    fp8_layers.png/.md show the two float8 runs layer by layer, with the best what-if recipe."""
    sweep = tmp_path / "sweep"
    _synthetic_run(sweep / "0", "fp8", "tensorwise", summary_casts=True)
    _synthetic_run(sweep / "1", "fp8", "rowwise")
    _synthetic_run(sweep / "2", "fp32")
    runs = find_runs([sweep])
    label_runs(runs)
    panels, _ = panels_with_data(runs)
    assert {"fp8/worst/flush", "fp8/worst/saturate", "fp8/worst/sqnr_db"} <= {p[1] for p in panels}
    old = fp8_casts(runs[1])["layers"]["block0.attn.qkv"]["input"]["whatif"]
    assert "mxfp8" in old and "block1x32" not in old  # the old run's what-if under its name now

    fig = build_fp8_figure(runs)
    lines = _plain_labels(fig, only=lambda title: "by recipe" not in title)
    assert len(fig.axes) == 8  # 2 layers x (flush, saturate, SQNR, recipe grid)
    flush = lines["block1.mlp.fc: flushed to 0 (% of non-zeros)"]
    assert len(flush.get_lines()) == 6  # 2 runs x 3 operands
    xs, ys = flush.get_lines()[1].get_data()  # tensorwise run, weight: 0.001 * 2 * 2 * step, in %
    assert list(xs) == [2, 4] and list(ys) == pytest.approx([0.8, 1.6])
    grid = next(ax for ax in fig.axes if ax.get_title() == "block1.mlp.fc: SQNR (dB) by recipe, last monitored step")
    texts = [t.get_text() for t in grid.texts]
    assert "exact" in texts and "36.4" in texts  # rowwise run's exact weight; its input under block1x128: 30.4 + 6
    gain = grid.images[0].get_array()  # coloured by dB over the run's own casts: row [2] input, own column rowwise
    assert gain[3][1] == 0 and gain[3][3] == pytest.approx(6.0) and gain[3][0] == pytest.approx(-3.0)

    code, out, err = _compare_here(capsys, sweep)
    assert code == 0, err
    png, md = sweep / "fp8_layers.png", (sweep / "fp8_layers.md").read_text()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    assert "fp8/worst" not in (sweep / "comparison.md").read_text()  # fp32 lacks them: not missing
    assert "[fp8_layers.md](fp8_layers.md)" in (sweep / "comparison.md").read_text()
    # the main table: each run's worst casts over all its monitored steps; fp32 has none
    table = {ln.split(" | ")[0].lstrip("| "): ln.rstrip(" |").split(" | ")[-3:]
             for ln in _each_run((sweep / "comparison.md").read_text()) if ln.startswith("| precision=")}
    tw_rows = [r for r in read_rows(sweep / "0") if "fp8/worst/flush" in r]
    assert table["precision=fp8 (0)"] == [f"{100 * max(r['fp8/worst/flush'] for r in tw_rows):.3g}%",
                                          f"{100 * max(r['fp8/worst/saturate'] for r in tw_rows):.3g}%",
                                          f"{min(r['fp8/worst/sqnr_db'] for r in tw_rows):.1f}"]
    assert table["precision=fp32 (2)"] == ["n/a"] * 3 and "| worst SQNR (dB) |" in (sweep / "comparison.md").read_text()
    tw, rw, rest = re.split(r"\n(?=\[\d\] )|\n\n(?=No float8)", md)[1:]
    assert tw.startswith("[1] precision=fp8 (0): recipe tensorwise, step 4 (from summary.json)")
    assert rw.startswith("[2] precision=fp8 (1): recipe rowwise, step 4 (from metrics.jsonl)")
    assert rest.strip() == "No float8 or 4-bit cast statistics: precision=fp32 (2)."
    header = "| layer | operand | flush % | saturate % | SQNR dB | best what-if |"
    assert header in tw and header in rw
    # tensorwise, block1.mlp.fc grad_output: flush 0.001*2*3*4 = 2.4%, saturate 0.15%, SQNR 31-2-2+0.4
    assert _md_rows(tw)[("block1.mlp.fc", "grad_output")] == [
        "2.4", "0.15", "27.4", "mxfp8", "0.02", "0", "32.4", "+5.0"]
    rows = _md_rows(rw)
    assert len(rows) == 6 and {c[3] for c in rows.values()} == {"block1x128"}
    assert rows[("block0.attn.qkv", "input")] == ["0.8", "0.05", "32.4", "block1x128", "0.03", "0", "38.4", "+6.0"]
    assert rows[("block1.mlp.fc", "weight")][2:] == ["inf (exact)", "block1x128", "0.03", "0", "35.4", "-inf"]
    assert md.split("\n", 2)[2] in out  # printed too


def test_no_fp8_layers_without_fp8_metrics(tmp_path, capsys):
    """Runs without float8 cast statistics get no fp8_layers output, and the worst-cast
    panels are not reported as missing."""
    for p in ("fp32", "bf16"):
        _synthetic_run(tmp_path / "sweep" / p, p)
    assert build_fp8_figure(find_runs([tmp_path / "sweep"])) is None
    code, out, err = _compare_here(capsys, tmp_path / "sweep")
    assert code == 0, err
    assert not list((tmp_path / "sweep").glob("fp8_layers*"))
    text = (tmp_path / "sweep" / "comparison.md").read_text()
    assert "Float8 casts" not in out + text and "fp8/worst" not in text and "Not logged" in text


def test_fp8_layers_figure_caps_layers_and_runs():
    """Past 12 layers the figure keeps those with the lowest SQNR (in model order), past 8 runs
    the first 8, and says which it left out."""
    from types import SimpleNamespace

    layers = [f"block{i}.mlp.fc" for i in range(14)]
    runs = [(SimpleNamespace(label=f"run{r}"),
             {"layers": {layer: {"input": {"sqnr_db": 40.0 - i}} for i, layer in enumerate(layers)}})
            for r in range(9)]
    runs[0][1]["layers"]["block0.mlp.fc"]["input"]["sqnr_db"] = 10.0  # one run's worst layer is kept
    shown, kept, dropped_layers, dropped_runs = _fp8_selection(runs)
    assert len(shown) == 8 and dropped_runs == ["run8"]
    assert kept == [layers[0], *layers[3:]] and dropped_layers == layers[1:3]


def test_the_signals_that_say_when_get_panels_where_a_run_has_them(tmp_path):
    """A run with the quantization signals beside an fp32 run without: a panel each (the
    fp32 run not reported missing them); the weight gradient's noise ratio on a log axis
    with sqrt(3) dashed and labelled, inside the axis though every point is far above it."""
    _synthetic_run(tmp_path / "sweep" / "0", "lab", "tensorwise", signals=True)
    _synthetic_run(tmp_path / "sweep" / "1", "fp32")
    runs = find_runs([tmp_path / "sweep"])
    label_runs(runs)
    panels, missing = panels_with_data(runs)
    quant = [f"numerics/quant/{m}" for m in ("weight_gradient/noise_ratio", "forward/noise_ratio",
                                             "input_gradient/noise_ratio", "weight_flips", "norm_bias")]
    assert set(quant) <= {p[1] for p in panels} and not any(m.startswith("numerics/quant") for m in missing)
    axes = _plain_labels(build_figure(runs))
    wg = axes["weight gradient: product over its quantization noise"]
    assert wg.get_yscale() == "log"
    dashed = [ln for ln in wg.get_lines() if ln.get_linestyle() == "--" and ln.get_color() == "black"]
    assert len(dashed) == 1 and list(dashed[0].get_ydata()) == [math.sqrt(3)] * 2
    assert [t.get_text() for t in wg.texts] == ["sqrt(3): below it, quantized training stops making progress (1.73)"]
    assert wg.get_ylim()[0] <= math.sqrt(3) < 10 <= min(40.0 / s for s in range(1, 5))
    assert not axes["forward: product over its quantization noise"].texts  # the line is the weight gradient's
    flips = axes["weight codes changed since the last monitored step"].get_lines()
    assert list(flips[0].get_ydata()) == pytest.approx([10.0, 0.2 / 3 * 100, 5.0])  # percent, from step 2


# ------------------------------------------------------------ settings over seeds (#52)
GOOD_LR, BAD_LR = "0.002", "0.0002"  # at 30 steps the lower one ends ~1.7 nats worse; seeds spread ~0.03


@pytest.fixture(scope="module")
def seed_sweep(tmp_path_factory) -> Path:
    """One real multirun (one process): optim.lr good and ten times too low, seeds 0, 1, 2;
    30 steps, a validation loss every 5 and the metrics every 3 (validation rows between
    logging rows, as in a default run). Jobs 0-2 are the good lr, 3-5 the low one."""
    root = tmp_path_factory.mktemp("seed-sweep")
    r = run_cli("-m", *TINY, "train.max_steps=30", "train.eval_every=5", "train.log_every=3", "train.eval_tokens=2048",
                "monitor.enabled=false", f"optim.lr={GOOD_LR},{BAD_LR}", "train.seed=0,1,2",
                f"hydra.sweep.dir={root / 'sweep'}", cwd=root)
    assert r.returncode == 0, r.stderr[-3000:]
    return root / "sweep"


def _section(md: str, head: str) -> list[str]:
    """The table rows of comparison.md's section ``### head``, by their first cell."""
    body = md.split(f"### {head}", 1)[1].split("###", 1)[0]
    return {ln.split("|")[1].strip(): [c.strip() for c in ln.split("|")[1:-1]]
            for ln in body.splitlines() if ln.startswith("| ") and not ln.startswith("| setting")}


def _seed_report(paths, *args):
    """The settings' report and the figure for ``paths``, in this process, as main makes them."""
    from mptrain.compare.seedfig import build_seed_figure
    from mptrain.compare.seeds import report

    runs = find_runs(paths)
    label_runs(runs)
    rep = report(runs, *args)
    return runs, rep, build_seed_figure(runs, rep)


def test_a_worse_learning_rate_is_resolved_and_never_reaches_the_target(seed_sweep, capsys):
    code, out, err = _compare_here(capsys, seed_sweep)
    assert code == 0, err
    md = (seed_sweep / "comparison.md").read_text()
    # the speed at matched quality leads, then the settings over seeds, then each run
    assert md.index("### Speed at matched quality") < md.index("### Final validation loss over seeds") \
        < md.index("### Each run")
    assert out.lstrip().startswith("### Speed at matched quality")
    good, bad = f"optim.lr={GOOD_LR}", f"optim.lr={BAD_LR}"
    speed = _section(md, "Speed at matched quality")
    assert set(speed) == {f"{good} (reference)", bad}
    assert speed[f"{good} (reference)"][5] == "1.00x"  # the reference's own mean curve ends at the target
    # its best seed ends at or below the mean: a number of tokens and seconds (a validation row
    # between logging rows must not break the training clock)
    assert re.match(r"[\d,]+ ± ", speed[f"{good} (reference)"][3]) and re.match(r"[\d.]+", speed[f"{good} (reference)"][4])
    short = re.search(r"0 of 3; never reached by 3: final val/loss short by \+(\d\.\d+)", speed[bad][2])
    assert short and float(short.group(1)) > 0.5, speed[bad]
    assert speed[bad][5].startswith("never (mean curve short by +")
    seeds = _section(md, "Final validation loss over seeds")
    assert seeds[good][1] == seeds[bad][1] == "0,1,2" and seeds[good][4] == "(reference)"
    assert seeds[bad][3].startswith("whole val split (")  # the runs' final/whole_val_loss, and it says so
    verdict = seeds[bad][5]
    assert verdict.startswith("resolved: +") and "worse than the reference" in verdict and "3 paired seeds" in verdict
    lo, hi = map(float, re.search(r"95% CI ([+-][\d.]+) to ([+-][\d.]+)", seeds[bad][4]).groups())
    assert 0.5 < lo < hi  # far from zero: the effect is ~1.7 nats against seed noise of ~0.03
    assert "the reference is the first setting" in md  # no fp32/bf16 pairing in an fp32 lr sweep: said


def test_the_seed_figure_reads_back(seed_sweep):
    from matplotlib.collections import PolyCollection

    runs, rep, fig = _seed_report([seed_sweep])
    titles = [ax.get_title() for ax in fig.axes]
    assert titles[0].startswith("speed at matched quality")  # leads, before any other panel
    assert titles[1].startswith("val loss - reference, paired by seed")
    lead_texts = [t.get_text() for t in fig.axes[0].texts]
    assert any(t.startswith(f"optim.lr={BAD_LR}: never, short by +") for t in lead_texts), lead_texts
    assert any(t.startswith(f"optim.lr={GOOD_LR}: ") and t.endswith("1.00x") for t in lead_texts), lead_texts
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "band: range (lowest to highest) over 3 seeds" in legend
    assert f"optim.lr={GOOD_LR} (3 seeds)" in legend
    # the validation loss panel: a band per setting spanning its seeds' lowest and highest loss
    val = next(ax for ax in fig.axes if ax.get_title() == "validation loss")
    bands = [c for c in val.collections if isinstance(c, PolyCollection)]
    assert len(bands) == 2
    for band, s in zip(bands, rep.settings, strict=True):
        curves = [dict(zip(*r.series("val/loss", "step"), strict=True)) for r in s.runs]
        ys = band.get_paths()[0].vertices[:, 1]
        assert min(ys) == pytest.approx(min(min(c.values()) for c in curves))
        assert max(ys) == pytest.approx(max(max(c.values()) for c in curves))
    # the difference panel: the worse lr's line is the mean of the seed-by-seed differences
    diff = fig.axes[1].lines[-1]
    good, bad = rep.settings
    last = [bad.by_seed()[k].series("val/loss", "step")[1][-1] - good.by_seed()[k].series("val/loss", "step")[1][-1]
            for k in (0, 1, 2)]
    assert diff.get_ydata()[-1] == pytest.approx(sum(last) / 3)
    assert "not logged" not in fig._suptitle.get_text()
    width: dict[int, int] = {}  # no empty slot: the panels of each grid row fill its six columns
    for ax in fig.axes:
        spec = ax.get_subplotspec()
        width[spec.rowspan.start] = width.get(spec.rowspan.start, 0) + len(spec.colspan)
    assert set(width.values()) == {6}, width


def _copy_setting(src: list[Path], dst: Path, order: list[int], **changes) -> None:
    """Copies of ``src`` (one run per seed) under ``dst``, numbered in ``order`` (so that a
    pairing by position would pair different seeds), with config keys ``changes`` set."""
    import shutil

    for i, j in enumerate(order):
        shutil.copytree(src[j], dst / str(i))
        cfg = yaml.safe_load((dst / str(i) / "config.yaml").read_text())
        for dotted, v in changes.items():
            section, key = dotted.split("__")
            cfg[section][key] = v
        (dst / str(i) / "config.yaml").write_text(yaml.safe_dump(cfg))


def test_one_setting_against_itself_is_not_resolved(seed_sweep, tmp_path, capsys):
    """A/A: the good lr's three runs, and the same runs under a key that cannot change a run
    that never meets a non-finite loss (train.on_nonfinite), numbered in another seed order.
    Paired by seed, every difference is exactly zero; paired by position it would not be."""
    good = [seed_sweep / str(i) for i in (0, 1, 2)]
    _copy_setting(good, tmp_path / "aa" / "a", [0, 1, 2])
    _copy_setting(good, tmp_path / "aa" / "b", [2, 0, 1], train__on_nonfinite="skip")
    code, _, err = _compare_here(capsys, tmp_path / "aa", "--reference", "train.on_nonfinite=abort")
    assert code == 0, err
    seeds = _section((tmp_path / "aa" / "comparison.md").read_text(), "Final validation loss over seeds")
    assert set(seeds) == {"train.on_nonfinite=abort", "train.on_nonfinite=skip"}
    verdict = seeds["train.on_nonfinite=skip"][5]
    assert verdict.startswith("not resolved at 3 seeds: +0.0000 nats (95% CI +0.0000 to +0.0000, p = 1.00")
    spread = float(seeds["train.on_nonfinite=abort"][2].split("± ")[1].split(" ")[0])
    assert spread > 0  # the seeds do differ: only pairing them seed by seed makes the difference zero


def test_one_seed_cannot_judge_the_noise(seed_sweep, tmp_path, capsys):
    code, _, err = _compare_here(capsys, seed_sweep / "0", seed_sweep / "3", "--out", tmp_path)
    assert code == 0, err
    md = (tmp_path / "comparison.md").read_text()
    seeds = _section(md, "Final validation loss over seeds")
    assert "at 1 seed: cannot judge the noise" in seeds[f"optim.lr={BAD_LR}"][5]
    assert "One seed per setting: the noise between seeds cannot be judged" in md
    _, _, fig = _seed_report([seed_sweep / "0", seed_sweep / "3"])
    assert "one seed per setting: the noise between seeds cannot be judged" in fig._suptitle.get_text()
    assert fig.axes[0].get_title().startswith("speed at matched quality")  # the per-run figure leads with it too


def test_target_loss_and_reference_flags(seed_sweep, tmp_path, capsys):
    code, _, err = _compare_here(capsys, seed_sweep, "--out", tmp_path, "--target-loss", "5.3",
                                 "--reference", f"optim.lr={BAD_LR}")
    assert code == 0, err
    md = (tmp_path / "comparison.md").read_text()
    speed = _section(md, "Speed at matched quality")
    good, bad = f"optim.lr={GOOD_LR}", f"optim.lr={BAD_LR} (reference)"
    assert speed[good][1] == speed[bad][1] == "5.3000" and speed[good][2] == speed[bad][2] == "3 of 3"
    tokens = {k: float(v[3].split(" ")[0].replace(",", "")) for k, v in speed.items()}
    assert tokens[good] < tokens[bad]  # the good lr is there in fewer tokens (steps: no clock in it)
    assert "Target: --target-loss" in md
    seeds = _section(md, "Final validation loss over seeds")
    assert seeds[good][5].startswith("resolved: -") and "better than the reference" in seeds[good][5]
    assert "the reference is optim.lr=0.0002 (--reference)" in md


@pytest.mark.parametrize("args, words", [
    (["--reference", "optim.lr=9"], "--reference optim.lr=9 names no settings (the settings: "),
    (["--target-loss", "low"], "argument --target-loss: invalid float value: 'low'"),
    (["--effect", "-0.1"], "--effect must be a positive number of nats"),
    (["--frobnicate"], "unrecognized arguments: --frobnicate"),
])
def test_bad_flags_are_one_line_and_exit_2(seed_sweep, tmp_path, capsys, args, words):
    code, _, err = _compare_here(capsys, seed_sweep, "--out", tmp_path, *args)
    assert code == 2 and err.count("\n") == 1 and err.startswith("compare: error: ") and words in err, err


def test_effect_asks_the_seed_estimate_for_a_given_size(tmp_path, capsys):
    """Three seeds of fp32 and bf16 whose differences (+0.010, -0.004, +0.006) do not resolve:
    the seed estimate is for the observed difference, or for --effect's."""
    runs = {}
    for k, (a, b) in enumerate([(3.300, 3.310), (3.320, 3.316), (3.310, 3.316)]):
        runs[f"{2 * k}"] = ({"precision": {"name": "fp32"}, "train": {"seed": k}}, a)
        runs[f"{2 * k + 1}"] = ({"precision": {"name": "bf16"}, "train": {"seed": k}}, b)
    root = _sweep_of(tmp_path / "sweep", runs)
    code, _, err = _compare_here(capsys, root)
    assert code == 0, err
    seeds = _section((root / "comparison.md").read_text(), "Final validation loss over seeds")
    assert seeds["precision=bf16"][5].startswith("not resolved at 3 seeds: +0.0040 nats")
    assert "would resolve a difference of this size" in seeds["precision=bf16"][5]
    # its mean curve ends 0.004 short of fp32's: "never", but said to be inside the noise
    speed = _section((root / "comparison.md").read_text(), "Speed at matched quality")["precision=bf16"][5]
    assert speed.startswith("never (mean curve short by +0.0040)") and "so this may be noise" in speed, speed
    code, _, err = _compare_here(capsys, root, "--effect", "0.05")
    seeds = _section((root / "comparison.md").read_text(), "Final validation loss over seeds")
    assert "would resolve a difference of 0.0500 nats" in seeds["precision=bf16"][5]


def test_whole_split_loss_is_used_where_every_run_has_it_and_unpaired_seeds_are_named(tmp_path, capsys):
    """fp32 and bf16 over seeds 0-2, bf16 also seed 3: seed 3 is left out of the pairing and
    named; the whole-split loss (final/whole_val_loss) is compared where every run has it."""
    runs = {}
    for k in range(4):
        if k < 3:
            runs[f"a{k}"] = ({"precision": {"name": "fp32"}, "train": {"seed": k}}, 3.30 + k / 100)
        runs[f"b{k}"] = ({"precision": {"name": "bf16"}, "train": {"seed": k}}, 3.31 + k / 100)
    root = _sweep_of(tmp_path / "sweep", runs)
    code, _, err = _compare_here(capsys, root)
    md = (root / "comparison.md").read_text()
    seeds = _section(md, "Final validation loss over seeds")
    assert seeds["precision=bf16"][1] == "0,1,2,3" and seeds["precision=bf16"][3] == "eval set"
    assert "3 paired seeds" in seeds["precision=bf16"][5]
    assert "precision=bf16 against precision=fp32: left out seed 3 (only precision=bf16)." in md
    for d in (p for p in root.iterdir() if p.is_dir()):  # the whole val split, 0.5 nats below the eval set's loss
        summary = json.loads((d / "summary.json").read_text())
        summary.update({"final/whole_val_loss": summary["final/val_loss"] - 0.5, "eval/whole_tokens": 90_000})
        (d / "summary.json").write_text(json.dumps(summary))
    code, _, err = _compare_here(capsys, root)
    seeds = _section((root / "comparison.md").read_text(), "Final validation loss over seeds")
    assert seeds["precision=fp32"][3] == "whole val split (90,000 tokens)"
    assert seeds["precision=fp32"][2].startswith("2.8100 ± 0.0100 (sd, 3 seeds)")


def test_fp8_layers_of_one_monitored_step_are_a_table_not_a_page_of_points(tmp_path, capsys):
    """Per-layer casts logged at one step per run: fp8_layers.md has them, and no figure of
    single-point panels is drawn; a figure that is drawn is saved at most MOST_PIXELS a side."""
    from mptrain.compare.fp8 import MOST_PIXELS, dpi_for

    _synthetic_run(tmp_path / "sweep" / "0", "fp8", "tensorwise")
    metrics = tmp_path / "sweep" / "0" / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    rows = [r if r["step"] == 4 else {k: v for k, v in r.items() if not k.startswith("fp8")} for r in rows]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _synthetic_run(tmp_path / "sweep" / "1", "bf16")
    code, _, err = _compare_here(capsys, tmp_path / "sweep")
    assert code == 0, err
    assert not (tmp_path / "sweep" / "fp8_layers.png").exists()
    md = (tmp_path / "sweep" / "fp8_layers.md").read_text()
    assert md.startswith("One monitored step per run: no curves to draw") and "| block" in md
    big = SimpleNamespace(get_size_inches=lambda: (21.0, 40.0))
    assert 40.0 * dpi_for(big) == pytest.approx(MOST_PIXELS)


def test_the_sqrt3_line_stands_in_the_figure_over_seeds_too(tmp_path):
    """Settings over seeds draw their own panels (mean and band): the weight gradient's
    noise ratio keeps its dashed sqrt(3) inside the axis there as well."""
    for seed in (0, 1):
        run = tmp_path / "sweep" / str(seed)
        _synthetic_run(run, "lab", "tensorwise", signals=True)
        cfg = yaml.safe_load((run / "config.yaml").read_text())
        (run / "config.yaml").write_text(yaml.safe_dump({**cfg, "train": {"seed": seed}}))
    _, rep, fig = _seed_report([tmp_path / "sweep"])
    assert not rep.one_seed
    wg = next(ax for ax in fig.axes if ax.get_title() == "weight gradient: product over its quantization noise")
    dashed = [ln for ln in wg.get_lines() if ln.get_linestyle() == "--" and ln.get_color() == "black"]
    assert len(dashed) == 1 and wg.get_ylim()[0] <= math.sqrt(3)
