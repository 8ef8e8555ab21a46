"""Entry point: ``python train.py [overrides]`` or ``torchrun ... train.py [overrides]``.

A thin script over the package's entry point, ``mptrain/train.py`` (``python -m
mptrain.train`` where mptrain is installed). The command line is checked here
first, with modules that do not load torch, so that a mistyped key is answered
at once rather than after torch's few seconds of import.
"""
import sys

from mptrain.run.startup import Startup

if __name__ == "__main__":
    startup = Startup()  # the process's start-up state (run/startup.py), handed on to the launch and the run
    refused = startup.check_command_line(sys.argv[1:])
    if refused is not None:
        sys.exit(refused)
    from mptrain.run.help import asks_hydra_help, hydra_help

    if asks_hydra_help(sys.argv[1:]):  # Hydra's usage needs the configs, not torch
        sys.exit(hydra_help(sys.argv[1:], startup))
    from mptrain.train import main  # loads torch: only for a command line that passed

    main(sys.argv[1:], startup)
