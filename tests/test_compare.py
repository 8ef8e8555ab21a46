"""scripts/compare.py on real run directories, and W&B grouping of a sweep."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from .conftest import ROOT, TINY, load_script, run_cli, train


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
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| precision=")}
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


def test_sweep_is_one_wandb_group_named_by_overrides(tmp_path):
    r = run_cli("-m", *TINY, "train.max_steps=2", "precision=fp32,bf16", "log.wandb.enabled=true", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    jobs = sorted(p for p in (tmp_path / "multirun").glob("*/*/*") if p.is_dir() and p.name.isdigit())
    assert len(jobs) == 2
    cfgs = [yaml.safe_load((j / "config.yaml").read_text()) for j in jobs]
    groups = {c["log"]["wandb"]["group"] for c in cfgs}
    assert len(groups) == 1 and groups.pop().startswith("sweep-multirun_")
    assert [c["run_info"]["run_name"].split("precision=")[1].split(",")[0] for c in cfgs] == ["fp32", "bf16"]
    for j in jobs:
        assert len(list((j / "wandb").glob("offline-run-*"))) == 1


def _plain_labels(fig) -> dict:
    """Panel title -> its axes, after checking that every tick label of every panel
    is a number written out: no offset ("+7.521"), no multiplier ("1e-5"), no powers."""
    fig.draw_without_rendering()  # tick labels and offsets are decided at draw time
    panels = {ax.get_title().split("\n")[0]: ax for ax in fig.axes if ax.get_title()}
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
    compare = load_script("compare")
    runs = compare.find_runs([short_runs])
    a, b, c = compare.label_runs(runs)
    assert a.endswith("(a)") and b.endswith("(b)") and c.endswith("(run)")  # same config: named by directory
    panels = _plain_labels(compare.build_figure(runs[:2]))  # only single points: matplotlib's offset case
    assert {"train loss", "gradient norm (unscaled, before clipping)"} <= set(panels)
    for title, ax in panels.items():
        la, lb = ax.get_lines()
        for line in (la, lb):  # a lone point is a marker one can see, not a pixel
            assert len(line.get_xdata()) == 1, title
            assert line.get_marker() not in ("", "None", None, ",", ".") and line.get_markersize() >= 6, title
        assert la.get_linestyle() != lb.get_linestyle() and la.get_marker() != lb.get_marker(), title
        assert f"same curve: {a} = {b}" in ax.get_title().replace("\n", " "), title
    from matplotlib.figure import Figure

    ax = Figure().subplots()  # two losses 1e-4 apart do not stretch over a whole panel
    ax.plot([1, 1], [7.5213, 7.5214])
    compare.min_span(ax, [7.5213, 7.5214])
    assert ax.get_ylim()[1] - ax.get_ylim()[0] >= 0.99 * compare.MIN_REL_SPAN * 7.5214
    title = _plain_labels(compare.build_figure(runs))["train loss"].get_title().replace("\n", " ")
    assert f"same curve: {a} = {b}" in title and c not in title
    code, out, err = _compare_here(capsys, short_runs, "--out", tmp_path / "report")
    assert code == 0, err
    note = next(line for line in out.splitlines() if line.startswith("Curves that coincide"))
    assert f"{a} = {b} (in: train loss, train loss vs tokens, " in note and c not in note
    assert note in (tmp_path / "report" / "comparison.md").read_text()


def test_a_whole_sweep_coinciding_is_named_once(tmp_path):
    """A panel where every run of a sweep draws the same curve (a metric no setting
    touches) says so in three words instead of listing every run."""
    compare = load_script("compare")
    for i in range(3):
        (tmp_path / str(i)).mkdir()
        (tmp_path / str(i) / "metrics.jsonl").write_text(
            "".join(json.dumps({"step": s, "train/loss": 3.0 + i - s / 10, "train/lr": 1e-3}) + "\n" for s in (1, 2)))
    runs = compare.find_runs([tmp_path])
    compare.label_runs(runs)
    panels = [("train loss", "train/loss", "step", "linear"), ("lr", "train/lr", "step", "linear")]
    assert compare.coincidences(runs, panels) == {"lr": [["all 3 runs"]]}
