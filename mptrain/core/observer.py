"""Work an observer does inside a training step, told apart from the step's own.

A monitor measures inside the step it watches: the float8 statistics cast a
layer's operands in a forward hook and gather a sharded weight whole, the
stability monitor folds activations into its sums. That work is not the
step's: the collective counter (``observe/comm.py``) leaves its collectives out
of the ``comm/*`` figures, and the dtype audit (``observe/audit.py``) leaves its
operators out of the table. One flag says so for both: work run inside
:func:`observing` is the observer's.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

_depth = 0  # how many observing() blocks are open: > 0 while an observer works


@contextlib.contextmanager
def observing() -> Iterator[None]:
    """Work run inside is an observer's, not the step's: the collective counter
    does not count its collectives, and a dtype audit does not record its operators."""
    global _depth
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1


def observer_at_work() -> bool:
    """Whether the work being run now is an observer's (inside :func:`observing`)."""
    return _depth > 0
