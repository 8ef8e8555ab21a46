"""User errors: what a user can fix, each naming the problem and the fix.

Every error a user can act on is a :class:`UserError`. Its ``kind`` says which
part of the run refused (the configuration, the run directory, a checkpoint,
a resume, a save), and the entry points print it as one line,
``mptrain: <kind>: <message>``, with exit code 2 (``docs/outputs.md``). The
kind is part of the message on purpose: "configuration error" in front of a
full disk would send the user to the wrong place. Numerics that stop a run
are not user errors (``run/faults.py``: exit code 3).

The classes that need another layer's context (checkpoints, resume, the run
directory) subclass these where they are raised; the family is defined here,
at the bottom, so that every layer can raise and catch it.
"""
from __future__ import annotations


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
