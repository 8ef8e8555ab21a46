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
busy directory), or one with nothing to train (a finished run resumed), undoes
what it wrote: a directory this launch created is
removed, and in a directory that already held a run, Hydra's ``.hydra/`` files
are restored and its log cut back to its old length.

The run writes its records only into files of its own directory. A symbolic
link planted in place of one (pointing outside) is never written through: a
file the run appends to (``.lock``, ``train.log``, ``metrics.jsonl``) refuses
it, naming it (:func:`link_refused`); a file it replaces whole (``config.yaml``,
``summary.json``, ...) replaces the link itself (``core/files.py``).
:func:`writing` turns the OS errors of those writes that a user can fix into
one line: the link, or no room left (disk full, quota, file-size limit: a
:class:`~mptrain.core.errors.DiskError` naming what is kept).

A run directory removed while the run trains (``rm -rf`` of a live run) stops
the run with one line (:class:`RunDirGone`), found by the first write that
fails for it (TensorBoard's) or by :func:`check_present` before each metrics
row and each checkpoint, whichever comes first: appends to ``metrics.jsonl`` and
``train.log`` would go on into files no longer in any directory, and a
checkpoint would make the directory again, holding nothing but itself.
"""
from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import re
import shutil
import socket
from pathlib import Path
from typing import Iterator, Optional, Sequence

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback

from mptrain.core import files
from mptrain.core.errors import NO_ROOM_FIXES, ConfigError, DiskError, UserError
from mptrain.checkpoint.integrity import complete_checkpoints
from mptrain.run.startup import Claims, RunRefused

LOCK_NAME = ".lock"

_LOCKED: dict[Path, "Claim"] = {}
"""The run directories this process holds locked, by resolved path (set by
:meth:`Claim.acquire`, cleared by :meth:`Claim.release`), for :func:`removed` and
:func:`check_present`. A module's table on purpose: a lock is the process's, as the
flock itself is, and the writers of a run's records (metrics rows, the console, the
run record, the trainer's save) ask by path whether the directory they write into
was removed under it, where handing each of them the claim would thread it through
every one. The start-up state (which claims a stop before training undoes) is not
here: it is passed (:func:`acquire`, :func:`held`)."""


class RunDirError(UserError):
    """The run directory cannot be used: locked by another run, not writable, or
    a symbolic link where the run writes one of its records."""

    kind = "run directory error"


class RunDirGone(RunDirError):
    """The run directory was removed while the run trained: every record written
    from then on would go nowhere (appends land in unlinked files) or rebuild a
    directory that holds nothing but them (a checkpoint's ``mkdir``)."""

    kind = "run directory removed"

    def __init__(self, run_dir: Path):
        super().__init__(f"the run directory {run_dir} was removed while the run was training; nothing more can be "
                         "saved there, so the run stopped. Start it again (the records and checkpoints that were "
                         "in that directory went with it).")


class Claim:
    """This process's hold on one run directory: the lock, and what the directory
    held before this launch (to undo a launch that never started training)."""

    def __init__(self, run_dir: Path, created_parents: Sequence[Path] = (), fresh: bool = False):
        self.run_dir = Path(run_dir)
        # The folders this launch created above its run directory (outermost first), removed with it
        # while empty: the launch agreement's list, read at undo time.
        self.created_parents = created_parents
        # fresh: inside a directory this launch created, so nothing in it is older than the launch. A
        # multirun job's directory already holds Hydra's .hydra/ when the job locks it; undone, it goes.
        self.existed = not fresh and _has_content(self.run_dir)
        self.snapshot = _snapshot(self.run_dir) if self.existed else {"entries": set(), "files": {}}
        self.started = False  # set once the run writes its own records: from then on, keep everything
        self._fd: Optional[int] = None

    def acquire(self) -> None:
        lock = self.run_dir / LOCK_NAME
        _refuse_hydra_links(self.run_dir)
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)  # a planted link is refused
        except OSError as e:
            if _is_link(e):
                raise link_refused(lock) from None
            raise RunDirError(f"run directory {self.run_dir} is not writable ({e.strerror}); "
                              "pick another hydra.run.dir.") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            recorded = os.pread(fd, 4096, 0).decode(errors="replace").strip()
            try:
                message = _busy(self.run_dir, fd, recorded)
            finally:
                os.close(fd)
            raise RunDirError(message) from None
        # Who holds it, for the message a second run prints.
        try:
            with writing(self.run_dir):
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"process {os.getpid()} on {socket.gethostname()} (started "
                              f"{datetime.datetime.now():%Y-%m-%d %H:%M:%S})\n".encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        _LOCKED[self.run_dir.resolve()] = self

    def removed(self) -> bool:
        """Whether ``.lock`` is no longer in the directory: the run directory was removed
        (``rm -rf``) since the lock was taken. The open lock file tells, by its link
        count, even when a directory of the same name has been made again since."""
        return self._fd is not None and os.fstat(self._fd).st_nlink == 0

    def release(self) -> None:
        """Give the lock up (the ``.lock`` file stays: holding it is what counts)."""
        if self._fd is not None:
            if _LOCKED.get(self.run_dir.resolve()) is self:
                del _LOCKED[self.run_dir.resolve()]
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = None

    def undo(self) -> None:
        """Remove what this launch wrote; only for a launch that never started training."""
        if self.started:
            return
        if not self.existed:
            shutil.rmtree(self.run_dir, ignore_errors=True)

            for parent in reversed(self.created_parents):  # innermost first; only while empty
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


HYDRA_FILES = ("config.yaml", "hydra.yaml", "overrides.yaml")
"""What Hydra writes into ``<run>/.hydra/`` after the lock is taken (with a plain open, which follows links)."""


def _refuse_hydra_links(run_dir: Path) -> None:
    """A link at ``.hydra`` or at one of its files is refused before Hydra writes
    through it: this runs in ``on_run_start``, before Hydra saves its configs."""
    hydra_dir = run_dir / ".hydra"
    for path in (hydra_dir, *(hydra_dir / name for name in HYDRA_FILES)):
        if path.is_symlink():
            raise link_refused(path)


def _has_content(run_dir: Path) -> bool:
    """Whether the directory holds anything besides a lock file (an empty
    directory made for this launch by ``${mptrain_new_dir:...}`` does not)."""
    return run_dir.is_dir() and any(p.name != LOCK_NAME for p in run_dir.iterdir())


def _snapshot(run_dir: Path) -> dict:
    """What a launch may change before training starts: the top-level entries
    (a new one is removed on undo), Hydra's ``.hydra/*`` files (whole; None for a
    file that did not exist) and the job logs (their length: they are appended to)."""
    # A symbolic link is left out: restoring it would write through it.
    kept: dict[Path, object] = {}
    for name in HYDRA_FILES:
        f = run_dir / ".hydra" / name
        if not f.is_symlink():
            kept[f] = f.read_bytes() if f.is_file() else None
    for f in run_dir.glob("*.log"):
        if not f.is_symlink():
            kept[f] = f.stat().st_size
    return {"entries": {p.name for p in run_dir.iterdir()}, "files": kept}


def _restore(path: Path, old) -> None:
    with contextlib.suppress(OSError):
        if old is None:
            path.unlink(missing_ok=True)
        elif isinstance(old, bytes):
            files.write_bytes(path, old)
        else:
            fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW)  # a link planted since the snapshot: refused
            try:
                if os.fstat(fd).st_size > old:
                    os.ftruncate(fd, old)
            finally:
                os.close(fd)


# ------------------------------------------------------------ who holds the lock
# A held lock whose .lock names a process that is gone, or one that is not
# holding it (its pid reused by an unrelated program), was left to a process
# that inherited the descriptor: a worker forked by that run, which outlived it.
# It is never taken over: while any process holds it, that process may still
# write into the directory. The message names the holder instead (Linux: from
# /proc; elsewhere the .lock's own words).

_RECORD = re.compile(r"process (\d+) on (\S+)")


def _busy(run_dir: Path, fd: int, recorded: str) -> str:
    """Why ``run_dir`` cannot be locked, naming the process that holds it."""
    plain = (f"run directory {run_dir} is in use by {recorded or 'another process'}: one run per directory. "
             "Wait for that run to end (or stop it), or pick another hydra.run.dir.")
    m = _RECORD.match(recorded)
    if not m or m.group(2) != socket.gethostname() or not os.path.isdir("/proc/self/fd"):
        return plain  # another machine's pid, or no /proc to look in: the .lock's own words
    pid, lock = int(m.group(1)), os.fstat(fd)
    holds, command = _holds(pid, lock), _command(pid)
    if holds or (holds is None and command is not None and _looks_like_a_run(command)):
        return plain
    if command is None:
        then = "has ended"
    elif _looks_like_a_run(command):
        then = f"no longer holds it ({command})"  # e.g. a multirun gone on to its next job
    else:
        then = f"has ended: pid {pid} now belongs to an unrelated process ({command})"
    holders = _holders(lock, own_fd=fd)
    now = (", ".join(f"process {p} ({_command(p) or '?'})" for p in holders) if holders
           else f"a process this user cannot see (fuser -v {run_dir / LOCK_NAME} names it)")
    return (f"run directory {run_dir} is locked, but not by the run its .lock names: process {pid} {then}. "
            f"The lock is held by {now}, likely left over from that run; stop it, then run again, or pick "
            "another hydra.run.dir (a held lock is never taken over: its holder may still write there).")


def _fds(pid: int) -> list[str]:
    """The paths of ``pid``'s open descriptors under /proc; PermissionError for another user's process."""
    base = f"/proc/{pid}/fd"
    return [f"{base}/{n}" for n in os.listdir(base)]


def _same_file(path: str, st: os.stat_result) -> bool:
    try:
        other = os.stat(path)
    except OSError:  # closed meanwhile
        return False
    return (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino)


def _holds(pid: int, lock: os.stat_result) -> Optional[bool]:
    """Whether process ``pid`` has the lock file open; None when this user cannot tell."""
    try:
        return any(_same_file(f, lock) for f in _fds(pid))
    except FileNotFoundError:  # no such process
        return False
    except OSError:
        return None


def _holders(lock: os.stat_result, own_fd: int) -> list[int]:
    """Processes of this machine (those this user may look into) with the lock file
    open, this process counted only for descriptors other than ``own_fd``."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        try:
            fds = _fds(pid)
        except OSError:
            continue
        if pid == os.getpid():
            fds = [f for f in fds if f != f"/proc/{pid}/fd/{own_fd}"]
        if any(_same_file(f, lock) for f in fds):
            out.append(pid)
    return out


def _command(pid: int) -> Optional[str]:
    """``pid``'s command line (shortened), or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except FileNotFoundError:
        return None
    except OSError:
        return "?"
    text = " ".join(" ".join(a.decode(errors="replace").split()) for a in argv if a) or "?"  # one line
    return text if len(text) <= 80 else text[:77] + "..."


def _looks_like_a_run(command: str) -> bool:
    return "train.py" in command or "mptrain" in command


# ------------------------------------------------------------ writing records
def _is_link(e: OSError) -> bool:
    """Whether ``e`` is an O_NOFOLLOW open refusing a symbolic link (ELOOP; EMLINK on FreeBSD)."""
    return e.errno in (errno.ELOOP, errno.EMLINK) and e.filename is not None and os.path.islink(e.filename)


def link_refused(path: Path) -> RunDirError:
    """The error for a symbolic link found where the run writes one of its records."""
    try:
        target = f" (to {os.readlink(path)})"
    except OSError:
        target = ""
    return RunDirError(f"{path} is a symbolic link{target}: a run writes its records only into files of its own "
                       "directory, never through a link. Remove the link, or pick another hydra.run.dir.")


def removed(run_dir: Path) -> bool:
    """Whether ``run_dir`` was removed while this process held it (the claim's
    lock file is gone; without a claim, whether the directory is missing)."""
    claim = _LOCKED.get(Path(run_dir).resolve())
    return claim.removed() if claim is not None else not Path(run_dir).is_dir()


def check_present(run_dir: Path) -> None:
    """Raise :class:`RunDirGone` when ``run_dir`` was removed under the run. Called
    where a removal would otherwise pass unseen: before each metrics row (appends to
    an unlinked file succeed) and before each checkpoint (its ``mkdir`` would make the
    directory again). One ``fstat`` of the lock file on rank 0; nothing elsewhere."""
    claim = _LOCKED.get(Path(run_dir).resolve())
    if claim is not None and claim.removed():
        raise RunDirGone(run_dir)


@contextlib.contextmanager
def writing(run_dir: Path, what: Optional[Path] = None) -> Iterator[None]:
    """Write records into ``run_dir``, with the OS errors a user can fix raised as
    one-line errors: a symbolic link in place of a record (:func:`link_refused`),
    no room for it (:class:`DiskError`, naming what is kept), the directory removed
    under the run (:class:`RunDirGone`). ``what`` is the file to name when the error
    names none (TensorBoard's writer thread's errors)."""
    try:
        yield
    except OSError as e:
        if _is_link(e):
            raise link_refused(Path(e.filename)) from None
        if e.errno in NO_ROOM_FIXES:
            raise _no_room(e, Path(run_dir), what) from None
        if e.errno == errno.ENOENT and removed(run_dir):
            raise RunDirGone(run_dir) from None
        raise


def _no_room(e: OSError, run_dir: Path, what: Optional[Path]) -> DiskError:
    name = errno.errorcode.get(e.errno, "")
    file = e.filename or what or run_dir
    step = _last_logged_step(run_dir / "metrics.jsonl")
    kept = [f"metrics.jsonl holds every row up to step {step}"] if step is not None else []
    try:
        last = complete_checkpoints(run_dir / "checkpoints")
        kept.append(f"the last complete checkpoint, {last[-1]}, is intact" if last else "no checkpoint was saved yet")
    except OSError:
        kept.append("the checkpoints were not touched")
    return DiskError(f"{file} could not be written: {e.strerror} ({name}); {' and '.join(kept)}; "
                     f"{NO_ROOM_FIXES[e.errno]}, then run again with hydra.run.dir={run_dir} (resume=auto "
                     "continues from the last complete checkpoint).")


def _last_logged_step(path: Path) -> Optional[int]:
    """The step of the last complete row of ``metrics.jsonl`` (its last 4 MiB are read), or None."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - (4 << 20)))
            lines = f.read().split(b"\n")[:-1]  # what follows the last newline is no complete row
    except OSError:
        return None
    for line in reversed(lines):
        with contextlib.suppress(ValueError, TypeError, KeyError):
            return int(json.loads(line)["step"])
    return None


def _is_rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def acquire(run_dir: Path, claims: Claims) -> Optional[Claim]:
    """Lock ``run_dir`` for this process (rank 0 only; a no-op when ``claims`` holds it
    already). Raises :class:`RunDirError` when another run holds it or it is not
    writable. The claim joins ``claims`` (the start-up's, ``run/startup.py``), so
    that a signal before training can undo it. A rank above 0 locks nothing; it notes
    whether the directory is still to be made (``Claims.note_absent``), for a refused
    launch to remove what its Hydra makes."""
    if not _is_rank0():
        if claims is not None:
            claims.note_absent(Path(run_dir))
        return None
    key = Path(run_dir).resolve()
    if key not in claims:
        made = [Path(d).resolve() for d in claims.agreement.created_dirs]
        claim = Claim(key, claims.agreement.created_parents, fresh=any(d == key or d in key.parents for d in made))
        claim.acquire()
        claims[key] = claim
    return claims[key]


def run_dir_of(given: Optional[str | Path]) -> Path:
    """The run's directory: ``given``, or the one Hydra made for this job (``run(cfg)``
    outside a Hydra job must be given one)."""
    if given:
        return Path(given)
    if not HydraConfig.initialized():
        raise ConfigError("run(cfg) outside @hydra.main needs an explicit run_dir.")
    return Path(HydraConfig.get().runtime.output_dir)


@contextlib.contextmanager
def held(run_dir: Path, claims: Optional[Claims] = None) -> Iterator[Optional[Claim]]:
    """The run's hold on its directory, for the length of ``run()``: a user error
    before training started undoes this launch's writes, and so does a launch that
    ends without having started (a finished run resumed: nothing to train), so that
    it leaves no empty run directory, lock or date folder; the lock is released at
    the end (a multirun runs its jobs one after another in one process). ``claims``:
    the launch's (a claim Hydra's callback took is found there); without a launch,
    claims of this run's own."""
    claims = Claims() if claims is None else claims
    claim = acquire(run_dir, claims)
    try:
        yield claim
        if claim is not None:
            claim.undo()  # a no-op once the run started writing its records
    except UserError:
        if claim is not None:
            claim.undo()
        raise
    finally:
        if claim is not None:
            claim.release()
            claims.pop(claim.run_dir, None)


class RunDirCallback(Callback):
    """Hydra callback (``hydra.callbacks`` in ``mptrain/configs/config.yaml``): lock
    the run directory in ``on_run_start``, before Hydra writes ``.hydra/`` and its
    log there. A refusal is raised as :class:`~mptrain.run.startup.RunRefused`,
    which Hydra cannot turn into a warning and go on; the entry point prints its
    one line and exits with code 2.

    Hydra makes this object itself, from its name in the config, so nothing can
    be handed to it: the launch lends it its claims for the length of its Hydra
    call (:meth:`lent`), the one place where start-up state is reached from
    outside the call chain. Hydra run without mptrain's launch locks nothing here;
    ``run()`` then takes the lock itself, after Hydra's own writes."""

    claims: Optional[Claims] = None
    """The claims of the launch whose Hydra call is running (None outside one)."""

    @classmethod
    @contextlib.contextmanager
    def lent(cls, claims: Claims) -> Iterator[None]:
        """``claims`` are where this callback's claims go while the block runs."""
        before, cls.claims = cls.claims, claims
        try:
            yield
        finally:
            cls.claims = before

    def on_run_start(self, config, **_kw) -> None:
        """Lock the run directory Hydra is about to write into, into the launch's claims."""
        if self.claims is None:
            return
        try:
            acquire(Path(str(config.hydra.run.dir)), self.claims)
        except UserError as e:
            raise RunRefused(e) from None
