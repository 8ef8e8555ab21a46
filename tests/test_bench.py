"""scripts/bench.py runs and prints every column, one banner and each run's progress
(no timing assertions: speed is a benchmark's job)."""
from __future__ import annotations

import contextlib
import io
import os
import signal
import sys
from pathlib import Path

import torch

from .conftest import load_script, read_rows


def test_bench_prints_the_table(monkeypatch, capsys):
    """bench.py's ``main`` in this process, with the command line a user would type:
    nothing in it depends on being a fresh process (it trains through
    ``mptrain.run.trainer.run`` like the in-process tests), and a new one would only add
    the start-up. Captured output is not a terminal: progress comes as plain lines."""
    bench = load_script("bench")
    harness_runs = []  # (summary, metrics rows) of each harness run, read before its directory goes

    def run_and_read(cfg, run_dir):
        summary = real_run(cfg, run_dir=run_dir)
        harness_runs.append((summary, read_rows(Path(run_dir))))
        return summary

    real_run = bench.run
    monkeypatch.setattr(bench, "run", run_and_read)
    monkeypatch.setattr(sys, "argv", ["bench.py", "model=gpt-nano", "data.tokenizer=byte", "data.max_chars=300000",
                                      "train.global_batch_size=8", "train.peak_tflops=1.0", "--steps", "3",
                                      "--repeats", "1", "--warmup", "1"])
    bench.main()
    out = capsys.readouterr().out
    for col in ("tokens/s", "step ms", "data ms", "data %", "MFU", "RSS GiB*", "vs bare"):
        assert col in out, col
    rows = [line for line in out.splitlines() if line.strip().startswith(("harness", "bare"))]
    assert len(rows) == 3
    for line in rows:
        cells = line.split()
        assert cells[-1].replace(".", "").isdigit() and cells[-3].endswith("%")  # ratio and MFU are numbers
        assert cells[-5].replace(".", "").isdigit() and cells[-4].endswith("%")  # input ms and its share
    assert rows[-1].split()[-1] == "1.000"  # the bare loop is the reference
    # The harness's data wait: in every logged row (a share of the step, no CUDA copy
    # time on the CPU) and in the summary, which is where the table's figure comes from.
    assert len(harness_runs) == 2
    for (summary, logged), line in zip(harness_runs, rows[:-1], strict=True):  # the last row is the bare loop's
        assert logged and all(0 <= r["perf/data_wait_s"] <= r["perf/step_time_s"] for r in logged)
        assert all(0 <= r["perf/data_wait_fraction"] <= 1 and "perf/data_copy_s" not in r for r in logged)
        assert line.split()[-5] == f"{1e3 * summary['perf/data_wait_s']:.2f}"
    assert "3 steps per run (1 untimed)" in out
    assert "every setting eager" in out  # like with like: no compiled harness against an eager bare loop
    # One compact banner: machine, torch, model and dtypes once; the harness's own banner and lines hidden.
    assert out.count("bench:") == 1 and f"torch {torch.__version__}" in out
    assert "gpt-nano: " in out and "precision=fp32: parameters fp32, compute fp32" in out
    assert "mptrain |" not in out and "run directory" not in out and "done in" not in out
    # Each run: which of how many, steps done of the total; plain lines, no carriage returns.
    assert "\r" not in out
    progress = [line.split() for line in out.splitlines() if line.startswith("  [")]
    for k, name in enumerate(bench.SETTINGS, 1):
        mine = [" ".join(words) for words in progress if words[0] == f"[{k}/3]"]
        assert mine[0] == f"[{k}/3] {name} 0/3 steps", mine
        assert mine[-1].startswith(f"[{k}/3] {name} 3/3 steps | ") and "tokens/s" in mine[-1], mine
    assert len(progress) == 6  # a start and an end line each: the runs are shorter than PLAIN_EVERY_S
    # The load beside the figures (an explicit --repeats is kept, busy or not), and the warning
    # exactly when the reading says other processes competed.
    assert any(line.startswith("  load average ") for line in out.splitlines()), out
    assert ("warning: these figures are unreliable: " in out) == ("is above the" in out or "(steal)" in out)


def test_steady_laps_leave_out_the_warmup():
    """The harness's timing after the warm-up: whole logged laps that start after it."""
    bench = load_script("bench")
    rows = [{"step": 1, "perf/step_time_s": 9.0}, {"step": 10, "perf/step_time_s": 2.0},
            {"step": 15, "val/loss": 1.0}, {"step": 20, "perf/step_time_s": 1.0},
            {"step": 30, "perf/step_time_s": 1.5}]
    assert bench.steady_laps(rows, 0) == (30, 9.0 + 18.0 + 10.0 + 15.0)
    assert bench.steady_laps(rows, 1) == (29, 18.0 + 10.0 + 15.0)  # the compiling first step is out
    assert bench.steady_laps(rows, 10) == (20, 25.0)
    assert bench.steady_laps(rows, 30) == (0, 0.0)


def test_progress_line_on_a_terminal_and_in_a_file(monkeypatch):
    """The progress line itself: on a real terminal (a pseudo-terminal) redrawn in
    place, elsewhere plain lines at the configured interval, with an ETA once
    steps have a rate."""
    bench = load_script("bench")
    monkeypatch.setattr(bench, "PLAIN_EVERY_S", 0.0)  # every update is due
    plain = io.StringIO()
    p = bench.Progress(plain, "[1/2] bare", 10)
    for done in (1, 4, 4, 2):  # repeats and stale counts (a slower poll) show nothing new
        p.update(done)
    p.finish("123 tokens/s")
    assert plain.getvalue().splitlines()[0] == "[1/2] bare  0/10 steps"
    assert plain.getvalue().splitlines()[1] == "[1/2] bare  1/10 steps"  # no rate yet: no ETA
    assert plain.getvalue().splitlines()[2].startswith("[1/2] bare  4/10 steps, eta ")
    assert plain.getvalue().splitlines()[3:] == ["[1/2] bare 10/10 steps | 123 tokens/s"]
    master, slave = os.openpty()
    with os.fdopen(slave, "w") as tty:
        p = bench.Progress(tty, "[2/2] bare", 10)
        p.update(5)
        p.finish("done")
    # One read may return only the first write: read until the closed terminal reports EIO.
    chunks = []
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    text = b"".join(chunks).decode()
    assert text.startswith("\r\x1b[K[2/2] bare  0/10 steps") and text.count("\n") == 1  # one line, redrawn
    assert "\r\x1b[K[2/2] bare 10/10 steps | done" in text


def test_a_slow_row_is_timed_on_its_first_steps_and_capped():
    """bench_precision's cap: the decision, then a real run stopped by it in this
    process (a zero budget makes any row over budget once its first step is seen)."""
    bp = load_script("bench_precision")
    # used up its budget, or on course to: stop; one step left, or no pace yet and time left: go on
    assert bp.over_budget(20.0, 3, 50, 20.0)
    assert bp.over_budget(6.0, 3, 50, 20.0)  # 2 s a step, 50 to go
    assert not bp.over_budget(6.0, 30, 20, 20.0)  # 0.2 s a step: done in 10 s
    assert not bp.over_budget(30.0, 3, 1, 20.0)  # nothing left worth stopping for
    assert not bp.over_budget(5.0, 0, 59, 20.0)  # the first step alone holds start-up work
    assert bp.over_budget(21.0, 0, 59, 20.0)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        best = bp.fastest(["fp32"], 2, 60, 15, lambda _: ["model=gpt-nano", "train.max_steps=60",
                                                           "data.max_chars=300000"], budget_s=0.0)
    r = best["fp32"]
    assert r.capped.startswith("capped after ") and " of 60 steps" in r.capped and r.tokens_per_s > 0
    steps = int(r.capped.split()[2])
    assert 1 <= steps < 60  # stopped by the trainer's own stop, not killed: the summary was written
    progress = [line for line in out.getvalue().splitlines() if line.startswith("  [")]
    assert all(line.startswith("  [1/2] fp32") for line in progress), progress  # not run again
    assert progress[-1].endswith(r.capped)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handlers put back
