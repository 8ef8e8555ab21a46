"""Atomic writes: a reader (a dashboard, a resumed run, another rank) sees the
old file or the new one, never half of either.

Each helper writes under a temporary name beside the target and renames it
into place; ``os.replace`` is atomic within one filesystem, and the temporary
file sits in the same directory so it is on the same filesystem. A write that
fails removes its temporary file or directory, and :func:`build_dir` also
removes what builders that were killed left behind.

No write follows a symbolic link planted where a file goes (a run directory
may be shared, or prepared by someone else): the temporary file is created new
(``O_EXCL | O_NOFOLLOW``), and the rename then replaces a link at the target
itself, never the file it points to. :class:`AppendFile`, for the files a run
appends to, refuses a link at its path instead (``O_NOFOLLOW``).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
from pathlib import Path
from typing import Callable, Optional


def write_bytes(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` in one step; a symbolic link at ``path`` is
    replaced by the new file, and what it pointed to is left as it was."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")  # pid: two writers never share a temp name
    try:
        with open(_create_new(tmp), "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)  # a full disk must not also leave half a file beside the target
        if isinstance(e, OSError) and e.filename is None:  # a failed write names no file
            e.filename = str(path)
        raise


def write_text(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` (UTF-8) in one step (see :func:`write_bytes`)."""
    write_bytes(path, text.encode("utf-8"))


def write_first(path: Path, data: bytes) -> bool:
    """Create ``path`` holding ``data`` unless it exists; False (and ``path`` left as
    it is) when another writer created it first, even one that finished a moment
    ago. For a choice several processes may make at once, where all must end up
    using the first one written: the loser reads the winner's file.

    The data goes to a temporary file first and is linked into place, so a reader
    never sees half of it; a filesystem without hard links falls back to a rename
    (the last writer then wins, as :func:`write_bytes` does)."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        with open(_create_new(tmp), "wb") as f:
            f.write(data)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        except OSError:  # no hard links here (some network and FUSE filesystems)
            os.replace(tmp, path)
        return True
    finally:
        tmp.unlink(missing_ok=True)


_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW


def _create_new(path: Path) -> int:
    """A file descriptor on a file created at ``path`` by this call: never an
    existing file, nor the target of a link waiting there (O_EXCL refuses both)."""
    try:
        return os.open(path, _NEW_FILE, 0o666)
    except FileExistsError:
        # Left by a writer with our pid that was killed, or planted: removing it
        # touches nothing else (a link is removed itself, not its target).
        path.unlink()
        return os.open(path, _NEW_FILE, 0o666)


class AppendFile:
    """A file that grows by whole records, opened without following a link.

    - Opened with ``O_NOFOLLOW``: a symbolic link at ``path`` is refused (an
      OSError, ELOOP, naming the path) rather than appended through, so a link
      planted in a run directory cannot make the run write outside it.
    - Each :meth:`write` lands whole or not at all: a write the OS cuts short
      (disk full, file-size limit) is undone by cutting the file back to its
      length before it, so a reader never meets half a record, and the OSError
      is raised. Unbuffered: what ``write`` returned from is in the file.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self.fd: Optional[int] = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o666)
        self.size = os.fstat(self.fd).st_size

    def read(self) -> bytes:
        """Everything the file holds."""
        chunks, at = [], 0
        while chunk := os.pread(self.fd, 1 << 20, at):
            chunks.append(chunk)
            at += len(chunk)
        return b"".join(chunks)

    def write(self, text: str) -> None:
        """Append ``text`` (UTF-8), all of it or none of it."""
        data = memoryview(text.encode("utf-8"))
        done = 0
        try:
            while done < len(data):
                done += os.write(self.fd, data[done:])
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, self.size)  # only shrinks: no room needed
            if e.filename is None:  # os.write's error names no file
                e.filename = str(self.path)
            raise
        self.size += done

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def write_json(path: Path, obj) -> None:
    """``obj`` as indented JSON; values JSON cannot hold (paths, dtypes) become strings."""
    write_text(path, json.dumps(obj, indent=2, default=str) + "\n")


def _host() -> str:
    # Only the characters a file name can always hold: the name is parsed back by _stale_builds.
    return re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname()) or "host"


def _tmp_name(final: Path) -> Path:
    """The temporary directory this process builds ``final`` in: ``<name>.tmp<pid>.<host>``.

    The host is in the name because a cache may sit on a filesystem that
    several machines share: there a pid says nothing about another machine's
    processes, and two machines may run builders with the same pid."""
    final = Path(final)
    return final.with_name(f"{final.name}.tmp{os.getpid()}.{_host()}")


def _pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this machine (signal 0 only checks)."""
    if pid <= 0:  # os.kill(0, ...) would address our own process group
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def _stale_builds(final: Path) -> list[Path]:
    """Temporary build directories of ``final`` whose builder on this machine is gone.

    ``<name>.tmp<pid>`` (no host: written by earlier versions) counts as this
    machine's. A directory whose pid is alive is left alone: it may be a
    concurrent builder (or an unrelated process that reused the pid, which
    only delays the clean-up to a later build). So is another machine's."""
    pattern = re.compile(re.escape(final.name) + r"\.tmp(\d+)(?:\.(.+))?")
    out = []
    for p in final.parent.iterdir() if final.parent.is_dir() else []:
        m = pattern.fullmatch(p.name)
        if not m or m.group(2) not in (None, _host()):
            continue
        pid = int(m.group(1))
        if pid == os.getpid() or not _pid_alive(pid):  # ours: a killed builder's pid, now reused by us
            out.append(p)
    return out


def build_dir(final: Path, write: Callable[[Path], None]) -> None:
    """Build a directory under a temporary name with ``write(tmp)``, then rename
    it to ``final``. If another process renamed its own copy into place first
    (a concurrent run building the same cache), ours is dropped: theirs is as good.

    Nothing is left behind: the temporary directory is removed when ``write``
    raises (or is interrupted), and the leftovers of builders of ``final`` that
    were killed are removed before this one starts."""
    final = Path(final)
    for stale in _stale_builds(final):
        shutil.rmtree(stale, ignore_errors=True)  # ignore: a second cleaner may be removing it too
    tmp = _tmp_name(final)
    try:
        write(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        os.replace(tmp, final)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not final.is_dir():  # not a lost race: the rename itself failed
            raise
