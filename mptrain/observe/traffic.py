"""Communication per training step, per mesh dimension, ON PAPER: ``python -m mptrain.memory ... --comm``.

An estimate from the model's shapes and the configuration, not a
measurement: for one rank and one optimizer step, every collective the
wrappers issue, by mesh dimension (``dp_shard``, ``dp_replicate``, ``tp``),
kind and dtype, with its calls and its *payload*: the full-size side of the
collective (the gathered output of an all-gather, the unreduced input of a
reduce-scatter, the buffer of an all-reduce), the figure the precision
settings change. What a ring algorithm puts on the wire per rank is
``(n-1)/n`` of that payload for an all-gather or a reduce-scatter over ``n``
ranks and ``2(n-1)/n`` for an all-reduce (:meth:`Flow.wire`).

What each wrapper issues (checked collective by collective against the
counter of ``monitor.comm`` on 2 gloo ranks, gpt-nano and llama-nano in
bf16, ``parallel=fsdp`` and ``fsdp_tp`` with and without sequence
parallelism; docs/distributed.md):

- FSDP2 on ``dp_shard``, per micro-batch: each block's linears all-gathered
  twice (forward, and again for the backward), in the gather dtype
  (``precision.param_dtype``, float8 under tensorwise float8 with
  ``fsdp_float8_all_gather``), its norms twice in the storage dtype, the root
  (embeddings, head, final norm) once in the storage dtype; per step every
  gradient reduce-scattered once in ``precision.reduce_dtype``. Of a TP
  rank's part of each tensor.
- HSDP on ``dp_replicate``, per step: the reduce-scattered gradient shards
  all-reduced across the replicas in ``reduce_dtype``.
- Tensor parallelism on ``tp`` (``distributed/tensor_parallel.py``), per
  micro-batch of ``B x T`` tokens, each payload ``B x T x d_model`` elements:
  with sequence parallelism, before each half of a block an all-gather of the
  norm's output (the residual stream's dtype) and after it a reduce-scatter
  of the half's output (the compute dtype), the backward pass the mirror
  image (the fan-out linears of a half share one input, so their input
  gradients cross once per half); without it an all-reduce after each half
  and one of each half's input gradient in the backward. The embedding
  output is all-reduced (vocabulary-split table), the logits all-gathered
  (``B x T x vocab``, compute dtype), GPT's fused qkv output gathered to whole
  heads and its gradient reduce-scattered back; under sequence parallelism
  the norms' weight gradients (partial sums over the sequence) are
  all-reduced in ``reduce_dtype`` once per micro-batch. Checkpointed blocks
  (``train.activation_checkpointing=block``) run their forward collectives
  again when the backward pass recomputes them, all but the last (torch's
  non-reentrant checkpoint stops recomputing at the last tensor the backward
  needs: the MLP's output reduction is not rerun; counted with SP).

Left out: scalars (the loss and gradient-norm reductions, float8 amax
all-reduces), the checks' and monitors' own collectives, and which linears a
float8 configuration excludes (every block linear counts as converted).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import torch.nn as nn

from mptrain.config.mesh import MESH_MODES, MeshShape
from mptrain.distributed.expert_parallel import TILE
from mptrain.observe.memory import BYTES, meta_model, shard_numel, tp_dims, tp_shape
from mptrain.plan.plan import Plan
from mptrain.precision.formats import dtype_name

FP8_ALL_GATHER = "float8_e4m3"
"""The dtype tensorwise float8 weights are all-gathered in (1 byte)."""


@dataclass(frozen=True)
class Flow:
    """One kind of collective on one mesh dimension in one dtype, summed over a step on one rank."""

    dim: str
    """``dp_shard``, ``dp_replicate`` or ``tp`` (``dp`` for DDP's whole world)."""
    kind: str
    """``all_gather``, ``reduce_scatter`` or ``all_reduce``."""
    dtype: str
    what: str
    """Which tensors, in words."""
    calls: int
    """Collectives per step."""
    payload: int
    """Bytes: the full-size side of each call, summed."""

    def wire(self, ranks: int) -> float:
        """Bytes a ring algorithm sends per rank over ``ranks`` ranks: (n-1)/n of
        the payload for an all-gather or reduce-scatter, twice that for an all-reduce."""
        if ranks <= 1:
            return 0.0
        share = (ranks - 1) / ranks
        return self.payload * share * (2 if self.kind == "all_reduce" else 1)


@dataclass(frozen=True)
class _Parts:
    """A TP rank's elements of the model, as the FSDP units group them."""

    linears: int  # every block's linear layers (one TP rank's part)
    norms: int  # every block's norms
    root: int  # embeddings, head, final norm
    replicated: int  # parameters every TP rank holds whole inside the split stream (the norms)
    n_norm_params: int


def _parts(model, tp: int) -> _Parts:
    """:class:`_Parts` of ``model`` (unwrapped, meta) on one of ``tp`` ranks."""
    dims = tp_dims(model)
    part = {name: tp_shape(tuple(p.shape), dims[name], tp) for name, p in model.named_parameters()}
    linear = {f"{n}.{pn}" for n, mod in model.named_modules() if isinstance(mod, nn.Linear) and n.startswith("blocks.")
              for pn, _ in mod.named_parameters(recurse=False)}
    size = {n: math.prod(s) for n, s in part.items()}
    blocks = {n for n in size if n.startswith("blocks.")}
    norms = [n for n in blocks if n not in linear] + [n for n in size if n.startswith("ln_f.")]
    return _Parts(sum(size[n] for n in linear), sum(size[n] for n in blocks - linear),
                  sum(v for n, v in size.items() if n not in blocks), sum(size[n] for n in norms), len(norms))


def traffic(plan: Plan, vocab: int, micro_batch: Optional[int] = None) -> list[Flow]:
    """Every collective of one optimizer step on one rank of the run ``plan``, on paper
    (``micro_batch``: sequences per forward instead of the plan's); see the module's
    docstring for what each wrapper issues. Empty on one rank."""
    mode, mesh, world = plan.parallel.name, plan.parallel.mesh, plan.world
    if world <= 1 or mode == "none":
        return []
    model = meta_model(plan.model, vocab)
    mbs = micro_batch or plan.batches.micro_batch
    accum = max(1, plan.batches.global_batch // mesh.dp // mbs)
    p = plan.precision
    store = plan.optimizer.param_dtype
    reduce = dtype_name(p.reduce_dtype)
    if mode == "ddp":
        n = sum(math.prod(tuple(t.shape)) for t in model.parameters())
        return [Flow("dp", "all_reduce", reduce, "gradients (DDP buckets)", 1, n * BYTES[reduce])]
    if mode not in MESH_MODES:  # fsdp1: flat shards over the whole world, about FSDP2's volumes
        mesh = MeshShape(1, world, 1)
    parts = _parts(model, mesh.tp)
    experts = sum(t.numel() for n, t in model.named_parameters() if ".mlp.experts." in n)
    if mesh.ep > 1:  # the experts are FSDP units of their own, on edp: out of dp_shard's flows
        parts = dataclasses.replace(parts, linears=parts.linears - experts)
    flows = _fsdp(plan, mesh, parts, store, accum, model)
    if mesh.ep > 1:
        flows += _experts(plan, mesh, experts // mesh.ep, store, mbs * plan.model.block_size, accum, model)
    if mesh.tp > 1:
        flows += _tensor_parallel(plan, mesh, parts, store, mbs * plan.model.block_size * accum, accum, vocab, model)
    return [f for f in flows if f.calls]


def _fsdp(plan: Plan, mesh: MeshShape, parts: _Parts, store: str, accum: int, model) -> list[Flow]:
    """FSDP's gathers and reduce-scatters on ``dp_shard``, HSDP's all-reduce on ``dp_replicate``."""
    p, L = plan.precision, plan.model.n_layer
    gather = FP8_ALL_GATHER if p.float8_gather else dtype_name(p.wrapper_param_dtype)
    gb = {**BYTES, FP8_ALL_GATHER: 1}
    reduce = dtype_name(p.reduce_dtype)
    split = gather != store  # linears and norms in separate units (PrecisionPolicy.splits_gather)
    units = L * (2 if split else 1) + 1
    out = []
    if mesh.dp_shard > 1:
        out += [Flow("dp_shard", "all_gather", gather, "block linears, forward + backward, per micro-batch",
                     2 * L * accum, 2 * accum * parts.linears * gb[gather])]
        if split:
            out.append(Flow("dp_shard", "all_gather", store, "block norms, forward + backward, per micro-batch",
                            2 * L * accum, 2 * accum * parts.norms * BYTES[store]))
        else:
            out[-1] = Flow("dp_shard", "all_gather", gather, "blocks, forward + backward, per micro-batch",
                           2 * L * accum, 2 * accum * (parts.linears + parts.norms) * gb[gather])
        out += [Flow("dp_shard", "all_gather", store, "root (embeddings, head, final norm), per micro-batch",
                     accum, accum * parts.root * BYTES[store]),
                Flow("dp_shard", "reduce_scatter", reduce, "every gradient, once per step", units,
                     (parts.linears + parts.norms + parts.root) * BYTES[reduce])]
    if mesh.dp_replicate > 1:
        dims = tp_dims(model)
        shard = sum(shard_numel(tp_shape(tuple(t.shape), dims[n], mesh.tp), mesh.dp_shard)
                    for n, t in model.named_parameters())
        out.append(Flow("dp_replicate", "all_reduce", reduce, "gradient shards across replicas, once per step",
                        units, shard * BYTES[reduce]))
    return out


def _experts(plan: Plan, mesh: MeshShape, held: int, store: str, tokens: int, accum: int, model) -> list[Flow]:
    """Expert parallelism's flows, ``held`` expert weights on this rank, ``tokens`` per micro-batch:
    on ``ep`` per routed layer and micro-batch the counts' all-to-all (int64, one per expert),
    the rows to the experts in the dispatch dtype and the outputs back in the compute dtype
    (again in the recompute of checkpointed blocks), the mirror image in the backward (the
    outputs' gradients in the compute dtype, the rows' in the residual stream's); on ``edp``
    FSDP's gathers and reduce-scatter of the held experts (as ``_fsdp``'s linears). Balanced
    routing is assumed: a rank receives as many rows as it sends (its own included)."""
    p, m = plan.precision, plan.model
    layers = sum(1 for n, _ in model.named_modules() if n.endswith(".mlp.router"))
    rows = tokens * int(m.moe.top_k)
    d = int(m.d_model)
    c = dtype_name(p.compute_dtype)
    dispatch = plan.parallel.ep_dispatch
    fwd = 2 if plan.train.activation_checkpointing.value == "block" else 1
    again = " (again in the recompute of checkpointed blocks)" if fwd == 2 else ""
    n = layers * accum
    if dispatch == "fp8":
        tiles = d // TILE if d % TILE == 0 else 1
        sent = [Flow("ep", "all_to_all", "float8_e4m3", f"token rows to their experts (forward){again}", fwd * n,
                     fwd * n * rows * d),
                Flow("ep", "all_to_all", "fp32", f"their fp8 scales, one per 128 features{again}", fwd * n,
                     fwd * n * rows * tiles * 4)]
    else:
        wire = c if dispatch == "compute" else dispatch
        sent = [Flow("ep", "all_to_all", wire, f"token rows to their experts (forward){again}", fwd * n,
                     fwd * n * rows * d * BYTES[wire])]
    out = [Flow("ep", "all_to_all", "int64", f"rows per expert, before each dispatch{again}", fwd * n,
                fwd * n * int(m.moe.n_experts) * 8), *sent,
           Flow("ep", "all_to_all", c, f"expert outputs back (forward){again}, their gradients out (backward)",
                (fwd + 1) * n, (fwd + 1) * n * rows * d * BYTES[c]),
           Flow("ep", "all_to_all", store, "the rows' gradients back (backward)", n, n * rows * d * BYTES[store])]
    if mesh.edp > 1 or mesh.dp_replicate > 1:
        gather = dtype_name(p.wrapper_param_dtype)
        reduce = dtype_name(p.reduce_dtype)
        if mesh.edp > 1:
            out += [Flow("edp", "all_gather", gather, "the held experts, forward + backward, per micro-batch",
                         2 * n, 2 * accum * held * BYTES[gather]),
                    Flow("edp", "reduce_scatter", reduce, "the held experts' gradients, once per step", layers,
                         held * BYTES[reduce])]
        if mesh.dp_replicate > 1:
            out.append(Flow("dp_replicate", "all_reduce", reduce, "expert gradient shards across replicas",
                            layers, shard_numel((held,), mesh.edp) * BYTES[reduce]))
    return out


def _tensor_parallel(plan: Plan, mesh: MeshShape, parts: _Parts, store: str, tokens: int, accum: int, vocab: int,
                     model) -> list[Flow]:
    """Tensor parallelism's activation collectives on ``tp``; ``tokens``: the step's, per rank."""
    m, L = plan.model, plan.model.n_layer
    c, r = dtype_name(plan.precision.compute_dtype), store  # the halves' outputs; the residual stream and norms
    u = tokens * m.d_model  # one B x T x d_model activation per micro-batch, summed over the step
    fused = plan.family.split.fused_qkv is not None  # gathered to whole heads, its gradient scattered back
    sp = plan.parallel.sequence_parallel
    bc, br = BYTES[c], BYTES[r]
    # A checkpointed block runs its forward again in the backward pass, collectives included,
    # up to the last tensor the backward needs: the MLP's output reduction is not rerun.
    ckpt = plan.train.activation_checkpointing.value == "block"
    fwd, halves = (2, 3) if ckpt else (1, 2)
    again = " (again in the recompute of checkpointed blocks)" if ckpt else ""
    redo = " (the attention half's again in the recompute)" if ckpt else ""
    ag_c, rs_c = [("logits (B x T x vocab)", accum, tokens * vocab * bc)], []
    if fused:
        ag_c.append((f"GPT's fused qkv output, to whole heads{again}", fwd * L * accum, fwd * L * 3 * u * bc))
        rs_c.append(("GPT's fused qkv gradient", L * accum, L * 3 * u * bc))
    # a half's fan-out linears share one input: their gradients cross once per half
    half_in = ("each half's input gradient (backward)", 2 * L * accum, 2 * L * u * br)
    ar_r = [("embedding output (vocabulary-split table)", accum, u * br)]
    rd = dtype_name(plan.precision.reduce_dtype)
    rows = []
    if sp:
        rows += [("all_gather", r, f"norm outputs before each half (forward){again}", fwd * 2 * L * accum,
                  fwd * 2 * L * u * br),
                 ("all_gather", r, "final norm output, embedding gradient", 2 * accum, 2 * u * br),
                 ("all_gather", c, "each half's output gradient (backward)", 2 * L * accum, 2 * L * u * bc),
                 ("reduce_scatter", c, f"each half's output (forward){redo}", halves * L * accum,
                  halves * L * u * bc),
                 ("reduce_scatter", r, "the head's input gradient", accum, u * br),
                 ("reduce_scatter", r, *half_in),
                 ("all_reduce", rd, "norm weight gradients (partial over the sequence), in the reduce dtype, "
                  "once per micro-batch", parts.n_norm_params * accum, parts.replicated * BYTES[rd] * accum)]
    else:
        rows += [("all_reduce", c, f"each half's output (forward){redo}", halves * L * accum,
                  halves * L * u * bc)]
        ar_r += [("the head's input gradient", accum, u * br), half_in]
    rows += [("all_gather", c, *x) for x in ag_c] + [("reduce_scatter", c, *x) for x in rs_c]
    rows += [("all_reduce", r, *x) for x in ar_r]
    return [Flow("tp", kind, dt, what, calls, payload) for kind, dt, what, calls, payload in rows]


def _sizes(mesh: MeshShape) -> dict[str, int]:
    """Ranks per dimension a flow can run on."""
    return {**mesh.as_dict(), "ep": mesh.ep, "edp": mesh.edp, "dp": mesh.world}


def by_dim(flows: list[Flow], mesh: MeshShape) -> dict[str, tuple[int, float]]:
    """(payload, ring wire bytes) per mesh dimension, summed over its flows."""
    sizes = _sizes(mesh)
    out: dict[str, tuple[int, float]] = {}
    for f in flows:
        pay, wire = out.get(f.dim, (0, 0.0))
        out[f.dim] = (pay + f.payload, wire + f.wire(sizes[f.dim]))
    return out


def _human(n: float) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


def format_traffic(flows: list[Flow], mesh: MeshShape) -> list[str]:
    """The table ``python -m mptrain.memory --comm`` prints, with the totals per dimension."""
    head = ["communication per optimizer step on one rank, ON PAPER (an estimate from the shapes, not a "
            "measurement; payload: the full-size side of each collective, ring: what a ring algorithm sends "
            "per rank)"]
    if not flows:
        return head + ["  none: one rank, or every mesh dimension of size 1"]
    sizes = _sizes(mesh)
    width = max(len(f.what) for f in flows)
    lines = head + [f"  {'dim':<12} {'collective':<14} {'dtype':<11} {'calls':>6} {'payload':>11} "
                    f"{'ring':>11}  {'what':<{width}}"]
    for f in flows:
        lines.append(f"  {f.dim:<12} {f.kind:<14} {f.dtype:<11} {f.calls:>6} {_human(f.payload):>11} "
                     f"{_human(f.wire(sizes[f.dim])):>11}  {f.what}")
    for dim, (pay, wire) in by_dim(flows, mesh).items():
        lines.append(f"  total on {dim} ({sizes[dim]} ranks): payload {_human(pay)}, ring {_human(wire)}")
    return lines
