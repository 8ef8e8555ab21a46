"""SIGTERM and SIGINT taken by one handler until they are given back.

Three parts of mptrain take the stop signals for a while: the start-up (a
signal before training undoes the launch), the loop (a signal asks the run to
checkpoint and stop) and the advisor (a signal stops the whole command). Each
takes both signals, acts in its own way, and gives the old handlers back;
:class:`SignalHandler` is the taking and giving back, the action is theirs.

What a signal that comes *again* does is decided here too, once for every
command (:func:`stop_exit_code`, :class:`Stopped`, :func:`end_on_first_signal`):
a repeated SIGTERM asks for nothing new (a scheduler sends it to every process
of a job, so a rank often gets two), a second SIGINT (Ctrl-C twice) stops at
once; either way the command ends with one line and exit code 128 + the
signal's number, never a traceback.
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


def stop_exit_code(signum: int) -> int:
    """The exit code of a command a signal ended before it finished: 128 + the signal's
    number (130 for SIGINT, 143 for SIGTERM), as a shell reports a process the signal killed."""
    return 128 + int(signum)


class Stopped(KeyboardInterrupt):
    """A stop signal ends the command where it stands. A KeyboardInterrupt (what Python
    raises for an unhandled SIGINT), so that every ``except Exception`` on the way lets
    it through and the entry point that catches KeyboardInterrupt catches this too."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = int(signum)


def signal_of(stop: KeyboardInterrupt) -> int:
    """The signal behind a KeyboardInterrupt: :class:`Stopped`'s own, else SIGINT (Python's handler)."""
    return getattr(stop, "signum", signal.SIGINT)


def stop_in(e: BaseException) -> Optional[KeyboardInterrupt]:
    """The KeyboardInterrupt (a signal's stop) that ``e`` is or carries, or None. torch's
    distributed checkpoint catches every BaseException inside a save or load and raises a
    ``CheckpointException`` holding it in ``failures`` (rank -> (exception, stack)), so a
    second Ctrl-C that lands in a save reaches the entry point wrapped."""
    if isinstance(e, KeyboardInterrupt):
        return e
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict):
        for failure in failures.values():
            inner = failure[0] if isinstance(failure, tuple) and failure else failure
            if isinstance(inner, KeyboardInterrupt):
                return inner
    return None


def end_on_first_signal() -> "SignalHandler":
    """A handler (not yet installed) for a command with nothing to save: the first SIGTERM
    or SIGINT raises :class:`Stopped` where the command stands, and every later one is
    ignored, so that a second signal cannot interrupt the command while it says its one
    line and leaves (``core/process_exit.py``'s ``run_then_leave`` installs it)."""
    seen: list[int] = []

    def stop(signum: int, frame) -> None:
        if seen:  # already on its way out: the exit must not be cut short by a traceback
            return
        seen.append(signum)
        raise Stopped(signum)

    return SignalHandler(stop)


def ignore_stop_signals() -> None:
    """Ignore SIGTERM and SIGINT from now on, for a command already leaving after a stop:
    its one line and its exit must not be cut short by the next signal. Main thread only
    (elsewhere Python changes no handler, and this does nothing)."""
    for sig in STOP_SIGNALS:
        with contextlib.suppress(ValueError):
            signal.signal(sig, signal.SIG_IGN)


@contextlib.contextmanager
def handlers_kept():
    """Give the stop signals' handlers back as they were on entry, whatever the block left
    (:func:`ignore_stop_signals` among it): for a command's ``main`` that ignores repeated
    signals while it says its line, and may run inside another program (a test, a
    notebook) that must get its own handlers back."""
    before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in before.items():
            if handler is not None:  # None: installed outside Python, which cannot put it back
                with contextlib.suppress(ValueError):  # not the main thread: nothing was changed
                    signal.signal(sig, handler)


def stopped_line(prog: str, stop: KeyboardInterrupt, what: str) -> str:
    """The one line a command says when a signal ended it: ``<prog>: stopped by <SIGNAL>
    before it finished; <what>`` (``what``: what was or was not written)."""
    return f"{prog}: stopped by {signal.Signals(signal_of(stop)).name} before it finished; {what}"


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
