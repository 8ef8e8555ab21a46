"""The stop signal of the loop: SIGTERM or SIGINT asks the run to checkpoint and exit."""
from __future__ import annotations

import signal

from mptrain.core.signals import SignalHandler


class StopSignal:
    """SIGTERM/SIGINT -> finish the step, checkpoint, exit 0.

    The handler only sets a flag; the trainer looks at it at step boundaries.
    A second SIGINT restores Python's default and interrupts at once.
    """

    def __init__(self, enabled: bool):
        self.flag = False
        self.name = ""
        # An ignored signal is taken too (leave_ignored=False): a run started as a background
        # job (its SIGINT ignored by the shell) still saves and stops on a SIGINT sent to it.
        self._handler = SignalHandler(self._handle, leave_ignored=False)
        if enabled:
            self._handler.install()

    def _handle(self, signum, frame) -> None:
        self.flag = True
        self.name = signal.Signals(signum).name
        if signum == signal.SIGINT:
            self._handler.interrupt_on_next_sigint()

    def restore(self) -> None:
        """Give the signals back as they were before the loop took them."""
        self._handler.restore()
