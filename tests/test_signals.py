"""The one signal-handling class (``mptrain/core/signals.py``) that the start-up, the
loop and the advisor share: it takes SIGTERM and SIGINT, leaves a signal ignored on
purpose alone (unless told not to), installs nothing outside the main thread, lets a
second SIGINT interrupt, and gives back only what it still holds. In this process,
with real signals."""
from __future__ import annotations

import os
import signal
import threading

import pytest

from mptrain.core.signals import STOP_SIGNALS, SignalHandler
from mptrain.run.stop import StopSignal


@pytest.fixture
def handlers():
    """Each test starts from the handlers a Python started from a terminal has (SIGINT:
    KeyboardInterrupt, SIGTERM: the default), whatever the suite was started with (a shell
    starts a background job with SIGINT ignored, which would hide what these tests check);
    the process's own are put back after the test whatever it did."""
    before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    start = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
    for sig, handler in start.items():
        signal.signal(sig, handler)
    yield start
    for sig, old in before.items():
        signal.signal(sig, old)


def test_it_takes_both_signals_and_gives_them_back(handlers):
    seen = []
    with SignalHandler(lambda signum, frame: seen.append(signum)) as taken:
        assert all(taken.holds(sig) for sig in STOP_SIGNALS)
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
    assert seen == [signal.SIGTERM, signal.SIGINT]
    assert {sig: signal.getsignal(sig) for sig in STOP_SIGNALS} == handlers


def test_an_ignored_signal_stays_ignored_unless_asked(handlers):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a shell starts a background job
    polite = SignalHandler(lambda *_: None).install()
    assert not polite.holds(signal.SIGINT) and polite.holds(signal.SIGTERM)
    polite.restore()
    taking = SignalHandler(lambda *_: None, leave_ignored=False).install()
    assert taking.holds(signal.SIGINT) and taking.previous(signal.SIGINT) is signal.SIG_IGN
    taking.restore()
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def test_outside_the_main_thread_nothing_is_installed(handlers):
    got = []
    thread = threading.Thread(target=lambda: got.append(SignalHandler(lambda *_: None).install()))
    thread.start()
    thread.join()
    assert got[0].replaced == {}
    assert {sig: signal.getsignal(sig) for sig in STOP_SIGNALS} == handlers


def test_a_handler_installed_on_top_stays_and_a_second_sigint_interrupts(handlers):
    outer = SignalHandler(lambda *_: None).install()
    stop = StopSignal(enabled=True)  # the loop's, on top of the outer one
    os.kill(os.getpid(), signal.SIGINT)
    assert stop.flag and stop.name == "SIGINT"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the next Ctrl-C interrupts at once
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
    outer.restore()  # the loop's handler is on top: the outer one leaves it where it is
    assert signal.getsignal(signal.SIGTERM) is not handlers[signal.SIGTERM]
    stop.restore()  # the loop gives the outer one's back, the interrupting SIGINT included
    assert signal.getsignal(signal.SIGTERM) is outer.on_signal
    assert signal.getsignal(signal.SIGINT) is outer.on_signal


def test_two_sigints_python_handles_as_one_still_interrupt(handlers):
    """Two Ctrl-C that land while the main thread is in one C call run Python's handler
    once; the loop's handler counts the deliveries (the wakeup fd) and the second one
    interrupts, as it does when they come apart. Two SIGTERMs so merged only ask to stop."""
    before_fd = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(before_fd)
    for sig, interrupts in ((signal.SIGINT, True), (signal.SIGTERM, False)):
        stop = StopSignal(enabled=True)
        # Another thread sends the signal to itself twice within one bytecode (``map`` calls
        # the C function twice), holding the GIL: both deliveries come before the main thread
        # runs another bytecode, as two do while a run's main thread waits in an fsync.
        sender = threading.Thread(target=lambda: list(map(signal.pthread_kill, [threading.get_ident()] * 2,
                                                          [sig] * 2)))
        raised = False
        try:
            sender.start()
            sender.join()
            for _ in range(1000):  # a few bytecodes: the pending handler runs
                pass
        except KeyboardInterrupt:
            raised = True
        assert stop.flag and raised is interrupts, (sig, raised)
        stop.restore()
        assert signal.set_wakeup_fd(before_fd) == before_fd  # the wakeup fd is given back


def test_a_checkpoint_fsyncs_with_the_stop_signals_left_to_other_threads(tmp_path, monkeypatch):
    """While a save waits in fsync the kernel would hold a Ctrl-C back and drop a second
    one; every fsync of a real save (DCP's files and mptrain's own) runs with SIGTERM and
    SIGINT blocked in the saving thread, so another thread takes them at once."""
    from .conftest import train

    real_fsync, blocked = os.fsync, []

    def fsync(fd):
        blocked.append(set(STOP_SIGNALS) <= signal.pthread_sigmask(signal.SIG_BLOCK, []))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    train(tmp_path / "run", "train.max_steps=2", "checkpoint.every=2")
    assert len(blocked) >= 2 and all(blocked), blocked
    assert not set(STOP_SIGNALS) & signal.pthread_sigmask(signal.SIG_BLOCK, [])  # and given back after
