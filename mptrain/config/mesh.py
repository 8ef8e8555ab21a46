"""The device mesh a run asks for: ``parallel.dp_replicate x dp_shard x tp``.

Resolved from the config and the launch alone (world size, ranks per node),
so the checks, the memory estimator and the advisor see the same sizes the
run will build (``mptrain/distributed/parallel.py``).

Rank order: ``tp`` varies fastest, then ``dp_shard``, then ``dp_replicate``
(torch's ``init_device_mesh`` order). With ``torchrun`` placing consecutive
ranks on one node, a ``tp`` or ``dp_shard`` that divides the ranks per node
stays inside a node, and ``dp_replicate`` spans the nodes.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from mptrain.core.errors import ConfigError

# The wrappers that build a mesh (FSDP2); the others take the whole world as one data-parallel group.
MESH_MODES = ("fsdp", "hsdp", "fsdp_tp")
DIMS = ("dp_replicate", "dp_shard", "tp")
# The mesh's guards that debug.unguarded may switch off (to rehearse what each prevents).
GUARDS = ("tp_reduce_dtype",)


@dataclass(frozen=True)
class MeshShape:
    """Sizes of the three mesh dimensions; their product is the world size."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    ep: int = 1
    """Expert parallelism: the routed experts split over this many of the ``dp_shard``
    ranks (consecutive ones: ep varies fastest inside dp_shard). Not a dimension of the
    product: it divides ``dp_shard``, whose ranks still see different data."""

    @property
    def edp(self) -> int:
        """The ``dp_shard`` ranks that hold the same experts (``dp_shard / ep``): FSDP shards
        the experts over them, as it shards the rest of the model over ``dp_shard``."""
        return self.dp_shard // self.ep

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp(self) -> int:
        """Ranks that see different data: both data-parallel dimensions."""
        return self.dp_replicate * self.dp_shard

    def text(self) -> str:
        """``2 x 2 x 1 (dp_replicate x dp_shard x tp)``, for the banner and errors; with
        expert parallelism ``..., experts over ep=2 of the dp_shard ranks``."""
        experts = f", experts over ep={self.ep} of the dp_shard ranks" if self.ep > 1 else ""
        return f"{self.dp_replicate} x {self.dp_shard} x {self.tp} (dp_replicate x dp_shard x tp){experts}"

    def as_dict(self) -> dict:
        """The sizes by name; ``ep`` only where it splits (records of runs without it keep their keys)."""
        out = {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "tp": self.tp}
        return {**out, "ep": self.ep} if self.ep > 1 else out


def _mode(pcfg: Any) -> str:
    name = pcfg.name
    return str(getattr(name, "value", name))


# Why a wrapper without a mesh cannot take mesh sizes, for the one-line refusal.
_NO_MESH = {"none": "parallel=none runs one process without a wrapper",
            "ddp": "parallel=ddp keeps a whole model on every rank",
            "fsdp1": "parallel=fsdp1 (FSDP1) takes no device mesh"}


def _no_mesh(mode: str, odd: dict) -> str:
    """The refusal of mesh sizes on ``ddp``/``fsdp1``/``none``, with the FSDP2
    preset that carries them (every FSDP2 preset takes any sizes)."""
    sizes = " ".join(f"parallel.{d}={v}" for d, v in odd.items())
    keys = " and ".join(f"parallel.{d}" for d in odd)
    preset = "fsdp_tp" if "tp" in odd else "hsdp" if "dp_replicate" in odd else "fsdp"
    return (f"{sizes} needs an FSDP2 device mesh, and {_NO_MESH[mode]}: use parallel={preset} {sizes}, "
            f"or leave {keys} at {'its default' if len(odd) == 1 else 'their defaults'}.")


def ranks_per_node(world: int) -> int:
    """torchrun's ``LOCAL_WORLD_SIZE`` (ranks on this node); the whole world without it."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world))


def mesh_shape(pcfg: Any, world: int, per_node: int | None = None) -> MeshShape:
    """The mesh of ``parallel`` on ``world`` ranks (``per_node`` of them on each
    node), or one :class:`ConfigError` naming the sizes and the fix."""
    per_node = ranks_per_node(world) if per_node is None else per_node
    mode = _mode(pcfg)
    given = {d: int(getattr(pcfg, d)) for d in DIMS}
    ep = int(getattr(pcfg, "ep", 1))
    if ep < 1:
        raise ConfigError(f"parallel.ep={ep} is not a size; use a positive number of ranks to split the experts "
                          "over (1: every rank holds every expert).")
    if mode not in MESH_MODES:
        odd = {d: v for d, v in given.items() if v not in ((-1, 1) if d == "dp_shard" else (1,))}
        if ep > 1:
            odd["ep"] = ep
        if odd:
            raise ConfigError(_no_mesh(mode, odd))
        return MeshShape(1, world, 1)  # every rank its own batches (parallel=none on several ranks is refused at setup)
    sizes = {}
    for d, v in given.items():
        if v == 0:
            v = max(1, world // per_node) if d == "dp_replicate" else per_node
        if v < -1:
            raise ConfigError(f"parallel.{d}={v} is not a size; use a positive size, -1 (the rest) or 0 "
                              "(dp_replicate: the number of nodes; dp_shard, tp: the ranks of one node).")
        sizes[d] = v
    rest = [d for d, v in sizes.items() if v == -1]
    if len(rest) > 1:
        raise ConfigError(f"parallel.{rest[0]} and parallel.{rest[1]} are both -1 ('the rest'); set one of them.")
    known = 1
    for d, v in sizes.items():
        known *= v if v != -1 else 1
    if rest:
        if world % known:
            others = " x ".join(f"parallel.{d}={v}" for d, v in sizes.items() if d != rest[0])
            raise ConfigError(f"{others} (= {known}) does not divide the world size {world}, so "
                              f"parallel.{rest[0]}=-1 has no whole size to take; use sizes whose product divides "
                              f"{world}.")
        sizes[rest[0]] = world // known
    shape = MeshShape(**sizes, ep=ep)
    if shape.world != world:
        given = " x ".join(f"parallel.{d}={v}" for d, v in sizes.items())
        raise ConfigError(f"the mesh {given} = {shape.world} ranks, but the world size is {world}: make the "
                          f"product equal {world}, or set one size to -1 to take the rest.")
    if ep > 1:
        _check_ep(shape)
    return shape


def _check_ep(shape: MeshShape) -> None:
    """Expert parallelism's rules against the mesh, one ConfigError each."""
    ep = shape.ep
    if shape.tp > 1:
        raise ConfigError(f"parallel.ep={ep} with parallel.tp={shape.tp}: expert parallelism is not built beside "
                          "tensor parallelism (the mixture's blocks have no tensor-parallel layout); use "
                          "parallel.tp=1.")
    if shape.dp_shard % ep:
        raise ConfigError(f"parallel.ep={ep} does not divide parallel.dp_shard={shape.dp_shard}: the experts are "
                          f"split over ep of the dp_shard ranks, in groups of {ep}; use an ep that divides "
                          f"{shape.dp_shard}.")


def tp_said(given: int, tp: int) -> str:
    """``parallel.tp`` as a refusal names it: with the size it stands for when
    the config says 0 (the ranks of a node) or -1 (the rest of the world)."""
    if given == tp:
        return f"parallel.tp={tp}"
    return f"parallel.tp={given} ({'the ranks of one node' if given == 0 else 'the rest of the world'}: {tp})"


def check_unguarded(names: Any) -> None:
    """``debug.unguarded`` names only known guards (a misspelt one would leave the guard on unnoticed)."""
    unknown = [n for n in names if n not in GUARDS]
    if unknown:
        raise ConfigError(f"debug.unguarded names {', '.join(map(str, unknown))}, which is not a guard of the mesh; "
                          f"the guards are {', '.join(GUARDS)}.")

