"""Checkpoints: exact resume, interrupted saves, preemption, resharding, bad checkpoints."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from mptrain.checkpoint import CheckpointError, complete_checkpoints, load_full_state

from .conftest import ROOT, TINY, read_rows, run_cli, train

BASE = [*TINY, "train.max_steps=20", "train.eval_every=5", "train.eval_batches=2"]
VOLATILE = ("perf/", "mem/")  # wall-clock figures: the only keys allowed to differ


def _values(rows):
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


FP16_BUSY = ["precision=fp16", "precision.loss_scale.growth_interval=3", "debug.inject_inf_grad_steps=[4,12]"]


@pytest.mark.parametrize("extra", [["precision=fp32"], FP16_BUSY], ids=["fp32", "fp16"])
def test_resume_is_exact(tmp_path, extra):
    _, straight = train(tmp_path / "straight", *BASE, *extra)
    s1, _ = train(tmp_path / "resumed", *BASE, *extra, "train.stop_after=10")
    assert s1["stopped_early"] == "train.stop_after=10" and s1["steps"] == 10
    assert [p.name for p in complete_checkpoints(tmp_path / "resumed" / "checkpoints")] == ["step-10"]
    s2, resumed = train(tmp_path / "resumed", *BASE, *extra)  # resume=auto finds step-10
    assert s2["resumed_from"].endswith("step-10") and s2["steps"] == 20
    assert [r["step"] for r in resumed] == [r["step"] for r in straight]  # one row per step, none doubled
    # bitwise: every loss, lr, grad norm, val loss (and loss scale / skips in fp16)
    assert _values(resumed) == _values(straight)
    if "precision=fp16" in extra:
        scales = [r["amp/loss_scale"] for r in straight]
        # the trajectory is not trivial: growth, the two injected skips (and natural overflows)
        assert len(set(scales)) > 2 and straight[-1]["amp/skipped_steps"] >= 2


def test_sigkill_during_save_resumes_from_previous_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    args = [*BASE, "checkpoint.every=5", f"hydra.run.dir={run_dir}"]
    r = run_cli(*args, "debug.kill_during_save_at_step=10")
    assert r.returncode == -signal.SIGKILL, (r.returncode, r.stderr[-2000:])
    ckpts = run_dir / "checkpoints"
    assert [p.name for p in complete_checkpoints(ckpts)] == ["step-5"]
    assert (ckpts / "step-10.tmp").is_dir()  # the half-written one is there, and ignored
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout and "step-5 at step 5" in r.stdout
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["steps"] == 20 and not (ckpts / "step-10.tmp").exists()
    _, straight = train(tmp_path / "straight", *BASE)
    assert _values(read_rows(run_dir)) == _values(straight)


def test_sigterm_checkpoints_and_exits_cleanly(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "train.py"), *TINY, "train.max_steps=100000", "train.eval_every=0",
           f"hydra.run.dir={run_dir}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline:  # wait until it is training
        if (run_dir / "metrics.jsonl").exists() and len((run_dir / "metrics.jsonl").read_text().splitlines()) >= 3:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["stopped_early"] == "SIGTERM"
    ckpt = complete_checkpoints(run_dir / "checkpoints")[-1]
    assert ckpt.name == f"step-{s['steps']}"
    state = load_full_state(ckpt)  # loadable, and complete
    assert "model.wte.weight" in state and any(k.startswith("optim.") for k in state)
    # and a run resumes from it
    s2, _ = train(tmp_path / "resume", *TINY, f"resume={ckpt}", f"train.max_steps={s['steps'] + 2}")
    assert s2["steps"] == s["steps"] + 2


def test_reshard_fsdp_two_ranks_to_one(tmp_path):
    from .test_distributed import torchrun

    src = tmp_path / "src"
    torchrun(tmp_path, *BASE, "parallel=fsdp", "train.stop_after=10", f"hydra.run.dir={src}")
    ckpt = src / "checkpoints" / "step-10"
    dst = tmp_path / "dst"
    # one process, no wrapper: load the 2-rank sharded checkpoint and write it again
    s, _ = train(dst, *BASE, "parallel=none", f"resume={ckpt}", "train.max_steps=10", "checkpoint.every=1")
    assert s["resumed_from"] == str(ckpt) and s["steps"] == 10
    a, b = load_full_state(ckpt), load_full_state(dst / "checkpoints" / "step-10")
    model_keys = [k for k in a if k.startswith("model.")]
    optim_keys = [k for k in a if k.startswith("optim.state.")]
    assert model_keys and optim_keys and a.keys() == b.keys()
    for k in a:
        if torch.is_tensor(a[k]):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def test_keep_last(tmp_path):
    train(tmp_path / "run", *TINY, "train.max_steps=10", "checkpoint.every=2", "checkpoint.keep_last=2")
    assert [p.name for p in complete_checkpoints(tmp_path / "run" / "checkpoints")] == ["step-8", "step-10"]


def test_bad_checkpoints_give_clear_errors(tmp_path):
    train(tmp_path / "run", *TINY, "train.max_steps=4", "checkpoint.every=4")
    ckpt = tmp_path / "run" / "checkpoints" / "step-4"
    with pytest.raises(CheckpointError, match=r"model.d_model: checkpoint 64, this run 128"):
        train(tmp_path / "other", *TINY, f"resume={ckpt}", "model.d_model=128", "train.max_steps=5")
    with pytest.raises(CheckpointError, match="no such file"):
        train(tmp_path / "other", *TINY, f"resume={tmp_path}/nope", "train.max_steps=5")
    shard = next(ckpt.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])  # truncated shard
    with pytest.raises(CheckpointError, match=r"step-4 could not be read"):
        train(tmp_path / "other", *TINY, f"resume={ckpt}", "train.max_steps=5")
    (ckpt / "meta.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="meta.json is corrupt"):
        train(tmp_path / "other", *TINY, f"resume={ckpt}", "train.max_steps=5")


def test_cli_bad_resume_is_one_clear_line(tmp_path):
    r = run_cli(*TINY, "train.max_steps=2", f"resume={tmp_path}/missing", f"hydra.run.dir={tmp_path}/run")
    assert r.returncode == 2 and "no such file" in r.stderr and "Traceback" not in r.stderr


def test_nonfinite_skip_count_survives_a_resume(tmp_path):
    """Every resumable part of the loop goes through the checkpoint, the guard's count included."""
    args = ["train.max_steps=6", "train.on_nonfinite=skip", "checkpoint.every=2",
            "debug.inject_inf_grad_steps=[1]"]
    train(tmp_path / "run", *args, "train.stop_after=4")
    _, rows = train(tmp_path / "run", *args)
    assert [r["train/nonfinite_skipped"] for r in rows] == [0, 1, 1, 1, 1, 1]
