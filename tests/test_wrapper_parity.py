"""Sharding changes no bit of the step: the 2-rank fsdp and fsdp1 runs of
test_distributed.py against its ddp runs (jobs of the launches ``two_rank_jobs``
shares), row by row."""
from __future__ import annotations

import pytest

from .conftest import read_rows

STEP_KEYS = ("train/", "val/", "amp/")
"""What a run logs of its step's math: loss, learning rate, gradient norm, loss
scale and skips, validation loss. The monitor's figures are left out: FSDP sums
them over shards in another order (test_distributed.py compares them with one
process), and so are the wall-clock and collective figures."""


def _step_figures(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k == "step" or k.startswith(STEP_KEYS)} for r in rows]


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("parallel", ["fsdp", "fsdp1"])
def test_sharded_wrappers_train_bit_for_bit_as_ddp(two_rank_jobs, parallel, precision):
    """Every wrapper has each rank compute its half of the batch in the same dtypes
    (the linears FSDP gathers in bf16/fp16 hold the values autocast casts to), sums
    the two halves' gradients in fp32 (one sum of two values: the same bits whatever
    the collective), and sums the gradient norm's squares in float64, where a
    shard's partial sum rounds as the whole tensor's does. Summed in fp32, the norm
    came out an ulp apart on shards, the clip factor with it, and bf16 runs under
    fsdp and fsdp1 left ddp's from step 4 on, by 1e-5 of the loss."""
    ddp = read_rows(two_rank_jobs("ddp")[precision])
    rows = read_rows(two_rank_jobs(parallel)[precision])
    assert len(rows) == len(ddp) and any("val/loss" in r for r in rows)
    assert _step_figures(rows) == _step_figures(ddp)
