"""Expert parallelism: a routed layer's experts split over ``parallel.ep`` ranks.

Each rank keeps every other part of the model (sharded by FSDP over
``dp_shard`` as usual) and ``n_experts / ep`` whole experts of each routed
layer (:class:`~mptrain.model.moe.ExpertSlice`: they keep their names, so a
checkpoint names an expert alike on every layout). The ranks of one EP group
are consecutive ``dp_shard`` ranks and see different data, as before; a
routed layer's forward on one of them:

1. routes its own tokens (the router is replicated: every rank decides as one
   process would for the same tokens);
2. sends each token choice to the rank that holds its expert, by one
   all-to-all of rows (in ``parallel.ep_dispatch``'s dtype) after one of the
   counts (int64, so the receivers know their split sizes);
3. each rank runs its experts on what it received, grouped by expert, through
   the slice's own forward (where FSDP gathers the experts' weights);
4. the outputs return by the mirror all-to-all, in the experts' output dtype,
   into the order the layer sent them in; the layer weights and sums them as
   without expert parallelism.

The backward runs the two exchanges in reverse: the gradients of the returned
outputs go back to the experts' ranks in the outputs' dtype, those of the sent
rows come home in the rows' own dtype (fp32 under autocast: the experts' input
gradient is summed and sent as one process sums it, never rounded to the wire's
dtype). With the default dispatch every value one process computes is then
computed alike, and only the order of sums differs (an expert's weight gradient
over several ranks' tokens at once).

Gradients: an expert's weight gradient on its rank sums the contributions of
every rank of its EP group (their tokens reached it), so FSDP's reduction of
the experts over the ranks that hold the same ones (``dp_shard / ep`` of them,
times the replicas) sums and divides by the whole data-parallel size, not by
its own group's: the mean over every rank's tokens, as for every other weight.

``parallel.ep_dispatch=fp8`` sends float8 e4m3 bytes with one fp32 scale per
token and 128 features (:func:`fp8_rows`); a rounding the dispatch dtype names
is applied with ``ep=1`` too (:class:`LocalRounding`), so one process computes
what the split computes, and the study can measure it without ranks.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from mptrain.core.errors import ConfigError
from mptrain.model.moe import ExpertSlice, MoEFeedForward, compute_dtype, routed_layers

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
TILE = 128
"""Features per fp8 scale (DeepSeek-V3's 1 x 128 activation tiles); a row narrower than
that, or not a multiple of it, has one scale for the whole row."""
WIRE = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _tiles(x: torch.Tensor) -> torch.Tensor:
    """``x`` (N, d) as (N, tiles, tile): 128 features per tile where they divide, else one."""
    n, d = x.shape
    tile = TILE if d % TILE == 0 else d
    return x.reshape(n, d // tile, tile)


def fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values as uint8 (N, d), fp32 scales (N, tiles)) of ``x``: each tile scaled so
    its largest magnitude maps to e4m3's largest (448), rounded to nearest; an all-zero
    tile gets scale 1. ``x`` is read in fp32."""
    t = _tiles(x.float())
    amax = t.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (t / scale).to(FP8)
    return q.reshape(x.shape).view(torch.uint8), scale.squeeze(-1)


def fp8_values(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values :func:`fp8_rows` encoded, in ``dtype``."""
    t = _tiles(q.view(FP8).float())
    return (t * scale.unsqueeze(-1)).reshape(q.shape).to(dtype)


def round_rows(x: torch.Tensor, dispatch: str) -> torch.Tensor:
    """``x`` as the dispatch dtype leaves it (same dtype as ``x``): through fp8 and back, or bf16."""
    if dispatch == "fp8":
        return fp8_values(*fp8_rows(x), x.dtype)
    return x.to(WIRE[dispatch]).to(x.dtype)


def wire_dtype(dispatch: str, compute: torch.dtype) -> Optional[torch.dtype]:
    """The dtype rows cross in for ``parallel.ep_dispatch`` under a ``compute`` dtype (None: fp8)."""
    if dispatch == "fp8":
        return None
    return compute if dispatch == "compute" else WIRE[dispatch]


def dispatch_said(dispatch: str, compute: torch.dtype) -> str:
    """``parallel.ep_dispatch`` in words, for the banner: the dtype rows cross in."""
    if dispatch == "fp8":
        return "float8 e4m3 with an fp32 scale per token and 128 features (parallel.ep_dispatch=fp8)"
    wire = wire_dtype(dispatch, compute)
    name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(wire, str(wire))
    return f"{name} (parallel.ep_dispatch={dispatch})"


def rounds(dispatch: str, compute: torch.dtype) -> bool:
    """Whether a dispatch changes values one process would compute with: a dtype
    narrower than the compute dtype (fp8; bf16 in an fp32 run)."""
    wire = wire_dtype(dispatch, compute)
    return wire is None or (wire.itemsize < compute.itemsize)


class _Straight(torch.autograd.Function):
    """The dispatch's rounding in the forward, the gradient passed as it is."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dispatch: str) -> torch.Tensor:
        return round_rows(x, dispatch)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g, None


class LocalRounding:
    """A routed layer's exchange with ``ep=1`` and a dispatch that rounds: the rows its
    experts read rounded as the dispatch would round them, the gradient straight through."""

    def __init__(self, dispatch: str):
        self.dispatch = dispatch

    def __call__(self, rows: torch.Tensor, sizes: torch.Tensor, layer: MoEFeedForward) -> torch.Tensor:
        return layer._experts(_Straight.apply(rows, self.dispatch), sizes)


def _all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


class _Exchange(torch.autograd.Function):
    """Rows to the ranks ``send`` sizes name, in ``wire`` (a dtype, or None: fp8 bytes and
    scales), received as ``out_dtype``; the gradient back in ``grad_dtype``."""

    @staticmethod
    def forward(ctx, x, send, recv, group, wire, out_dtype, grad_dtype):
        ctx.send, ctx.recv, ctx.group, ctx.grad_dtype, ctx.in_dtype = send, recv, group, grad_dtype, x.dtype
        if wire is None:
            q, scale = fp8_rows(x)
            return fp8_values(_all_to_all(q, send, recv, group), _all_to_all(scale, send, recv, group), out_dtype)
        return _all_to_all(x.to(wire), send, recv, group).to(out_dtype)

    @staticmethod
    def backward(ctx, g):
        back = _all_to_all(g.to(ctx.grad_dtype), ctx.recv, ctx.send, ctx.group).to(ctx.in_dtype)
        return back, None, None, None, None, None, None


class ExpertExchange:
    """A routed layer's exchange under expert parallelism (the module docstring's steps 2-4):
    ``group`` the EP group's process group, of ``ep`` ranks."""

    def __init__(self, group, ep: int, dispatch: str):
        self.group, self.ep, self.dispatch = group, ep, dispatch

    def __call__(self, rows: torch.Tensor, sizes: torch.Tensor, layer: MoEFeedForward) -> torch.Tensor:
        ep, group = self.ep, self.group
        local = layer.n_experts // ep
        counts = _all_to_all(sizes.to(torch.int64), [local] * ep, [local] * ep, group).view(ep, local)
        mine = counts.tolist()  # one host read: the split sizes are host lists
        send = sizes.view(ep, local).sum(dim=1).tolist()
        recv = [sum(r) for r in mine]
        compute = compute_dtype(rows)
        wire = wire_dtype(self.dispatch, compute)
        # Received in the rows' own dtype (values the wire's), so the experts' input gradient sums
        # in it as one process's would, and crosses back in it: one process's bits, not rounded.
        got = _Exchange.apply(rows, send, recv, group, wire, rows.dtype, rows.dtype)
        order = _expert_major(mine, rows.device)  # received rows by source rank, then expert: regrouped by expert
        y = layer.experts(got[order], counts.sum(dim=0), layer._experts)
        back = y[torch.argsort(order)]
        return _Exchange.apply(back, recv, send, group, y.dtype, y.dtype, y.dtype)


def _expert_major(counts: list[list[int]], device: torch.device) -> torch.Tensor:
    """The row order that regroups rows received source by source (``counts[p][e]`` rows
    from rank ``p`` for local expert ``e``, in that order) expert by expert, sources in
    rank order within an expert."""
    starts, at = [], 0
    for row in counts:
        starts.append([])
        for c in row:
            starts[-1].append(at)
            at += c
    pieces = [torch.arange(starts[p][e], starts[p][e] + counts[p][e], device=device)
              for e in range(len(counts[0])) for p in range(len(counts))]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64, device=device)


def split_experts(model: nn.Module, group, ep: int, index: int, dispatch: str) -> None:
    """Keep this rank's ``n_experts / ep`` experts of every routed layer (the ``index``-th
    share) and give each layer the exchange."""
    for layer in routed_layers(model):
        local = layer.n_experts // ep
        layer.experts = ExpertSlice(layer.experts, index * local, local)
        layer.exchange = ExpertExchange(group, ep, dispatch)


def round_locally(model: nn.Module, dispatch: str) -> None:
    """``ep=1`` with a dispatch that rounds: every routed layer rounds its experts' input as it."""
    for layer in routed_layers(model):
        layer.exchange = LocalRounding(dispatch)


def expert_mesh(device_type: str, dp_replicate: int, dp_shard: int, ep: int):
    """The mesh ``dp_replicate x edp x ep`` over every rank (``edp = dp_shard / ep``; ep
    fastest, so an EP group is ``ep`` consecutive dp_shard ranks). Every rank builds it:
    creating its groups is a collective."""
    from torch.distributed.device_mesh import DeviceMesh

    ranks = torch.arange(dp_replicate * dp_shard).reshape(dp_replicate, dp_shard // ep, ep)
    return DeviceMesh(device_type, ranks, mesh_dim_names=("dp_replicate", "edp", "ep"))


def ep_group(rank: int, world: int, ep: int):
    """This rank's EP group: ``ep`` consecutive ranks, a process group of its own (every rank
    creates every one, as torch requires). Not the mesh's ``ep`` dimension's: where that
    spans the ranks of ``dp_shard`` (ep = dp_shard) torch reuses one communicator for both,
    and the traffic counter could no longer tell the all-to-alls from FSDP's collectives."""
    mine = None
    for first in range(0, world, ep):
        group = dist.new_group(list(range(first, first + ep)))
        if first <= rank < first + ep:
            mine = group
    return mine


def shard_experts(experts: ExpertSlice, mesh, shape, mp) -> None:
    """FSDP over the ranks that hold the same experts (``edp`` of ``mesh``, and the replicas
    as HSDP): a unit of its own, gathered when the slice runs. The reduction sums and
    divides by every data-parallel rank (the module docstring says why), not by this
    unit's ranks as FSDP would. ``shape``: the run's ``MeshShape``; ``mp``: FSDP2's
    mixed-precision policy for the experts (the block linears')."""
    from torch.distributed.fsdp import fully_shard

    fully_shard(experts, mesh=mesh["dp_replicate", "edp"] if shape.dp_replicate > 1 else mesh["edp"], mp_policy=mp)
    if not (hasattr(experts, "set_gradient_divide_factor") and hasattr(experts, "set_force_sum_reduction_for_comms")):
        raise ConfigError(f"parallel.ep={shape.ep} needs FSDP2's gradient divide factor, which torch "
                          f"{torch.__version__} lacks; use a newer torch, or parallel.ep=1.")
    # Where edp > 1: reduce-scatter (and all-reduce) as plain sums, divided once afterwards
    # (gloo has no pre-multiplied sum). Where each rank is alone on edp (ep = dp_shard),
    # FSDP2 skips the reduce-scatter and divides its copy by the factor itself, and with a
    # forced sum would divide again afterwards (torch 2.13: the factor squared): there the
    # default path, whose only other collective (the replicas' all-reduce) is a plain sum.
    experts.set_force_sum_reduction_for_comms(shape.edp > 1)
    experts.set_gradient_divide_factor(float(shape.dp))
