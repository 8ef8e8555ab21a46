"""Run integrity: one live run per directory, records that describe exactly the
steps the model went through, resumes that refuse a silently changed config, and
launches refused before training that leave the directory as they found it."""
from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from mptrain.core.errors import ConfigError
from mptrain.run.resume import ResumeRefused
from mptrain.run.rundir import Claim, RunDirError

from .conftest import ROOT, TINY, read_rows, train


def _launch(cwd: Path, *args: str) -> subprocess.Popen:
    """``python train.py ...`` started now, not waited for: several run at once."""
    return subprocess.Popen([sys.executable, str(ROOT / "train.py"), *TINY, *args], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(procs: list[subprocess.Popen]) -> list[tuple[int, str, str]]:
    """(exit code, stdout, stderr) of each, in order."""
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        out.append((p.returncode, stdout, stderr))
    return out


def _wait_for_lock(lock: Path, proc: subprocess.Popen, timeout: float = 240.0) -> None:
    """Until ``proc`` holds ``lock``: the lock file names its pid once the lock is taken."""
    deadline = time.monotonic() + timeout
    while f"process {proc.pid} " not in (lock.read_text() if lock.exists() else ""):
        assert proc.poll() is None, f"the first launch ended ({proc.returncode}) before it held {lock}"
        assert time.monotonic() < deadline, f"{lock} never named process {proc.pid}"
        time.sleep(0.05)


def _steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_rows(run_dir)]


def _seed_records(run_dir: Path) -> tuple[int, list[str]]:
    """The seed config.yaml says and the overrides Hydra recorded for the same directory."""
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    overrides = yaml.safe_load((run_dir / ".hydra" / "overrides.yaml").read_text())
    return cfg["train"]["seed"], [o for o in overrides if o.startswith("train.seed=")]


def _tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (but the lock file, which a refused launch may rewrite) with its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != ".lock"}


def test_concurrent_launches_never_share_a_directory(tmp_path):
    """Observations 1 and 2: two launches in one second without hydra.run.dir got one
    directory; two with the same hydra.run.dir mixed their metrics. Four launches:
    two with default directories at the same moment, and a second launch into a
    directory whose run is live (held still by SIGSTOP once its lock names it, so
    that "live" does not depend on how fast this machine trains 4 steps)."""
    shared = tmp_path / "shared"
    steps = ["train.max_steps=4"]
    procs = [_launch(tmp_path, *steps, "train.seed=1", f"hydra.run.dir={shared}"),
             _launch(tmp_path, *steps, "train.seed=3"),
             _launch(tmp_path, *steps, "train.seed=4")]
    holder = procs[0]
    try:
        _wait_for_lock(shared / ".lock", holder)
        holder.send_signal(signal.SIGSTOP)
        second = _launch(tmp_path, *steps, "train.seed=2", f"hydra.run.dir={shared}")
        refused = _finish([second])[0]
    finally:
        holder.send_signal(signal.SIGCONT)
    results = _finish(procs)
    for rc, out, err in results:
        assert rc == 0, (out[-2000:], err[-3000:])
    # The same explicit directory: the live run trains, the second is refused naming it.
    rc, out, err = refused
    assert rc == 2, (out[-2000:], err[-2000:])
    assert f"in use by process {holder.pid}" in err and "Traceback" not in err, err[-2000:]
    assert _steps(shared) == [1, 2, 3, 4]
    assert _seed_records(shared) == (1, ["train.seed=1"])
    # Default directories: one each, every record from one run.
    dirs = sorted(p for p in (tmp_path / "outputs").glob("*/*") if p.is_dir())
    assert len(dirs) == 2, dirs
    seeds = set()
    for d in dirs:
        assert _steps(d) == [1, 2, 3, 4]
        seed, overrides = _seed_records(d)
        assert overrides == [f"train.seed={seed}"]
        seeds.add(seed)
    assert seeds == {3, 4}


def test_restarts_and_reruns_keep_each_step_once(tmp_path, capsys):
    """Observations 3 and 4: a restart with no checkpoint appended its steps again; a
    rerun of a finished run nulled its summary. Then more steps continue it."""
    run_dir = tmp_path / "run"
    args = ["train.max_steps=5", "checkpoint.every=3"]
    # Killed in the middle of the first save: rows 1-3 logged, no complete checkpoint.
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), *TINY, *args, "debug.kill_during_save_at_step=3",
                        f"hydra.run.dir={run_dir}"], capture_output=True, text=True, timeout=300)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    assert _steps(run_dir) == [1, 2, 3] and not (run_dir / "checkpoints" / "step-3").exists()
    _, rows = train(run_dir, *args)  # starts from scratch: the old rows go
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    records = _tree(run_dir)
    capsys.readouterr()
    again, _ = train(run_dir, *args)  # finished: nothing to do, nothing rewritten
    assert "nothing to train" in capsys.readouterr().out
    assert _tree(run_dir) == records
    assert again["steps"] == 5 and again["final/train_loss"] is not None
    more, rows = train(run_dir, "train.max_steps=7", "checkpoint.every=3")  # asks for more: continues
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6, 7] and more["steps"] == 7
    # ... and says what the longer run does to the schedule: step 6 was past the end of the old decay
    said = capsys.readouterr().out
    assert "train.max_steps 5 -> 7 stretches the learning-rate schedule" in said, said
    lr6 = next(r["train/lr"] for r in rows if r["step"] == 6)
    assert f"The learning rate at step 6 is {lr6:.2e}" in said
    assert more["config_history"] == [{"from_step": 5, "changes": {"train.max_steps": [5, 7]}}]


def test_a_resume_that_changes_the_math_is_refused_unless_named(tmp_path):
    """Observation 6: a changed precision or seed trained on silently, and the records
    then called the whole run by the new setting."""
    run_dir = tmp_path / "run"
    train(run_dir, "train.max_steps=2", "checkpoint.every=2")
    before = _tree(run_dir)
    for change, listed in [("precision=bf16", "precision.name: 'fp32' -> 'bf16'"),
                           ("train.seed=7", "train.seed: 1337 -> 7"),
                           ("model=gpt-mini", "model.d_model: 64 -> 128")]:
        with pytest.raises(ResumeRefused, match="allow_changes") as e:
            train(run_dir, "train.max_steps=4", change)
        assert listed in str(e.value)
        assert _tree(run_dir) == before  # a refused resume writes nothing
    with pytest.raises(ConfigError, match="'precison' is not a config key"):
        train(run_dir, "train.max_steps=4", "precision=bf16", "resume.allow_changes=[precison]")
    with pytest.raises(ResumeRefused, match="resume=none"):
        train(run_dir, "train.max_steps=4", "resume=none")
    # Update clipping gives each parameter its own optimizer group: a state of another shape.
    with pytest.raises(ResumeRefused, match="optim.update_clip: 0.0 -> 1.0 changes the layout"):
        train(run_dir, "train.max_steps=4", "optim.update_clip=1.0", "resume.allow_changes=[optim]")
    assert _tree(run_dir) == before
    # Named: it trains on, and the records say from which step the change applies.
    s, _ = train(run_dir, "train.max_steps=3", "checkpoint.every=1", "precision=bf16",
                 "resume.allow_changes=[precision]")
    (entry,) = s["config_history"]
    assert entry["from_step"] == 2 and entry["changes"]["precision.name"] == ["fp32", "bf16"]
    assert entry["changes"]["train.max_steps"] == [2, 3]
    info = yaml.safe_load((run_dir / "config.yaml").read_text())["run_info"]
    assert info["config_history"] == s["config_history"]
    meta = json.loads((run_dir / "checkpoints" / "step-3" / "meta.json").read_text())
    assert meta["history"] == s["config_history"]
    # fp32/bf16 -> fp16 used to die in GradScaler: the scaler starts fresh instead.
    s, _ = train(run_dir, "train.max_steps=4", "precision=fp16", "resume.allow_changes=[precision]")
    assert [h["from_step"] for h in s["config_history"]] == [2, 3] and s["amp/final_loss_scale"] > 0


def test_refused_launches_leave_no_trace(tmp_path):
    """Observations 7 and 10: errors after Hydra started left a directory with .hydra/
    and an empty log; an unwritable directory failed at the first checkpoint."""
    kept = tmp_path / "kept"
    train(kept, "train.max_steps=2", "checkpoint.every=2")
    before = _tree(kept)
    procs = {
        "resume": _launch(tmp_path, "train.max_steps=4", "precision=bf16", f"hydra.run.dir={kept}"),
        "fresh": _launch(tmp_path, "model.n_head=3", f"hydra.run.dir={tmp_path / 'fresh'}"),
        "default": _launch(tmp_path, "model.n_head=3"),
        "unwritable": _launch(tmp_path, "hydra.run.dir=/sys/mptrain-test/run"),
    }
    results = dict(zip(procs, _finish(list(procs.values())), strict=True))
    for name, (rc, out, err) in results.items():
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert rc == 2 and "Traceback" not in err and len(lines) == 1, (name, err[-2000:])
    assert "allow_changes" in results["resume"][2]
    assert "not writable" in results["unwritable"][2]
    assert _tree(kept) == before and not (kept / ".hydra").exists()
    assert not (tmp_path / "fresh").exists()
    assert not (tmp_path / "outputs").exists()  # not even the empty outputs/<date>/ it made


def _wait_for_cmdline(pid: int, timeout: float = 20.0) -> None:
    """Popen returns once the child's exec has closed its close-on-exec pipe, which
    the kernel does before it writes the new program's arguments: on a busy machine
    /proc/<pid>/cmdline can still read empty for a moment (CI saw "?")."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if f.read():
                return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} showed no command line within {timeout} s")


def test_a_lock_left_to_another_process_names_it(tmp_path):
    """The lock is held, but .lock names a pid that now belongs to an unrelated
    program (pid reuse; the holder is a process that kept the run's descriptor):
    the message said that program was the run. It now names both, and the lock is
    not taken over."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    unrelated = subprocess.Popen(["sleep", "30"])
    _wait_for_cmdline(unrelated.pid)
    fd = os.open(run_dir / ".lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # this process holds it, as a leftover worker of the run would
        os.write(fd, f"process {unrelated.pid} on {socket.gethostname()} (started 2026-01-01 09:00:00)\n".encode())
        with pytest.raises(RunDirError) as e:
            Claim(run_dir).acquire()
        msg = str(e.value)
        assert msg.startswith(f"run directory {run_dir} is locked, but not by the run its .lock names: process "
                              f"{unrelated.pid} has ended: pid {unrelated.pid} now belongs to an unrelated process "
                              f"(sleep 30). The lock is held by process {os.getpid()} ("), msg
        assert "stop it, then run again, or pick another hydra.run.dir" in msg and "\n" not in msg
        with pytest.raises(BlockingIOError):  # still ours: nothing took it over
            fcntl.flock(os.open(run_dir / ".lock", os.O_RDONLY), fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
        unrelated.kill()
        unrelated.wait()
