"""One live run per run directory, and nothing left behind by a launch that never started.

A run directory holds one run's records: ``metrics.jsonl``, ``config.yaml``,
checkpoints. Two processes writing into it at once mix those records (both
runs' steps in one metrics file, one run's config beside the other's
checkpoints), so every run holds an OS file lock on ``<run>/.lock`` for its
whole life:

- ``fcntl.flock`` is released by the kernel when the process ends, however it
  ends (``kill -9`` included), so a crash never leaves a stale lock behind, as
  a marker file would. The file itself stays; holding it is what counts.
- A second run on a locked directory stops before it touches anything, naming
  the process that holds it. Under ``torchrun`` only global rank 0 locks.
- Hydra writes ``.hydra/`` and its log into the directory before the task
  function runs, so ``RunDirCallback`` takes the lock in Hydra's
  ``on_run_start``, before any of that. ``run()`` takes it itself when called
  without Hydra, and for each job of a multirun.

A launch refused before training starts (a bad config, a refused resume, a
busy directory) undoes what it wrote: a directory this launch created is
removed, and in a directory that already held a run, Hydra's ``.hydra/`` files
are restored and its log cut back to its old length.
"""
from __future__ import annotations

import contextlib
import datetime
import fcntl
import os
import shutil
import socket
import sys
from pathlib import Path
from typing import Iterator, Optional

from hydra.experimental.callback import Callback

from mptrain.core.errors import UserError
from mptrain.distributed.launch import CREATED_PARENTS

LOCK_NAME = ".lock"


class RunDirError(UserError):
    """The run directory cannot be used: locked by another run, or not writable."""

    kind = "run directory error"


class Claim:
    """This process's hold on one run directory: the lock, and what the directory
    held before this launch (to undo a launch that never started training)."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.existed = _has_content(self.run_dir)
        self.snapshot = _snapshot(self.run_dir) if self.existed else {"entries": set(), "files": {}}
        self.started = False  # set once the run writes its own records: from then on, keep everything
        self._fd: Optional[int] = None

    def acquire(self) -> None:
        lock = self.run_dir / LOCK_NAME
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise RunDirError(f"run directory {self.run_dir} is not writable ({e.strerror}); "
                              "pick another hydra.run.dir.") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise RunDirError(f"run directory {self.run_dir} is in use by {holder}: one run per directory. "
                              "Wait for that run to end (or stop it), or pick another hydra.run.dir.") from None
        # Who holds it, for the message a second run prints.
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"process {os.getpid()} on {socket.gethostname()} (started "
                      f"{datetime.datetime.now():%Y-%m-%d %H:%M:%S})\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = None

    def undo(self) -> None:
        """Remove what this launch wrote; only for a launch that never started training."""
        if self.started:
            return
        if not self.existed:
            shutil.rmtree(self.run_dir, ignore_errors=True)

            for parent in reversed(CREATED_PARENTS):  # innermost first; only while empty
                with contextlib.suppress(OSError):
                    parent.rmdir()
            return
        for path in self.run_dir.iterdir():  # top-level entries this launch added (Hydra's log, .hydra/)
            if path.name in self.snapshot["entries"] or path.name == LOCK_NAME:
                continue
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        for path, old in self.snapshot["files"].items():
            _restore(path, old)


def _has_content(run_dir: Path) -> bool:
    """Whether the directory holds anything besides a lock file (an empty
    directory made for this launch by ``${mptrain_new_dir:...}`` does not)."""
    return run_dir.is_dir() and any(p.name != LOCK_NAME for p in run_dir.iterdir())


def _snapshot(run_dir: Path) -> dict:
    """What a launch may change before training starts: the top-level entries
    (a new one is removed on undo), Hydra's ``.hydra/*`` files (whole; None for a
    file that did not exist) and the job logs (their length: they are appended to)."""
    files: dict[Path, object] = {}
    for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
        f = run_dir / ".hydra" / name
        files[f] = f.read_bytes() if f.is_file() else None
    for f in run_dir.glob("*.log"):
        files[f] = f.stat().st_size
    return {"entries": {p.name for p in run_dir.iterdir()}, "files": files}


def _restore(path: Path, old) -> None:
    with contextlib.suppress(OSError):
        if old is None:
            path.unlink(missing_ok=True)
        elif isinstance(old, bytes):
            path.write_bytes(old)
        elif path.is_file() and path.stat().st_size > old:
            os.truncate(path, old)


_HELD: dict[Path, Claim] = {}


def _is_rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def acquire(run_dir: Path) -> Optional[Claim]:
    """Lock ``run_dir`` for this process (rank 0 only; a no-op when already held).
    Raises :class:`RunDirError` when another run holds it or it is not writable."""
    if not _is_rank0():
        return None
    key = Path(run_dir).resolve()
    if key not in _HELD:
        claim = Claim(key)
        claim.acquire()
        _HELD[key] = claim
    return _HELD[key]


@contextlib.contextmanager
def held(run_dir: Path) -> Iterator[Optional[Claim]]:
    """The run's hold on its directory, for the length of ``run()``: a user error
    before training started undoes this launch's writes; the lock is released at
    the end (a multirun runs its jobs one after another in one process)."""
    claim = acquire(run_dir)
    try:
        yield claim
    except UserError:
        if claim is not None:
            claim.undo()
        raise
    finally:
        if claim is not None:
            claim.release()
            _HELD.pop(claim.run_dir, None)


class RunDirCallback(Callback):
    """Hydra callback (``hydra.callbacks`` in ``configs/config.yaml``): lock the run
    directory in ``on_run_start``, before Hydra writes ``.hydra/`` and its log
    there. A refusal is printed as one line and the process exits with code 2."""

    def on_run_start(self, config, **_kw) -> None:
        try:
            acquire(Path(str(config.hydra.run.dir)))
        except UserError as e:
            print(f"mptrain: {e.one_line()}", file=sys.stderr)
            sys.exit(2)
