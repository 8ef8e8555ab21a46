"""The stop signal of the loop: SIGTERM or SIGINT asks the run to checkpoint and exit."""
from __future__ import annotations

import signal

from mptrain.core.signals import Deliveries, SignalHandler


class StopSignal:
    """SIGTERM/SIGINT -> finish the step, checkpoint, exit 0.

    The handler only sets a flag; the trainer looks at it at step boundaries.
    A second SIGINT interrupts at once: the first puts Python's own handler back,
    and two that Python handled as one (both came during one long C call, such as
    a checkpoint's fsync on a loaded host) are told apart by :class:`Deliveries`.
    """

    def __init__(self, enabled: bool):
        self.flag = False
        self.name = ""
        # An ignored signal is taken too (leave_ignored=False): a run started as a background
        # job (its SIGINT ignored by the shell) still saves and stops on a SIGINT sent to it.
        self._handler = SignalHandler(self._handle, leave_ignored=False)
        self._deliveries = Deliveries()
        if enabled:
            self._handler.install()
            self._deliveries.start()

    def _handle(self, signum, frame) -> None:
        times = self._deliveries.take(signum)
        self.flag = True
        self.name = signal.Signals(signum).name
        if signum == signal.SIGINT:
            self._handler.interrupt_on_next_sigint()
            if times > 1:  # Ctrl-C twice, handled by Python as one: the second interrupts
                signal.default_int_handler(signum, frame)

    def restore(self) -> None:
        """Give the signals back as they were before the loop took them."""
        self._handler.restore()
        self._deliveries.stop()
