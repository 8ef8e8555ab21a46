"""The fast-path switches: activation checkpointing, torch.compile per block, fused AdamW."""
from __future__ import annotations

import pytest
import yaml

from .conftest import train

STEPS = ["train.max_steps=5"]


def _losses(rows):
    return [r["train/loss"] for r in rows]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The plain path (no switch), once for every comparison below."""
    return train(tmp_path_factory.mktemp("plain") / "run", *STEPS)[1]


def _switched(run_dir, *overrides):
    """Rows and run_info of the same short run with ``overrides``."""
    _, rows = train(run_dir, *STEPS, *overrides)
    return rows, yaml.safe_load((run_dir / "config.yaml").read_text())["run_info"]


def test_activation_checkpointing_recomputes_the_same_numbers(tmp_path, plain):
    ac, info = _switched(tmp_path / "b", "train.activation_checkpointing=block", "checkpoint.every=5")
    # the same math; only the order in which backward accumulates some gradients (e.g. the
    # tied embedding's two contributions) changes, so values agree to fp32 rounding
    assert _losses(ac)[0] == _losses(plain)[0]
    # AdamW amplifies ulps a little
    assert max(abs(a - b) for a, b in zip(_losses(ac), _losses(plain), strict=True)) < 1e-4
    for a, b in zip(ac, plain, strict=True):
        assert abs(a["train/grad_norm"] - b["train/grad_norm"]) < 1e-4 * b["train/grad_norm"]
    assert info["activation_checkpointing"] == "block"
    # the wrapper does not leak into checkpoint keys: a run without it resumes from it
    s2, _ = train(tmp_path / "c", "train.max_steps=6", f"resume={tmp_path / 'b' / 'checkpoints' / 'step-5'}")
    assert s2["resumed_from"].endswith("step-5") and s2["steps"] == 6


def test_compiled_blocks_train_like_eager(tmp_path, plain, monkeypatch):
    from torch._dynamo.utils import counters

    from mptrain.core import machine

    # as on a busy machine, every time (the busy-machine check timed an eval-mode forward of the
    # compiled blocks: more graphs, which only a loaded host showed)
    monkeypatch.setattr(machine, "busy_reason", lambda *a: "the load a test stands in for")
    graphs = counters["stats"]["unique_graphs"]
    # Monitored every other step: the monitor's per-block hooks come and go, and the
    # monitored steps run eagerly, so the blocks compile once, and the loss once (traced,
    # the hooks made every block recompile on and off those steps, to dynamo's limit of 8).
    comp, info = _switched(tmp_path / "b", "train.compile=true", "monitor.every=2")
    assert counters["stats"]["unique_graphs"] - graphs <= 2
    assert info["compile"] is True
    # inductor fuses and reorders float ops: equal up to fp32 rounding, not bitwise
    assert max(abs(a - b) for a, b in zip(_losses(comp), _losses(plain), strict=True)) < 1e-4


def test_fused_adamw(tmp_path, plain):
    fused, info = _switched(tmp_path / "b", "optim.fused=true")
    assert info["fused_adamw"] is True
    # plain = torch's for-loop AdamW (the CPU default)
    assert max(abs(a - b) for a, b in zip(_losses(fused), _losses(plain), strict=True)) < 1e-5


def test_fsdp_with_activation_checkpointing_two_ranks(two_rank_jobs, reference):
    """2-rank FSDP2 with checkpointed blocks (a job of the fsdp launch, case "ckpt")
    follows the single-process fp32 curve."""
    from .conftest import read_rows
    from .test_distributed import TOL

    rows = [r for r in read_rows(two_rank_jobs("fsdp")["ckpt"]) if "train/loss" in r]
    ref = [r for r in reference["fp32"] if "train/loss" in r]
    assert max(abs(a["train/loss"] - b["train/loss"]) for a, b in zip(rows, ref, strict=True)) < TOL["fp32"]


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_no_host_sync_between_logging_steps(tmp_path, precision):
    """10 more steps between the same logging points add no device-to-host read.

    Counted through torch's Python API (``item``, ``bool``, ``float``, ``tolist``,
    ``cpu``, ...), which sees every read mptrain makes; with fused AdamW (the CUDA
    default) neither the inf/nan guard nor fp16's GradScaler reads back per step."""
    from mptrain.observe.perf import HostSyncCounter

    counts = {}
    for steps in (10, 20):
        with HostSyncCounter() as c:
            train(tmp_path / str(steps), f"precision={precision}", f"train.max_steps={steps}",
                  f"train.log_every={steps}", "optim.fused=true", "monitor.enabled=false")
        counts[steps] = c.calls
    extra = list(counts[20])
    for call in counts[10]:
        extra.remove(call) if call in extra else None
    assert counts[10] and not extra, f"per-step host syncs: {extra}"


def test_host_sync_counter_sees_the_per_step_check_of_a_foreach_optimizer(tmp_path):
    """The counter is not blind: without the fused kernel, the inf/nan guard reads its
    flag back every step, and the counter attributes it to the guard's line."""
    from mptrain.observe.perf import HostSyncCounter

    with HostSyncCounter() as c:
        train(tmp_path / "run", "train.max_steps=6", "train.log_every=6", "optim.fused=false",
              "monitor.enabled=false")
    guard_reads = [w for name, w in c.calls if name == "__bool__" and w.startswith("nonfinite.py")]
    assert len(guard_reads) >= 6
