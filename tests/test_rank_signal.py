"""A rank killed by a signal under ``python -m mptrain.torchrun``: two lines that name the rank,
the signal and the step the run resumes from, instead of the surviving rank's gloo traceback
and torch's ChildFailedError report; exit code 128 + the signal's number.

One real 2-rank launch (gloo), with a real SIGKILL sent to rank 1's process once the run
has saved a checkpoint.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from mptrain.checkpoint.integrity import complete_checkpoints, step_of

from .conftest import TINY
from .test_distributed import LAUNCH_ENV, mptrain_torchrun


def _worker(launcher: int, rank: int) -> int:
    """The pid of the launcher's worker process that holds global rank ``rank``."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (entry / "environ").read_bytes().split(b"\0") if ppid == launcher else []
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        if f"RANK={rank}".encode() in env:
            return int(entry.name)
    raise AssertionError(f"no worker of process {launcher} holds rank {rank}")


def test_a_rank_killed_by_a_signal_is_named_with_the_step_the_run_resumes_from(tmp_path):
    run_dir, log = tmp_path / "run", tmp_path / "launch.log"
    cmd = mptrain_torchrun(*TINY, "parallel=ddp", "train.max_steps=2000", "checkpoint.every=3",
                           f"hydra.run.dir={run_dir}")
    with log.open("w") as out:  # a file, not a pipe nobody reads while we poll
        proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
                                env={**LAUNCH_ENV, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 240
        while not complete_checkpoints(run_dir / "checkpoints"):
            assert proc.poll() is None, f"exited {proc.returncode} before a checkpoint:\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.05)
        victim = _worker(proc.pid, 1)
        os.kill(victim, signal.SIGKILL)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    said = log.read_text()
    assert code == 128 + signal.SIGKILL, (code, said[-4000:])
    newest = complete_checkpoints(run_dir / "checkpoints")[-1]  # (another may have completed before the kill)
    ours = [line for line in said.splitlines() if line.startswith("mptrain.torchrun:")]
    assert len(ours) == 2, said[-4000:]
    assert ours[0].startswith(f"mptrain.torchrun: rank 1 (pid {victim}) was killed by SIGKILL"), ours
    assert ours[1].startswith(f"mptrain.torchrun: the run resumes from step {step_of(newest)} ({newest}, "), ours
    assert f"hydra.run.dir={run_dir}" in ours[1], ours
    # the surviving rank's failure and torch's agent stay out of it
    for noise in ("Traceback", "ChildFailedError", "transport/tcp", "by peer", "Error executing job", "failed (exitcode",
                  "closing signal"):
        assert noise not in said, (noise, said[-4000:])
