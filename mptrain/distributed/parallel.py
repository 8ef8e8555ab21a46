"""Process-group life cycle, model wrapping and the collectives the step needs.

Everything that depends on ``parallel=none|ddp|fsdp|fsdp1`` is here, so the
trainer and the step never branch on it: they call ``ctx.grad_sync``,
``ctx.clip_grad_norm`` and ``ctx.all_reduce_mean``.

Launch: ``torchrun`` sets RANK / WORLD_SIZE / LOCAL_RANK; without them the run
is one process. A wrapper asked for in a single process still wraps (over a
one-rank group), so ``python train.py parallel=fsdp`` runs the same code path
as the multi-rank job.
"""
from __future__ import annotations

import atexit
import contextlib
import datetime
import math
import os
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from mptrain.config.mesh import DIMS, MESH_MODES, MeshShape
from mptrain.config.schema import ParallelMode
from mptrain.core.errors import ConfigError
from mptrain.core.shards import local_shard
from mptrain.distributed import expert_parallel, tensor_parallel
from mptrain.model.common import Block, write_weights
from mptrain.model.moe import ExpertSlice
from mptrain.plan.plan import Plan
from mptrain.precision.formats import dtype_name
from mptrain.precision.policy import PrecisionPolicy


_MESH = tuple(ParallelMode(m) for m in MESH_MODES)


def _pick_device(spec: str, local_rank: int) -> torch.device:
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    if spec == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("train.device=cuda but this torch build sees no CUDA device; use train.device=cpu.")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if spec == "cpu":
        return torch.device("cpu")
    raise ConfigError(f"train.device='{spec}' is not one of auto, cpu, cuda.")


@dataclass
class DistContext:
    """Who this process is and how its model is wrapped."""

    mode: ParallelMode
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None
    owns_group: bool = False
    shape: MeshShape = field(default_factory=MeshShape)
    mesh: object = None  # the DeviceMesh (dp_replicate, dp_shard, tp) of the FSDP2 wrappers; None otherwise
    dp_group: object = None  # the ranks with this rank's tp coordinate; None: the whole world
    sequence_parallel: bool = False  # parallel.sequence_parallel, where tp > 1
    ep_group: object = None  # expert parallelism: the process group of this rank's EP group (ep > 1)
    expert_mesh: object = None  # expert parallelism: the mesh dp_replicate x edp x ep (expert_parallel.expert_mesh)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        """This rank's place among the ranks that see different data (the TP
        ranks of a group share one): its batches' shard."""
        return self.rank // self.shape.tp

    @property
    def dp_ranks(self) -> list[int]:
        """The ranks that share this rank's tp coordinate: those that see different
        data (``dp_group``'s ranks; every rank without TP)."""
        return list(range(self.rank % self.shape.tp, self.world, self.shape.tp))

    @property
    def dp_world(self) -> int:
        return self.world // self.shape.tp

    @property
    def sequence_multiple(self) -> int:
        """Sequence lengths the wrapped model takes are multiples of this:
        sequence parallelism splits them evenly over the TP ranks."""
        return self.shape.tp if self.sequence_parallel else 1

    @property
    def uses_mesh(self) -> bool:
        return self.mode.value in MESH_MODES

    @property
    def ep_index(self) -> int:
        """This rank's place in its expert-parallel group (which share of the experts it holds)."""
        return self.rank % self.shape.ep

    def owned_shard(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``t`` if this rank is the first of the ranks that
        hold the same part (its coordinate is 0 on every mesh dimension along
        which ``t`` is replicated), else an empty tensor: summed over every
        rank, each value then counts once. Under HSDP the replicate groups hold
        copies, under TP the TP ranks hold copies of what is not split."""
        local = local_shard(t)
        if self.mesh is None or local is t:
            return local
        if "edp" in t.device_mesh.mesh_dim_names:
            # An expert (expert parallelism): its EP rank is its only holder along ep, its
            # mesh says where it is copied (the replicas) and where sharded.
            mine = dict(zip(t.device_mesh.mesh_dim_names, t.device_mesh.get_coordinate()))
            copied = [n for n, pl in zip(t.device_mesh.mesh_dim_names, t.placements) if pl.is_replicate()]
            return local if all(mine[d] == 0 for d in copied) else local.reshape(-1)[:0]
        mine = dict(zip(self.mesh.mesh_dim_names, self.mesh.get_coordinate()))
        split = {n for n, pl in zip(t.device_mesh.mesh_dim_names, t.placements) if not pl.is_replicate()}
        if all(mine[d] == 0 for d in DIMS if d not in split):
            return local
        return local.reshape(-1)[:0]

    @property
    def has_group(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    # ---------------------------------------------------------------- collectives
    def barrier(self) -> None:
        if self.has_group:
            dist.barrier()

    def all_reduce_mean(self, t: torch.Tensor) -> torch.Tensor:
        """Mean over the data-parallel ranks (SUM then divide: gloo has no AVG).
        TP ranks share a batch, so each data-parallel group is counted once:
        the mean of a loss is one process's mean over the same batches."""
        if self.has_group and self.dp_world > 1:
            t = t.clone()
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.dp_group)
            t /= self.dp_world
        return t

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the data-parallel ranks (statistics of per-rank data, such as
        a loss's sum and token count; the TP ranks of a group hold the same)."""
        if self.has_group and self.dp_world > 1:
            t = t.clone()
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.dp_group)
        return t

    def shard_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks that *shard* the parameters (FSDP, TP); identity
        where every rank holds full copies (none, DDP). Under a mesh, sum only
        :meth:`owned_shard` parts: replicas would otherwise count twice."""
        if self.mode in (ParallelMode.fsdp1, *_MESH) and self.has_group and self.world > 1:
            t = t.clone()
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def shard_max(self, t: torch.Tensor) -> torch.Tensor:
        if self.mode in (ParallelMode.fsdp1, *_MESH):
            return self.all_reduce_max(t)
        return t

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        if self.has_group and self.world > 1:
            t = t.clone()
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t

    def any_rank(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on any (a collective when world > 1)."""
        if not (self.has_group and self.world > 1):
            return flag
        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=self.device)  # int32: NCCL reduces it, unlike bool
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Stack of every rank's ``t`` (world, *t.shape); just ``t[None]`` alone."""
        if not (self.has_group and self.world > 1):
            return t[None]
        parts = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(parts, t.contiguous())
        return torch.stack(parts)

    def ranks_agree(self, t: torch.Tensor) -> bool:
        """True when every rank holds exactly the same values (nan equal to nan).
        A collective: every rank must call it."""
        g = self.all_gather(t)
        return bool(all(torch.equal(g[0].nan_to_num(nan=7.0), g[i].nan_to_num(nan=7.0)) for i in range(len(g))))

    def replica_fingerprint(self, model: nn.Module) -> torch.Tensor:
        """(sum, sum of squares, non-finite count) of the full, gathered
        parameters in fp64, and of the buffers every rank must hold alike (a
        module's ``fp32_buffers``: the mixture's balancing bias, which each rank
        moves itself). A collective under FSDP (gathers shards)."""
        acc = torch.zeros(3, dtype=torch.float64, device=self.device)

        def add(p: torch.Tensor) -> None:
            x = p.detach().double()
            acc[0] += x.nan_to_num().sum()
            acc[1] += x.nan_to_num().pow(2).sum()
            acc[2] += (~torch.isfinite(x)).sum()

        if self.mode == ParallelMode.fsdp1:
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            with FSDP.summon_full_params(model, writeback=False):
                for p in model.parameters():
                    add(p)
        else:
            experts = {id(p) for m in model.modules() if isinstance(m, ExpertSlice) for p in m.parameters()}
            for p in (p for p in model.parameters() if id(p) not in experts):
                add(p.full_tensor() if hasattr(p, "full_tensor") else p)
            if experts:  # each EP rank holds its share of the experts: their sums added over the EP group
                shared, acc[:] = acc.clone(), 0
                for p in (p for p in model.parameters() if id(p) in experts):
                    add(p.full_tensor())
                dist.all_reduce(acc, group=self.ep_group)
                acc += shared
        for mod in model.modules():
            for name in getattr(mod, "fp32_buffers", ()):
                add(getattr(mod, name))
        return acc

    def all_gather_object(self, obj) -> list:
        """Every rank's ``obj`` (small, picklable), in rank order; ``[obj]`` alone.
        A collective: every rank must call it, so it also serves as a barrier."""
        if not (self.has_group and self.world > 1):
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj):
        if self.has_group and self.world > 1:
            box = [obj]
            dist.broadcast_object_list(box, src=0)
            return box[0]
        return obj

    def shutdown(self) -> None:
        if self.owns_group and self.has_group:
            dist.destroy_process_group()

    # ---------------------------------------------------------------- step hooks
    def grad_sync(self, model: nn.Module, enabled: bool):
        """Context for one micro-batch's forward+backward: gradients are
        reduced across ranks only when ``enabled`` (the last micro-batch)."""
        if enabled or self.mode == ParallelMode.none:
            if self.uses_mesh:
                model.set_requires_gradient_sync(True)
            return contextlib.nullcontext()
        if self.uses_mesh:
            model.set_requires_gradient_sync(False)
            return contextlib.nullcontext()
        return model.no_sync()  # ddp and fsdp1

    def reshard(self, model: nn.Module) -> None:
        """Free the unsharded parameters FSDP2 keeps after a forward without a
        backward (evaluation): the root does not reshard after forward."""
        if self.uses_mesh:
            for mod in model.modules():
                if hasattr(mod, "reshard"):
                    mod.reshard()

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Global L2 norm of the (unscaled) gradients before clipping, in fp32, the
        same on every rank; clips to ``max_norm`` when it is > 0.

        The same figure under every wrapper: the squares are summed in float64
        (:func:`_sq_sum`) over this rank's part of each gradient, then over the
        ranks that shard them (FSDP2's DTensor shards; FSDP1's slices of its flat
        shard, padding excluded: each value counted once), and only the square
        root is rounded to fp32. In fp32 the shards' partial sums would round
        otherwise than one full tensor's, and a norm one ulp off moves the clip
        factor, then every weight: a bf16 run under fsdp then left ddp's (and
        one process's with as many micro-batches) after 3 steps. The range stays
        fp32's: a sum of squares past fp32's max is inf, as an fp32 sum would
        be (the guard's "global norm overflowed" diagnosis). Not
        ``FSDP.clip_grad_norm_`` (FSDP1): it returns the norm cast to the
        gradients' dtype, rounding what the log and the inf/nan guard see (an
        fp16 norm overflows past 65504)."""
        params = [p for p in model.parameters() if p.grad is not None]
        sq = self.shard_sum(_sq_sum([self.owned_shard(p.grad) for p in params], self.device))
        # on the device (no host sync); NaN stays NaN
        sq = sq.masked_fill(sq > torch.finfo(torch.float32).max, math.inf)
        norm = sq.sqrt().float()
        if max_norm > 0:
            # One call per device mesh: under TP the split and the unsplit parameters
            # live on different meshes, and foreach kernels take one mesh per list.
            groups: dict = {}
            for p in params:
                groups.setdefault(getattr(p, "device_mesh", None), []).append(p)
            for group in groups.values():
                torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm, foreach=None)
        return norm


def _sq_sum(grads: list, device: torch.device) -> torch.Tensor:
    """Sum of the squares of every value of ``grads`` (plain tensors), as a float64
    0-d tensor. An fp32 (or bf16/fp16) value's square is exact in float64 and
    the sum's rounding is some 2^-29 of fp32's ulp, so splitting the values
    otherwise (shards, another world size) moves the fp32 norm only when it sits
    that close to an fp32 rounding boundary. One gradient at a time is upcast
    (``vector_norm``'s dtype), never all of them. Zero for a rank that holds no
    gradient."""
    norms = [torch.linalg.vector_norm(g, 2.0, dtype=torch.float64) for g in grads if g.numel()]
    if not norms:
        return torch.zeros((), dtype=torch.float64, device=device)
    return torch.stack(norms).square().sum()


def _destroy_at_exit() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def export_submitit_env() -> None:
    """Under a submitit (Slurm or local) job with several tasks and no torchrun,
    turn the task layout into the env:// variables torch.distributed reads."""
    if "RANK" in os.environ or not any(k in os.environ for k in ("SUBMITIT_EXECUTOR", "SUBMITIT_LOCAL_JOB_ID")):
        return
    try:
        from submitit.helpers import TorchDistributedEnvironment
    except ImportError:
        return
    env = TorchDistributedEnvironment()
    if env.world_size > 1:
        env.export(set_cuda_visible_devices=False)


def setup(plan: Plan) -> DistContext:
    """Join (or create) the process group of ``plan``'s launch, pick this rank's device
    and, for the FSDP2 wrappers, build the plan's device mesh ``dp_replicate x dp_shard x tp``."""
    par, launch = plan.parallel, plan.launch
    device = _pick_device(plan.device, launch.local_rank)
    ctx = DistContext(mode=par.mode, rank=launch.rank, world=launch.world, local_rank=launch.local_rank,
                      device=device, shape=par.mesh, sequence_parallel=par.sequence_parallel)
    if par.mode == ParallelMode.none:
        return ctx
    if not dist.is_available():
        raise ConfigError(f"parallel={par.name} needs torch.distributed, which this torch build lacks.")
    ctx.backend = _backend(par.backend, device)
    _join(ctx)
    if ctx.uses_mesh:
        _build_mesh(ctx)
    if ctx.shape.ep > 1:
        s = ctx.shape
        ctx.expert_mesh = expert_parallel.expert_mesh(device.type, s.dp_replicate, s.dp_shard, s.ep)
        ctx.ep_group = expert_parallel.ep_group(ctx.rank, ctx.world, s.ep)
    return ctx


def _backend(backend: str, device: torch.device) -> str:
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError("parallel.backend=nccl needs CUDA devices; on CPU use parallel.backend=gloo (or auto).")
    if backend not in ("gloo", "nccl"):
        raise ConfigError(f"parallel.backend='{backend}' is not one of auto, gloo, nccl.")
    return backend


def _join(ctx: DistContext) -> None:
    """The process group: torchrun's, joined once per process; or a one-rank one."""
    backend = ctx.backend
    if dist.is_initialized():
        if dist.get_backend() != backend:
            raise ConfigError(
                f"this process already joined a '{dist.get_backend()}' process group; parallel.backend={backend} "
                "cannot change inside one torchrun launch (e.g. across multirun jobs)."
            )
        return
    timeout = datetime.timedelta(minutes=10)
    if "MASTER_ADDR" in os.environ:
        # The torchrun group lives as long as the process: Hydra multirun runs several
        # jobs in one process, and tearing the group down and re-creating it between
        # jobs races on the rendezvous store (a rank still leaving job 1 meets a rank
        # entering job 2). Every job reuses it; it is destroyed at exit.
        dist.init_process_group(backend, rank=ctx.rank, world_size=ctx.world, timeout=timeout)
        atexit.register(_destroy_at_exit)
    else:  # one process without torchrun: an in-memory one-rank group, just for this run
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        ctx.owns_group = True


def _build_mesh(ctx: DistContext) -> None:
    """The named mesh (tp fastest, then dp_shard, then dp_replicate) and, with
    TP, the group of the ranks that share this rank's tp coordinate (those
    that see different data: the loss is averaged over them). Every rank
    creates every such group, as torch requires."""
    from torch.distributed.device_mesh import init_device_mesh

    s = ctx.shape
    ctx.mesh = init_device_mesh(ctx.device.type, (s.dp_replicate, s.dp_shard, s.tp), mesh_dim_names=DIMS)
    if s.tp > 1:
        mine = ctx.dp_ranks
        for t in range(s.tp):
            group = dist.new_group(list(range(t, ctx.world, s.tp)))
            if mine[0] == t:
                ctx.dp_group = group


def _checkpoint_and_compile(model: nn.Module, activation_checkpointing: bool, compile_blocks: bool) -> None:
    """The block-level passes of :func:`wrap`, in place and in this order: each
    block wrapped for activation checkpointing, then each block (and the loss)
    compiled, so the compiled graph holds the checkpointing."""
    if activation_checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            CheckpointImpl,
            checkpoint_wrapper,
        )

        # Non-reentrant checkpointing: works with FSDP, autocast and float8; the
        # wrapper hides its own name from state_dict keys, so checkpoints do not change.
        for i, blk in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(blk, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    if compile_blocks:
        for blk in model.blocks:
            blk.compile()  # in place: module names (and checkpoints) stay as they are
        # The loss too: eager, its fp32 upcast and log-softmax write B x T x vocab fp32
        # tensors out whole, about a third of gpt-small's step on an H200 (gpu_check's profile).
        # In place, as the blocks: the model's own declared loss object compiles itself.
        model.loss_fn.compile()


def wrap(model: nn.Module, policy: PrecisionPolicy, ctx: DistContext, activation_checkpointing: bool = False,
         compile_blocks: bool = False, init_seed: Optional[int] = None,
         initial_weights: Optional[dict[str, torch.Tensor]] = None, unguarded: frozenset = frozenset(),
         ep_dispatch: str = "compute") -> nn.Module:
    """Wrap ``model`` for ``ctx.mode``; :func:`wrapper_dtypes` says which dtypes
    the wrapper was given.

    Order (the one place it is decided): move to device -> float8 conversion
    -> activation checkpointing -> torch.compile per block -> data-parallel
    wrapper last, so the wrapper sees the final module tree.

    A model built on the meta device (``with torch.device("meta")``) has no
    storage yet; it is materialized here and filled by its
    ``reset_parameters`` from a generator seeded with ``init_seed``. Under
    FSDP2 that happens after sharding, so no rank ever holds the whole model;
    under the other wrappers, on the device, before wrapping. Either way the
    weights equal those of a model built on the CPU and reset with the same seed.
    ``initial_weights`` (whole CPU tensors by parameter name, ``model.init_from``)
    replace the drawn ones, written at the same point (:func:`materialize`).
    ``unguarded``: mesh guards switched off (``debug.unguarded``, a test aid).
    ``ep_dispatch``: the dtype a mixture's tokens cross to their experts in
    (``parallel.ep_dispatch``): with ``ctx.shape.ep > 1`` each rank keeps its share of
    the experts (``expert_parallel.split_experts``), after the precision's conversion
    (each expert converted on its own) and before FSDP (which shards the experts apart).
    """
    on_meta = any(p.is_meta for p in model.parameters())
    if on_meta and init_seed is None:
        raise ValueError("a model on the meta device needs init_seed to be materialized")
    if initial_weights is not None and not on_meta:
        raise ValueError("initial_weights are written when a meta-device model is materialized; this one has storage")
    model = model.to(dtype=policy.param_dtype)  # fp32 unless master_weights=false
    if on_meta and not ctx.uses_mesh:
        materialize(model, ctx.device, init_seed, initial_weights)
        on_meta = False
    if not on_meta:
        model = model.to(ctx.device)
    model = policy.convert_model(model)  # float8 linears first: FSDP must shard the converted weights
    if ctx.shape.ep > 1:
        expert_parallel.split_experts(model, ctx.ep_group, ctx.shape.ep, ctx.ep_index, ep_dispatch)
    elif expert_parallel.rounds(ep_dispatch, policy.compute_dtype):
        expert_parallel.round_locally(model, ep_dispatch)
    if ctx.shape.tp > 1:  # split before the block-level passes, which rename the blocks' insides
        tensor_parallel.apply(model, ctx.mesh["tp"], ctx.sequence_parallel)
    _checkpoint_and_compile(model, activation_checkpointing, compile_blocks)
    mode = ctx.mode
    if mode == ParallelMode.none:
        return model
    if mode == ParallelMode.ddp:
        return _wrap_ddp(model, policy, ctx)
    if ctx.uses_mesh:
        model = _wrap_fsdp2(model, policy, ctx)
        if ctx.sequence_parallel and "tp_reduce_dtype" not in unguarded:
            tensor_parallel.reduce_tp_partials_in(model, policy.reduce_dtype)
        if on_meta:
            materialize(model, ctx.device, init_seed, initial_weights)
        return model
    if mode == ParallelMode.fsdp1:
        return _wrap_fsdp1(model, policy, ctx)
    raise ConfigError(f"parallel={mode} is unknown")  # unreachable: the schema's Enum rejects it


def materialize(model: nn.Module, device: torch.device, seed: int,
                weights: Optional[dict[str, torch.Tensor]] = None) -> None:
    """Give a meta-device model storage on ``device`` and its initial weights, in
    place: ``weights`` when given (whole tensors by name, :func:`write_weights`),
    else ``reset_parameters`` with a generator seeded ``seed``. Under FSDP2 only
    this rank's shards get storage, and take only their part of each tensor."""
    model.to_empty(device=device)
    model.tie_weights()  # to_empty gives each module its own new tensor: tie them again
    if weights is None:
        model.reset_parameters(torch.Generator().manual_seed(seed))
    else:  # no random draw to throw away: an 8B model's takes minutes on the CPU
        write_weights(model, weights)
    for m in model.modules():  # state that to_empty left uninitialized (delayed float8 scaling's histories)
        if hasattr(m, "reset_delayed_state"):
            m.reset_delayed_state()


def wrapper_dtypes(policy: PrecisionPolicy, mode: ParallelMode, shape: Optional[MeshShape] = None) -> dict:
    """What the wrapper of ``mode`` is given under ``policy`` (storage, gathered
    and reduced dtypes), for the banner and run_info. A function of these,
    not a record kept by :func:`wrap`: every part of it follows from them.
    ``shape``: the mesh of the FSDP2 modes, which says on which dimension the
    gradient reductions run (HSDP adds an all-reduce over ``dp_replicate``)."""
    if mode == ParallelMode.ddp:
        comm = "fp32 (all-reduce)"
        if policy.reduce_dtype != torch.float32:
            comm = f"{dtype_name(policy.reduce_dtype)} (compress comm hook)"
        return {
            "wrapper": "DistributedDataParallel",
            "param_storage": dtype_name(policy.param_dtype),
            "compute_params": dtype_name(policy.compute_dtype) + (" (autocast casts per op)" if policy.autocast_enabled else ""),
            "grad_reduce": comm,
            "buffers": dtype_name(policy.buffer_dtype),
        }
    if mode.value in MESH_MODES:
        out = _sharded_dtypes("FSDP2 fully_shard (per block + its norms, root)", "sharded", policy)
        if shape is not None:
            reduce = dtype_name(policy.reduce_dtype)
            out["grad_reduce"] = (f"{reduce} (reduce-scatter on dp_shard"
                                  + (f"; all-reduce of the shards on dp_replicate, {reduce})"
                                     if shape.dp_replicate > 1 else ")"))
        return out
    if mode == ParallelMode.fsdp1:
        return _sharded_dtypes("FullyShardedDataParallel (FSDP1, per-block auto-wrap)", "flat, sharded", policy)
    return {"wrapper": "none"}


def _sharded_dtypes(wrapper: str, storage: str, policy) -> dict:
    """What an FSDP wrapper was given, for the banner and run_info: which parts
    are all-gathered in which dtype (see ``PrecisionPolicy.gather_dtype``)."""
    linears = dtype_name(policy.wrapper_param_dtype)
    kept = dtype_name(policy.param_dtype)
    if policy.splits_gather:
        gathered = {
            "compute_params": f"{linears} (all-gathered: linear layers"
                              + ("; inputs cast to it)" if policy.wrapper_casts_inputs else ")"),
            "norm_emb_params": f"{kept} (all-gathered: embeddings + tied head, norms)",
        }
    else:
        gathered = {"compute_params": f"{linears} (all-gathered: every parameter)"}
    return {
        "wrapper": wrapper,
        "param_storage": f"{dtype_name(policy.param_dtype)} ({storage})",
        **gathered,
        "grad_reduce": dtype_name(policy.reduce_dtype) + " (reduce-scatter)",
        "buffers": dtype_name(policy.buffer_dtype),
    }


def _cast_buffers(model: nn.Module, dtype: torch.dtype) -> None:
    # DDP and FSDP2 have no buffer dtype of their own; floating buffers are
    # cast here so `precision.buffer_dtype` means the same under every wrapper.
    # A module's `fp32_buffers` keep fp32 storage whatever the dtype (the mixture's
    # balancing bias: its small steps would round away in bf16).
    for mod in model.modules():
        kept = getattr(mod, "fp32_buffers", ())
        for name, buf in list(mod.named_buffers(recurse=False)):
            if buf.is_floating_point() and name not in kept:
                setattr(mod, name, buf.to(dtype))


def _gloo_bf16_compress_hook(process_group, bucket):
    """PyTorch's bf16 compression hook, for gloo.

    DDP refuses a hook *named* ``bf16_compress_hook`` unless NCCL >= 2.10 is
    present, but gloo all-reduces bf16 fine; this runs the very same
    implementation (cast the bucket to bf16, divide by world size, all-reduce,
    copy back) under another name so CPU runs can use it."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks._compress_hook(torch.bfloat16, process_group, bucket)


def _no_buffer_sync(model: nn.Module) -> dict:
    """DDP's arguments that stop it from copying rank 0's buffers to the others before
    every forward. The buffers are delayed float8 scaling's running amaxes (each rank's
    own, all-reduced by ``update_histories``: a copy erases them) and the mixture's bias
    (moved alike on every rank, ``run/mixture.py``: a copy hides one that was not). None: nothing
    to pass; newer torch calls it ``forward_sync_buffers`` (it still syncs once, when all agree)."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel as DDP

    if not any(True for _ in model.buffers()):
        return {}
    if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def _wrap_ddp(model, policy, ctx):
    from torch.nn.parallel import DistributedDataParallel as DDP

    _cast_buffers(model, policy.buffer_dtype)
    ddp = DDP(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None, **_no_buffer_sync(model))
    if policy.reduce_dtype != torch.float32:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hook = {torch.bfloat16: default_hooks.bf16_compress_hook, torch.float16: default_hooks.fp16_compress_hook}[policy.reduce_dtype]
        if policy.reduce_dtype == torch.bfloat16 and ctx.backend == "gloo":
            hook = _gloo_bf16_compress_hook
        ddp.register_comm_hook(dist.group.WORLD, hook)  # wrapper_dtypes' "compress comm hook"
    return ddp


def _wrap_fsdp2(model, policy, ctx):
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError as e:  # torch < 2.6
        raise ConfigError(f"parallel=fsdp needs FSDP2 (torch>=2.6); this torch is {torch.__version__}. Use parallel=fsdp1.") from e
    _cast_buffers(model, policy.buffer_dtype)
    # HSDP when there is a replicate dimension (FSDP2 reads a 2-D mesh as
    # replicate x shard); plain sharding over dp_shard otherwise, as before.
    mesh = ctx.mesh["dp_replicate", "dp_shard"] if ctx.shape.dp_replicate > 1 else ctx.mesh["dp_shard"]

    def mp(param_dtype: torch.dtype) -> MixedPrecisionPolicy:
        # Explicit on every field: FSDP2 defaults have changed between releases.
        # No input casting under autocast: casting a block's input to the gathered
        # dtype would make the residual stream bf16/fp16 (see PrecisionPolicy).
        return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=policy.reduce_dtype, output_dtype=None,
                                    cast_forward_inputs=policy.wrapper_casts_inputs)

    # Units, bottom-up (a parameter belongs to the first unit that claims it):
    # 1. per block, its norms, gathered in the storage dtype: one group for all of
    #    a block's norms (fully_shard takes a list), so they cost one collective;
    # 2. the block itself: what is left of it, the linear layers, in the compute dtype;
    # 3. the root: embeddings, the head tied to the token embedding, the final norm,
    #    in the storage dtype. The embedding output is then fp32 as autocast leaves
    #    it, and autocast casts the tied weight per op for the head's matmul.
    # When both dtypes are one (fp32, bf16-pure), step 1 is skipped: no split needed.
    for blk in model.blocks:  # (possibly checkpoint-wrapped or compiled: modules() sees inside)
        for experts in (m for m in blk.modules() if isinstance(m, ExpertSlice)):
            expert_parallel.shard_experts(experts, ctx.expert_mesh, ctx.shape, mp(policy.wrapper_param_dtype))
        kept = [m for m in blk.modules() if policy.keeps_storage_dtype(m)]
        if kept and policy.splits_gather:
            fully_shard(kept, mesh=mesh, mp_policy=mp(policy.gather_dtype(kept[0])))
        fully_shard(blk, mesh=mesh, mp_policy=mp(policy.wrapper_param_dtype))
    fully_shard(model, mesh=mesh, mp_policy=mp(policy.param_dtype))
    return model


def _wrap_fsdp1(model, policy, ctx):
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import MixedPrecision
    except ImportError as e:
        raise ConfigError(f"parallel=fsdp1 is not available in torch {torch.__version__}; use parallel=fsdp.") from e
    from torch.distributed.fsdp.wrap import CustomPolicy


    def mp(param_dtype: torch.dtype, buffer_dtype: torch.dtype = policy.buffer_dtype) -> MixedPrecision:
        # No input casting under autocast (root included): it would make the
        # residual stream bf16/fp16 (see PrecisionPolicy.gather_dtype).
        return MixedPrecision(param_dtype=param_dtype, reduce_dtype=policy.reduce_dtype,
                              buffer_dtype=buffer_dtype, cast_forward_inputs=policy.wrapper_casts_inputs,
                              cast_root_forward_inputs=policy.wrapper_casts_inputs,
                              _module_classes_to_ignore=())  # norms are handled below, not by FSDP1's fp32 override

    # Blocks gather their linears in the compute dtype; each norm inside a block is
    # its own unit in the storage dtype (FSDP1 flattens a unit into one flat
    # parameter of one dtype, so a block's two norms cannot share a unit the way
    # FSDP2's module list lets them). The root keeps the rest, in the storage
    # dtype: embeddings, the tied head and the final norm. A module whose buffers
    # must stay fp32 (``fp32_buffers``: the mixture's router) is a unit of its own
    # whose buffer dtype is fp32: FSDP1 casts each unit's buffers to its buffer dtype.
    kept = {m for blk in model.blocks for m in blk.modules() if policy.keeps_storage_dtype(m)} \
        if policy.splits_gather else set()
    fp32_buffers = {m for m in model.modules() if getattr(m, "fp32_buffers", ())}

    def unit(module: nn.Module):
        if isinstance(module, Block):
            return {"mixed_precision": mp(policy.wrapper_param_dtype)}
        if module in kept or module in fp32_buffers:
            return {"mixed_precision": mp(policy.gather_dtype(module),
                                          torch.float32 if module in fp32_buffers else policy.buffer_dtype)}
        return False

    wrapped = FSDP(
        model,
        auto_wrap_policy=CustomPolicy(unit),
        mixed_precision=mp(policy.param_dtype),
        device_id=ctx.device,  # explicit: FSDP1 otherwise refuses a CPU-only machine
        use_orig_params=True,
    )
    return wrapped
