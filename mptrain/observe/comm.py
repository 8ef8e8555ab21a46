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

Under a device mesh each collective is also attributed to the mesh dimension
whose process group it ran on (:class:`MeshGroups`): ``dp_shard`` (FSDP's
all-gathers and reduce-scatters), ``dp_replicate`` (HSDP's all-reduce of the
reduced shards), ``tp`` (tensor and sequence parallelism), ``dp`` (every
data-parallel rank, when both dp dimensions are split or beside TP: loss
means), ``world`` (every rank: the monitor's sums) and, under expert
parallelism, ``ep`` (the all-to-alls that carry tokens to their experts and
back) and ``edp`` (FSDP's collectives of the experts, over the ranks that hold
the same ones). A group the mesh does not know is ``other``. An all-to-all's
payload is what this rank sends (its input, its own share included).
"""
from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Optional

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from mptrain.core.observer import observer_at_work
from mptrain.precision.formats import dtype_name

# c10d operator name (overload packet) -> kind (the dtype audit reads it too). Functional collectives
# (``_c10d_functional``) are what compiled code and DTensor use.
KINDS = {
    "allgather_": "all_gather", "_allgather_base_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
    "allgather_coalesced_": "all_gather", "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather", "all_gather_into_tensor_out": "all_gather",
    "reduce_scatter_": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce", "all_reduce_coalesced": "all_reduce", "all_reduce_coalesced_": "all_reduce",
    "broadcast_": "broadcast", "broadcast": "broadcast",
    "alltoall_base_": "all_to_all", "alltoall_": "all_to_all", "all_to_all_single": "all_to_all",
}
_NAMESPACES = ("c10d", "_c10d_functional")
try:
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # a torch build without distributed
    _DTensor = None


def _gathered(func, args) -> int:
    """The group size of a functional all-gather (whose output, the gathered
    payload, is not among its arguments: DTensor's and compiled code's), else 1."""
    name = func.overloadpacket.__name__
    if func.namespace == "_c10d_functional" and name.startswith("all_gather_into_tensor") and len(args) > 1:
        return int(args[1])
    return 1


def _arg_bytes(arg) -> tuple[int, set]:
    ts = [t for t in tree_leaves(arg) if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in ts), {t.dtype for t in ts}


class MeshGroups:
    """Which mesh dimension a process group is: the ranks of a group, compared
    with those of this rank's group along each dimension of ``mesh`` (a
    ``DeviceMesh`` named ``dp_replicate, dp_shard, tp``). ``dp_ranks``: the
    ranks that see different data (None: every rank). Where two names have the
    same ranks the first of ``dp_shard, tp, dp_replicate, dp, world`` wins: a
    dimension of size 1 is this rank alone, and FSDP2 still shards over
    ``dp_shard`` when it is one rank (one process, or all of the ranks in TP);
    with tp = 1 and no replication ``dp_shard`` is every rank."""

    def __init__(self, mesh, world: int, dp_ranks: Optional[list[int]] = None, expert_mesh=None, ep_group=None):
        # Expert parallelism's groups by name first: with ep = dp_shard the EP group has the
        # ranks of dp_shard, and its all-to-alls are still expert parallelism's.
        self.named: dict[str, str] = {}
        if expert_mesh is not None and expert_mesh["edp"].size() > 1:
            self.named[expert_mesh["edp"].get_group().group_name] = "edp"
        if ep_group is not None:
            self.named[ep_group.group_name] = "ep"
        self.names: dict[tuple[int, ...], str] = {}
        for name in sorted(mesh.mesh_dim_names, key=("dp_shard", "tp", "dp_replicate").index):
            self.names.setdefault(tuple(sorted(dist.get_process_group_ranks(mesh[name].get_group()))), name)
        self.names.setdefault(tuple(sorted(dp_ranks if dp_ranks is not None else range(world))), "dp")
        self.names.setdefault(tuple(range(world)), "world")
        self._cache: dict[str, str] = {}  # group name -> dimension

    def of(self, args) -> str:
        """The dimension of the collective whose arguments are ``args``: its
        process group (c10d ops) or group name (functional ones)."""
        for a in reversed(args):  # the group comes after the tensors
            name = _group_name(a)
            if name is None:
                continue
            if name in self.named:
                return self.named[name]
            if name not in self._cache:
                try:
                    pg = dist.distributed_c10d._resolve_process_group(name)
                    ranks = tuple(sorted(dist.get_process_group_ranks(pg)))
                except (RuntimeError, ValueError, KeyError):  # a string argument that names no group
                    continue
                self._cache[name] = self.names.get(ranks, "other")
            return self._cache[name]
        return "other"


def _group_name(arg) -> Optional[str]:
    """The name of the process group ``arg`` is or names; None for other
    arguments. Under a dispatch mode a c10d operator's group arrives as a
    TorchScript object, which ``ProcessGroup.unbox`` turns back into the group."""
    if isinstance(arg, torch.ScriptObject):
        if not arg._type().qualified_name().endswith(".ProcessGroup"):
            return None  # a reduce op
        arg = dist.ProcessGroup.unbox(arg)
    if isinstance(arg, dist.ProcessGroup):
        return arg.group_name
    if isinstance(arg, str) and arg not in _REDUCE_OPS:
        return arg
    return None


_REDUCE_OPS = frozenset({"sum", "avg", "product", "min", "max", "band", "bor", "bxor", "premul_sum"})


class CommCounter(TorchDispatchMode):
    """Counts collectives while active. ``bytes[(kind, dtype)]`` and
    ``calls[(kind, dtype)]`` accumulate over everything run inside; with
    ``groups`` (a :class:`MeshGroups`), ``dim_bytes[(dim, kind, dtype)]`` and
    ``dim_calls`` split the same figures by mesh dimension."""

    def __init__(self, groups: Optional[MeshGroups] = None):
        super().__init__()
        self.groups = groups
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)
        self.dim_bytes: dict[tuple[str, str, str], int] = defaultdict(int)
        self.dim_calls: dict[tuple[str, str, str], int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _DTensor is not None and any(issubclass(t, _DTensor) for t in types):
            # Let DTensor run its own dispatch with this mode still active, so the
            # collectives it issues on local shards (e.g. the grad norm's
            # all-reduce under FSDP2) come back here; inside this handler the
            # mode is off and they would go uncounted.
            return NotImplemented
        if func.namespace in _NAMESPACES:
            kind = KINDS.get(func.overloadpacket.__name__)
            if kind is not None and not observer_at_work():  # a monitor's own collective: not the step's
                self._count(kind, args, _gathered(func, args))
        return func(*args, **(kwargs or {}))

    def _count(self, kind: str, args, times: int = 1) -> None:
        # The full-size side is the largest tensor argument (group) of the call; a functional
        # all-gather takes only its input (this rank's part): ``times`` the group's size.
        if kind == "all_to_all":  # what this rank sends (its own share included): its input
            size, dtypes = _arg_bytes(args[1])
        else:
            size, dtypes = max((_arg_bytes(a) for a in args), key=lambda r: r[0], default=(0, set()))
        size *= times
        dt = ",".join(sorted(dtype_name(d) for d in dtypes)) or "none"
        self.bytes[(kind, dt)] += size
        self.calls[(kind, dt)] += 1
        if self.groups is not None:
            dim = self.groups.of(args)
            self.dim_bytes[(dim, kind, dt)] += size
            self.dim_calls[(dim, kind, dt)] += 1

    def metrics(self) -> dict[str, int]:
        """``comm/<kind>/<dtype>_bytes`` per (kind, dtype), plus ``comm/total_bytes``;
        under a mesh also ``comm/<dim>/<kind>/<dtype>_bytes`` and ``comm/<dim>/total_bytes``."""
        out = {f"comm/{k}/{d}_bytes": b for (k, d), b in sorted(self.bytes.items())}
        if out:
            out["comm/total_bytes"] = sum(self.bytes.values())
        totals: dict[str, int] = defaultdict(int)
        for (dim, k, d), b in sorted(self.dim_bytes.items()):
            out[f"comm/{dim}/{k}/{d}_bytes"] = b
            totals[dim] += b
        out.update({f"comm/{dim}/total_bytes": b for dim, b in sorted(totals.items())})
        return out

    def text(self) -> str:
        """One line: what one step moved, by kind and dtype (under a mesh, by
        dimension first: ``dp_shard: all_gather bf16 ...; tp: ...``)."""
        if not self.bytes:
            return "no collectives"
        if self.groups is None:
            return _parts(self.bytes, self.calls)
        dims: dict[str, tuple[dict, dict]] = {}
        for (dim, k, d), b in self.dim_bytes.items():
            sizes, calls = dims.setdefault(dim, ({}, {}))
            sizes[(k, d)], calls[(k, d)] = b, self.dim_calls[(dim, k, d)]
        return "; ".join(f"{dim}: {_parts(*dims[dim])}" for dim in sorted(dims, key=_dim_order))


_DIM_ORDER = ("dp_replicate", "dp_shard", "tp", "ep", "edp", "dp", "world", "other")


def _dim_order(dim: str) -> int:
    return _DIM_ORDER.index(dim) if dim in _DIM_ORDER else len(_DIM_ORDER)


def _parts(sizes: dict, calls: dict) -> str:
    """``all_gather bf16 434.8 KiB (11 calls), ...`` for (kind, dtype) -> bytes and calls."""
    out = []
    for (k, d), b in sorted(sizes.items()):
        n = calls[(k, d)]
        out.append(f"{k} {d} {_human(b)} ({n} call{'s' if n != 1 else ''})")
    return ", ".join(out)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def counting(enabled: bool, groups: Optional[MeshGroups] = None):
    """A counter to wrap a step in, or a no-op context when this step is not counted."""
    return CommCounter(groups) if enabled else contextlib.nullcontext()
