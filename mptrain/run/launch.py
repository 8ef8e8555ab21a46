"""A launch: the command line, the process's start-up, Hydra, the run; its outcome as an exit code.

:func:`launch` is what ``python train.py`` (``mptrain/train.py``) and ``python -m
mptrain.audit`` run: the command line checked before Hydra (or torch) does any
work, the process's start-up (``run/startup.py``: the run directory agreed
between the ranks, the stop before training, Hydra's error mode), Hydra's
composition with the configs of ``mptrain/configs/``, then
``mptrain.run.trainer.run``. It returns the exit code (0 finished or
preempted, 2 a user error said in one line, 3 numerics stopped the run); the
entry point ends the process with it.
"""
from __future__ import annotations

import sys
from typing import Optional

import hydra
from hydra.errors import HydraException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from mptrain.config.checks import CONFIG_DIR, composition_error, expand_shorthands
from mptrain.core.errors import NO_ROOM_FIXES, DiskError, UserError
from mptrain.run.startup import RunRefused, Startup
from mptrain.run.nonfinite import NonFiniteError
from mptrain.run.trainer import run


class RunExit(SystemExit):
    """The run's exit code, carried out of Hydra to :func:`launch`. A SystemExit,
    as the task's ``sys.exit`` was: Hydra lets it through (it records an
    Exception as a failed job and goes on), so a multirun stops at the job
    that met the error, and in a submitit job's process it ends the job with
    that code."""


class Task:
    """Hydra's task function: run the composed config, its errors as exit codes.

    An object rather than a function so that it carries the process's start-up
    object, and so that a submitit job (``hydra/launcher=slurm``) can start from
    it: submitit pickles the task into each job's new process, where
    unpickling it (:meth:`__reduce__`) begins that process's own start-up (the
    resolvers come with Hydra's job state, see ``Startup.register_resolvers``)."""

    def __init__(self, startup: Startup):
        self.startup = startup

    def __call__(self, cfg: DictConfig) -> None:
        """Hydra calls this once per job with the composed config: composition is over, the run starts."""
        self.startup.hydra_errors.give_back()
        try:
            run(cfg)
        except UserError as e:
            # One clear message, no traceback: the problem is the user's to fix, not
            # the code's; its kind (configuration, run directory, checkpoint, save...)
            # says where to look. Under torchrun, once for all the ranks that meet it.
            self.startup.agreement.say_once(f"mptrain: {e.one_line()}")
            raise RunExit(2) from None
        except NonFiniteError as e:
            self.startup.agreement.say_once(f"mptrain: training stopped: {e}")
            raise RunExit(3) from None

    def __reduce__(self):
        """Pickled as "make the task anew": the start-up object (signals, threads, a store client) stays here."""
        return (_task_in_job, ())


def _task_in_job() -> Task:
    """The task, unpickled in a submitit job's process: that process's start-up."""
    return Task(Startup.begin())


def launch(argv: list[str], startup: Optional[Startup] = None) -> int:
    """Check ``argv`` (``train.py``'s overrides), run Hydra on it, and return the
    exit code; ``startup`` is the process's when the caller began it already."""
    startup = startup or Startup.begin()
    try:
        argv = expand_shorthands(argv)
        refused = startup.check_command_line(argv)
        if refused is not None:
            return refused
        sys.argv[1:] = argv + startup.rank_overrides()  # Hydra reads its command line from sys.argv
        startup.stop.install()  # until training starts, a SIGTERM leaves the run directory as it was
        startup.register_resolvers()
        startup.hydra_errors.raise_while_composing()
        return _run_hydra(startup)
    finally:
        startup.close()


def _run_hydra(startup: Startup) -> int:
    """Hydra's composition and the task; every way out of it as an exit code."""
    try:
        hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")(Task(startup))()
        return 0
    except SystemExit as e:  # the task (RunExit) and Hydra itself (--help, ...) end through here
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
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
