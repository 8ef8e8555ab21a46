"""The stop signal of the loop: SIGTERM or SIGINT asks the run to checkpoint and exit."""
from __future__ import annotations

import contextlib
import os
import signal

from mptrain.core.signals import Deliveries, SignalHandler


class StopSignal:
    """SIGTERM/SIGINT -> finish the step, checkpoint, exit 0.

    The handler only sets a flag; the trainer looks at it at step boundaries.
    A second SIGINT interrupts at once: the first puts Python's own handler back,
    and two that Python handled as one (both came during one long C call, such as
    a checkpoint's fsync on a loaded host) are told apart by :class:`Deliveries`.

    With ``announce`` (rank 0's), the first signal is acknowledged at once on stderr,
    before the step ends: a user who pressed Ctrl-C sees that it was taken and that a
    second one stops at once. Two signals the kernel merged (a standard signal does
    not queue: one sent while the first is still pending is dropped) are one request;
    the line tells the user to send the second after it.
    """

    def __init__(self, enabled: bool, announce: bool = False):
        self.flag = False
        self.name = ""
        self.announce = announce
        # An ignored signal is taken too (leave_ignored=False): a run started as a background
        # job (its SIGINT ignored by the shell) still saves and stops on a SIGINT sent to it.
        self._handler = SignalHandler(self._handle, leave_ignored=False)
        self._deliveries = Deliveries()
        if enabled:
            self._handler.install()
            self._deliveries.start()

    def _handle(self, signum, frame) -> None:
        times = self._deliveries.take(signum)
        first, self.flag = not self.flag, True
        self.name = signal.Signals(signum).name
        if first and self.announce:
            self._say(signum)
        if signum == signal.SIGINT:
            self._handler.interrupt_on_next_sigint()
            if times > 1:  # Ctrl-C twice, handled by Python as one: the second interrupts
                signal.default_int_handler(signum, frame)

    def _say(self, signum: int) -> None:
        """The acknowledgement, written to fd 2 directly: this runs between two bytecodes
        of whatever the main thread was doing, possibly inside a print to the same stream,
        whose buffer may not be entered twice."""
        again = "; Ctrl-C again stops at once, without that checkpoint" if signum == signal.SIGINT else ""
        with contextlib.suppress(OSError):  # stderr closed: the step's own lines say the rest
            os.write(2, f"mptrain: {self.name} received: the run stops after this step, with a checkpoint"
                        f"{again}\n".encode())

    def restore(self) -> None:
        """Give the signals back as they were before the loop took them."""
        self._handler.restore()
        self._deliveries.stop()
