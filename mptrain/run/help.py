"""``python train.py --help`` (and ``--hydra-help``) without torch's import.

Hydra prints the usage of a Hydra app from its composed config and exits
before the task runs, so the task's imports (the trainer, torch: seconds, 20 s
on a busy machine) are not needed for it. :func:`hydra_help` runs Hydra on the
same configs, resolvers and command line as a launch (``run/launch.py``), with
a task that never runs.
"""
from __future__ import annotations

import sys

import hydra

from mptrain.config.checks import CONFIG_DIR, expand_shorthands
from mptrain.run.startup import Startup

HYDRA_HELP_FLAGS = ("--help", "-h", "--hydra-help")
"""Hydra's flags that print a usage and exit."""


def asks_hydra_help(argv: list[str]) -> bool:
    """Whether ``argv`` (train.py's command line) asks Hydra for a usage."""
    return any(a in HYDRA_HELP_FLAGS for a in argv)


def hydra_help(argv: list[str], startup: Startup) -> int:
    """Hydra's usage for ``argv``, as a launch would print it; the exit code."""
    sys.argv[1:] = expand_shorthands(argv)  # Hydra reads its command line from sys.argv
    startup.register_resolvers()
    try:
        hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")(_never)()
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 0
    return 0


def _never(cfg) -> None:
    raise AssertionError("Hydra ran the task of a usage request")
