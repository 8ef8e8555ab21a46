"""How much memory a configuration needs per rank: ``python -m mptrain.memory <overrides> [--world N]``.

    python -m mptrain.memory [train.py's overrides...] [--world N] [--vocab V]
    python -m mptrain.memory model=gpt-6.7b precision=bf16 parallel=fsdp --world 8

Prints, per rank, the bytes (GiB and bytes per parameter) of the weights,
gradients, Adam moments, Kahan buffers, gathered copies and activations of a
training step under that config: the same estimate the trainer checks before
it allocates (``train.memory_check``). Under the table: what the estimate
leaves out (the framework's own memory, measured in this process; allocator
slack; transient buffers; the data), and where a run reports its measured
peak. ``--world``: the number of ranks
(default 1); ``--vocab``: the embedding rows when ``model.vocab_size`` is
unset (default 4096). Nothing is built or allocated.
"""
from __future__ import annotations

import sys

from mptrain.config.checks import compose_checked
from mptrain.core.errors import ConfigError, UserError
from mptrain.core.process_exit import run_then_leave
from mptrain.core.text import wants_help
from mptrain.model.families import adopt_init_from
from mptrain.observe.memory import estimate, format_table, left_out, micro_batch_of


def _parse_args(argv: list[str]) -> tuple[int, int | None, list[str]]:
    """(``--world``, ``--vocab``, the Hydra overrides); a bad flag is a ConfigError."""
    flags: dict[str, int] = {}
    rest = []
    it = iter(argv)
    for a in it:
        name, eq, given = a.partition("=")
        if name not in ("--world", "--vocab"):
            rest.append(a)
            continue
        value = given if eq else next(it, None)
        if value is None or not value.isdigit() or int(value) < 1:
            raise ConfigError(f"{name} needs a positive whole number (got {value!r}); "
                              f"e.g. python -m mptrain.memory model=gpt-small {name} 8.")
        flags[name] = int(value)
    return flags.get("--world", 1), flags.get("--vocab"), rest


def main(argv: list[str]) -> None:
    """``python -m mptrain.memory <overrides> [--world N] [--vocab V]``: the
    estimate as a table. A bad argument is one line on stderr and exit code 2."""
    if wants_help(argv):
        print(__doc__.strip())
        return
    try:
        world, vocab, rest = _parse_args(argv)
        cfg = compose_checked(rest)
        adopt_init_from(cfg.model)  # the model a run from model.init_from would build
        vocab = vocab or cfg.model.vocab_size or 4096
        e = estimate(cfg, vocab, world)
    except UserError as err:
        print(f"mptrain: {err.one_line()}", file=sys.stderr)
        sys.exit(2)
    state = cfg.optim.state_dtype
    micro = micro_batch_of(cfg, world)
    print(f"memory per rank: model={cfg.model.name} precision={cfg.precision.name} "
          f"optim.state_dtype={getattr(state, 'value', state) or 'null'} "
          f"parallel={cfg.parallel.name.value} world={world} vocab={vocab} "
          f"micro_batch={micro}x{cfg.model.block_size} tokens")
    print("\n".join(format_table(e) + left_out(e, micro, cfg.model.block_size, vocab)))


if __name__ == "__main__":
    run_then_leave(main, sys.argv[1:])
