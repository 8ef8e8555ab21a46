"""Non-finite numbers across ranks: a bad batch on one rank stops every rank, promptly, naming the module."""
from __future__ import annotations

import subprocess
import sys
import time

from .conftest import ROOT, TINY


def test_nan_on_one_rank_stops_every_rank_naming_the_module(tmp_path):
    """Only rank 1's forward holds the NaN. The replay that names the module must keep
    both ranks in step: a rank that stopped before backward alone would leave the other
    waiting in DDP's gradient all-reduce until the process group's 10-minute timeout."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "train.py"), *TINY, "train.max_steps=6", "parallel=ddp", "precision=fp32",
           "debug.nan_in_module=blocks.0.attn", "debug.nan_at_steps=[2]", "debug.nan_rank=1",
           f"hydra.run.dir={tmp_path}/run"]
    t0 = time.monotonic()
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    took = time.monotonic() - t0
    assert r.returncode != 0, r.stdout[-2000:]
    assert "step 3: the forward pass produced a non-finite loss" in r.stderr, r.stderr[-3000:]
    assert "forward output of 'blocks.0.attn' on rank 1" in r.stderr, r.stderr[-3000:]
    assert took < 60, f"took {took:.0f}s: a rank waited for a collective the other never joined"
