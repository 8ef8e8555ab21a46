"""Sums whose rounding does not depend on how many threads compute them.

A full reduction on CPU (``t.sum()``) splits its input into one chunk per
OpenMP thread and adds the chunks' partial sums: the rounding, and so the last
bits of the result, follow the number of threads (1 and 3 threads give
different attention entropies from the same tensors). A reduction along a
dimension is different: each output is summed by one thread from start to end,
whatever the split. :func:`fixed_sum` sums rows of a fixed length first, then
the rows' sums, each level a reduction along a dimension or one small enough
to run on one thread, so that its order is fixed by the tensor's size alone.
(``torch.linalg.vector_norm`` needs none of this: it reduces the last
dimension of each output on one thread, a whole tensor included.)
"""
from __future__ import annotations

import torch

ROW = 1 << 14
"""Elements per row of the first level. Below ATen's grain size (32768): a
reduction of at most this many elements runs serially, on one thread."""


def _row_sums(rows: torch.Tensor) -> torch.Tensor:
    """float64 sum of each row of ``rows`` (2-D), accumulated in its own dtype."""
    return rows.sum(dim=1).double()


def fixed_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum of every element of ``t`` as a float64 0-d tensor on its device, in an
    order fixed by ``t.numel()``: the same bits on any number of threads. Rows
    of ``ROW`` fp32 (or float64) values are summed in their own dtype (fp16 and
    bf16 are upcast to fp32 first), the rows' sums in float64: no float64 copy
    of more than ``ROW`` values is made. No host sync."""
    flat = t.detach().reshape(-1)
    if flat.dtype in (torch.float16, torch.bfloat16):
        flat = flat.float()
    while flat.numel() > ROW:
        n = flat.numel() - flat.numel() % ROW
        parts = _row_sums(flat[:n].view(-1, ROW))
        if n < flat.numel():  # the shorter last row
            parts = torch.cat([parts, _row_sums(flat[n:].view(1, -1))])
        flat = parts
    return flat.double().sum()
