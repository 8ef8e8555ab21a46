"""scripts/compare.py on real run directories, and W&B grouping of a sweep."""
from __future__ import annotations

import functools
import importlib.util
import subprocess
import sys

import yaml

from .conftest import ROOT, TINY, run_cli, train


def _compare(*args):
    """``python scripts/compare.py ...`` as a user runs it."""
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "compare.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=300)


@functools.cache
def _compare_module():
    spec = importlib.util.spec_from_file_location("compare_script", ROOT / "scripts" / "compare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _compare_here(capsys, *args) -> tuple[int, str, str]:
    """compare.py's ``main`` in this process: (exit status, stdout, stderr). The CLI
    itself is run by test_compare_a_sweep; here a new process would only add its
    start-up (torch, imported through mptrain) to the same code."""
    main = _compare_module().main
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
    assert rows["precision=fp16"].split("|")[6].strip() == "0"  # skipped steps, from summary.json
    assert "val loss - fp32" in r.stdout  # the table is printed too
    assert "Not logged" not in text  # every panel had data (fp16 brings the loss scale)


def test_compare_single_run_with_missing_metrics(tmp_path, capsys):
    train(tmp_path / "run", "train.max_steps=3", "monitor.enabled=false")
    code, _, err = _compare_here(capsys, tmp_path / "run", "--out", tmp_path / "report")
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
