"""What a run says at its end and what it leaves unsaid: the closing lines of a
stopped run, and the torch note about a gather mptrain makes on purpose.
(The W&B upload command is checked in test_metrics.py, with the W&B run it names.)"""
from __future__ import annotations

import subprocess
import sys

from .conftest import ROOT, train


def test_a_stopped_run_closes_on_its_stop_without_cadence_advice(tmp_path, capsys):
    """train.stop_after=3 with the monitor every 2 steps: the outlier table is from step
    2, and the line under it says the run stopped at 3, not which monitor.every would
    have scanned step 3 (advice for a run that reaches its end, irrelevant to a stop)."""
    train(tmp_path / "run", "train.max_steps=8", "train.stop_after=3", "monitor.every=2", "train.log_every=4")
    out = capsys.readouterr().out
    assert "stopping (train.stop_after=3)" in out, out
    lines = [ln for ln in out.splitlines() if ln.startswith("the outlier table is from step")]
    assert lines == ["the outlier table is from step 2, the last step the monitor scanned before the run "
                     "stopped at step 3"], out
    closing = out[out.index("stopping (train.stop_after=3)"):]
    assert "monitor.every" not in closing and "cadence" not in closing, closing


# A parameter of FSDP2 x tensor parallelism, (_StridedShard, Shard) on a 2x2 mesh of a fake
# process group (this process stands for rank 0 of 4: the gather runs, its data is made up),
# fingerprinted as a run's end does. torch notes the two all-gathers this takes on every rank.
_GATHER = r'''
import sys
import logging
import torch, torch.distributed as dist
import mptrain
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from mptrain.config.schema import ParallelMode
from mptrain.distributed.parallel import DistContext

dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
ctx = DistContext(mode=ParallelMode.fsdp_tp, world=4)

def fingerprint(names):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
    model = torch.nn.Linear(4, 8, bias=False)
    w = DTensor.from_local(torch.ones(2, 4), mesh, (_StridedShard(0, split_factor=2), Shard(0)), run_check=False)
    model.weight = torch.nn.Parameter(w)
    ctx.replica_fingerprint(model)

fingerprint(("dp_shard", "tp"))
print("--- without mptrain's filter", file=sys.stderr, flush=True)
logging.getLogger("torch.distributed.tensor._redistribute").filters.clear()
fingerprint(("dp_shard_b", "tp_b"))  # another mesh: torch notes each mesh once
'''


def test_the_strided_gather_note_is_silenced_by_its_own_text():
    r = subprocess.run([sys.executable, "-c", _GATHER], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    ours, theirs = r.stderr.split("--- without mptrain's filter")
    assert "While redistributing" not in ours, ours
    # The gather does make torch's note: without the filter it is printed (the test can fail).
    assert "While redistributing from (_StridedShard(dim=0, sf=2), Shard(dim=0)) to (Replicate(), Replicate()), " \
           "2 sequential all_gather operations" in theirs, theirs


def test_the_note_filter_keeps_the_same_warning_about_reductions():
    """The filter drops the all-gather's note only: the same words about a reduce-scatter
    or an all-reduce (where the order of a sum is a real question) still print."""
    import logging

    from mptrain.core.noise import _Drop, SILENCED

    name, pattern = SILENCED[-1]
    assert name == "torch.distributed.tensor._redistribute"
    note = ("While redistributing from (_StridedShard(dim=0, sf=2), Shard(dim=0)) to (Replicate(), Replicate()), "
            "2 sequential {} operations will be performed. This is suboptimal")

    def kept(msg):
        return _Drop(pattern).filter(logging.LogRecord(name, logging.WARNING, "", 0, msg, None, None))

    assert not kept(note.format("all_gather"))
    assert kept(note.format("reduce_scatter")) and kept(note.format("all_reduce"))
    assert kept(note.format("all_gather").replace("(_StridedShard(dim=0, sf=2), Shard(dim=0))",
                                                  "(Shard(dim=0), Partial(sum))"))
