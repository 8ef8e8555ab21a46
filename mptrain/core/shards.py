"""The part of a parameter or gradient that lives on this rank."""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2 parameters and gradients); any other
    tensor as it is (plain tensors, FSDP1's flat shards, DDP replicas).

    Reads the DTensor's local tensor directly instead of calling ``to_local()``:
    no operator is dispatched, so this also works inside a TorchDispatchMode
    (the dtype audit) and on the fake tensors DTensor's sharding propagation
    passes through one.
    """
    return t._local_tensor if isinstance(t, DTensor) else t
