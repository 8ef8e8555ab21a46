"""docs/outputs.md names every key a run writes to metrics.jsonl and summary.json.

The names are parsed from the first column of the two tables under "Metric
names" (backticked; ``<placeholder>`` stands for one path segment or part of
one, ``{a,b}`` for a closed set), and matched against the keys of two tiny
in-process runs that between them switch on every optional family a CPU run
can have in one process: fp16 loss scaling, the numerics and stability
monitors, evaluation, z-loss and update clipping, a precision phase; float8 linears with cast
statistics, a one-rank process group (collective bytes), the dtype audit,
``train.on_nonfinite=skip`` and an early stop. A key that no table names fails
here, so a new metric cannot go undocumented.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from .conftest import train

DOC = Path(__file__).resolve().parents[1] / "docs" / "outputs.md"
TABLES = {"metrics": "### metrics.jsonl", "summary": "### summary.json"}


def _section(text: str, heading: str) -> str:
    """From ``heading`` to the next heading of the same or a higher level."""
    start = text.index(heading + "\n") if heading + "\n" in text else text.index(heading)
    level = len(heading) - len(heading.lstrip("#"))
    rest = text[start + len(heading):]
    nxt = re.search(rf"^#{{1,{level}}} ", rest, flags=re.M)
    return rest[:nxt.start()] if nxt else rest


def _pattern(name: str) -> re.Pattern:
    """``numerics/grad_{underflow,overflow}/<format>`` -> a regex matching whole keys."""
    out, i = [], 0
    for m in re.finditer(r"<[^<>]+>|\{[^{}]+\}", name):
        out.append(re.escape(name[i:m.start()]))
        tok = m.group()
        out.append("[^/]+" if tok.startswith("<") else "(?:" + "|".join(map(re.escape, tok[1:-1].split(","))) + ")")
        i = m.end()
    out.append(re.escape(name[i:]))
    return re.compile("".join(out))


def documented(table: str, text: str | None = None) -> list[str]:
    """The backticked names in the first column of one of the doc's key tables."""
    text = DOC.read_text(encoding="utf-8") if text is None else text
    names = []
    for line in _section(_section(text, "## Metric names"), TABLES[table]).splitlines():
        if not line.startswith("|") or set(line) <= set("|- "):
            continue
        first = re.split(r"(?<!\\)\|", line)[1]
        names += re.findall(r"`([^`]+)`", first)
    return [n for n in names if n not in ("metric", "key")]


def undocumented(keys, names: list[str]) -> list[str]:
    patterns = [_pattern(n) for n in names]
    return sorted(k for k in set(keys) if not any(p.fullmatch(k) for p in patterns))


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """The folder of the two runs (``fp16``, ``fp8``)."""
    return tmp_path_factory.mktemp("outputs-doc")


@pytest.fixture(scope="module")
def runs(root):
    """(metrics.jsonl keys, summary.json keys) over the two runs."""
    half = train(root / "fp16", "precision=fp16", "train.max_steps=3", "monitor.every=2", "train.eval_every=3",
                 "train.eval_tokens=512", "train.z_loss=1e-4", "optim.update_clip=1.0",
                 "precision.phases=[{start: 2, precision: fp16}]")  # a phase: precision/phase
    fp8 = train(root / "fp8", "precision=fp8", "parallel=ddp", "train.max_steps=2", "train.stop_after=1",
                "monitor.every=1", "monitor.fp8_whatif=[rowwise]", "train.audit=true", "train.on_nonfinite=skip")
    metrics = {k for _, rows in (half, fp8) for r in rows for k in r}
    summary = {k for s, _ in (half, fp8) for k in s}
    return metrics, summary


def test_the_runs_cover_every_optional_family(runs):
    """Guards the test itself: each family it claims to cover was really written."""
    metrics, summary = runs
    for prefix in ("amp/", "numerics/", "stability/", "fp8.", "fp8/worst/", "comm/", "val/loss", "audit/flags",
                   "train/z_loss", "train/update_clip_max", "train/nonfinite_skipped", "precision/phase"):
        assert any(k.startswith(prefix) for k in metrics), prefix
    for key in ("amp/final_loss_scale", "final/train_loss", "baseline/unigram_val_loss", "wall_time_s", "fp8",
                "fp8_casts", "stopped_early", "comm/total_bytes", "train/nonfinite_skipped"):
        assert key in summary, key


def test_every_metrics_jsonl_key_is_in_the_doc(runs):
    missing = undocumented(runs[0], documented("metrics"))
    assert not missing, f"metrics.jsonl keys missing from docs/outputs.md's metrics.jsonl table: {missing}"


def test_every_summary_key_is_in_the_doc(runs):
    missing = undocumented(runs[1], documented("summary"))
    assert not missing, f"summary.json keys missing from docs/outputs.md's summary.json table: {missing}"


def test_the_measured_peak_stands_beside_the_estimate(runs, root):
    """summary.json and the closing console line of a CPU run: its peak resident
    memory, what the process held before building anything, and the estimate."""
    s = json.loads((root / "fp16" / "summary.json").read_text())
    assert 0 < s["mem/start_rss_gib"] <= s["mem/peak_rss_gib"]
    assert s["mem/peak_rss_gib"] >= s["mem/state_gib"]  # at least the weights, gradients and moments it held
    log = (root / "fp16" / "train.log").read_text()
    line = next(ln for ln in log.splitlines() if " memory: peak" in ln)  # train.log: each line after its time
    assert f"peak resident {s['mem/peak_rss_gib']:.3f} GiB ({s['mem/start_rss_gib']:.3f} GiB of it before" in line
    assert f"estimate {s['mem/estimate_gib']:.3f} GiB" in line


def test_the_closing_outlier_table_says_its_step(runs, root):
    """3 steps, monitor.every=2: the table is from step 2, and a line says so;
    a run that ended on its last monitored step gets no such line."""
    log = (root / "fp16" / "train.log").read_text()
    assert "outliers at step 2 " in log and "the outlier table is from step 2 of 3" in log, log
    assert "the outlier table is from" not in (root / "fp8" / "train.log").read_text()


def test_patterns_match_whole_keys_only():
    names = ["`numerics/grad_{underflow,overflow}/<format>`", "`comm/<kind>/<dtype>_bytes`", "`step`"]
    doc = ("## Metric names\n\n### metrics.jsonl\n\n| metric | meaning |\n| --- | --- |\n"
           + "".join(f"| {n} | x \\| y |\n" for n in names) + "\n### summary.json\n\n| key | meaning |\n")
    found = documented("metrics", doc)
    assert found == ["numerics/grad_{underflow,overflow}/<format>", "comm/<kind>/<dtype>_bytes", "step"]
    assert undocumented(["numerics/grad_underflow/fp16", "comm/all_reduce/bf16,fp32_bytes", "step"], found) == []
    assert undocumented(["numerics/grad_subnormal/fp16", "numerics/grad_underflow/fp16/block0", "steps",
                         "comm/all_reduce/fp32"], found) == [
        "comm/all_reduce/fp32", "numerics/grad_subnormal/fp16", "numerics/grad_underflow/fp16/block0", "steps"]
    assert documented("summary", doc) == []
