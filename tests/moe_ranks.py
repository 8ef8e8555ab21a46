"""One of two gloo ranks for tests/test_moe_observe.py (``torch.multiprocessing.spawn``
imports this module, not the test file, so that each rank imports only what it runs):
a tiny mixture-of-experts model, this rank's half of the batch, and the numerics
monitor reducing as a run's does (``DistContext``'s all-reduces); its ``moe/*``
figures into ``<out>.<rank>``."""
from __future__ import annotations

import json
from types import SimpleNamespace

import torch
import torch.distributed as dist

from mptrain.config.schema import ParallelMode
from mptrain.distributed.parallel import DistContext
from mptrain.model.moe import MoE, MoEShape
from mptrain.observe.numerics import NumericsMonitor

SHAPE = dict(vocab_size=64, n_layer=2, n_head=2, d_model=64, block_size=64, n_kv_head=2, ffn_hidden=128,
             n_experts=4, top_k=2)
MONITOR = SimpleNamespace(enabled=True, every=1, histogram=False, activations=False, stability=False)


def model_and_halves() -> tuple[MoE, list]:
    """The model (seed 0) and the two halves of one batch of 4 x 64 tokens (seed 1)."""
    torch.manual_seed(0)
    model = MoE(MoEShape(**SHAPE))
    x = torch.randint(0, 64, (4, 65), generator=torch.Generator().manual_seed(1))
    return model, [(c[:, :-1], c[:, 1:]) for c in x.split(2)]


def routing(model: MoE, monitor: NumericsMonitor, batches: list) -> dict:
    """The ``moe/*`` figures of one monitored step over ``batches`` (forwards only)."""
    monitor.start_step(0)
    for x, y in batches:
        model(x, y)
    monitor.after_backward(model, None)
    return {k: v for k, v in monitor.collect()[0].items() if k.startswith("moe/")}


def rank_figures(rank: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    try:
        ctx = DistContext(mode=ParallelMode.ddp, rank=rank, world=2, backend="gloo")
        model, halves = model_and_halves()
        monitor = NumericsMonitor(MONITOR, model, reduce_max_all=ctx.all_reduce_max,
                                  reduce_sum_all=ctx.all_reduce_sum, reduce_sum_dp=ctx.all_reduce_sum)
        with open(f"{out}.{rank}", "w") as f:
            json.dump(routing(model, monitor, [halves[rank]]), f)
    finally:
        dist.destroy_process_group()
