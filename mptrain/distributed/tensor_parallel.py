"""Tensor parallelism (and sequence parallelism) for both model families.

Megatron's layout, through torch's ``parallelize_module``: in each block the
projections that fan out (attention's q/k/v or GPT's fused qkv, the MLP's
up/gate/fc) are split by output column, the ones that fan in (attention's
output, the MLP's down/proj) by input row, so a block costs one gather before
and one reduction after each half, and a rank holds ``1/tp`` of the heads and
of the MLP width. The token embedding and the head are split over the
vocabulary (a tied head shares the embedding's split matrix). Which linears
those are, and GPT's fused qkv, is the family spec's table
(:class:`mptrain.model.spec.TensorSplit`), found from the model's class.

With ``parallel.sequence_parallel`` the residual stream between the halves
is split over the sequence instead of repeated on every TP rank: the norms
run on a rank's ``T/tp`` positions, the gather before a half is an
all-gather and the reduction after it a reduce-scatter.

Nothing here changes what the model computes: the logits every rank sees
are the whole ones, and the loss is one process's loss on the same batch up
to the order of the row-split matmuls' partial sums (fp32 rounding).

Low precision. A split linear's casts must scale by the logical tensor, not a
rank's part of it (torchtitan #3109: NaN from amaxes of local shards). The
styles are chosen per linear (:func:`block_plan`): tensorwise float8 linears
get torchao's ``Float8ColwiseParallel``/``Float8RowwiseParallel``, which cast
the input as a DTensor before any gather (so its amax is the whole
activation's, and under sequence parallelism over NCCL the output gradient is
all-gathered in float8, :func:`float8_gathers`); every other linear keeps
torch's styles. There the layer receives DTensors and its own casts make the
scales whole: torchao's rowwise and MX casts and delayed scaling as DTensor
reductions, the lab's linears (nvfp4, mxfp4, lab) with explicit MAX
all-reduces (``labtrain.LabLinear``). tests/test_tp_precision.py checks each
against one process.
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from mptrain.model.families import model_spec
from mptrain.model.spec import TensorSplit


def float8_styles(linear: nn.Module) -> Optional[tuple[type, type]]:
    """torchao's float8 TP styles for a tensorwise ``Float8Linear``, else None.

    Those styles cast a layer's input to float8 as a DTensor, before any
    redistribution: the scale comes from the amax of the whole (logical)
    activation, and an all-gather of it moves float8 bytes. They cast with one
    scale per tensor whatever the layer's recipe says, so a rowwise layer keeps
    torch's plain styles: its input then reaches ``Float8Linear`` as a
    DTensor, whose amax along the unsplit feature dimension needs no other rank.
    """
    config = getattr(linear, "config", None)
    if type(linear).__name__ != "Float8Linear" or config is None:
        return None
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    casts = (config.cast_config_input, config.cast_config_weight, config.cast_config_grad_output)
    if all(c.scaling_granularity == ScalingGranularity.TENSORWISE for c in casts):
        return Float8ColwiseParallel, Float8RowwiseParallel
    return None


def moves_float8(mesh: DeviceMesh) -> bool:
    """Whether the mesh's collectives can carry float8 tensors: NCCL can, gloo
    cannot (it refuses the dtype), so a CPU run keeps its collectives in high precision."""
    return "nccl" in str(dist.get_backend(mesh.get_group()))


def float8_gathers(model: nn.Module, mesh: DeviceMesh, sequence_parallel: bool) -> bool:
    """Whether a split ``model`` moves float8 over the TP group: some linear took
    torchao's float8 styles (tensorwise float8, a backend that carries float8) and
    sequence parallelism all-gathers that linear's output gradient, which those
    styles cast to float8 first. The forward's activation all-gather before each
    half stays in high precision (the blocks' plain input preparation). For the
    banner and ``run_info``."""
    return (sequence_parallel and moves_float8(mesh)
            and any(float8_styles(m) is not None for m in model.modules()))


def _styles(block: nn.Module, name: str, colwise, rowwise, float8_ok: bool) -> tuple[type, type]:
    """The (colwise, rowwise) styles of linear ``name`` in ``block``: the given
    ones when the caller chose, else by the layer's kind (:func:`float8_styles`)
    where ``float8_ok``."""
    if colwise is not None and rowwise is not None:
        return colwise, rowwise
    mine = float8_styles(block.get_submodule(name)) if float8_ok else None
    return mine or (colwise or ColwiseParallel, rowwise or RowwiseParallel)


def block_plan(split: TensorSplit, sequence_parallel: bool, colwise=None, rowwise=None,
               block: Optional[nn.Module] = None, float8_ok: bool = True) -> dict:
    """The ``parallelize_module`` plan of one block of a family that ``split``
    describes. ``colwise``/``rowwise`` are the styles of the linears; None: chosen
    per linear of ``block`` (torchao's float8 ones for tensorwise float8 linears,
    torch's otherwise)."""
    between = Shard(1) if sequence_parallel else Replicate()  # the residual stream's layout

    def style(name: str, side: int):
        if block is None:
            return (colwise or ColwiseParallel, rowwise or RowwiseParallel)[side]
        return _styles(block, name, colwise, rowwise, float8_ok)[side]

    plan: dict = {s.path: style(s.path, 0)() for s in split.side(colwise=True)}
    plan.update({s.path: style(s.path, 1)(output_layouts=between) for s in split.side(colwise=False)})
    # Each half takes its input as one replicated DTensor that its fan-out linears
    # share: their input gradients (partial sums) add up on the rank and cross the TP
    # ranks once per half (a reduce-scatter with SP, an all-reduce without) instead of
    # once per linear, as when each linear wraps a plain tensor of its own.
    for norm, half in (("ln_1", "attn"), ("ln_2", "mlp")):
        if sequence_parallel:
            plan[norm] = SequenceParallel()
        plan[half] = PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),),
                                        use_local_output=False)
    return plan


def _gather_fused_qkv(module: nn.Module, inputs, output):
    """GPT's fused qkv, split by output column, gives a rank a contiguous slice
    of ``[q; k; v]``: not whole heads. Gather the full output and keep this
    rank's heads of each of q, k and v, in the ``[q_r; k_r; v_r]`` order the
    attention splits by thirds. The gradient flows back as a partial sum
    (each rank's nonzero columns), reduce-scattered to the weight's split."""
    mesh = output.device_mesh
    tp, r = mesh.size(), mesh.get_local_rank()
    full = output.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
    *lead, width = full.shape
    parts = full.view(*lead, 3, tp, width // (3 * tp)).select(-2, r)
    return parts.reshape(*lead, width // tp)


def apply(model: nn.Module, mesh: DeviceMesh, sequence_parallel: bool, colwise=None,
          rowwise=None) -> nn.Module:
    """Split ``model`` (either family, unwrapped, converted to its precision's
    linears) over the 1-D ``mesh``, in place. ``colwise``/``rowwise``: the
    linears' styles; None picks them per linear (:func:`block_plan`)."""
    split = model_spec(model).split
    fused = split.fused_qkv
    # The head's gathered logits come back as a view of the collective's buffer, and
    # FSDP2 warns, on every rank, that an in-place op on a view its root returns would
    # skip its backward hook. Nothing writes into the logits in place (the loss reads
    # them), so the warning says nothing about this run: dropped, by its own words only.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(\w+\) returned a view tensor")
    # torchao's float8 styles cast a gradient to float8 before sequence parallelism's
    # all-gather of it: only a backend that moves float8 can run them there.
    float8_ok = not sequence_parallel or moves_float8(mesh)
    for i, block in enumerate(model.blocks):
        plan = block_plan(split, sequence_parallel, colwise, rowwise, block, float8_ok)
        if fused:  # kept a DTensor, for the hook below to gather
            plan[fused] = _styles(block, fused, colwise, rowwise, float8_ok)[0](use_local_output=False)
        parallelize_module(block, mesh, plan)
        if sequence_parallel and i == 0:  # the embeddings hand over the whole sequence: keep this rank's part
            parallelize_module(block, mesh, PrepareModuleInput(input_layouts=(Replicate(),),
                                                               desired_input_layouts=(Shard(1),),
                                                               use_local_output=True))
        if fused:
            block.get_submodule(fused).register_forward_hook(_gather_fused_qkv)
    between = Shard(1) if sequence_parallel else Replicate()
    top = {
        split.embedding: RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        split.head: ColwiseParallel(input_layouts=between, output_layouts=Replicate()),
    }
    if sequence_parallel:
        top["ln_f"] = SequenceParallel()
    parallelize_module(model, mesh, top)
    model.tie_weights()  # a tied head takes the embedding's (vocabulary-split) matrix again
    return model


def reduce_tp_partials_in(model: nn.Module, dtype: torch.dtype) -> None:
    """Make the tensor-parallel gradient all-reduce run in ``dtype`` (the
    configured reduce dtype), as FSDP's own reduce-scatter does. Only sequence
    parallelism makes such partial gradients (without it every TP rank sees the
    whole input of what it holds whole), so only then are the hooks installed.

    A weight held whole on every TP rank but fed a split input (the norms
    under sequence parallelism) gets a partial-sum gradient on each rank.
    FSDP2 sums it over the TP ranks itself, but in the gradient's dtype,
    before it casts to its ``reduce_dtype`` (pytorch #190626): a bf16 reduce
    config would still all-reduce these in fp32, or not, depending on the
    path. A hook on each such parameter's gradient sums it over the TP ranks
    in ``dtype`` first and hands FSDP a whole (replicated) gradient, so the
    dtype is the configured one with and without gradient accumulation. The
    hooks go on the unsharded parameters FSDP hands each module in forward
    (registered once per parameter object, which FSDP2 reuses)."""
    hooked: set[int] = set()

    def reduce_partial(grad: torch.Tensor) -> torch.Tensor:
        places = getattr(grad, "placements", ())
        if not any(pl.is_partial() for pl in places):
            return grad
        whole = [Replicate() if pl.is_partial() else pl for pl in places]
        return grad.to(dtype).redistribute(placements=whole).to(grad.dtype)

    def hook_params(module: nn.Module, args) -> None:
        for param in module.parameters(recurse=False):
            if param.requires_grad and id(param) not in hooked:
                hooked.add(id(param))
                param.register_hook(reduce_partial)

    for module in model.modules():
        if any(True for _ in module.parameters(recurse=False)):
            module.register_forward_pre_hook(hook_params)
