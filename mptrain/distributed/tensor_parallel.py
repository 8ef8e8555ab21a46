"""Tensor parallelism (and sequence parallelism) for both model families.

Megatron's layout, through torch's ``parallelize_module``: in each block the
projections that fan out (attention's q/k/v or GPT's fused qkv, the MLP's
up/gate/fc) are split by output column, the ones that fan in (attention's
output, the MLP's down/proj) by input row, so a block costs one gather before
and one reduction after each half, and a rank holds ``1/tp`` of the heads and
of the MLP width. The token embedding and the head are split over the
vocabulary (a tied head shares the embedding's split matrix).

With ``parallel.sequence_parallel`` the residual stream between the halves
is split over the sequence instead of repeated on every TP rank: the norms
run on a rank's ``T/tp`` positions, the gather before a half is an
all-gather and the reduction after it a reduce-scatter.

Nothing here changes what the model computes: the logits every rank sees
are the whole ones, and the loss is one process's loss on the same batch up
to the order of the row-split matmuls' partial sums (fp32 rounding).
"""
from __future__ import annotations

import warnings

import torch
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

# Per family: (the fan-out projections, the fan-in ones), by attribute path in a block.
_SPLITS = {
    "gpt": (("attn.qkv", "mlp.fc"), ("attn.proj", "mlp.proj")),
    "llama": (("attn.q", "attn.k", "attn.v", "mlp.gate", "mlp.up"), ("attn.o", "mlp.down")),
}


def family_of_model(model: nn.Module) -> str:
    """``gpt`` or ``llama``, from the block's attention (no config needed)."""
    return "gpt" if hasattr(model.blocks[0].attn, "qkv") else "llama"


def block_plan(family: str, sequence_parallel: bool, colwise=ColwiseParallel, rowwise=RowwiseParallel) -> dict:
    """The ``parallelize_module`` plan of one block. ``colwise``/``rowwise``
    are the styles of the linears (torchao's float8 ones for float8 linears)."""
    fan_out, fan_in = _SPLITS[family]
    between = Shard(1) if sequence_parallel else Replicate()  # the residual stream's layout
    plan: dict = {name: colwise() for name in fan_out}
    plan.update({name: rowwise(output_layouts=between) for name in fan_in})
    if sequence_parallel:
        for norm, half in (("ln_1", "attn"), ("ln_2", "mlp")):
            plan[norm] = SequenceParallel()
            plan[half] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                            use_local_output=True)
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


def apply(model: nn.Module, mesh: DeviceMesh, sequence_parallel: bool, colwise=ColwiseParallel,
          rowwise=RowwiseParallel) -> nn.Module:
    """Split ``model`` (either family, unwrapped) over the 1-D ``mesh``, in place."""
    family = family_of_model(model)
    # The head's gathered logits come back as a view of the collective's buffer, and
    # FSDP2 warns, on every rank, that an in-place op on a view its root returns would
    # skip its backward hook. Nothing writes into the logits in place (the loss reads
    # them), so the warning says nothing about this run: dropped, by its own words only.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(\w+\) returned a view tensor")
    for i, block in enumerate(model.blocks):
        plan = block_plan(family, sequence_parallel, colwise, rowwise)
        if family == "gpt":
            plan["attn.qkv"] = colwise(use_local_output=False)
        parallelize_module(block, mesh, plan)
        if sequence_parallel and i == 0:  # the embeddings hand over the whole sequence: keep this rank's part
            parallelize_module(block, mesh, PrepareModuleInput(input_layouts=(Replicate(),),
                                                               desired_input_layouts=(Shard(1),),
                                                               use_local_output=True))
        if family == "gpt":
            block.attn.qkv.register_forward_hook(_gather_fused_qkv)
    between = Shard(1) if sequence_parallel else Replicate()
    top = {
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "lm_head": ColwiseParallel(input_layouts=between, output_layouts=Replicate()),
    }
    if sequence_parallel:
        top["ln_f"] = SequenceParallel()
    parallelize_module(model, mesh, top)
    model.tie_weights()  # a tied head takes the embedding's (vocabulary-split) matrix again
    return model
