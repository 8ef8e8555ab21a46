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
so a scheduler sees what the rank said. A rank that dies of a signal (``kill
-9``, the kernel's out-of-memory killer, a crash in native code) is reported in
two lines instead of the surviving ranks' gloo tracebacks and torch's report:
which rank died of which signal, and the step the run resumes from (its newest
complete checkpoint) or that none was saved yet; the launcher exits 128 + the
signal's number, as a shell reports a process killed by it. The survivors exit
4 without a word (``run/startup.py``'s ``PEER_LOST``). Any other failure is
reported as torch reports it.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Optional

from mptrain.core.usage import answer_help


def launcher_args(argv: list[str]) -> list[str]:
    """The launcher's own arguments: those before the training script (``train.py``,
    ``-m module``), whose own ``--help`` is the script's."""
    end = next((i for i, a in enumerate(argv) if a.endswith(".py") or a in ("-m", "--module", "--no-python",
                                                                                "--no_python")), len(argv))
    return argv[:end]


# --help before torch's import (seconds; 20 s on a busy machine). torchrun's own options are
# torch's: its parser needs torch, so the usage names them by reference.
answer_help(__name__, f"{__doc__}\nEvery option of torchrun is taken as torchrun takes it: `torchrun --help` "
            "lists them.", launcher_args(sys.argv[1:]))

from torch.distributed.elastic.agent.server import api as _agent  # noqa: E402
from torch.distributed.elastic.multiprocessing import api as _elastic  # noqa: E402
from torch.distributed.elastic.multiprocessing.api import SignalException  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.run import main as _torch_main

from mptrain.checkpoint.resolve import resume_line
from mptrain.core.process_exit import run_then_leave
from mptrain.core.signals import ignore_stop_signals, stop_exit_code
from mptrain.run.startup import PEER_LOST, LauncherReport

REPORTED = (2, 3)
"""Exit codes whose rank said why in one line (``docs/outputs.md``, Exit codes): passed on as they are."""

# Signal received -> signal sent to the workers.
FORWARD = {signal.SIGTERM: signal.SIGTERM, signal.SIGINT: signal.SIGINT, signal.SIGHUP: signal.SIGTERM}


class Forwarder:
    """Stands in for torch's signal handler: forwards the first stop signal to the running workers."""

    def __init__(self):
        self.context = None  # the PContext whose workers are running (None until they are spawned)
        self.forwarded = False
        self.torch_stops = False  # a signal went to torch's handler: its shutdown is the user's doing
        self.stopped_by = 0  # that signal's number
        self.repeat_said = False  # whether a repeated SIGTERM was said (once is enough)
        self.repeat_name = ""  # the repeated signal's name
        # whether the first signal's line is out: a repeat that interrupts its handler before
        # then is said after it, so the two lines come in the order the signals came
        self.first_said = False
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
        """Forward the first stop signal to the workers and let a repeated SIGTERM (or
        SIGHUP) go, said in one line; anything else raises as torch does (a second
        SIGINT, a signal while no workers run): :func:`main` says that in one line."""
        if self.forwarded and self.context is not None and FORWARD.get(signum) == signal.SIGTERM:
            # A repeat of the stop already under way (a scheduler signals every process of a job, and
            # may signal again): shutting the workers down now would cut their save short for nothing.
            if not self.repeat_said:
                self.repeat_said = True
                self.repeat_name = signal.Signals(signum).name
                if self.first_said:  # else the first signal's handler, interrupted by this one, says it after its own
                    self._say_repeat()
            return
        if self.forwarded or self.context is None or signum not in FORWARD:
            self.torch_stops = True
            self.stopped_by = signum
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
                    f"save and exit, starting ones exit at once (a second SIGINT stops them at once)\n".encode())
        self.first_said = True
        if self.repeat_said:  # a repeat that came while the workers were being signalled: said in order
            self._say_repeat()

    def _say_repeat(self) -> None:
        os.write(2, f"mptrain.torchrun: {self.repeat_name} again: the workers are already stopping and saving; "
                    f"waiting for them (a SIGINT stops them at once)\n".encode())

    def stopped_line(self, report: LauncherReport) -> str:
        """The one line for a job torch's agent shut down on a signal (after :meth:`handle` let it through)."""
        name = signal.Signals(self.stopped_by).name
        if self.forwarded:
            what = f"stopped at once by {name}: the workers were shut down without saving the step in progress"
        else:
            what = f"stopped by {name} while no workers were training (the rendezvous, or their start)"
        return f"mptrain.torchrun: {what}; {resume_line(report.run_dir())}"


class _AgentReport(logging.Filter):
    """Holds back the lines torch's agent logs when a worker fails (``failed
    (exitcode: N) local_rank: ...``, ``Sending process N closing signal SIGTERM``)
    until :func:`main` knows whether it reports the failure itself; released as they
    were otherwise. While a signal makes the agent shut the workers down, its lines
    about that (``Received N death signal``, ``Sending process N closing signal``) are
    held too, and dropped: :func:`main`'s one line says what happened."""

    HELD = ("failed (exitcode: ", "Sending process ")
    SHUTDOWN = ("Received ", "Sending process ")

    def __init__(self, forwarder: Forwarder):
        self.forwarder = forwarder
        self.held: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if self.forwarder.torch_stops:
            return not str(record.msg).startswith(self.SHUTDOWN)
        if not str(record.msg).startswith(self.HELD):
            return True
        self.held.append(record)
        return False

    def release(self, logger: logging.Logger) -> None:
        """torch reports the failure: its lines, in their order, before its ChildFailedError."""
        logger.removeFilter(self)
        for record in self.held:
            logger.handle(record)


def _secondary(failure: ProcessFailure) -> bool:
    """A rank that failed because another did: its peer was gone (PEER_LOST), or the
    agent stopped it with SIGTERM once the first failure was seen."""
    return failure.exitcode in (PEER_LOST, -signal.SIGTERM)


def root_cause(failures: dict[int, ProcessFailure]) -> tuple[int, ProcessFailure]:
    """(global rank, failure) of the rank that failed first. torch's own choice, the
    earliest timestamp, has a resolution of one second and cannot tell a rank that
    died from one that lost its peer in the same poll; those are passed over."""
    primary = {r: f for r, f in failures.items() if not _secondary(f)} or failures
    return min(primary.items(), key=lambda rf: (rf[1].timestamp, rf[0]))


def explain(failures: dict[int, ProcessFailure], report: LauncherReport) -> Optional[int]:
    """Say why the job failed in at most two lines and return the launcher's exit code,
    or None when torch's own report says it better (a crash's traceback)."""
    rank, failure = root_cause(failures)
    code = failure.exitcode
    if code in REPORTED:  # the rank said why in its one line
        return code
    if code < 0 and code != -signal.SIGTERM:
        name = failure.signal_name()
        why = " (also what the kernel's out-of-memory killer sends)" if code == -signal.SIGKILL else ""
        print(f"mptrain.torchrun: rank {rank} (pid {failure.pid}) was killed by {name}{why}; "
              f"the other ranks were stopped.\nmptrain.torchrun: {resume_line(report.run_dir())}",
              file=sys.stderr, flush=True)
        return 128 - code
    if code == PEER_LOST:  # every rank here lost a peer: the one that died ran on another node
        ranks = ", ".join(str(r) for r, f in sorted(failures.items()) if f.exitcode == PEER_LOST)
        print(f"mptrain.torchrun: rank(s) {ranks} stopped: another rank is gone (on another node, whose launcher "
              f"says why, or the network failed).\nmptrain.torchrun: {resume_line(report.run_dir())}",
              file=sys.stderr, flush=True)
        return PEER_LOST
    return None


def main(args=None) -> None:
    """``torch.distributed.run.main`` with the first stop signal forwarded to the
    workers, a rank's exit code 2 or 3 passed on as the launcher's, and a rank
    killed by a signal said in two lines (exit 128 + the signal's number)."""
    forwarder = Forwarder()
    forwarder.install()
    agent_log = logging.getLogger(_elastic.__name__)
    held = _AgentReport(forwarder)
    agent_log.addFilter(held)
    logging.getLogger(_agent.__name__).addFilter(held)  # where "Received N death signal" is logged
    with tempfile.TemporaryDirectory(prefix="mptrain-torchrun-") as folder:
        os.environ[LauncherReport.ENV] = folder  # the workers inherit it
        try:
            _torch_main(args)
        except ChildFailedError as e:
            code = None if forwarder.torch_stops else explain(e.failures, LauncherReport(Path(folder)))
            if code is None:
                held.release(agent_log)
                raise
            sys.exit(code)
        except SignalException:  # torch's agent has shut the workers down (the signal, then SIGKILL)
            ignore_stop_signals()  # the line and the exit go through whatever comes next
            print(forwarder.stopped_line(LauncherReport(Path(folder))), file=sys.stderr, flush=True)
            sys.exit(stop_exit_code(forwarder.stopped_by))


if __name__ == "__main__":
    run_then_leave(main)
