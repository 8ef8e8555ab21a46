"""Train: ``python train.py [overrides]`` in a checkout, ``python -m mptrain.train [overrides]``
wherever mptrain is installed, ``torchrun ... train.py [overrides]`` on several ranks.

    python train.py model=gpt-nano precision=bf16
    python train.py -m precision=fp32,bf16      # a Hydra multirun
    torchrun --standalone --nproc_per_node=2 train.py parallel=fsdp

The launch itself (command line, start-up, Hydra, the run) is ``run/launch.py``'s;
this entry point ends the process with its exit code (:func:`exit_process`).
"""
from __future__ import annotations

import os
import sys
from typing import NoReturn, Optional

from mptrain.core.process_exit import leave
from mptrain.run.startup import Startup

if __name__ == "__main__":
    from mptrain.run.help import asks_hydra_help, hydra_help

    if asks_hydra_help(sys.argv[1:]):  # Hydra's usage needs the configs, not torch (20 s to import when busy)
        sys.exit(hydra_help(sys.argv[1:], Startup()))

from mptrain.run.launch import launch  # noqa: E402  (loads torch)


def exit_process(code: int) -> NoReturn:
    """End this process with ``code`` through :func:`mptrain.core.process_exit.leave`
    (Python's exit without the interpreter's teardown, as every mptrain command ends).
    A torchrun rank whose process group is live destroys it first if it succeeded,
    and leaves without the ``atexit`` handlers.

    On a rank of a multi-process torchrun job, the teardown is a hazard as well as slow:
    gloo's worker threads release each finished collective's work object
    themselves, and releasing it drops Python references, which needs the GIL.
    If the main thread has already reached interpreter finalization (it
    returns from the last barrier and exits at once), that thread cannot take
    the GIL, and CPython ends it with a forced unwind that C++ turns into
    ``std::terminate``: "terminate called without an active exception",
    SIGABRT, and torchrun reports the whole (finished, saved) job as failed.
    Seen about once in 30 runs on a loaded 2-core machine.
    """
    under_torchrun = "MASTER_ADDR" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1
    dist = sys.modules.get("torch.distributed") if under_torchrun else None  # no group without it: no import
    if dist is None or not (dist.is_available() and dist.is_initialized()):
        leave(code)  # (does not return)
    try:
        if code == 0:
            # After a failure a peer may still sit in a collective; leaving without
            # the clean-up (the atexit handlers included: one destroys the group)
            # lets torchrun stop the job instead of hanging it.
            dist.destroy_process_group()
    finally:
        leave(code, exit_handlers=False)


def main(argv: Optional[list[str]] = None, startup: Optional[Startup] = None) -> None:
    """``python -m mptrain.train <overrides>``: the launch, then the process's exit with its code.
    ``startup``: the process's start-up object when ``train.py`` began it already."""
    exit_process(launch(sys.argv[1:] if argv is None else list(argv), startup))  # (--help is Hydra's)


if __name__ == "__main__":
    main()
