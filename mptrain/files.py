"""Atomic writes: a reader (a dashboard, a resumed run, another rank) sees the
old file or the new one, never half of either.

Each helper writes under a temporary name beside the target and renames it
into place; ``os.replace`` is atomic within one filesystem, and the temporary
file sits in the same directory so it is on the same filesystem.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable


def write_text(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` (UTF-8) in one step."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")  # pid: two writers never share a temp name
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_json(path: Path, obj) -> None:
    """``obj`` as indented JSON; values JSON cannot hold (paths, dtypes) become strings."""
    write_text(path, json.dumps(obj, indent=2, default=str) + "\n")


def build_dir(final: Path, write: Callable[[Path], None]) -> None:
    """Build a directory under a temporary name with ``write(tmp)``, then rename
    it to ``final``. If another process renamed its own copy into place first
    (a concurrent run building the same cache), ours is dropped: theirs is as good."""
    final = Path(final)
    tmp = final.with_name(f"{final.name}.tmp{os.getpid()}")
    write(tmp)
    try:
        os.replace(tmp, final)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
