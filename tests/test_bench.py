"""scripts/bench.py runs and prints every column, one banner and each run's progress;
Ctrl-C stops it and bench_precision.py at once with what they measured, and their
progress counts what they run (no timing assertions: speed is a benchmark's job)."""
from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from .conftest import ROOT, TINY, load_script, read_rows


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
        # two settings of the same run, each planned twice: [k/N] must count what will run
        best, stopped = bp.fastest(["a", "b"], 2, 60, 1, lambda _: ["model=gpt-nano", "train.max_steps=60",
                                                                   "data.max_chars=300000"], budget_s=0.0)
    assert stopped is None
    progress = [line for line in out.getvalue().splitlines() if line.startswith("  [")]
    for k, name in enumerate("ab"):
        r = best[name]
        assert r.capped.startswith("capped after ") and " of 60 steps" in r.capped and r.tokens_per_s > 0
        steps = int(r.capped.split()[2])
        assert 1 <= steps < 60  # stopped by the trainer's own stop, not killed: the summary was written
        mine = [line for line in progress if line.split()[1] == name]
        # planned: 4 runs; a's cap drops its second one (3 left), b's drops its own (2 in all)
        start, end = [("[1/4]", "[1/3]"), ("[2/3]", "[2/2]")][k]
        assert mine[0].split()[0] == start and mine[-1].split()[0] == end, mine  # not run again
        assert mine[-1].endswith(r.capped)
        assert mine[-1].split()[2] == f"{steps}/60", mine  # the steps it ran, never 60/60
    assert len([line for line in progress if "steps |" in line]) == 2
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handlers put back


def _wait_for(predicate, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_ctrl_c_stops_bench_at_once_with_a_table_of_what_it_measured():
    """A real Ctrl-C (SIGINT) to a real bench.py once its first run has printed steps: the
    run ends after its step, its line and the table give the steps it ran (never
    N/N), no other run starts, no traceback, exit code 130."""
    steps = 5000  # far more than the run reaches before the signal lands
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "bench.py"),
                             *[o for o in TINY if not o.startswith("log.")], "train.log_every=1", "--steps", str(steps),
                             "--repeats", "1", "--warmup", "0", "--progress-every", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    # Each pipe has one reader of its own, to the end: communicate() would read stdout beside
    # the line reader, and the lines it took (the run's closing line, in one busy suite) were lost.
    lines: list[str] = []
    errs: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    err_reader = threading.Thread(target=lambda: errs.append(proc.stderr.read()), daemon=True)
    reader.start()
    err_reader.start()
    try:
        def training() -> bool:
            assert proc.poll() is None, f"bench.py ended (exit {proc.returncode}) before its first run trained"
            return any(line.startswith("  [1/3] harness, monitor off") and not line.split()[4].startswith("0/")
                       for line in list(lines))
        _wait_for(training)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=300)
    finally:
        proc.kill()
    reader.join(30)
    err_reader.join(30)
    out, err = "".join(lines), "".join(errs)
    assert proc.returncode == 130, (out, err)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    ends = [line for line in lines if line.startswith("  [1/3]") and "steps |" in line]
    assert len(ends) == 1 and ends[0].rstrip().endswith("stopped by SIGINT: partial"), ends
    done = int(ends[0].split()[4].split("/")[0])
    assert 1 <= done < steps and ends[0].split()[4] == f"{done}/{steps}"
    assert "[2/3]" not in out  # no next run
    row = [line for line in lines if line.startswith("  harness, monitor off ")]
    assert len(row) == 1 and row[0].rstrip().endswith(f"partial: {done}/{steps} steps (stopped by SIGINT)"), row
    assert "not measured (stopped first): harness, monitor default, bare PyTorch loop" in out
    assert "bench: stopped by SIGINT: the table holds what was measured before it." in out


def test_ctrl_c_in_the_bare_loop_keeps_the_steps_it_ran():
    """The bare loop has no trainer to take the signal: a real SIGINT, sent at its third
    step, ends it there with the three steps' figures, marked stopped."""
    bench = load_script("bench")

    class SignalAtThree(bench.Progress):
        def update(self, done: int) -> None:
            super().update(done)
            if done == 3:
                os.kill(os.getpid(), signal.SIGINT)

    before = signal.getsignal(signal.SIGINT)
    with bench.stoppable():
        r = bench.bare([*[o for o in TINY if not o.startswith("log.")]], 50, SignalAtThree(None, "bare", 50))
    assert signal.getsignal(signal.SIGINT) is before  # given back
    assert r["stopped"] == "SIGINT" and r["steps"] == 3 and r["tokens_per_s"] > 0 and r["step_time_s"] > 0


def test_ctrl_c_stops_bench_precision_with_what_it_measured(monkeypatch):
    """bench_precision's (and bench_monitor's) runs: a real SIGINT once the first run
    has logged steps; it ends after its step, counts as a partial figure with the steps
    it ran, and nothing more runs."""
    bp = load_script("bench_precision")
    monkeypatch.setattr(sys.modules["bench"], "PLAIN_EVERY_S", 0.0)  # a line per logged step
    out = io.StringIO()

    def sender() -> None:
        _wait_for(lambda: any(line.startswith("  [1/2] a") and not line.split()[2].startswith("0/")
                              for line in out.getvalue().splitlines()))
        os.kill(os.getpid(), signal.SIGINT)

    t = threading.Thread(target=sender, daemon=True)
    t.start()
    with contextlib.redirect_stdout(out):
        best, stopped = bp.fastest(["a", "b"], 1, 3000, 1, lambda _: [*TINY, "train.max_steps=3000"])
    t.join()
    assert stopped == signal.SIGINT and list(best) == ["a"]
    done = int(best["a"].partial.split()[1])
    assert best["a"].partial == f"partial: {done} of 3000 steps, stopped by SIGINT" and 1 <= done < 3000
    progress = [line for line in out.getvalue().splitlines() if line.startswith("  [")]
    assert progress[-1].split()[2] == f"{done}/3000" and "[2/2]" not in out.getvalue(), progress[-3:]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_the_default_bench_is_the_quick_form_and_full_the_long_one():
    """Defaults that finish in about a minute and a half idle; --full the long form the
    documented figures were taken with; --steps wins over both."""
    bench = load_script("bench")
    assert bench.options([])[0].steps == bench.QUICK_STEPS < bench.options(["--full"])[0].steps == bench.FULL_STEPS
    assert bench.options(["--full", "--steps", "7", "model=gpt-nano"]) [0].steps == 7
    assert bench.options(["model=gpt-nano"])[1] == ["model=gpt-nano"]
