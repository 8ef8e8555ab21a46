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


def run_then_leave(main: Callable[..., Any], *args: Any) -> NoReturn:
    """``sys.exit(main(*args))`` for a command's ``__main__`` block, leaving through
    :func:`leave`; a ``SystemExit`` raised inside ``main`` gives its code the same
    way. Any other exception propagates: Python prints its traceback and exits 1."""
    try:
        code = main(*args)
    except SystemExit as e:
        code = e.code
    leave(code)
