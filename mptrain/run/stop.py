"""The stop signal of the loop: SIGTERM or SIGINT asks the run to checkpoint and exit."""
from __future__ import annotations

import signal


class StopSignal:
    """SIGTERM/SIGINT -> finish the step, checkpoint, exit 0.

    The handler only sets a flag; the trainer looks at it at step boundaries.
    A second SIGINT restores Python's default and interrupts at once.
    """

    def __init__(self, enabled: bool):
        self.flag = False
        self.name = ""
        self._old: dict = {}
        if enabled:
            for sig in (signal.SIGTERM, signal.SIGINT):
                try:
                    self._old[sig] = signal.signal(sig, self._handle)
                except ValueError:  # not the main thread (e.g. some launchers): no handler
                    pass

    def _handle(self, signum, frame) -> None:
        self.flag = True
        self.name = signal.Signals(signum).name
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}
