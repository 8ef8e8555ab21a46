"""``--help`` answered before a command loads torch.

Importing torch takes a few seconds on an idle machine and took 20 s on a busy
one, and a user who asks a command for its usage should not wait for it. So
each ``python -m mptrain.<command>`` asks here, at the top of its module and
before its heavy imports, whether its command line wants the usage:

- a command whose usage is its docstring calls :func:`answer_help`, which prints
  it and exits 0;
- a command whose usage is argparse's keeps its heavy imports behind
  ``if not usage_only():``; the parser (which needs none of them) then answers
  ``--help`` as always.

A script (``python scripts/X.py``) builds its parser before its heavy imports
and parses its command line there, so that ``--help`` is answered first. The
one-line errors and their parser (:func:`one_line_errors`, :class:`OneLineParser`)
are here, not with a command's work, so that a script can use them that early.

Nothing here imports more than the standard library, ``core/text.py`` and
``core/errors.py``.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Iterator, Optional

from mptrain.core.errors import ConfigError, UserError
from mptrain.core.text import wants_help


def usage_only(argv: Optional[list[str]] = None) -> bool:
    """Whether this process runs an mptrain command (``python -m mptrain.<command>``)
    whose command line (``argv``, else ``sys.argv[1:]``) asks for its usage: then
    modules need not load what the command's work needs. False in any other process
    (a test, a script importing mptrain), which imports everything as usual."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is None or not spec.name.startswith("mptrain."):
        return False
    return wants_help(sys.argv[1:] if argv is None else argv)


def answer_help(module_name: str, doc: Optional[str], argv: Optional[list[str]] = None) -> None:
    """For the module running as the command (``module_name`` is ``"__main__"``): when
    its command line asks for usage, print ``doc`` and exit 0 (what its ``main``
    would print for ``--help``, without its imports)."""
    if module_name == "__main__" and usage_only(argv):
        print((doc or "").strip())
        sys.exit(0)


@contextlib.contextmanager
def one_line_errors(prog: str) -> Iterator[None]:
    """User errors (:class:`~mptrain.core.errors.UserError`: config, checkpoint, request) leave as one line
    ``<prog>: <message>`` on stderr and exit status 2, as ``train.py``'s do; a
    traceback would say the code failed when the request did."""
    try:
        yield
    except UserError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        raise SystemExit(2) from None


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are a :class:`ConfigError` (one line through
    :func:`one_line_errors`, exit 2) rather than its usage text and message."""

    def error(self, message: str):
        raise ConfigError(f"{message}; see {self.prog} --help")
