"""A launch: the command line, the process's start-up, Hydra, the run; its outcome as an exit code.

:func:`launch` is what ``python train.py`` (``mptrain/train.py``) and ``python -m
mptrain.audit`` run: the command line checked before Hydra (or torch) does any
work, the process's start-up (``run/startup.py``: the run directory agreed
between the ranks, the stop before training, Hydra's error mode), Hydra's
composition with the configs of ``mptrain/configs/``, then
``mptrain.run.trainer.run``. It returns the exit code (0 finished or
preempted, 2 a user error said in one line, 3 numerics stopped the run, 4 a
torchrun rank whose peer is gone); the entry point ends the process with it.

A multirun (``-m``) runs every job whatever the others' outcomes, and ends with
a table of them (:class:`Sweep`, ``docs/sweeps.md``): its exit code is the worst
job's.
"""
from __future__ import annotations

import os
import re
import signal
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from mptrain.config.checks import CONFIG_DIR, composition_error, expand_shorthands
from mptrain.checkpoint.resolve import resume_line
from mptrain.core import files
from mptrain.core.errors import NO_ROOM_FIXES, DiskError, UserError
from mptrain.core.signals import ignore_stop_signals, signal_of, stop_exit_code, stop_in
from mptrain.core.text import fmt, text_table
from mptrain.run.rundir import RunDirCallback
from mptrain.run.startup import PEER_LOST, LauncherReport, RunRefused, Startup
from mptrain.run.nonfinite import NonFiniteError
from mptrain.run.trainer import run


class RunExit(SystemExit):
    """The run's exit code, carried out of Hydra to :func:`launch`. A SystemExit,
    as the task's ``sys.exit`` was: Hydra lets it through (it records an
    Exception as a failed job and goes on). A job of a sweep raises it only
    where the sweep cannot go on (:attr:`SweepJob.goes_on`); in a submitit
    job's process it ends the job with that code."""


OUTCOMES = {0: "ok", 3: "numerics stop", 2: "user error", PEER_LOST: "rank lost", 1: "crash"}
"""A job's outcome by its exit code, from the best to the worst; a sweep exits with its
worst job's code. A crash (a traceback: a bug to report) is the worst; a user error
(the job did not run what was asked) outranks a numerics stop (the job ran, and its
numbers stopped it: a finding of the sweep, not a mistake in it)."""


def _rank(code: int) -> int:
    """How bad exit code ``code`` is, by :data:`OUTCOMES`' order (an unknown code is the worst)."""
    order = list(OUTCOMES)
    return order.index(code) if code in order else len(order)


PEER_GONE = re.compile(r"Connection (reset|closed) by peer|Broken pipe")
"""What gloo's transport says when the rank at the other end of a collective has died."""


def peer_gone(e: BaseException) -> bool:
    """Whether ``e`` is a collective that failed because another rank's process is gone
    (torch raises gloo's transport errors as RuntimeError, DistBackendError among them)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and isinstance(e, RuntimeError) and bool(
        PEER_GONE.search(str(e)))


@dataclass
class SweepJob:
    """One job of a multirun that runs in this process, and how it ended."""

    num: int
    overrides: list[str]
    dir: Path
    sweep_dir: Path
    goes_on: bool
    """Whether the sweep goes on after this job fails: one process runs the jobs. Under
    torchrun every rank runs them in step, and a rank that failed alone cannot tell its
    peers, which may still be training that job: there, a failed job ends the launch."""
    code: int = 0
    said: str = ""
    signal: str = ""
    """The signal that stopped this job (SIGTERM, SIGINT), which stops the sweep too."""

    @property
    def outcome(self) -> str:
        return f"stopped ({self.signal})" if self.signal else OUTCOMES.get(self.code, f"exit {self.code}")


class Sweep:
    """The jobs of this process's multirun as they end: the table printed at the end
    and kept in ``<sweep dir>/outcomes.md`` (rewritten after each job, so a sweep
    that is killed keeps the jobs it finished), and the sweep's exit code."""

    FILE = "outcomes.md"

    def __init__(self, rank: int):
        self.rank = rank
        self.jobs: list[SweepJob] = []
        self.unwritten: Optional[str] = None  # why outcomes.md could not be written

    @staticmethod
    def current() -> Optional[SweepJob]:
        """The job Hydra is running, when it is a job of a multirun run in this process
        (Hydra's basic launcher); None for a single run, or a submitit job's process,
        whose outcome is its own exit code."""
        hc = HydraConfig.get()
        if hc.mode != RunMode.MULTIRUN or not str(hc.launcher.get("_target_", "")).endswith(".BasicLauncher"):
            return None
        return SweepJob(int(hc.job.num), [str(o) for o in hc.overrides.task], Path(hc.runtime.output_dir),
                        Path(str(hc.sweep.dir)), goes_on=int(os.environ.get("WORLD_SIZE", "1")) <= 1)

    def ended(self, job: SweepJob, code: int, said: str) -> None:
        """Record ``job``'s outcome and rewrite the table in the sweep directory (rank 0)."""
        job.code, job.said = code, said
        self.jobs.append(job)
        if self.rank != 0:
            return
        head, rows = self.table()
        text = "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
                           *("| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows)])
        try:
            files.write_text(job.sweep_dir / self.FILE, text + "\n")
            self.unwritten = None
        except OSError as e:  # a full disk ends no sweep: the table is printed at the end all the same
            self.unwritten = f"{job.sweep_dir / self.FILE} could not be written: {e.strerror}"

    def table(self) -> tuple[list[str], list[list[str]]]:
        """Head and rows: job number, the overrides that differ between the jobs, outcome, code, line."""
        pairs = [dict(o.split("=", 1) for o in j.overrides if "=" in o) for j in self.jobs]
        varying = {k for p in pairs for k in p if any(q.get(k) != p[k] for q in pairs)}
        rows = []
        for job in self.jobs:
            shown = [o for o in job.overrides if o.split("=", 1)[0] in varying] or job.overrides
            said = job.said
            if job.code and not job.dir.exists():
                said += (" Its" if said.endswith(".") else "; its") + " directory was removed (nothing had been trained)"
            rows.append([str(job.num), " ".join(shown), job.outcome,
                         str(job.code), said])
        return ["job", "overrides", "outcome", "exit code", "what happened"], rows

    def finish(self, code: int) -> int:
        """The launch's exit code: the worst job's in a sweep (``code`` otherwise), after
        the table and a summary line (rank 0)."""
        if not self.jobs:
            return code
        worst = max([code, *(j.code for j in self.jobs)], key=_rank)
        if self.rank != 0:
            return worst
        last, sweep_dir = self.jobs[-1], self.jobs[-1].sweep_dir
        counts: dict[str, int] = {}
        for job in self.jobs:
            counts[job.outcome] = counts.get(job.outcome, 0) + 1
        lines = ["", *text_table(*self.table())]
        if last.signal:
            lines.append(f"the sweep stopped at job {last.num}: {last.signal} asked the command to stop; the later "
                         f"jobs did not run (job {last.num} continues with its own command and "
                         f"hydra.run.dir={last.dir})")
        elif last.code and not last.goes_on:
            lines.append(f"the sweep stopped at job {last.num}: under torchrun every rank runs the jobs in step, "
                         "so a failed job ends the launch; the later jobs did not run")
        lines.append(f"sweep {sweep_dir}: {len(self.jobs)} jobs: "
                     f"{', '.join(f'{n} {o}' for o, n in counts.items())}; exit code {worst}"
                     + (" (the worst outcome)" if worst else ""))
        lines.append(self.unwritten or f"(this table is also in {sweep_dir / self.FILE})")
        print("\n".join(lines), flush=True)
        return worst


class Task:
    """Hydra's task function: run the composed config, its errors as exit codes.

    An object rather than a function so that it carries the process's start-up
    object and the sweep's outcomes, and so that a submitit job
    (``hydra/launcher=slurm``) can start from it: submitit pickles the task into
    each job's new process, where unpickling it (:meth:`__reduce__`) begins that
    process's own start-up (the resolvers come with Hydra's job state, see
    ``Startup.register_resolvers``)."""

    def __init__(self, startup: Startup):
        self.startup = startup
        self.sweep = Sweep(startup.rank)
        self.run_dir: Optional[Path] = None  # the job's run directory, once Hydra has chosen it

    def __call__(self, cfg: DictConfig) -> None:
        """Hydra calls this once per job with the composed config: composition is over, the run starts."""
        self.startup.hydra_errors.give_back()
        job = Sweep.current()
        self.run_dir = Path(HydraConfig.get().runtime.output_dir)
        LauncherReport.from_env().note_run_dir(self.run_dir)
        code, said, signal = self._run(cfg, in_sweep=job is not None)
        if job is not None:
            job.signal = signal
            self.sweep.ended(job, code, said)
        if (code or signal) and not (job is not None and job.goes_on and not signal):
            # a signal asked the whole command to stop: the job saved its checkpoint, no later job starts
            raise RunExit(code)

    def _run(self, cfg: DictConfig, in_sweep: bool) -> tuple[int, str, str]:
        """Run ``cfg``: the exit code, the line said about it, and the signal that stopped
        it early ("" when none did; ``train.stop_after`` is a planned stop, not a signal)."""
        try:
            summary = run(cfg, claims=self.startup.claims)
        except UserError as e:
            # One clear message, no traceback: the problem is the user's to fix, not
            # the code's; its kind (configuration, run directory, checkpoint, save...)
            # says where to look. Under torchrun, once for all the ranks that meet it.
            return *self._say(2, e.one_line()), ""
        except NonFiniteError as e:
            return *self._say(3, f"training stopped: {e}"), ""
        except Exception as e:
            if peer_gone(e):
                return *self._peer_lost(e), ""
            if not in_sweep:
                raise  # Hydra reports it (a single run, or a submitit job)
            traceback.print_exc()  # a bug: its traceback, and the sweep's other jobs still run
            return 1, f"{type(e).__name__}: {e}".splitlines()[0], ""
        summary = summary if isinstance(summary, dict) else {}
        loss, stopped = summary.get("final/train_loss"), str(summary.get("stopped_early", ""))
        if stopped and not stopped.startswith("train.stop_after"):
            return 0, f"stopped by {stopped} at step {summary.get('steps')} (checkpoint saved)", stopped
        return 0, "finished" + (f", train loss {fmt(loss)}" if loss is not None else ""), ""

    def _say(self, code: int, line: str) -> tuple[int, str]:
        self.startup.agreement.say_once(f"mptrain: {line}")
        return code, line

    def _peer_lost(self, e: Exception) -> tuple[int, str]:
        """A collective failed because another rank died: that rank is the story, not this
        one's traceback (kept in train.log on rank 0). ``python -m mptrain.torchrun`` says
        which rank died of what and where the run resumes; under plain torchrun, one line."""
        line = (f"rank {self.startup.rank} stopped: a collective failed because another rank is gone "
                f"({PEER_GONE.search(str(e)).group(0)}); torchrun's report names the rank that failed first")
        if LauncherReport.from_env().folder is None:
            print(f"mptrain: {line}", file=sys.stderr, flush=True)
        return PEER_LOST, line

    def stopped_at_once(self, stop: KeyboardInterrupt) -> int:
        """A signal ended the launch where it stood (a second SIGINT, a Ctrl-C twice, which
        the loop lets interrupt the step): one line naming the signal and where the run
        resumes, said by rank 0 (none under ``python -m mptrain.torchrun``, whose own line
        says it for the job), and exit code 128 + the signal's number. Later signals are
        ignored, so that this line and the exit go through."""
        ignore_stop_signals()
        signum = signal_of(stop)
        if self.startup.rank == 0 and LauncherReport.from_env().folder is None:
            where = resume_line(self.run_dir) if self.run_dir is not None else "nothing was trained"
            print(f"mptrain: stopped at once by {signal.Signals(signum).name}: the step in progress was not saved "
                  f"(nothing saved before it is lost); {where}", file=sys.stderr, flush=True)
        return stop_exit_code(signum)

    def __reduce__(self):
        """Pickled as "make the task anew": the start-up object (signals, threads, a store client) stays here."""
        return (_task_in_job, ())


def _task_in_job() -> Task:
    """The task, unpickled in a submitit job's process: that process's start-up."""
    return Task(Startup())


def launch(argv: list[str], startup: Optional[Startup] = None) -> int:
    """Check ``argv`` (``train.py``'s overrides), run Hydra on it, and return the
    exit code; ``startup`` is the process's when the caller began it already."""
    startup = startup or Startup()
    try:
        argv = expand_shorthands(argv)
        refused = startup.check_command_line(argv)
        if refused is not None:
            return refused
        sys.argv[1:] = argv + startup.rank_overrides()  # Hydra reads its command line from sys.argv
        startup.stop.install()  # until training starts, a SIGTERM leaves the run directory as it was
        startup.register_resolvers()
        startup.hydra_errors.raise_while_composing()
        code = _run_hydra(startup)
        if code == 2:  # refused before training: what a rank above 0 made goes, if still empty
            startup.claims.remove_made()
        return code
    finally:
        startup.close()


def _run_hydra(startup: Startup) -> int:
    """Hydra's composition and the task; every way out of it as an exit code."""
    task = Task(startup)
    try:
        with RunDirCallback.lent(startup.claims):  # Hydra makes the callback itself: it cannot be handed them
            hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")(task)()
        return task.sweep.finish(0)
    except SystemExit as e:  # the task (RunExit) and Hydra itself (--help, ...) end through here
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        return task.sweep.finish(e.code if isinstance(e.code, int) else (0 if e.code is None else 1))
    except RunRefused as e:  # the run directory, refused in Hydra's on_run_start (rank 0)
        return startup.refuse(e.error)
    except (HydraException, OmegaConfBaseException) as e:
        if not startup.hydra_errors.composing:
            raise  # the task had started, or the user asked for Hydra's full error
        return startup.refuse(composition_error(e))
    except OSError as e:
        if not startup.hydra_errors.composing or e.errno not in NO_ROOM_FIXES:
            raise
        # Hydra's own writes before the task (.hydra/*.yaml): nothing of the run was written yet, so the
        # launch is undone as a refused one is (a new directory removed, an existing one put back).
        where = ", ".join(str(d) for d in startup.undo_unstarted()) or "the run directory"
        return startup.refuse(DiskError(f"Hydra could not write its .hydra/ files in {where}: {e.strerror}; "
                                        f"{NO_ROOM_FIXES[e.errno]}, then run the command again (nothing was "
                                        "trained, and the directory is as it was)."))
    except BaseException as e:  # a signal the loop lets interrupt (Ctrl-C twice): one line, not a traceback
        stop = stop_in(e)  # (it may come wrapped by torch's checkpoint save it landed in)
        if stop is None:
            raise
        return task.stopped_at_once(stop)
