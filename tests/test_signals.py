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
