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
"""
from __future__ import annotations

import datetime
import json
import os
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


def run_stamp() -> datetime.datetime:
    """Rank 0's start time, the same in every process of this launch (and its restarts)."""
    return datetime.datetime.fromisoformat(_agree("stamp", lambda: datetime.datetime.now().isoformat()))


CREATED_PARENTS: list[Path] = []  # folders new_dir created above run directories, outermost first


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
    import sys

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
