"""SIGTERM and SIGINT taken by one handler until they are given back.

Three parts of mptrain take the stop signals for a while: the start-up (a
signal before training undoes the launch), the loop (a signal asks the run to
checkpoint and stop) and the advisor (a signal stops the whole command). Each
takes both signals, acts in its own way, and gives the old handlers back;
:class:`SignalHandler` is the taking and giving back, the action is theirs.
"""
from __future__ import annotations

import contextlib
import signal
from types import FrameType
from typing import Callable, Optional, Union

Handler = Union[Callable[[int, Optional[FrameType]], object], int, None]
"""What ``signal.getsignal`` returns: a function, ``SIG_DFL``/``SIG_IGN``, or None
(a handler that Python did not install)."""

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
"""The signals that ask a command to stop: a scheduler's or ``kill``'s SIGTERM, Ctrl-C's SIGINT."""


class SignalHandler:
    """``on_signal(signum, frame)`` handles SIGTERM and SIGINT from :meth:`install`
    until :meth:`restore` (or within ``with``).

    ``leave_ignored``: a signal ignored on purpose when it is installed (a
    background job's SIGINT, ``nohup``) stays ignored. Outside the main thread
    Python allows no handler: nothing is installed there, and the process keeps
    the handlers it has. :meth:`restore` gives back only the signals whose
    handler is still one this object installed, so a handler installed on top
    of it and not yet given back is left in place."""

    def __init__(self, on_signal: Callable[[int, Optional[FrameType]], None], leave_ignored: bool = True):
        self.on_signal = on_signal
        self.leave_ignored = leave_ignored
        self.replaced: dict[int, Handler] = {}  # signal -> the handler install() replaced
        self._ours: dict[int, Handler] = {}  # signal -> the handler this object installed last

    def install(self) -> "SignalHandler":
        """Take the stop signals (see the class docstring for those left alone)."""
        for sig in STOP_SIGNALS:
            if self.leave_ignored and signal.getsignal(sig) is signal.SIG_IGN:
                continue
            try:
                self.replaced[sig] = signal.signal(sig, self.on_signal)
            except ValueError:  # not the main thread (some launchers): no handler, the process's stay
                continue
            self._ours[sig] = self.on_signal
        return self

    def holds(self, sig: int) -> bool:
        """Whether ``sig``'s handler is still the one this object installed."""
        return sig in self._ours and signal.getsignal(sig) is self._ours[sig]

    def previous(self, sig: int) -> Handler:
        """The handler :meth:`install` replaced for ``sig`` (``SIG_DFL`` for one it did not take)."""
        return self.replaced.get(sig, signal.SIG_DFL)

    def interrupt_on_next_sigint(self) -> None:
        """The next SIGINT interrupts at once (Python's KeyboardInterrupt): for a
        handler that only asked for a stop, so that a second Ctrl-C is not ignored.
        Still this object's to give back."""
        if signal.SIGINT in self._ours:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            self._ours[signal.SIGINT] = signal.default_int_handler

    def restore(self) -> None:
        """Give back the signals this object still holds, as they were before :meth:`install`."""
        for sig, previous in self.replaced.items():
            if self.holds(sig):
                with contextlib.suppress(ValueError):  # (not the main thread: it cannot change them)
                    signal.signal(sig, signal.SIG_DFL if previous is None else previous)
        self.replaced, self._ours = {}, {}

    def forget(self) -> None:
        """Every taken signal back as it was before :meth:`install`, whoever holds it
        now: for a forked child, which must not act for its parent."""
        with contextlib.suppress(ValueError):
            for sig, previous in self.replaced.items():
                signal.signal(sig, signal.SIG_DFL if previous is None else previous)
        self.replaced, self._ours = {}, {}

    def __enter__(self) -> "SignalHandler":
        """``with SignalHandler(act):`` installs it for the block."""
        return self.install()

    def __exit__(self, *exc) -> None:
        """Give the signals back, whatever ended the block."""
        self.restore()
