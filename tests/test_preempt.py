"""Preemption with real processes and real signals: SIGTERM under ``python -m mptrain.torchrun``
exits 0 and resumes bitwise; repeated SIGKILLs resume bitwise from the last complete checkpoint."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from mptrain.checkpoint.integrity import complete_checkpoints, step_of

from .conftest import ROOT, TINY, read_rows, train
from .test_distributed import PREEMPT

VOLATILE = ("perf/", "mem/")  # wall-clock figures: the only keys allowed to differ


def _values(rows):
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def _steps_written(run_dir: Path) -> list[int]:
    """Steps of the complete rows of metrics.jsonl so far (a row may be half-written while we read)."""
    steps = []
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return steps
    for line in lines:
        try:
            steps.append(json.loads(line)["step"])
        except (json.JSONDecodeError, KeyError):
            pass
    return steps


def _last_checkpoint_step(run_dir: Path) -> int:
    """Step of the newest complete checkpoint (what resume=auto takes), 0 when there is none."""
    done = complete_checkpoints(run_dir / "checkpoints")
    return step_of(done[-1]) if done else 0


def _start(cmd: list[str], log: Path) -> subprocess.Popen:
    # Output goes to a file: a pipe nobody reads while we poll could fill and stall the run.
    # Unbuffered, so what a SIGKILLed launch printed is in the file.
    with log.open("w") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(cmd, cwd=log.parent, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int, log: Path, timeout: float = 240) -> None:
    """Return once metrics.jsonl holds a row for ``step``; fail if the process ends first."""
    deadline = time.monotonic() + timeout
    while step not in _steps_written(run_dir):
        assert proc.poll() is None, f"exited {proc.returncode} before step {step}:\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"no step {step} after {timeout}s:\n{log.read_text()[-4000:]}"
        time.sleep(0.05)


def test_two_rank_fsdp_sigterm_exits_0_and_resumes_exactly(tmp_path, two_rank_jobs):
    straight = read_rows(two_rank_jobs("fsdp")["preempt"])  # the same run, uninterrupted (a job of a shared launch)
    run_dir, log = tmp_path / "b" / "run", tmp_path / "b" / "launch.log"
    run_dir.parent.mkdir()
    cmd = [sys.executable, "-m", "mptrain.torchrun", "--standalone", "--nproc_per_node=2", str(ROOT / "train.py"),
           *PREEMPT, "parallel=fsdp", f"hydra.run.dir={run_dir}"]
    proc = _start(cmd, log)
    _wait_for_step(proc, run_dir, 3, log)
    proc.send_signal(signal.SIGTERM)  # to the launcher only, as a scheduler or `kill <pid>` does
    assert proc.wait(timeout=120) == 0, log.read_text()[-4000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["stopped_early"] == "SIGTERM" and 3 <= s["steps"] < 20, s
    # the signal's own checkpoint, at the step where it stopped
    assert [p.name for p in complete_checkpoints(run_dir / "checkpoints")] == [f"step-{s['steps']}"]
    r = subprocess.run(cmd, cwd=run_dir.parent, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    s2 = json.loads((run_dir / "summary.json").read_text())
    assert s2["resumed_from"].endswith(f"step-{s['steps']}") and s2["steps"] == 20 and s2["dist/replicas_identical"]
    rows = read_rows(run_dir)
    assert [r["step"] for r in rows] == [r["step"] for r in straight]  # one row per step, none doubled
    assert _values(rows) == _values(straight)


KILL9 = [*TINY, "precision=fp32", "train.max_steps=24", "checkpoint.every=2"]


def test_sigkill_loop_resumes_exactly(tmp_path):
    rng = random.Random(14)  # fixed: a failing sequence of kill points reproduces
    run_dir, log = tmp_path / "run", tmp_path / "launch.log"
    cmd = [sys.executable, str(ROOT / "train.py"), *KILL9, f"hydra.run.dir={run_dir}"]
    for _ in range(3):
        resume_at = _last_checkpoint_step(run_dir)
        # A step this launch has not written yet: seeing its row proves the launch got there.
        # At least 3 steps on, so the first launch has saved step-2 (saves are synchronous)
        # and every relaunch resumes rather than starts over.
        target = max(_steps_written(run_dir), default=0) + rng.randint(3, 6)
        proc = _start(cmd, log)
        _wait_for_step(proc, run_dir, target, log)
        proc.kill()
        assert proc.wait(timeout=60) == -signal.SIGKILL
        assert max(_steps_written(run_dir)) < 24, "the run finished before it was killed"
        # without this, launches that silently started over would pass the checks below
        assert not resume_at or f"step-{resume_at} at step {resume_at}" in log.read_text(), log.read_text()[-3000:]
    resume_at = _last_checkpoint_step(run_dir)
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["steps"] == 24 and s["resumed_from"].endswith(f"step-{resume_at}"), (s, resume_at)
    _, straight = train(tmp_path / "straight", *KILL9, "checkpoint.every=0")  # saving changes no value
    rows = read_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 25)) == [r["step"] for r in straight]  # each step once
    assert _values(rows) == _values(straight)
