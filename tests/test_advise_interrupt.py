"""A SIGTERM or Ctrl-C stops ``python -m mptrain.advise`` and says so; the same command continues.

One advise command, three launches in one directory:

1. in this process, a real SIGTERM sent to this process once the probe has
   logged its first step: one line naming the probe and its step, exit 0, no
   advice written, and not a configuration error;
2. the same command (``--confirm`` on two seeds) as a subprocess: it
   continues the probe from the checkpoint the signal saved, trains the first
   seed's pair, then a real SIGINT (Ctrl-C) once the second seed's
   recommended run has logged its first step: exit 0, one line saying the
   comparison is incomplete, no loss gap claimed;
3. the same command again, in this process: the finished probe and the first
   seed's runs are reused (their summaries untouched), the second seed's
   recommended run continues, and the comparison over both seeds is reported.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from mptrain.advice.command import COMMAND_FILE, command_line, refusal
from mptrain.advise import parse_args
from mptrain.advise import main as advise_main

from .conftest import ROOT, TINY, make_cfg

CONFIRM = 30  # steps of each --confirm run: room for the signal to land in the second seed's recommended one


def _first_row(metrics: Path, timeout_s: float = 300) -> None:
    """Wait until the run has written its first metrics row (the run is training)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if metrics.exists() and metrics.read_text().strip():
            return
        time.sleep(0.02)
    raise AssertionError(f"{metrics} got no row within {timeout_s:.0f} s")


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def test_a_signal_stops_advise_with_one_line_and_the_same_command_continues(tmp_path, capfd):
    run_dir = tmp_path / "advise"
    args = [*TINY, "--steps", "10", "--confirm", str(CONFIRM), "--seeds", "2", f"hydra.run.dir={run_dir}"]

    # 1. SIGTERM during the probe, in this process (the probe's monitored steps take long enough here)
    sender = threading.Thread(target=lambda: (_first_row(run_dir / "probe" / "metrics.jsonl"),
                                              os.kill(os.getpid(), signal.SIGTERM)))
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    sender.start()
    code = advise_main(args)
    sender.join()
    # the repeated signals it ignored while saying its line are this process's again (they were
    # left ignored, and every later subprocess of the session inherited SIGTERM ignored)
    assert {sig: signal.getsignal(sig) for sig in before} == before
    err = capfd.readouterr().err.strip().splitlines()
    assert code == 0, err
    probe = _summary(run_dir / "probe")
    assert probe["stopped_early"] == "SIGTERM" and probe["steps"] < 10
    line = [ln for ln in err if ln.startswith("mptrain.advise: ")]
    assert line == [f"mptrain.advise: stopped by SIGTERM during the probe at step {probe['steps']} of 10: no "
                    f"advice was written to {run_dir}; rerun the same command to continue there."], err
    assert not (run_dir / "advice.json").exists()

    # 2. the same command, as a user runs it: accepted; Ctrl-C during the second seed's recommended confirm run
    proc = subprocess.Popen([sys.executable, "-m", "mptrain.advise", *args], cwd=tmp_path, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        _first_row(run_dir / "confirm-recommended-s1" / "metrics.jsonl")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    probe = _summary(run_dir / "probe")
    assert probe["steps"] == 10 and "stopped_early" not in probe and "resumed_from" in probe
    seed = int(make_cfg().train.seed)  # TINY's default: the seeds are it and the next one
    for name in ("recommended", "baseline"):  # the first seed's pair finished before the signal
        done = _summary(run_dir / f"confirm-{name}-s0")
        assert done["steps"] == CONFIRM and "stopped_early" not in done
    rec = _summary(run_dir / "confirm-recommended-s1")
    assert rec["stopped_early"] == "SIGINT" and rec["steps"] < CONFIRM
    assert err.strip().splitlines()[-1] == (
        f"mptrain.advise: stopped by SIGINT during --confirm's recommended run with train.seed={seed + 1} (seed 2 of "
        f"2) at step {rec['steps']} of {CONFIRM}: the comparison is incomplete (no loss gap); no advice was written "
        f"to {run_dir}; rerun the same command to continue there."), err[-3000:]
    assert "loss gap" not in out and "Traceback" not in err and not (run_dir / "advice.json").exists()
    assert not (run_dir / "confirm-baseline-s1").exists()

    # 3. the same command once more: the probe and the first seed's runs are read back, not trained again;
    # the second seed's recommended run continues; the comparison is made over both seeds
    kept = [run_dir / "probe", run_dir / "confirm-recommended-s0", run_dir / "confirm-baseline-s0"]
    before = {d: ((d / "summary.json").read_bytes(), (d / "summary.json").stat().st_mtime_ns) for d in kept}
    assert advise_main(args) == 0
    assert {d: ((d / "summary.json").read_bytes(), (d / "summary.json").stat().st_mtime_ns) for d in kept} == before
    rec = _summary(run_dir / "confirm-recommended-s1")
    assert rec["steps"] == CONFIRM and "stopped_early" not in rec and "resumed_from" in rec
    base = _summary(run_dir / "confirm-baseline-s1")
    assert base["steps"] == CONFIRM and "resumed_from" not in base
    doc = json.loads((run_dir / "advice.json").read_text())
    assert doc["comparison"]["seeds"] == [seed, seed + 1]
    assert doc["comparison"]["recommended"]["loss"][1] == rec["final/val_loss"]
    assert doc["comparison"]["baseline"]["loss"][1] == base["final/val_loss"]
    assert any(ln.startswith("loss gap (recommended - baseline): ") for ln in doc["confirm"]), doc["confirm"]


def test_a_directory_takes_the_command_it_records_and_refuses_a_finished_advise(tmp_path):
    same = command_line(parse_args([*TINY, "--steps", "10", f"hydra.run.dir={tmp_path}"]))
    other = command_line(parse_args([*TINY, "--steps", "12", f"hydra.run.dir={tmp_path}"]))
    assert "hydra.run.dir" not in same and same != other
    # --confirm's seeds are part of the command (default 2): a rerun with other seeds is another comparison
    assert "--confirm 5 --seeds 2" in command_line(parse_args([*TINY, "--confirm", "5"]))
    assert "--seeds" not in same
    assert refusal(tmp_path, same) == ""  # a new directory
    (tmp_path / "probe").mkdir()
    assert "recorded no command" in refusal(tmp_path, same)  # an advise of a version that did not record it
    (tmp_path / COMMAND_FILE).write_text(json.dumps({"command": same}))
    assert refusal(tmp_path, same) == ""  # interrupted: the same command continues
    assert refusal(tmp_path, other) == (
        f"{tmp_path} holds an unfinished advise run of another command (python -m mptrain.advise {same}); "
        "rerun that command to continue it, or pick another hydra.run.dir.")
    (tmp_path / "advice.json").write_text("{}")
    assert "already holds a finished advise run (advice.json)" in refusal(tmp_path, same)


def test_a_directory_that_cannot_be_written_is_one_line(tmp_path, capsys):
    # as root chmod does not refuse: a path under a regular file (ENOTDIR) cannot be created
    (tmp_path / "file").write_text("")
    assert advise_main([*TINY, "--steps", "10", f"hydra.run.dir={tmp_path / 'file' / 'advise'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mptrain.advise: disk error: ") and "command.json" in err[0], err


def test_help_and_the_stop_line_give_the_same_way_to_continue(tmp_path):
    """Without hydra.run.dir an advise starts a new directory each time, so a plain rerun
    does not continue: the stop line and --help both say to rerun with hydra.run.dir."""
    from mptrain import advise
    from mptrain.advice.advisor import Interrupted, interrupted_line

    class Stopped:  # the advisor's state a stop line reads: its stage, directory and overrides
        stage, run_dir, overrides = "during the probe", tmp_path, [*TINY]

    line = interrupted_line(Interrupted("SIGINT", " at step 3 of 30"), Stopped())
    assert line.endswith(f"rerun the same command with hydra.run.dir={tmp_path} to continue there."), line
    doc = " ".join(advise.__doc__.split())
    assert "rerun the same command with ``hydra.run.dir=<its advise directory>``" in doc, doc
    assert "the same command run again continues" not in doc


def test_the_probe_estimate_comes_from_a_step_measured_here(capsys):
    """advise times a step of the model's own shape before it estimates, and the estimate
    is that step's time x the probe's steps (a prediction from one matmul's speed said
    ~2m30s for a probe whose 15th step of 30 came at 552 s on a busy machine)."""
    from mptrain.advice.advisor import Advisor
    from mptrain.run.startup import Startup

    with Startup() as startup:
        advisor = Advisor(parse_args([*TINY, "--steps", "12"]), startup)
        advisor.announce()
    out = capsys.readouterr().out
    line = [ln for ln in out.splitlines() if "estimated time" in ln]
    assert len(line) == 1 and line[0].startswith("advise: a training step of this model took "), out
    step_s = float(line[0].split(" took ")[1].split(" s ")[0])
    said = line[0].split("the probe ~")[1].split(";")[0]  # 42s or 3m05s
    minutes, _, seconds = said.rstrip("s").rpartition("m")
    estimate = 60 * int(minutes or 0) + int(seconds)
    # the step is printed to 3 digits and the estimate to the second
    assert step_s > 0 and abs(estimate - 12 * step_s) <= 1 + 0.01 * 12 * step_s, line
