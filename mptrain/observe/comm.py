"""What crossed the wire: payload bytes of every collective in a step, by kind and dtype.

Every c10d collective, whether issued from Python (FSDP2, FSDP1, DDP comm
hooks, ``dist.all_reduce``) or from C++ (DDP's reducer), is dispatched as a
``c10d::`` operator, so one ``TorchDispatchMode`` sees them all. Counting costs
a Python call per operator of the step, so it runs only on the steps the
numerics monitor watches (``monitor.comm``), never on the others.

Bytes are the *payload* of each collective on this rank: the full-size side
of it (the gathered output of an all-gather, the unreduced input of a
reduce-scatter, the buffer of an all-reduce or broadcast). What the network
carries depends on the algorithm (a ring all-reduce sends about twice the
payload), but the payload is what the precision settings change: an
all-gather in bf16 moves half the bytes of one in fp32, whatever the
algorithm.
"""
from __future__ import annotations

import contextlib
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from mptrain.precision.formats import dtype_name

# c10d operator name (overload packet) -> kind. Functional collectives
# (``_c10d_functional``) are what compiled code and DTensor use.
_KINDS = {
    "allgather_": "all_gather", "_allgather_base_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
    "allgather_coalesced_": "all_gather", "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather", "all_gather_into_tensor_out": "all_gather",
    "reduce_scatter_": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce", "all_reduce_coalesced": "all_reduce", "all_reduce_coalesced_": "all_reduce",
    "broadcast_": "broadcast", "broadcast": "broadcast",
}
_NAMESPACES = ("c10d", "_c10d_functional")
try:
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # a torch build without distributed
    _DTensor = None


def _arg_bytes(arg) -> tuple[int, set]:
    ts = [t for t in tree_leaves(arg) if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in ts), {t.dtype for t in ts}


_uncounted = 0  # > 0 inside uncounted(): collectives the monitor issues to measure, not the step's own


@contextlib.contextmanager
def uncounted():
    """Collectives issued inside are left out of the counts: the monitor's own
    (the float8 statistics gather a sharded weight whole), which the step
    would not issue without it."""
    global _uncounted
    _uncounted += 1
    try:
        yield
    finally:
        _uncounted -= 1


class CommCounter(TorchDispatchMode):
    """Counts collectives while active. ``bytes[(kind, dtype)]`` and
    ``calls[(kind, dtype)]`` accumulate over everything run inside."""

    def __init__(self):
        super().__init__()
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _DTensor is not None and any(issubclass(t, _DTensor) for t in types):
            # Let DTensor run its own dispatch with this mode still active, so the
            # collectives it issues on local shards (e.g. the grad norm's
            # all-reduce under FSDP2) come back here; inside this handler the
            # mode is off and they would go uncounted.
            return NotImplemented
        if func.namespace in _NAMESPACES:
            name = func.overloadpacket.__name__
            kind = _KINDS.get(name)
            if kind is not None and not _uncounted:
                # The full-size side is the largest tensor argument (group) of the call.
                size, dtypes = max((_arg_bytes(a) for a in args), key=lambda r: r[0], default=(0, set()))
                dt = ",".join(sorted(dtype_name(d) for d in dtypes)) or "none"
                self.bytes[(kind, dt)] += size
                self.calls[(kind, dt)] += 1
        return func(*args, **(kwargs or {}))

    def metrics(self) -> dict[str, int]:
        """``comm/<kind>/<dtype>_bytes`` per (kind, dtype), plus ``comm/total_bytes``."""
        out = {f"comm/{k}/{d}_bytes": b for (k, d), b in sorted(self.bytes.items())}
        if out:
            out["comm/total_bytes"] = sum(self.bytes.values())
        return out

    def text(self) -> str:
        """One line: what one step moved, by kind and dtype."""
        if not self.bytes:
            return "no collectives"
        parts = []
        for (k, d), b in sorted(self.bytes.items()):
            n = self.calls[(k, d)]
            parts.append(f"{k} {d} {_human(b)} ({n} call{'s' if n != 1 else ''})")
        return ", ".join(parts)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def counting(enabled: bool):
    """A counter to wrap a step in, or a no-op context when this step is not counted."""
    return CommCounter() if enabled else contextlib.nullcontext()
