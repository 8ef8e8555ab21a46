"""The advise command as its run directory records it.

What was asked (:class:`Args`), that request as one canonical command line
(:func:`command_line`), and the run directory the line belongs to
(:func:`advise_dir`): a new ``outputs/<date>/<time>-advise`` or the one
``hydra.run.dir`` names, where the same command, interrupted, continues, and
another command's unfinished run or a finished advice is refused
(:func:`refusal`). Rank 0 decides; every rank gets its answer.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from mptrain.core.errors import ConfigError, DiskError
from mptrain.run.startup import Agreement

DEFAULT_STEPS = 30
"""The probe's length when ``--steps`` is not given."""
DEFAULT_SEEDS = 2
"""``--confirm``'s paired seeds when ``--seeds`` is not given: the fewest that can tell a gap from noise."""


@dataclass
class Args:
    """One advise request: ``python -m mptrain.advise``'s flags and train.py's overrides."""

    steps: int = DEFAULT_STEPS
    """``--steps``: how many steps the probe trains."""
    budget_gib: Optional[float] = None
    """``--budget-gib``: the memory per rank the advice must fit (None: no limit)."""
    world: int = 1
    """``--world``: the ranks to advise for (the launch's own by default)."""
    target: Optional[str] = None
    """``--target``: the hardware to advise for (None: this machine)."""
    confirm: int = 0
    """``--confirm``: steps of each confirm run (0: none)."""
    seeds: int = DEFAULT_SEEDS
    """``--seeds``: paired seeds ``--confirm`` trains each side on (``train.seed`` and the next ones)."""
    overrides: tuple[str, ...] = ()
    """train.py's overrides, the mesh flags' ``parallel.*`` among them."""
    lab: tuple[str, ...] = ()
    """``--lab``: named lab recipes the probe measures as what-ifs."""
    tp: Optional[int] = None
    """``--tp``: the tensor-parallel size of the mesh advised for."""
    replicate: Optional[int] = None
    """``--replicate``: the replicate size of the mesh advised for."""


COMMAND_FILE = "command.json"
"""The advise command a run directory belongs to: a rerun of the same command continues there."""


def command_line(args: Args) -> str:
    """``args`` as one canonical command line, without ``hydra.run.dir``: what a rerun must repeat."""
    flags = [f"--steps {args.steps}", f"--world {args.world}", f"--confirm {args.confirm}",
             *([f"--seeds {args.seeds}"] if args.confirm else []),
             *([f"--tp {args.tp}"] if args.tp else []), *([f"--replicate {args.replicate}"] if args.replicate else []),
             *([f"--budget-gib {args.budget_gib:g}"] if args.budget_gib is not None else []),
             *([f"--target {args.target}"] if args.target else [])]
    return " ".join([*(o for o in args.overrides if not o.startswith("hydra.run.dir=")), *flags])


def refusal(d: Path, command: str) -> str:
    """Why ``d`` cannot take this advise command; empty when it can: a new
    directory, or one where the same command was interrupted (no advice.json)."""
    if (d / "advice.json").exists():
        return (f"{d} already holds a finished advise run (advice.json); pick another hydra.run.dir, "
                "or leave it out for a new outputs/<date>/<time>-advise.")
    try:
        recorded = json.loads((d / COMMAND_FILE).read_text())["command"]
    except (OSError, ValueError, KeyError, TypeError):
        recorded = None
    if recorded is None and (d / "probe").exists():
        return (f"{d} already holds an advise run that recorded no command (probe/, no {COMMAND_FILE}); pick "
                "another hydra.run.dir, or leave it out for a new outputs/<date>/<time>-advise.")
    if recorded is not None and recorded != command:
        return (f"{d} holds an unfinished advise run of another command (python -m mptrain.advise {recorded}); "
                "rerun that command to continue it, or pick another hydra.run.dir.")
    return ""


def advise_dir(args: Args, agreement: Agreement) -> Path:
    """The advise run's directory, chosen and created by rank 0, the same on every
    rank, with the command it belongs to recorded in it (:data:`COMMAND_FILE`)."""
    given = [o.split("=", 1)[1] for o in args.overrides if o.startswith("hydra.run.dir=")]
    command = command_line(args)
    if not given:
        stamp = agreement.stamp()
        d = Path(agreement.new_dir(f"outputs/{stamp:%Y-%m-%d}/{stamp:%H-%M-%S}-advise"))
    else:
        d = Path(given[-1])
    said = ""
    # rank 0 alone looks: another rank would find the probe/ rank 0 has just begun
    if int(os.environ.get("RANK", "0")) == 0:
        said = refusal(d, command) if given else ""
        if not said:
            try:
                d.mkdir(parents=True, exist_ok=True)
                (d / COMMAND_FILE).write_text(json.dumps({"command": command}) + "\n")
            except OSError as e:  # (marked for the other ranks: a disk error, not a configuration one)
                said = (f"disk: {d / COMMAND_FILE} could not be written: {e.strerror}; free disk space, or pick "
                        "another hydra.run.dir.")
    said = agreement.rank0_value("advise_dir", said)
    if said.startswith("disk: "):
        raise DiskError(said.removeprefix("disk: "))
    if said:
        raise ConfigError(said)
    return d
