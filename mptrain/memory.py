"""How much memory a configuration needs per rank: ``python -m mptrain.memory <overrides> [--world N]``.

    python -m mptrain.memory [train.py's overrides...] [--world N] [--tp T] [--replicate R]
                             [--per-node P] [--vocab V] [--comm]
    python -m mptrain.memory model=gpt-6.7b precision=bf16 parallel=fsdp --world 8
    python -m mptrain.memory model=llama-8b precision=bf16 parallel=fsdp_tp train.global_batch_size=64 \
        --world 64 --tp 2 --replicate 8 --comm

Prints, per rank, the bytes (GiB and bytes per parameter) of the weights,
gradients, Adam moments, Kahan buffers, gathered copies and activations of a
training step under that config: the same estimate the trainer checks before
it allocates (``train.memory_check``). With ``precision.phases`` the table is
the largest phase's, named in the header; under it each phase's total and each
switch's (both phases' weights and optimizer state at once), and which decides. A mixture of
experts (``model.family=moe``) adds its parameters against those one token uses, the
routed experts' share of the weights and what its routers keep in fp32. Under the table: what the estimate
leaves out (the framework's own memory, measured in this process; allocator
slack; transient buffers; the data), and where a run reports its measured
peak. ``--world``: the number of ranks (default 1); ``--tp``, ``--replicate``:
the mesh's tensor-parallel and replicate sizes (``parallel.tp``,
``parallel.dp_replicate``; ``dp_shard`` takes the rest), for ``parallel=fsdp``,
``hsdp`` or ``fsdp_tp`` (the config's own ``parallel.*`` sizes otherwise);
``--per-node``: ranks per node, for the sizes 0 means (default: the whole
world on one node); ``--comm``: also the communication volume of one step
per mesh dimension, on paper (``mptrain/observe/traffic.py``); ``--vocab``:
the embedding rows when ``model.vocab_size`` is unset (default 4096). The
configuration is planned as ``train.py`` plans it (``mptrain/plan/build.py``): what a run on that many ranks would refuse (a
global batch the data-parallel ranks do not divide, ...) is refused here too,
in one line. Nothing is built or allocated.
"""
from __future__ import annotations

from mptrain.core.usage import answer_help

answer_help(__name__, __doc__)  # --help before the imports below load torch (seconds; 20 s on a busy machine)

import sys

from mptrain.config.checks import compose_checked
from mptrain.config.mesh import MESH_MODES
from mptrain.core.errors import ConfigError, UserError
from mptrain.core.process_exit import run_then_leave
from mptrain.core.text import wants_help
from mptrain.observe.memory import format_table, left_out, mesh_overrides, mixture_lines
from mptrain.observe.memory_phases import phase_estimates
from mptrain.plan.build import build_plan
from mptrain.plan.plan import Launch
from mptrain.observe.traffic import format_traffic, traffic


_FLAGS = ("--world", "--vocab", "--tp", "--replicate", "--per-node")


def _parse_args(argv: list[str]) -> tuple[dict[str, int], bool, list[str]]:
    """(the numeric flags by name without dashes, ``--comm``, the Hydra
    overrides); a bad flag is a ConfigError."""
    flags: dict[str, int] = {}
    rest = []
    comm = False
    it = iter(argv)
    for a in it:
        name, eq, given = a.partition("=")
        if a == "--comm":
            comm = True
            continue
        if name not in _FLAGS:
            rest.append(a)
            continue
        value = given if eq else next(it, None)
        if value is None or not value.isdigit() or int(value) < 1:
            raise ConfigError(f"{name} needs a positive whole number (got {value!r}); "
                              f"e.g. python -m mptrain.memory model=gpt-small {name} 8.")
        flags[name[2:].replace("-", "_")] = int(value)
    return flags, comm, rest


def main(argv: list[str]) -> None:
    """``python -m mptrain.memory <overrides> [--world N] [--tp T] [--replicate R]
    [--per-node P] [--vocab V] [--comm]``: the estimate as a table. A bad
    argument is one line on stderr and exit code 2."""
    if wants_help(argv):
        print(__doc__.strip())
        return
    try:
        flags, comm, rest = _parse_args(argv)
        world = flags.get("world", 1)
        cfg = compose_checked([*rest, *mesh_overrides(flags.get("tp"), flags.get("replicate"))])
        plan = build_plan(cfg, Launch(world=world, per_node=flags.get("per_node", world)))
        vocab = flags.get("vocab") or plan.vocab.given or 4096
        phased = phase_estimates(plan, vocab)
        flows = traffic(plan, vocab) if comm else []
    except UserError as err:
        print(f"mptrain: {err.one_line()}", file=sys.stderr)
        sys.exit(2)
    mesh, mode, m = plan.parallel.mesh, plan.parallel.name, plan.model
    # the table is the largest phase's: its precision and moments in the header
    e, big = phased.estimate, plan.in_phase(phased.largest + plan.phase) if plan.phases else plan
    state = big.optimizer.state if len(plan.phases) > 1 else plan.optim.state_dtype
    micro = plan.batches.micro_batch
    on = f" mesh={mesh.text()}" + (" sequence_parallel" if plan.parallel.sequence_parallel else "") \
        if mode in MESH_MODES else ""
    which = f" ({phased.names[phased.largest].split(' (')[0]} of {len(plan.phases)}, the largest)" \
        if len(plan.phases) > 1 else ""
    print(f"memory per rank: model={m.name} precision={big.precision.name}{which} "
          f"optim.state_dtype={getattr(state, 'value', state) or 'null'} "
          f"parallel={mode} world={world}{on} vocab={vocab} "
          f"micro_batch={micro}x{m.block_size} tokens")
    print("\n".join(format_table(e) + mixture_lines(plan, vocab) + phased.lines()
                    + left_out(e, micro, m.block_size, vocab)))
    if comm:
        print("\n".join(format_traffic(flows, mesh)))

if __name__ == "__main__":
    run_then_leave(main, sys.argv[1:])
