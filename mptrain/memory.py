"""How much memory a configuration needs per rank: ``python -m mptrain.memory <overrides> [--world N]``.

Exact for the tensors whose size is known in advance (parameters, gradients,
optimizer state: what ``tests/test_perf.py`` checks against a real step),
an estimate for activations (the per-layer count of Korthikanti et al. 2022,
"Reducing activation recomputation", scaled to the compute dtype's width) and
for FSDP's gathered copies. ``summary.json`` puts the estimate beside the
measured peak.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass
class Estimate:
    params: int
    grads: int
    optimizer: int
    gathered: int
    activations: int

    @property
    def state(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        return self.state + self.gathered + self.activations

    def rows(self) -> list[tuple[str, int]]:
        return [("parameters", self.params), ("gradients", self.grads), ("optimizer (AdamW moments)", self.optimizer),
                ("FSDP gathered copies", self.gathered), ("activations (estimate)", self.activations),
                ("total", self.total)]


def param_count(n_layer: int, d_model: int, vocab: int, block: int, bias: bool = True, qk_norm_dim: int = 0) -> int:
    """Exact parameter count of mptrain's GPT (tied head counted once);
    ``qk_norm_dim`` is the head size of a model with QK-layernorm, 0 without."""
    d = d_model
    per_block = 3 * d * d + d * d + 4 * d * d + 4 * d * d  # qkv, attn proj, mlp fc, mlp proj weights
    norms = 2 * d + 2 * qk_norm_dim  # ln_1, ln_2, and the q/k norms (one per attention, shared by its heads)
    if bias:
        per_block += 3 * d + d + 4 * d + d  # the linears' biases
        final_norm = 2 * d
    else:
        final_norm = d
    per_block += norms * (2 if bias else 1)  # norm weights, and their biases
    return n_layer * per_block + vocab * d + block * d + final_norm


def estimate(cfg, vocab: int, world: int = 1, micro_batch: int | None = None) -> Estimate:
    """Bytes per rank for ``cfg`` (a composed mptrain config) with ``vocab`` rows."""
    m, p = cfg.model, cfg.precision
    qk = m.d_model // m.n_head if m.qk_norm else 0
    n = param_count(m.n_layer, m.d_model, vocab, m.block_size, m.bias, qk)
    store = BYTES[p.compute_dtype.name] if not p.master_weights else 4
    sharded = cfg.parallel.name.value in ("fsdp", "fsdp1")
    shard = world if sharded else 1
    per_rank = math.ceil(n / shard)
    params = per_rank * store
    grads = per_rank * store
    optimizer = 2 * per_rank * store  # AdamW: exp_avg and exp_avg_sq, in the parameters' dtype
    gathered = 0
    if sharded and world > 1:
        # one block gathered for compute, one prefetched, in the gather dtype
        blk = param_count(1, m.d_model, 0, 0, m.bias, qk) - (2 * m.d_model if m.bias else m.d_model)
        gathered = 2 * blk * BYTES[(p.param_dtype or p.compute_dtype).name]
    b = micro_batch or cfg.train.micro_batch_size or max(1, cfg.train.global_batch_size // world)
    t, d, a = m.block_size, m.d_model, m.n_head
    width = BYTES[p.compute_dtype.name] / 2  # the published count is for 16-bit activations
    per_layer = t * b * d * (34 + 5 * a * t / d)
    logits = b * t * vocab * (BYTES[p.compute_dtype.name] + 4)  # logits, and their fp32 copy for the loss
    activations = int(m.n_layer * per_layer * width + logits)
    return Estimate(params, grads, optimizer, gathered, activations)


def _parse_args(argv: list[str]) -> tuple[int, int | None, list[str]]:
    """(``--world``, ``--vocab``, the Hydra overrides); a bad flag is a ConfigError."""
    from .config import ConfigError

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
    from .config import ConfigError
    from .config_checks import compose_checked

    try:
        world, vocab, rest = _parse_args(argv)
        cfg = compose_checked(rest)
    except ConfigError as e:
        print(f"mptrain: configuration error: {e}", file=sys.stderr)
        sys.exit(2)
    vocab = vocab or cfg.model.vocab_size or 4096
    e = estimate(cfg, vocab, world)
    print(f"memory per rank: model={cfg.model.name} precision={cfg.precision.name} "
          f"parallel={cfg.parallel.name.value} world={world} vocab={vocab}")
    for name, v in e.rows():
        print(f"  {name:<28} {v / 2**30:10.3f} GiB")


if __name__ == "__main__":
    main(sys.argv[1:])
