"""What has to happen before Hydra composes the config, so that every rank of a
``torchrun`` job agrees on one run directory and only rank 0 writes into it.

Hydra's ``${now:...}`` is evaluated in each process at its own start-up, so two
ranks started a second apart would pick two directories. ``${mptrain_now:...}``
is rank 0's clock, and ``${mptrain_new_dir:<path>}`` (used by
``configs/config.yaml`` for the default ``hydra.run.dir`` and
``hydra.sweep.dir``) is a directory rank 0 has just created for this launch
alone: ``<path>``, or ``<path>-2``, ``-3``, ... when another launch created that
one first, so two launches in the same second never share a directory. Both are
shared with the other ranks through torchrun's own rendezvous store before any
process group exists. Jobs that submitit starts (``hydra/launcher=slurm``)
inherit the launching process's values through the environment.

The same store lets the ranks say a line once (:func:`say_once`: every rank
hits the same configuration error), and :func:`stop_cleanly_before_training`
makes a SIGTERM or SIGINT that arrives while a run is still starting leave
the run directory as it was and exit 0.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import sys
import threading
import zlib
from pathlib import Path
from typing import Callable

from omegaconf import OmegaConf

_ENV = "MPTRAIN_LAUNCH"  # the values this launch agreed on, for submitit jobs it starts
_AGREED: dict[str, str] = {}
_STORE = None


def _torchrun_store():
    """A client of the key-value store torchrun's agent hosts, or None when not under torchrun."""
    global _STORE
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return None  # not launched by torchrun: nobody hosts a store yet
    if _STORE is None:
        from torch.distributed import TCPStore

        _STORE = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]), is_master=False,
                          timeout=datetime.timedelta(minutes=5))
    return _STORE


def _agree(key: str, compute: Callable[[], str]) -> str:
    """``compute()`` evaluated once, by rank 0, and the same string in every
    process of this launch. The value outlives torchrun's elastic restarts (the
    store does): a restarted job continues in the same directory, where
    ``resume=auto`` finds its checkpoints."""
    if key in _AGREED:
        return _AGREED[key]
    inherited = json.loads(os.environ.get(_ENV, "{}"))
    in_submitit = any(k in os.environ for k in ("SUBMITIT_EXECUTOR", "SUBMITIT_LOCAL_JOB_ID"))
    store = _torchrun_store()
    if in_submitit and key in inherited:
        # A submitit job re-resolves the directories the launching process printed;
        # it must get the launcher's values, not its own.
        value = inherited[key]
    elif store is not None:
        name = f"mptrain/{key}/{os.environ.get('TORCHELASTIC_RUN_ID', '')}"
        if int(os.environ.get("RANK", "0")) == 0 and not store.check([name]):
            store.set(name, compute())
        value = store.get(name).decode()  # get() waits for rank 0
    else:
        value = compute()
    _AGREED[key] = value
    os.environ[_ENV] = json.dumps({**inherited, **_AGREED})  # for submitit jobs launched from this process
    return value


def rank0_value(key: str, value: str) -> str:
    """Rank 0's ``value`` for ``key``, in every process of this torchrun launch
    (``value`` itself outside torchrun): ranks that each computed a value from
    the same files compare theirs with rank 0's. Once per key and launch."""
    store = _torchrun_store()
    if store is None:
        return value
    name = f"mptrain/value/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{key}"
    if int(os.environ.get("RANK", "0")) == 0:
        store.set(name, value)
    return store.get(name).decode()  # get() waits for rank 0


def run_stamp() -> datetime.datetime:
    """Rank 0's start time, the same in every process of this launch (and its restarts)."""
    return datetime.datetime.fromisoformat(_agree("stamp", lambda: datetime.datetime.now().isoformat()))


CREATED_PARENTS: list[Path] = []  # folders new_dir created above run directories, outermost first
CREATED_DIRS: list[Path] = []  # the directories new_dir claimed for this launch (rank 0), in order


def new_dir(path: str) -> str:
    """A directory created for this launch alone: ``path`` or, if it exists,
    the first free ``path-2``, ``path-3``, ... (``mkdir`` without ``exist_ok`` is
    the atomic claim). Rank 0 creates it; every rank gets its name."""

    def claim() -> str:
        base = Path(path)
        # Remembered so that a launch refused before training removes the empty
        # outputs/<date>/ it made, not only its run directory (rundir.Claim.undo).
        CREATED_PARENTS.extend(p for p in reversed(base.parents) if not p.exists())
        base.parent.mkdir(parents=True, exist_ok=True)
        for n in range(1, 10_000):
            candidate = base if n == 1 else base.with_name(f"{base.name}-{n}")
            try:
                candidate.mkdir()
                CREATED_DIRS.append(candidate)
                return str(candidate)
            except FileExistsError:
                continue
        raise FileExistsError(f"{path}: no free name among 10,000 suffixes")

    return _agree(f"dir:{path}", claim)


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("mptrain_now"):
        OmegaConf.register_new_resolver("mptrain_now", lambda fmt: run_stamp().strftime(fmt))
    if not OmegaConf.has_resolver("mptrain_new_dir"):
        OmegaConf.register_new_resolver("mptrain_new_dir", new_dir)


def rank_overrides() -> list[str]:
    """Extra Hydra overrides for ranks > 0: no ``.hydra/`` copy of the config and
    no log file in the shared run directory (rank 0 writes those)."""
    if int(os.environ.get("RANK", "0")) == 0:
        return []
    return ["hydra.output_subdir=null", "hydra/job_logging=stdout"]


def say_once(line: str) -> None:
    """Print ``line`` on stderr once per launch. Under torchrun every rank that
    meets the same error (a configuration the world size rules out, a
    non-finite step the ranks agreed on) would print it; the first rank to
    claim the line in torchrun's store prints it, the others stay silent. A
    line that differs between ranks is printed by each."""
    store = _torchrun_store()
    if store is not None:
        key = f"mptrain/said/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{zlib.crc32(line.encode()):08x}"
        try:
            if store.add(key, 1) > 1:
                return
        except Exception:  # the store is gone (the launcher is stopping): better twice than never
            pass
    print(line, file=sys.stderr, flush=True)


class _Claims(dict):
    """Run-directory claims by path; remembers whether one that is gone had
    started (a multirun's finished job): this launch has then trained."""

    trained = False

    def pop(self, key, default=None):
        claim = super().pop(key, default)
        if getattr(claim, "started", False):
            self.trained = True
        return claim


LIVE_CLAIMS = _Claims()
"""The run directories this process holds, by path (``run/rundir.py`` keeps its
claims here): what a stop before training undoes. Each has ``started`` (the
run has begun writing its records) and ``undo()``."""

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_REPLACED: dict = {}  # signal -> the handler stop_cleanly_before_training replaced
_STOPPING = threading.Lock()  # the main thread's handler and the watcher: one of them undoes and exits
_OWNER = [0]  # the process that installed the handlers (a forked child inherits them, not the watcher)


def stop_cleanly_before_training() -> None:
    """From now until the run starts training, a SIGTERM or SIGINT ends this
    process at once with exit code 0, after undoing what the launch wrote: the
    run directory is removed if this launch created it (and the empty folders
    above it), or put back as it was (Hydra's ``.hydra/`` and log). Nothing
    else is lost: the run had not trained.

    Why: the loop's own handler (``run/stop.py``: finish the step, save, exit
    0) exists only once training runs; before that a signal killed the process
    where it stood, leaving ``.lock``, ``.hydra/`` and a launch's log in a run
    directory that holds no run, and a preempted start counted as a failure.
    Training has begun once the loop's handler replaced this one, or once a
    claim has started (``Claim.started``: the run writes its records); from
    then on the signal does what it did before.

    A Python signal handler runs only when the main thread is between
    bytecodes, and a rank can sit for minutes in one C++ call while starting
    (joining the process group waits for every rank, up to its timeout; a
    peer that has just exited never comes). So the signal also wakes a thread
    of ours (``signal.set_wakeup_fd``), which does the same without waiting
    for the main thread."""
    for sig in _STOP_SIGNALS:
        if signal.getsignal(sig) is signal.SIG_IGN:
            continue  # ignored on purpose (a background job's SIGINT, nohup): leave it so
        _REPLACED[sig] = signal.signal(sig, _stop_before_training)
    if not _REPLACED:
        return
    _OWNER[0] = os.getpid()
    os.register_at_fork(after_in_child=_forget_in_child)
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)  # the C-level handler must never block
    theirs = signal.set_wakeup_fd(write_end)
    if theirs != -1:  # another part of the process uses it: theirs stays, and no watcher
        signal.set_wakeup_fd(theirs)
        os.close(read_end)
        os.close(write_end)
        return
    threading.Thread(target=_watch, args=(read_end,), name="mptrain-stop-watch", daemon=True).start()


def _forget_in_child() -> None:
    """A forked child (a pool of tokenizing processes) gets the signals as they
    were: it holds no claim, and its signals must not wake the parent's watcher."""
    with contextlib.suppress(ValueError):  # (not the main thread: nothing to restore)
        signal.set_wakeup_fd(-1)
        for sig, previous in _REPLACED.items():
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)


def _watch(fd: int) -> None:
    """The watcher: each byte is a signal number the process received."""
    while data := os.read(fd, 64):
        for signum in data:
            # Ours only while our handler is installed: the loop's own replaces it.
            if signum in _REPLACED and signal.getsignal(signum) is _stop_before_training:
                _stop_if_not_started(signum)


def _stop_before_training(signum: int, frame) -> None:
    """The Python handler: stop now if training has not begun, else what the signal did before."""
    _stop_if_not_started(signum)
    previous = _REPLACED.get(signum, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)  # Python's SIGINT handler: KeyboardInterrupt
        return
    signal.signal(signum, signal.SIG_DFL)  # (an ignored signal was never replaced)
    os.kill(os.getpid(), signum)  # ended by the signal, as it was without this handler


def _stop_if_not_started(signum: int) -> None:
    """Undo this launch's writes and exit 0, unless a claim has started (then return)."""
    claims = list(LIVE_CLAIMS.values())
    if os.getpid() != _OWNER[0] or any(c.started for c in claims):  # training has begun: its records stay
        return
    with _STOPPING:  # the other caller, if any, waits here for the exit
        for claim in claims:
            with contextlib.suppress(Exception):
                claim.undo()
        if LIVE_CLAIMS.trained:  # a multirun whose earlier jobs trained: this job's start is undone,
            return  # and the launch ends as a signal ended it before (it is not "nothing written")
        # A directory new_dir made but no run claimed yet (Hydra still composing) is empty.
        for folder in [*reversed(CREATED_DIRS), *reversed(CREATED_PARENTS)]:
            with contextlib.suppress(OSError):
                folder.rmdir()
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:  # under torchrun its launcher says what happened
            os.write(2, f"mptrain: stopped by {signal.Signals(signum).name} before training started: nothing "
                        f"was written, the run directory is as it was; rerun the same command to launch it again.\n".encode())
        os._exit(0)  # at once: whatever the process was doing had not produced anything to keep


def exit_process(code: int) -> None:
    """End this process with ``code``. A rank of a multi-process torchrun job
    leaves through ``os._exit`` after an explicit clean-up.

    Why: gloo's worker threads release each finished collective's work object
    themselves, and releasing it drops Python references, which needs the GIL.
    If the main thread has already reached interpreter finalization (it
    returns from the last barrier and exits at once), that thread cannot take
    the GIL, and CPython ends it with a forced unwind that C++ turns into
    ``std::terminate``: "terminate called without an active exception",
    SIGABRT, and torchrun reports the whole (finished, saved) job as failed.
    Seen about once in 30 runs on a loaded 2-core machine. Skipping
    finalization removes the window; everything it would have done is done
    here first (group destroyed, W&B and log handlers closed, streams flushed).
    """
    under_torchrun = "MASTER_ADDR" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1
    if not under_torchrun or "torch.distributed" not in sys.modules:  # no group can exist: skip torch's import
        sys.exit(code)
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        sys.exit(code)
    import logging

    try:
        if code == 0:
            # After a failure a peer may still sit in a collective; leaving without
            # the clean-up lets torchrun stop the job instead of hanging it.
            dist.destroy_process_group()
    finally:
        if "wandb" in sys.modules:
            try:
                sys.modules["wandb"].teardown()
            except Exception:  # nothing to tear down, or an old wandb: the runs are already finished
                pass
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


# Registered on import, as the schema is: train.py imports this module before Hydra
# composes, and Hydra resolves hydra.run.dir / hydra.sweep.dir with these.
register_resolvers()
