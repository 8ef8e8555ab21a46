"""Which precision to train in, decided from your model's own numbers: ``python -m mptrain.advise``.

    python -m mptrain.advise [train.py's overrides...] [--steps N] [--budget-gib G] [--world W] [--tp T]
                             [--replicate R]
                             [--target cpu|v100|a100|a10g|l4|l40s|h100|h100-pcie|h200|b200] [--confirm K]
                             [--seeds S] [--lab RECIPE,RECIPE,...]
    python -m mptrain.advise model=gpt-mini --target h100 --budget-gib 40
    python -m mptrain.advise model=gpt-mini --lab nvfp4,nvfp4_4over6,mxfp6_e2m3,mxfp6_e3m2
    torchrun --standalone --nproc_per_node=2 -m mptrain.advise parallel=fsdp --world 2
    python -m mptrain.advise model=llama-1b parallel=fsdp_tp --world 64 --tp 2 --replicate 8 --target h100

Prints its plan and a time estimate, runs a short probe of the model and data
those overrides name (``--steps``, default 30; the monitors on every few
steps; float8 linears so that every float8 recipe's casts can be measured),
then answers, each decision with its evidence and the threshold it used:
the precision, whether fp16 is safe and its initial loss scale, which linears
float8 can take (and the speed it promises on the target: a speed-up or a
slowdown), the weights and optimizer state that fit ``--budget-gib`` per
rank on ``--world`` ranks, and the risks the monitors saw (logit growth,
Adam's second moment, massive activations), each with the switch that
addresses it.

The answer goes to the console and to ``advice.md``, ``advice.json`` and
``advice.yaml`` (an experiment config) in the advise run directory
(``outputs/<date>/<time>-advise`` under the launch directory, or
``hydra.run.dir=``); the probe's own run directory is ``probe/`` inside it.
``--target``: the hardware to advise for (default: this machine: ``cpu``, or
the GPU it has). ``--confirm K`` then trains the recommendation and the
baseline (bf16; fp32 on a CPU without native bf16) for K steps each on
``--seeds S`` paired seeds (default 2: train.seed and the next ones; seed k
of both sides shares its initial weights and data order) and reports each
side's mean and spread, the loss gap with its 95% interval and p-value (a gap
inside the noise is "no measurable difference", never a loss; one seed gets
no verdict), speed (faster, slower or within noise; when the recommendation
is the baseline's configuration, the comparison measures only run-to-run
noise, and it says so) and bytes per parameter. ``--seeds`` without
``--confirm`` is refused. A SIGTERM
or Ctrl-C stops the whole command: one line says what it stopped, nothing is
claimed, exit code 0, and how to continue: rerun the same command with
``hydra.run.dir=<its advise directory>`` (the line gives the directory; a
command that named one already has it) to continue there, the seeds' finished
runs read back, the stopped one resumed. Without it, a rerun starts a new
advise in a new directory.
``--lab``: named recipes of the format lab (docs/formats.md: mxfp8, nvfp4,
nvfp4_4over6, mxfp6_e2m3, ...) the probe measures as what-ifs
beside the float8 candidates; the answer ranks them by the noise their casts
add to each linear and prints the best as a command line
(``precision=lab precision.lab.recipe=...``). Lab recipes are emulated: the
ranking is about numerics, not speed, and ``--confirm`` does not train them.
``--tp``, ``--replicate`` (or ``parallel.*`` overrides): the device mesh
of ``--world`` ranks to advise for (``dp_shard`` takes the rest). The probe
and ``--confirm`` still train on the launch's own ranks (the mesh sizes
dropped, ``hsdp``/``fsdp_tp`` read as ``fsdp``); the mesh changes the
answer: the memory per rank, whether the float8 recipe can all-gather in
float8, whether MX and NVFP4 blocks fit each linear's per-rank width, and the
advised configuration's bytes per step per mesh dimension, on paper.
The rules and their thresholds: docs/advise.md.
"""
from __future__ import annotations

from mptrain.core.usage import answer_help

answer_help(__name__, __doc__)  # --help before the imports below load torch (seconds; 20 s on a busy machine)

import os
import sys
from typing import Optional

from mptrain.advice.advisor import Advisor, Interrupted, interrupted_line, stop_advising
from mptrain.advice.command import Args
from mptrain.core.errors import ConfigError, UserError
from mptrain.core.process_exit import run_then_leave
from mptrain.core.signals import SignalHandler, handlers_kept, ignore_stop_signals
from mptrain.core.text import wants_help
from mptrain.observe.memory import mesh_overrides
from mptrain.precision.recipe import NAMED
from mptrain.run.startup import Startup

_FLAGS = {"--steps": int, "--budget-gib": float, "--world": int, "--target": str, "--confirm": int,
          "--seeds": int, "--lab": str, "--tp": int, "--replicate": int}


def lab_names(value: str) -> tuple[str, ...]:
    """``--lab``'s comma-separated named lab recipes, or ConfigError naming the unknown ones."""
    names = tuple(dict.fromkeys(n.strip() for n in value.split(",") if n.strip()))
    unknown = [n for n in names if n not in NAMED]
    if unknown or not names:
        raise ConfigError(f"--lab {value!r}: {', '.join(unknown) or 'no name'} is not a named lab recipe; give "
                          f"one or more of {', '.join(NAMED)}, separated by commas.")
    return names


def parse_args(argv: list[str]) -> Args:
    """The flags and the Hydra overrides; a bad flag is a ConfigError naming it."""
    got: dict = {}
    rest = []
    it = iter(argv)
    for a in it:
        name, eq, given = a.partition("=")
        if name not in _FLAGS:
            if a.startswith("--"):
                raise ConfigError(f"unknown flag {a}; python -m mptrain.advise takes {', '.join(_FLAGS)} "
                                  "and train.py's overrides (--help says more).")
            rest.append(a)
            continue
        value = given if eq else next(it, None)
        try:
            v = _FLAGS[name](value)
            if _FLAGS[name] is not str and not v > 0 and not (name == "--confirm" and v == 0):
                raise ValueError
        except (TypeError, ValueError):
            raise ConfigError(f"{name} needs a positive {'number' if _FLAGS[name] is float else 'whole number'} "
                              f"(got {value!r}); e.g. python -m mptrain.advise model=gpt-mini {name} "
                              f"{'cpu' if name == '--target' else 8}.") from None
        got[name[2:].replace("-", "_")] = lab_names(v) if name == "--lab" else v
    if "seeds" in got and not got.get("confirm"):
        # refused rather than ignored: a user who asks for seeds expects a comparison that would not happen
        raise ConfigError(f"--seeds {got['seeds']} does nothing without --confirm K (the seeds are those of "
                          "--confirm's runs); add e.g. --confirm 200, or drop --seeds.")
    world = got.pop("world", int(os.environ.get("WORLD_SIZE", "1")))
    rest += mesh_overrides(got.get("tp"), got.get("replicate"))
    return Args(world=world, overrides=tuple(rest), **got)


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m mptrain.advise``: the advice for ``argv``'s request; the exit code
    (0 advised or stopped by a signal, 2 a user error said in one line)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if wants_help(argv):
        print(__doc__.strip())
        return 0
    advisor: Optional[Advisor] = None
    # the launch agreement between torchrun ranks and the claimed run dirs; a signal: Interrupted
    # handlers_kept: the ignoring below ends with main(), in a test or a notebook too
    with handlers_kept(), Startup() as startup, SignalHandler(stop_advising):
        try:
            advisor = Advisor(parse_args(argv), startup)
            advisor.main()
        except UserError as e:
            startup.agreement.say_once(f"mptrain.advise: {e.one_line()}")
            return 2
        except (Interrupted, KeyboardInterrupt) as e:  # KeyboardInterrupt: a second Ctrl-C inside a step
            # exit 0, as train.py's on a signal: the user asked for the stop, and nothing is lost.
            ignore_stop_signals()  # a signal repeated now would raise again, past this line, as a traceback
            startup.agreement.say_once(interrupted_line(e, advisor))
            return 0
    return 0


if __name__ == "__main__":
    run_then_leave(main)
