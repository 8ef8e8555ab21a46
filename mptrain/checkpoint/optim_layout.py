"""How optimizer state is laid out in a checkpoint: plain tensors only.

torchao's quantized Adam moments (``optim.state_dtype=8bit|4bit|fp8``) are
tensor subclasses; each is saved as its parts (``<param>.exp_avg.codes``,
``.scale``, ``.qmap``) and rebuilt around the loaded parts
(:func:`plain_optim_state`, :func:`rebuild_quantized`). Under FSDP2 on several
ranks every rank quantized its own shard in its own blocks, so the parts go
under a key of that rank (``<param>.exp_avg.rank1of2.codes``); such a
checkpoint resumes only with the wrapper and world size it was saved with
(:func:`quantized_layout_refusal`). The learning rate torchao keeps as a 0-d
tensor, torch-optimi's per-group step and its Kahan buffers are plain tensors
and need nothing of this.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from torch.distributed.tensor import DTensor

from mptrain.config.mesh import MESH_MODES, MeshShape
from mptrain.core.shards import local_shard
from mptrain.plan.plan import Plan
from mptrain.precision.optimizers import QUANTIZED, state_parts, stored_as


def _sharded_key(t: torch.Tensor) -> Optional[str]:
    """``rank<R>of<W>`` for a state tensor split across ranks (FSDP2 on more than one),
    None for one every rank holds whole."""
    if isinstance(t, DTensor) and t.device_mesh.size() > 1 and any(p.is_shard() for p in t.placements):
        return f"rank{t.device_mesh.get_rank()}of{t.device_mesh.size()}"
    return None


def plain_optim_state(osd: dict) -> tuple[dict, list]:
    """``osd`` (``get_state_dict``'s optimizer state) with every torchao quantized
    moment replaced by a dict of its plain tensors (``codes``, ``scale``, ``qmap``),
    and the list of what was replaced, for :func:`rebuild_quantized`.

    Why: DCP would otherwise pickle the subclass itself into the shard, and
    unpickling it means importing and running torchao's code from a checkpoint
    file. Where the moment is a shard of an FSDP2 DTensor, its parts go one
    level deeper, under the rank's own key: each rank quantized its own shard
    (its own codes, its own block scales), and DCP keeps a single copy of a
    plain tensor that several ranks save under the same key. The parts are the
    moment's own tensors, so loading into them fills the moment in place."""
    state, replaced = {}, []
    for fqn, entry in osd["state"].items():
        entry = dict(entry)
        for k, v in list(entry.items()):
            if torch.is_tensor(v) and stored_as(v) in QUANTIZED:
                parts, shard = dict(state_parts(v)), _sharded_key(v)
                entry[k] = {shard: parts} if shard else parts
                replaced.append((fqn, k, v, shard))
        state[fqn] = entry
    return {**osd, "state": state}, replaced


def rebuild_quantized(osd: dict, replaced: list) -> dict:
    """The optimizer state of :func:`plain_optim_state` with each quantized moment
    rebuilt from its (loaded) parts: the same subclass, flags and shape as the
    moment it replaced, wrapped in the same DTensor placement under FSDP2."""
    state = {fqn: dict(entry) for fqn, entry in osd["state"].items()}
    for fqn, k, was, shard in replaced:
        parts = state[fqn][k][shard] if shard else state[fqn][k]
        local = local_shard(was)
        names, flags = local.__tensor_flatten__()
        moment = type(local).__tensor_unflatten__({n: parts[n] for n in names}, flags, local.shape, local.stride())
        if isinstance(was, DTensor):
            moment = DTensor.from_local(moment, was.device_mesh, was.placements, run_check=False,
                                        shape=was.shape, stride=was.stride())
        state[fqn][k] = moment
    return {**osd, "state": state}


def _quantized_layout(state_dtype, parallel: str, world: int) -> Optional[str]:
    """How a run stores quantized moments in a checkpoint: ``per-rank`` (FSDP2 on
    several ranks: see :func:`plain_optim_state`), ``whole``, or None (none quantized)."""
    state_dtype = getattr(state_dtype, "value", state_dtype)
    if state_dtype not in QUANTIZED:
        return None
    return "per-rank" if parallel in MESH_MODES and world > 1 else "whole"


def quantized_layout_refusal(path: Path, meta: dict, plan: Plan) -> Optional[str]:
    """Why checkpoint ``path`` (its ``meta``) cannot be loaded by the run of ``plan``, or
    None. Quantized moments saved per rank under FSDP2 load only under
    the same wrapper and world size: their blocks and scales were taken over
    each rank's shard, and another split of the tensor needs other blocks."""
    saved_state = meta.get("config", {}).get("optim", {}).get("state_dtype")
    saved_parallel, saved_world = meta.get("parallel"), meta.get("world_size")
    # A checkpoint from before the mesh: FSDP split over every rank, as dp_shard = world does.
    saved_mesh = meta.get("mesh") or MeshShape(1, saved_world or 1, 1).as_dict()
    saved = _quantized_layout(saved_state, saved_parallel, saved_world)
    now_parallel, world = plan.parallel.name, plan.world
    now = _quantized_layout(plan.optim.state_dtype, now_parallel, world)
    if saved is None or now is None or (saved, now) == ("whole", "whole"):
        return None
    now_mesh = plan.parallel.mesh.as_dict()
    if (saved_parallel in MESH_MODES) == (now_parallel in MESH_MODES) and (saved_world, saved_mesh) == (world, now_mesh):
        return None
    how = (f"within each of its {saved_world} ranks' FSDP shards" if saved == "per-rank"
           else "over whole tensors")
    return (f"checkpoint {path} holds {saved_state} Adam moments whose blocks and scales were taken {how}, and "
            f"this launch (parallel={now_parallel} on {world} rank{'s' if world > 1 else ''}"
            f"{_mesh_words(now_parallel, now_mesh)}) divides the tensors otherwise, so they do not carry over; "
            f"resume it with parallel={saved_parallel} on {saved_world} rank{'s' if saved_world > 1 else ''}"
            f"{_mesh_words(saved_parallel, saved_mesh, ' and')}, the layout it was saved with.")


def _mesh_words(parallel: str, mesh: dict, lead: str = ",") -> str:
    """``, mesh 1 x 2 x 2 (...)`` for a wrapper on a mesh; nothing for the others."""
    return f"{lead} mesh {MeshShape(**mesh).text()}" if parallel in MESH_MODES else ""
