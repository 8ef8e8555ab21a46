"""Atomic writes: a reader (a dashboard, a resumed run, another rank) sees the
old file or the new one, never half of either.

Each helper writes under a temporary name beside the target and renames it
into place; ``os.replace`` is atomic within one filesystem, and the temporary
file sits in the same directory so it is on the same filesystem. A write that
fails removes its temporary file or directory, and :func:`build_dir` also
removes what builders that were killed left behind.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
from pathlib import Path
from typing import Callable


def write_text(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` (UTF-8) in one step."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")  # pid: two writers never share a temp name
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk must not also leave half a file beside the target
        raise


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
