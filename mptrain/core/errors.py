"""User errors: what a user can fix, each naming the problem and the fix.

Every error a user can act on is a :class:`UserError`. Its ``kind`` says which
part of the run refused (the configuration, the run directory, a checkpoint,
a resume, a save), and the entry points print it as one line,
``mptrain: <kind>: <message>``, with exit code 2 (``docs/outputs.md``). The
kind is part of the message on purpose: "configuration error" in front of a
full disk would send the user to the wrong place. Numerics that stop a run
are not user errors (``run/nonfinite.py``: exit code 3).

The classes that need another layer's context (checkpoints, resume, the run
directory) subclass these where they are raised; the family is defined here,
at the bottom, so that every layer can raise and catch it.
"""
from __future__ import annotations

import errno
import importlib
import importlib.util
import os
import re
from typing import Optional


class UserError(Exception):
    """Something the user can fix; the message names the problem and the fix."""

    kind = "error"
    """What refused, as the one-line report names it: ``mptrain: <kind>: <message>``."""

    def one_line(self) -> str:
        """``<kind>: <message>``, what an entry point prints after ``mptrain: ``."""
        return f"{self.kind}: {self}"


class ConfigError(UserError, ValueError):
    """A configuration that cannot run. The message names the key and the fix."""

    kind = "configuration error"


class NotEnoughMemory(UserError):
    """A run whose memory estimate per rank exceeds what its device or host has
    free, refused before anything is allocated (``train.memory_check``). The
    message gives both figures and the ways to bring the estimate down."""

    kind = "not enough memory"


class DiskError(UserError):
    """A record of the run (metrics.jsonl, TensorBoard, train.log, config.yaml,
    summary.json) that the operating system would not let it write: disk full,
    quota, file-size limit. The message names the file and what is kept (the
    rows written, the last complete checkpoint); checkpoint saves report their
    own (``save error``). Not a "configuration error": the config was fine, the
    disk was not."""

    kind = "disk error"


class MissingPackage(UserError):
    """An optional part asked for (W&B, ``data=hf``) whose package is an extra of
    the install (``pyproject.toml``) and is not installed. The message names the
    extra to install; nothing was started."""

    kind = "missing package"


def _missing(module: str, extra: str, what: str) -> MissingPackage:
    return MissingPackage(f"{what} needs the '{module}' package, which is not installed here; install it with "
                          f"pip install 'mptrain[{extra}]' (from a clone: pip install -e '.[{extra}]').")


def require_extra(module: str, extra: str, what: str) -> None:
    """Refuse ``what`` when ``module`` cannot be found, naming the extra that
    installs it. Looks without importing: a start-up check must not pay for
    importing wandb or datasets."""
    if importlib.util.find_spec(module) is None:
        raise _missing(module, extra, what)


def import_extra(module: str, extra: str, what: str):
    """``module``, imported where it is used (an extra: a run without ``what``
    never loads it), or :class:`MissingPackage` naming the extra."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise _missing(module, extra, what) from None


NO_ROOM_FIXES = {
    errno.ENOSPC: "free disk space",
    errno.EDQUOT: "free space within your disk quota",
    errno.EFBIG: "raise the file-size limit (ulimit -f) or write the run to a filesystem that takes larger files",
}
"""The OS errors that mean "no room for this write", each with the fix to name."""

_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def os_error_of(e: BaseException) -> Optional[OSError]:
    """``e`` as the OS error it is, or None. The libraries written in Rust
    (safetensors, tokenizers) raise their own exception types, or a plain
    ``Exception``, with the OS error only in the text ("... (os error 28)"): that
    one is rebuilt as the ``OSError`` it stands for (no file name: the caller knows
    what it was writing)."""
    if isinstance(e, OSError):
        return e
    code = _RUST_OS_ERROR.search(str(e))
    return OSError(int(code[1]), os.strerror(int(code[1]))) if code else None
