"""How every mptrain command ends its process: Python's own exit up to the point where
it would tear the interpreter down, then ``os._exit``.

The teardown frees every module and object one by one. With torch, its compiler stack
and transformers loaded, that takes 1 to 2 s on a 2-core CPU after the command has
finished and written everything (measured 2026-12-03 on an AMD EPYC without avx512,
Python 3.11.7, torch 2.13.0: 0.8-1.0 s with torch alone, 1.9 s with transformers too,
0.06 s through ``os._exit``). Everything the exit does that a user could see (threads
finishing, ``atexit`` handlers such as W&B's and the log handlers', streams flushed) is
done here first, in Python's order.
"""
from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
from typing import Any, Callable, NoReturn

from mptrain.core.signals import end_on_first_signal, ignore_stop_signals, signal_of, stop_exit_code, stopped_line


def leave(code: Any = 0, exit_handlers: bool = True) -> NoReturn:
    """End the process as ``sys.exit(code)`` would, without the interpreter's teardown.
    ``code`` as ``sys.exit`` takes it: None is 0, an int is the status, anything else
    is printed to stderr and the status is 1. ``exit_handlers=False`` (a torchrun rank
    whose group is live, see ``mptrain.train.exit_process``) skips waiting for threads
    and the ``atexit`` handlers: W&B and the log handlers are still closed and the
    streams flushed."""
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    if exit_handlers:  # what Python waits for before atexit
        for thread in threading.enumerate():
            if thread is not threading.current_thread() and not thread.daemon:
                thread.join()
    if "wandb" in sys.modules:
        try:
            sys.modules["wandb"].teardown()
        except Exception:  # nothing to tear down, or an old wandb: its runs are already finished
            pass
    # The registered exit handlers, in the order Python would run them (private in
    # name, but the function the interpreter itself calls at exit, since 3.0).
    if exit_handlers:
        atexit._run_exitfuncs()
    logging.shutdown()  # one of those handlers too; again in case a handler logged
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


def command_name() -> str:
    """How the user called this command: ``mptrain.sample`` for ``python -m mptrain.sample``,
    else the script's file name (the one line a command says starts with it)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return spec.name if spec is not None and spec.name else os.path.basename(sys.argv[0] or "mptrain")


def run_then_leave(main: Callable[..., Any], *args: Any,
                   stopped: str = "nothing it had not finished was written; rerun the same command") -> NoReturn:
    """``sys.exit(main(*args))`` for a command's ``__main__`` block, leaving through
    :func:`leave`; a ``SystemExit`` raised inside ``main`` gives its code the same
    way. Any other exception propagates: Python prints its traceback and exits 1.

    A SIGTERM or SIGINT that ``main`` does not take itself ends the command with one
    line (``<command>: stopped by SIGTERM before it finished; <stopped>``) and exit
    code 128 + the signal's number, and the signals that follow it are ignored while it
    leaves: without this, SIGTERM ended the process without a word and SIGINT (or the
    second of two) printed a KeyboardInterrupt traceback from wherever it landed."""
    try:
        with end_on_first_signal():
            try:
                code = main(*args)
            except SystemExit as e:
                code = e.code
    except KeyboardInterrupt as e:  # Stopped, or Python's own SIGINT where main had put it back
        ignore_stop_signals()  # for good (the handler above is given back by now): the line and the exit go through
        print(stopped_line(command_name(), e, stopped), file=sys.stderr, flush=True)
        code = stop_exit_code(signal_of(e))
    leave(code)
