"""What has to happen before Hydra composes the config, so that every rank of a
``torchrun`` job agrees on one run directory and only rank 0 writes into it.

Hydra's ``${now:...}`` is evaluated in each process at its own start-up, so two
ranks started a second apart would pick two directories. ``${mptrain_now:...}``
(used by ``configs/config.yaml`` for ``hydra.run.dir`` and
``hydra.sweep.dir``) is rank 0's clock, shared through torchrun's own
rendezvous store before any process group exists. Jobs that submitit starts
(``hydra/launcher=slurm``) inherit the launching process's time through the
environment.
"""
from __future__ import annotations

import datetime
import os
from typing import Optional

from omegaconf import OmegaConf

_STAMP: Optional[datetime.datetime] = None
_ENV = "MPTRAIN_RUN_STAMP"


def _torchrun_store():
    """A client of the key-value store torchrun's agent hosts, or None when not under torchrun."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return None  # not launched by torchrun: nobody hosts a store yet
    from torch.distributed import TCPStore

    return TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                    int(os.environ["WORLD_SIZE"]), is_master=False,
                    timeout=datetime.timedelta(minutes=5))


def run_stamp() -> datetime.datetime:
    """Rank 0's start time, the same in every process of this launch (and restart)."""
    global _STAMP
    if _STAMP is None:
        inherited = os.environ.get(_ENV)
        in_submitit = any(k in os.environ for k in ("SUBMITIT_EXECUTOR", "SUBMITIT_LOCAL_JOB_ID"))
        store = _torchrun_store()
        if inherited and in_submitit:
            # A submitit job re-resolves the sweep dir the launching process printed;
            # it must get the launcher's time, not its own.
            _STAMP = datetime.datetime.fromisoformat(inherited)
        elif store is not None:
            key = (f"mptrain/run_stamp/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/"
                   f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")
            if int(os.environ.get("RANK", "0")) == 0:
                store.set(key, datetime.datetime.now().isoformat())
            _STAMP = datetime.datetime.fromisoformat(store.get(key).decode())  # get() waits for rank 0
        else:
            _STAMP = datetime.datetime.now()
        os.environ[_ENV] = _STAMP.isoformat()  # for submitit jobs launched from this process
    return _STAMP


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("mptrain_now"):
        OmegaConf.register_new_resolver("mptrain_now", lambda fmt: run_stamp().strftime(fmt))


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

    import torch.distributed as dist

    under_torchrun = "MASTER_ADDR" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1
    if not (under_torchrun and dist.is_available() and dist.is_initialized()):
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
