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

import collections
import contextlib
import os
import signal
import threading
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


@contextlib.contextmanager
def stop_signals_to_other_threads():
    """Keep the kernel from handing SIGTERM and SIGINT to this thread for the block,
    for a block that waits in an uninterruptible system call (a checkpoint's fsync).

    Why: the kernel hands a process's signal to its main thread even while that
    thread waits in such a call, and keeps it pending until the call returns; a
    second SIGINT meanwhile finds one pending and is dropped, so Ctrl-C twice
    during a save would ask only to stop. With the signals blocked here, another
    thread (the prefetcher, the start-up's watchdog) takes each one at once, the
    C-level handler counts it (:class:`Deliveries`), and Python runs the handler in
    the main thread when the block's call returns, as it would have."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)

class Deliveries:
    """How many times each signal arrived, which Python's handlers cannot tell.

    Python runs a signal's handler once for every delivery that came since the
    main thread last ran a bytecode: two Ctrl-C 50 ms apart that both land in
    one long C call (an fsync of a checkpoint, a matmul on a loaded host) run
    the handler once, and a handler that stops at the second Ctrl-C never sees
    it. The C-level handler also writes each delivery's signal number to the
    process's wakeup fd (``signal.set_wakeup_fd``), one byte per delivery, before
    the Python handler runs: :meth:`take` reads them.

    While counting this holds the wakeup fd. Its SIGTERM and SIGINT bytes are
    kept here: the stop signals are the counting handler's (the start-up's
    watchdog, ``run/startup.py``, ignores them while the loop holds them, and
    handing them on late could reach it after it holds them again). Any other
    signal's byte goes on to whatever held the fd before (an event loop), a
    little later (on :meth:`take` and :meth:`stop`). Main thread only (Python
    allows the wakeup fd nowhere else); elsewhere nothing is counted and
    :meth:`take` says 1."""

    def __init__(self):
        self._pipe: Optional[tuple[int, int]] = None
        self._theirs = -1  # the wakeup fd before ours (-1: none)
        self._pending: collections.Counter = collections.Counter()

    def start(self) -> "Deliveries":
        """Count from now on."""
        if threading.current_thread() is not threading.main_thread():
            return self
        read_end, write_end = os.pipe()
        os.set_blocking(read_end, False)
        os.set_blocking(write_end, False)  # the C-level handler must never block
        self._theirs = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        self._pipe = (read_end, write_end)
        _counting.append(self)
        return self

    def take(self, signum: int) -> int:
        """How many times ``signum`` arrived since the last :meth:`take` of it; at
        least 1, for the handler that calls this was called for one."""
        self._drain()
        return max(1, self._pending.pop(int(signum), 0))

    def _drain(self) -> None:
        if self._pipe is None:
            return
        while True:
            try:
                data = os.read(self._pipe[0], 512)
            except (BlockingIOError, InterruptedError):
                break
            if not data:
                break
            self._pending.update(data)
            others = bytes(b for b in data if b not in STOP_SIGNALS)
            if others and self._theirs != -1:
                with contextlib.suppress(OSError):  # theirs full or closed: as the C-level handler does
                    os.write(self._theirs, others)

    def stop(self) -> None:
        """Give the wakeup fd back (unless someone took it after us: theirs stays)."""
        if self._pipe is None:
            return
        self._drain()
        with contextlib.suppress(ValueError):
            current = signal.set_wakeup_fd(-1)
            signal.set_wakeup_fd(self._theirs if current == self._pipe[1] else current)
        self._close()

    def _close(self) -> None:
        for fd in self._pipe or ():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._pipe = None
        with contextlib.suppress(ValueError):
            _counting.remove(self)


_counting: list[Deliveries] = []
"""The counts running in this process: a forked child gives their wakeup fd up (its
signals are its own, and must not be counted as its parent's)."""


def _forget_counts_in_child() -> None:
    for count in list(_counting):
        with contextlib.suppress(ValueError):
            signal.set_wakeup_fd(-1)
        count._close()


os.register_at_fork(after_in_child=_forget_counts_in_child)
