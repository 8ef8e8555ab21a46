"""What a process does before its run trains, held by one object per process.

An entry point (``train.py``, ``python -m mptrain.audit``, ``python -m
mptrain.advise``) creates the process's :class:`Startup` and calls, in order,
what it needs of it; importing this module registers nothing, starts nothing
and changes no setting. It holds:

- the launch agreement (:class:`Agreement`): rank 0's start time and the run
  directory rank 0 created for this launch, the same in every rank, shared
  through torchrun's store (``distributed/store.py``) before any process group
  exists; and the two resolvers ``mptrain/configs/config.yaml`` names them by,
  ``${mptrain_now:...}`` and ``${mptrain_new_dir:...}``, registered by
  :meth:`Startup.register_resolvers` before Hydra composes;
- the run directories this process holds (:class:`Claims`: ``run/rundir.py``
  locks and releases them; a stop before training undoes them);
- Hydra's error mode while it composes (:class:`HydraErrorMode`);
- the stop before training (:class:`StopBeforeTraining`): a SIGTERM or SIGINT
  while the run is still starting leaves the run directory as it was and
  exits 0;
- the refusal of a command line (:meth:`Startup.refuse`): one line, said by
  rank 0, exit code 2.

Why one object: these used to be module globals of three files, shared by
aliasing one dict, and the resolvers were registered as a side effect of an
import. The object is handed to what needs it, never looked up: the launch's
task passes its claims to ``mptrain.run.trainer.run``, the advisor passes its
own; a run started without an entry point (a test, a script) holds its
directory in claims of its own.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import sys
import threading
import time
import zlib
from pathlib import Path
from typing import Callable, Optional

from omegaconf import OmegaConf

from mptrain.config.checks import CONFIG_DIR, check_overrides, expand_shorthands
from mptrain.core import files
from mptrain.core.errors import UserError
from mptrain.core.signals import SignalHandler
from mptrain.distributed.store import TorchrunStore, rank

LAUNCH_ENV = "MPTRAIN_LAUNCH"
"""The values a launch agreed on, as JSON in the environment, for the submitit jobs it starts."""

REFUSAL_WAIT_S = 30.0
"""How long a rank > 0 waits for rank 0 to print a refused command line's line (see :meth:`Startup.refuse`)."""

PEER_LOST = 4
"""The exit code of a torchrun rank whose collective failed because another rank's process
is gone: the rank that died is the one to report (``python -m mptrain.torchrun`` does)."""


class LauncherReport:
    """What the ranks tell ``python -m mptrain.torchrun`` for its report when one of them
    dies: the folder it names in :data:`ENV` (inherited by its workers) holds the current
    run directory, written by each node's local rank 0 when a run (or sweep job) starts.
    The launcher reads it to say where the run resumes. Without the variable (plain
    torchrun, a single process) nothing is written."""

    ENV = "MPTRAIN_TORCHRUN_DIR"
    RUN_DIR = "run_dir"

    def __init__(self, folder: Optional[Path]):
        self.folder = folder

    @classmethod
    def from_env(cls) -> "LauncherReport":
        """The launcher's folder, when this process is a worker of ``python -m mptrain.torchrun``."""
        folder = os.environ.get(cls.ENV)
        return cls(Path(folder) if folder else None)

    def note_run_dir(self, run_dir: Path) -> None:
        """Local rank 0: this is the run directory now (every rank agrees on it)."""
        if self.folder is None or int(os.environ.get("LOCAL_RANK", "0")) != 0:
            return
        with contextlib.suppress(OSError):  # the report loses a line; the run goes on
            files.write_text(self.folder / self.RUN_DIR, str(Path(run_dir).resolve()))

    def run_dir(self) -> Optional[Path]:
        """The run directory the ranks last noted, or None (none was chosen yet, or on another node)."""
        try:
            return Path((self.folder / self.RUN_DIR).read_text()) if self.folder else None
        except OSError:
            return None


class Agreement:
    """What every process of one launch must agree on before any process group
    exists: rank 0's start time and the run directories rank 0 created.

    Hydra's ``${now:...}`` is evaluated in each process at its own start-up, so
    two ranks started a second apart would pick two directories. Here rank 0
    computes each value once and torchrun's store hands it to the other ranks.
    Jobs that submitit starts (``hydra/launcher=slurm``) have no such store:
    they inherit the launching process's values through the environment
    (:data:`LAUNCH_ENV`), since they re-resolve the directories it printed."""

    def __init__(self, connect: Callable[[], Optional[TorchrunStore]] = TorchrunStore.connect):
        self._connect = connect
        self._store: Optional[TorchrunStore] = None
        self._connected = False
        self.values: dict[str, str] = {}  # key -> the agreed value, once asked for
        self.created_dirs: list[Path] = []  # the directories new_dir claimed for this launch (rank 0), in order
        self.created_parents: list[Path] = []  # folders new_dir created above them, outermost first

    def __getstate__(self) -> dict:
        """Pickled without the store's connection (a submitit job gets the resolvers, and with
        them this agreement's values, through Hydra's job state; it connects anew if it must)."""
        return {**self.__dict__, "_store": None, "_connected": False}

    @property
    def store(self) -> Optional[TorchrunStore]:
        """torchrun's store (None outside torchrun), connected on first use: it loads torch."""
        if not self._connected:
            self._connected = True
            self._store = self._connect()
        return self._store

    def agree(self, key: str, compute: Callable[[], str]) -> str:
        """``compute()`` evaluated once, by rank 0, and the same string in every
        process of this launch. The value outlives torchrun's elastic restarts
        (the store does): a restarted job continues in the same directory, where
        ``resume=auto`` finds its checkpoints."""
        if key in self.values:
            return self.values[key]
        inherited = json.loads(os.environ.get(LAUNCH_ENV, "{}"))
        in_submitit = any(k in os.environ for k in ("SUBMITIT_EXECUTOR", "SUBMITIT_LOCAL_JOB_ID"))
        if in_submitit and key in inherited:
            value = inherited[key]  # the launcher's value, not one of this job's own
        elif self.store is not None:
            value = self.store.first_value(key, compute)
        else:
            value = compute()
        self.values[key] = value
        os.environ[LAUNCH_ENV] = json.dumps({**inherited, **self.values})  # for submitit jobs launched from here
        return value

    def stamp(self) -> datetime.datetime:
        """Rank 0's start time, the same in every process of this launch (and its restarts)."""
        return datetime.datetime.fromisoformat(self.agree("stamp", lambda: datetime.datetime.now().isoformat()))

    def now(self, fmt: str) -> str:
        """``${mptrain_now:<fmt>}``: :meth:`stamp` as ``strftime`` writes it."""
        return self.stamp().strftime(fmt)

    def new_dir(self, path: str) -> str:
        """A directory created for this launch alone: ``path`` or, if it exists,
        the first free ``path-2``, ``path-3``, ... (``mkdir`` without ``exist_ok``
        is the atomic claim), so two launches in the same second never share
        one. Rank 0 creates it; every rank gets its name."""

        def claim() -> str:
            base = Path(path)
            # Remembered so that a launch refused before training removes the empty
            # outputs/<date>/ it made, not only its run directory (rundir.Claim.undo).
            self.created_parents.extend(p for p in reversed(base.parents) if not p.exists())
            base.parent.mkdir(parents=True, exist_ok=True)
            for n in range(1, 10_000):
                candidate = base if n == 1 else base.with_name(f"{base.name}-{n}")
                try:
                    candidate.mkdir()
                    self.created_dirs.append(candidate)
                    return str(candidate)
                except FileExistsError:
                    continue
            raise FileExistsError(f"{path}: no free name among 10,000 suffixes")

        return self.agree(f"dir:{path}", claim)

    def rank0_value(self, key: str, value: str) -> str:
        """Rank 0's ``value`` for ``key``, in every process of this torchrun launch
        (``value`` itself outside torchrun): ranks that each computed a value from
        the same files compare theirs with rank 0's. Once per key and launch."""
        store = self.store
        return value if store is None else store.rank0_value(key, value)

    def say_once(self, line: str) -> None:
        """Print ``line`` on stderr once per launch. Under torchrun every rank that
        meets the same error (a configuration the world size rules out, a
        non-finite step the ranks agreed on) would print it; the first rank to
        claim the line in torchrun's store prints it, the others stay silent. A
        line that differs between ranks is printed by each."""
        try:
            if self.store is not None and not self.store.claim(f"said/{zlib.crc32(line.encode()):08x}"):
                return
        except Exception:  # the store is gone (the launcher is stopping): better twice than never
            pass
        print(line, file=sys.stderr, flush=True)


class Claims(dict):
    """The run directories this process holds, by resolved path: each a
    ``rundir.Claim`` with ``started`` (the run has begun writing its records) and
    ``undo()``; what a stop before training undoes. Remembers whether a claim
    that is gone had started (a multirun's finished job): this launch has then
    trained. ``agreement``: the launch's, whose new directories (``created_dirs``)
    hold nothing older than the launch, and whose folders made above them
    (``created_parents``) go with a claim undone; a run without a launch has
    one of its own, which created nothing."""

    trained = False

    def __init__(self, agreement: Optional[Agreement] = None):
        super().__init__()
        self.agreement = agreement or Agreement()
        # A rank above 0 claims nothing, but its Hydra makes the run directory too (and the folders
        # above it), maybe after rank 0 undid a refused launch: what it found absent, innermost first.
        self.made: list[Path] = []

    def note_absent(self, run_dir: Path) -> None:
        """A rank above 0 is about to let Hydra make ``run_dir``: remember it and the
        folders above it that do not exist yet, for :meth:`remove_made`."""
        absent = [p for p in (Path(run_dir), *Path(run_dir).parents) if not p.exists()]
        self.made.extend(p for p in absent if p not in self.made)

    def remove_made(self) -> None:
        """A rank above 0 whose launch was refused (or stopped) before training: the folders
        :meth:`note_absent` found absent go again, each only while empty (``rmdir``), so
        that nothing a run wrote (rank 0's records) and no directory that existed before
        is ever removed. Without this, a rank slower than rank 0 re-made the run directory
        after rank 0 had removed it, and the refused launch left it behind, empty."""
        for folder in self.made:  # innermost first
            with contextlib.suppress(OSError):
                folder.rmdir()
        self.made = []

    def pop(self, key, default=None):
        """Release ``key``'s claim from the set, remembering whether its run had trained."""
        claim = super().pop(key, default)
        if getattr(claim, "started", False):
            self.trained = True
        return claim


class HydraErrorMode:
    """``HYDRA_FULL_ERROR`` set while Hydra composes, and only then.

    Hydra prints a composition error itself (with its search path and a hint
    about ``HYDRA_FULL_ERROR``) and exits 1, unless ``HYDRA_FULL_ERROR`` is set,
    in which case it raises. Setting it while Hydra composes lets the entry
    point put the error in mptrain's one-line form; it is given back as soon as
    the task starts, so errors of the run itself are reported by Hydra as
    before. A user's own setting is left alone."""

    VAR = "HYDRA_FULL_ERROR"

    def __init__(self):
        self.composing = False  # whether this object set the variable and holds it

    def raise_while_composing(self) -> None:
        """Have Hydra raise composition errors (for the entry point to put in one line) instead of printing them."""
        if self.VAR not in os.environ:
            os.environ[self.VAR] = "1"
            self.composing = True

    def give_back(self) -> None:
        """Give error reporting back to Hydra: composition is over."""
        if self.composing:
            os.environ.pop(self.VAR, None)
            self.composing = False


class StopBeforeTraining:
    """From :meth:`install` until the run starts training, a SIGTERM or SIGINT
    ends this process at once with exit code 0, after undoing what the launch
    wrote: the run directory is removed if this launch created it (and the empty
    folders above it), or put back as it was (Hydra's ``.hydra/`` and log).
    Nothing else is lost: the run had not trained.

    Why: the loop's own handler (``run/stop.py``: finish the step, save, exit
    0) exists only once training runs; before that a signal killed the process
    where it stood, leaving ``.lock``, ``.hydra/`` and a launch's log in a run
    directory that holds no run, and a preempted start counted as a failure.
    Training has begun once the loop's handler replaced this one, or once a
    claim has started (``Claim.started``: the run writes its records); from
    then on the signal does what it did before.

    A Python signal handler runs only when the main thread is between
    bytecodes, and a rank can sit for minutes in one C++ call while starting
    (joining the process group waits for every rank, up to its timeout; a peer
    that has just exited never comes). So the signal also wakes a thread of
    ours (``signal.set_wakeup_fd``), the watchdog, which does the same without
    waiting for the main thread. Taking and giving back the signals is
    ``core/signals.py``'s :class:`~mptrain.core.signals.SignalHandler`, as for
    the loop and the advisor; the undo, the exit and the watchdog are this
    class's."""

    def __init__(self, claims: Claims, agreement: Agreement):
        self.claims, self.agreement = claims, agreement
        self.handler = SignalHandler(self._on_signal)  # leaves a signal ignored on purpose (nohup) ignored
        self.owner = 0  # the process that installed it (a forked child inherits the handlers, not the watchdog)
        self._stopping = threading.Lock()  # the main thread's handler and the watchdog: one of them undoes and exits
        self._pipe: Optional[tuple[int, int]] = None

    def install(self) -> None:
        """Take SIGTERM and SIGINT (those not ignored on purpose) until training starts."""
        self.handler.install()
        if not self.handler.replaced:
            return
        self.owner = os.getpid()
        os.register_at_fork(after_in_child=self._forget_in_child)
        read_end, write_end = os.pipe()
        os.set_blocking(write_end, False)  # the C-level handler must never block
        theirs = signal.set_wakeup_fd(write_end)
        if theirs != -1:  # another part of the process uses it: theirs stays, and no watchdog
            signal.set_wakeup_fd(theirs)
            os.close(read_end)
            os.close(write_end)
            return
        self._pipe = (read_end, write_end)
        threading.Thread(target=self._watch, args=(read_end,), name="mptrain-stop-watch", daemon=True).start()

    def uninstall(self) -> None:
        """Give the signals back as they were, for an entry point that returns
        into a process that goes on (a test, ``python -m mptrain.audit`` called
        in-process); the watchdog ends. Main thread only, as signal handlers are."""
        if self.owner != os.getpid():
            return
        self.handler.restore()  # (the loop's handler gives ours back when it ends)
        if self._pipe is not None:
            read_end, write_end = self._pipe
            self._pipe = None
            theirs = signal.set_wakeup_fd(-1)
            if theirs != write_end:  # someone took it after us: theirs stays
                signal.set_wakeup_fd(theirs)
            os.close(write_end)  # the watchdog reads the end of the pipe and returns (it closes read_end)

    def _forget_in_child(self) -> None:
        """A forked child (a pool of tokenizing processes) gets the signals as they
        were: it holds no claim, and its signals must not wake the parent's watchdog."""
        if not self.handler.replaced:
            return
        with contextlib.suppress(ValueError):  # (not the main thread: nothing to restore)
            signal.set_wakeup_fd(-1)
        self.handler.forget()
        for fd in self._pipe or ():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._pipe = None

    def _watch(self, fd: int) -> None:
        """The watchdog: each byte is a signal number the process received."""
        try:
            while data := os.read(fd, 64):
                for signum in data:
                    # Ours only while our handler is installed: the loop's own replaces it.
                    if self.handler.holds(signum):
                        self._stop_if_not_started(signum)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _on_signal(self, signum: int, frame) -> None:
        """The Python handler: stop now if training has not begun, else what the signal did before."""
        self._stop_if_not_started(signum)
        previous = self.handler.previous(signum)
        if callable(previous):
            previous(signum, frame)  # Python's SIGINT handler: KeyboardInterrupt
            return
        signal.signal(signum, signal.SIG_DFL)  # (an ignored signal was never replaced)
        os.kill(os.getpid(), signum)  # ended by the signal, as it was without this handler

    def _stop_if_not_started(self, signum: int) -> None:
        """Undo this launch's writes and exit 0, unless a claim has started (then return)."""
        claims = list(self.claims.values())
        if os.getpid() != self.owner or any(c.started for c in claims):  # training has begun: its records stay
            return
        with self._stopping:  # the other caller, if any, waits here for the exit
            for claim in claims:
                with contextlib.suppress(Exception):
                    claim.undo()
            if self.claims.trained:  # a multirun whose earlier jobs trained: this job's start is undone,
                return  # and the launch ends as a signal ended it before (it is not "nothing written")
            # A directory new_dir made but no run claimed yet (Hydra still composing) is empty.
            for folder in [*reversed(self.agreement.created_dirs), *reversed(self.agreement.created_parents)]:
                with contextlib.suppress(OSError):
                    folder.rmdir()
            self.claims.remove_made()  # a rank above 0: what its Hydra made, if still empty
            if int(os.environ.get("WORLD_SIZE", "1")) <= 1:  # under torchrun its launcher says what happened
                os.write(2, f"mptrain: stopped by {signal.Signals(signum).name} before training started: nothing "
                            "was written, the run directory is as it was; rerun the same command to launch it "
                            "again.\n".encode())
            # os._exit, not sys.exit: this also runs in the watchdog thread, where SystemExit would end
            # only that thread, and the main thread may sit for minutes in one C++ call (a gloo barrier,
            # a tokenizer's training) that no exception interrupts. Nothing is lost by skipping Python's
            # clean-up: the process had not produced anything to keep, and what it wrote is undone above.
            os._exit(0)


class RunRefused(BaseException):
    """A run directory refused in Hydra's ``on_run_start`` (``rundir.RunDirCallback``),
    carrying the :class:`UserError` to print. A BaseException, not an Exception:
    Hydra turns a callback's Exception into a warning and goes on to write its
    files into the directory it was refused; this one reaches the entry point,
    which prints the error's one line and exits 2."""

    def __init__(self, error: UserError):
        super().__init__(str(error))
        self.error = error


class Startup:
    """One process's start-up state: the launch agreement, the claimed run
    directories, Hydra's error mode and the stop before training (see the
    module's docstring). An entry point creates it and hands it on."""

    def __init__(self, agreement: Optional[Agreement] = None):
        self.rank = rank()  # this process's global rank (0 outside torchrun)
        self.agreement = agreement or Agreement()
        self.claims = Claims(self.agreement)
        self.hydra_errors = HydraErrorMode()
        self.stop = StopBeforeTraining(self.claims, self.agreement)

    def __enter__(self) -> "Startup":
        """``with Startup() as startup:``, for an entry point that returns rather than exits."""
        return self

    def __exit__(self, *exc) -> None:
        """Close on the way out, whatever ended the block."""
        self.close()

    def close(self) -> None:
        """The entry point is done: signals and Hydra's error mode as they were."""
        self.stop.uninstall()
        self.hydra_errors.give_back()

    def register_resolvers(self) -> None:
        """``${mptrain_now:<strftime format>}`` (rank 0's start time) and
        ``${mptrain_new_dir:<path>}`` (a directory rank 0 created for this launch
        alone), which ``config.yaml`` uses for the default ``hydra.run.dir`` and
        ``hydra.sweep.dir``: called by the entry point before Hydra composes.
        Registered anew for each start-up object (OmegaConf's resolvers are
        process-wide; the newest entry point's agreement is the one in force).
        Both are methods of the agreement alone, which pickles: Hydra hands
        OmegaConf's resolvers to each submitit job with its own state, so a job
        resolves its sweep directory to the one this process created."""
        OmegaConf.register_new_resolver("mptrain_now", self.agreement.now, replace=True)
        OmegaConf.register_new_resolver("mptrain_new_dir", self.agreement.new_dir, replace=True)

    def check_command_line(self, argv: list[str]) -> Optional[int]:
        """The command line's keys, options and values checked before Hydra (or
        torch) does any work: None when they pass, else the exit code of the
        refusal (:meth:`refuse`)."""
        try:
            check_overrides(expand_shorthands(argv), CONFIG_DIR)
        except UserError as e:
            return self.refuse(e)
        return None

    def rank_overrides(self) -> list[str]:
        """Extra Hydra overrides for ranks > 0: no ``.hydra/`` copy of the config and
        no log file in the shared run directory (rank 0 writes those)."""
        return [] if self.rank == 0 else ["hydra.output_subdir=null", "hydra/job_logging=stdout"]

    def refuse(self, error: UserError) -> int:
        """A launch refused before training: its one line on stderr, said by rank 0
        alone (every rank meets the same error), and exit code 2.

        torchrun stops the whole job when its first rank exits, so a rank > 0
        must not leave before rank 0 has printed: it waits until rank 0 marks
        the line as said in torchrun's store (or :data:`REFUSAL_WAIT_S` passes,
        should rank 0 not meet the error). Without a store (ranks started by
        something other than torchrun) it gives rank 0 two seconds, as it always
        did: there is nothing to wait on."""
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # a restart's refusal is said again
        if self.rank == 0:
            print(f"mptrain: {error.one_line()}", file=sys.stderr, flush=True)
            with contextlib.suppress(Exception):  # no store, or gone: the line is out, nothing to tell
                if self.agreement.store is not None:
                    self.agreement.store.mark(f"refused/{restart}")
            return 2
        try:
            store = self.agreement.store
        except Exception:  # the launcher is stopping: rank 0 has exited
            return 2
        if store is not None:
            store.wait(f"refused/{restart}", REFUSAL_WAIT_S)
        else:
            time.sleep(2)
        return 2

    def undo_unstarted(self) -> list[Path]:
        """Undo the claims whose run never started (Hydra could not write its
        own files), as a refused launch is undone; their directories."""
        claims = [c for c in self.claims.values() if not c.started]
        for claim in claims:
            claim.undo()
        return [c.run_dir for c in claims]
