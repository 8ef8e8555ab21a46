"""torchrun that reports a preempted-and-saved job as a success.

Why: a SIGTERM or SIGINT makes every mptrain rank finish its step, save a
checkpoint and exit 0, but plain ``torchrun`` turns the signal reaching *it*
into a ``SignalException``: its agent shuts the workers down (SIGTERM, then
SIGKILL after ``--shutdown-timeout``) and the launcher exits 1 with a
traceback, so a scheduler records a cleanly saved job as failed.

Use it exactly like torchrun, with the same arguments::

    python -m mptrain.torchrun --standalone --nproc_per_node=8 train.py parallel=fsdp

What changes, and only while workers are running:

- The first SIGTERM, SIGINT or SIGHUP reaching the launcher is forwarded to its
  own worker processes (SIGHUP as SIGTERM: the workers stop gracefully on
  SIGTERM/SIGINT only). torch starts the workers in their own sessions, so a
  terminal's Ctrl-C or a ``kill <launcher pid>`` would not reach them otherwise.
  The launcher keeps monitoring; its exit code is then the workers' outcome:
  0 when every rank saved and exited 0, torchrun's usual failure report
  otherwise. The workers take as long as their save needs (the agent's
  shutdown timeout does not apply); a scheduler bounds that with its grace
  period, and if it then SIGKILLs the launcher, the workers, already told to
  stop, still save and exit on their own.
- A second signal, or one arriving while no workers exist (during the
  rendezvous or while they are being spawned), gets torch's own behaviour:
  the agent sends it to the workers, SIGKILLs those still running after
  ``--shutdown-timeout`` and the launcher exits non-zero. So a second Ctrl-C
  (which interrupts a worker mid-step) still stops everything.
- Several nodes: each node's launcher forwards to its own workers; the ranks
  agree on stopping at the next step boundary, so one signalled node suffices.
- Workers still starting (no training step yet) exit 0 at once on the
  forwarded signal and leave the run directory as it was
  (``run/startup.py``'s ``StopBeforeTraining``).

And whatever stops the job: a rank that exits 2 (a user error) or 3 (numerics
stopped the run) has printed its one line, once for all ranks; the launcher
exits with that code, without torch's agent adding its failure report (an
error log line and a ``ChildFailedError`` traceback of some 40 lines, exit 1),
so a scheduler sees what the rank said. Any other failure is reported as
torch reports it.
"""
from __future__ import annotations

import logging
import os
import signal
import sys

from torch.distributed.elastic.multiprocessing import api as _elastic
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as _torch_main

from mptrain.core.process_exit import run_then_leave

REPORTED = (2, 3)
"""Exit codes whose rank said why in one line (``docs/outputs.md``, Exit codes): passed on as they are."""

# Signal received -> signal sent to the workers.
FORWARD = {signal.SIGTERM: signal.SIGTERM, signal.SIGINT: signal.SIGINT, signal.SIGHUP: signal.SIGTERM}


class Forwarder:
    """Stands in for torch's signal handler: forwards the first stop signal to the running workers."""

    def __init__(self):
        self.context = None  # the PContext whose workers are running (None until they are spawned)
        self.forwarded = False
        self._torch_handler = _elastic._terminate_process_handler
        self._torch_start = _elastic.PContext.start

    def install(self) -> None:
        """Route torch's elastic signal handling and worker start-up through this object."""
        # PContext.start() looks the handler up by name each time it installs it,
        # so replacing the module attribute is enough; start() itself is wrapped
        # to learn which workers are running.
        _elastic._terminate_process_handler = self.handle
        forwarder = self

        def start(context) -> None:
            # None while spawning: a signal then gets torch's behaviour, whose
            # clean-up also stops a half-spawned group (and on a restart the old workers are gone).
            forwarder.context = None
            forwarder._torch_start(context)
            forwarder.context = context

        _elastic.PContext.start = start

    def handle(self, signum: int, frame) -> None:
        """Forward the first stop signal to the workers; anything else raises as torch does."""
        if self.forwarded or self.context is None or signum not in FORWARD:
            self._torch_handler(signum, frame)  # raises SignalException
            return
        self.forwarded = True
        pids = sorted(self.context.pids().values())
        for pid in pids:
            try:
                # The worker only, not its process group: it stops at a step boundary,
                # and helpers it may have started must live until it has saved.
                os.kill(pid, FORWARD[signum])
            except ProcessLookupError:  # already exited
                pass
        name = signal.Signals(signum).name
        # os.write, not print: a handler may interrupt a print on this thread.
        os.write(2, f"mptrain.torchrun: {name} forwarded to workers {pids}; training ones finish the step, "
                    f"save and exit, starting ones exit at once (a second signal shuts them down)\n".encode())


class _ReportedFailure(logging.Filter):
    """Drops the agent's ``failed (exitcode: N) local_rank: ...`` error line for
    the exit codes in :data:`REPORTED`: the rank has already said why."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (str(record.msg).startswith("failed (exitcode: ") and args and args[0] in REPORTED)


def main(args=None) -> None:
    """``torch.distributed.run.main`` with the first stop signal forwarded to the
    workers, and a rank's exit code 2 or 3 passed on as the launcher's."""
    Forwarder().install()
    logging.getLogger(_elastic.__name__).addFilter(_ReportedFailure())
    try:
        _torch_main(args)
    except ChildFailedError as e:
        _, failure = e.get_first_failure()  # the root cause: the other ranks were stopped after it
        if failure.exitcode in REPORTED:
            sys.exit(failure.exitcode)
        raise


if __name__ == "__main__":
    run_then_leave(main)
