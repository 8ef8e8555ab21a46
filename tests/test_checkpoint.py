"""Checkpoints: exact resume, interrupted saves, preemption, resharding, bad checkpoints."""
from __future__ import annotations

import json
import resource
import shutil
import signal
import struct
import subprocess
import sys
import time

import pytest
import torch

from mptrain.checkpoint.checkpointer import load_full_state
from mptrain.checkpoint.integrity import CheckpointError, complete_checkpoints, verify
from mptrain.checkpoint.resolve import resolve_resume

from .aids import first_difference, without_wall_clock
from .conftest import ROOT, TINY, make_plan, read_rows, run_cli, train

BASE = [*TINY, "train.max_steps=20", "train.eval_every=5", "train.eval_tokens=1024"]
_values = without_wall_clock


FP16_BUSY = ["precision=fp16", "precision.loss_scale.growth_interval=3", "debug.inject_inf_grad_steps=[4,12]"]


# Delayed float8 scaling: the amax histories and scales are state; the float8 cast
# statistics of every 5th step (saturation included) must come out the same too.
FP8_DELAYED = ["precision=fp8-delayed", "precision.fp8.amax_history_len=4", "monitor.every=5"]


@pytest.mark.parametrize("extra", [["precision=fp32"], FP16_BUSY, FP8_DELAYED], ids=["fp32", "fp16", "fp8-delayed"])
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
    if "precision=fp8-delayed" in extra:
        state = load_full_state(tmp_path / "resumed" / "checkpoints" / "step-10", log=lambda _: None)
        hist = state["model.blocks.0.attn.qkv.grad_output_amax_history"]
        assert hist.shape == (4,) and bool((hist > 0).all())  # a full history, saved
        assert any(r.get("fp8.block0.attn.qkv/input/amax") for r in resumed if r["step"] > 10)


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
    rerun, straight = _values(read_rows(run_dir)), _values(straight)
    assert rerun == straight, first_difference(rerun, straight)  # subprocess launches vs this process


def test_a_kill_after_the_final_checkpoint_is_closed_by_the_rerun(tmp_path, capsys):
    """Killed between the final checkpoint and summary.json: the rerun used to say
    "nothing to train" and leave the run without a summary for good."""
    run_dir = tmp_path / "run"
    args = [*TINY, "train.max_steps=4", "checkpoint.every=2", "checkpoint.keep_last=1", "train.eval_every=2",
            "train.eval_tokens=512", f"hydra.run.dir={run_dir}"]
    r = run_cli(*args, "debug.kill_after_save_at_step=4")
    assert r.returncode == -signal.SIGKILL, (r.returncode, r.stderr[-2000:])
    ckpts = run_dir / "checkpoints"
    assert [p.name for p in complete_checkpoints(ckpts)] == ["step-2", "step-4"]  # killed before pruning
    assert not (run_dir / "summary.json").exists()
    rows = read_rows(run_dir)
    capsys.readouterr()
    s, after = train(run_dir, *args)
    said = capsys.readouterr().out
    assert "step-4 is the run's final checkpoint (step 4), but the launch that saved it ended before" in said
    assert after == rows  # nothing trained: the rows are the killed launch's, untouched
    assert s["steps"] == 4 and s["resumed_from"].endswith("step-4") and "stopped_early" not in s
    assert s["final/train_loss"] == rows[-1]["train/loss"] and s["final/val_loss"] == rows[-1]["val/loss"]
    assert s["dtypes"]["gradients"] == "fp32"  # the run's, not "none" from a launch that ran no backward
    assert (s["eval/tokens"], s["eval/windows"]) == (512, 8)  # the set the val loss was measured on (64 x 8)
    assert json.loads((run_dir / "summary.json").read_text()) == s
    assert [p.name for p in complete_checkpoints(ckpts)] == ["step-4"]  # keep_last=1, as the save would have
    assert "done in" in (run_dir / "train.log").read_text().splitlines()[-2]
    again, _ = train(run_dir, *args)  # and now it is finished: a no-op
    assert "nothing to train" in capsys.readouterr().out and again == s


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
    # One process, no wrapper: load the 2-rank sharded checkpoint and write it again.
    # (A run resumed at its last step has nothing to train, so the Trainer is built
    # and saved directly: the same load and save a resumed run goes through.)
    from mptrain.distributed.parallel import setup
    from mptrain.plan.plan import Resume
    from mptrain.run.trainer import Trainer

    plan = make_plan(*BASE, "parallel=none")
    ctx = setup(plan)
    try:
        t = Trainer(plan.decided(Resume(path=ckpt, step=10)), ctx, dst)
        assert t.start == 10 and t.resumed_from == ckpt
        t.ckpt.save(10, t.model, t.optimizer, t.states)
        t.metrics.close()
    finally:
        ctx.shutdown()
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


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """One run with two checkpoints (step-2, step-4) for the tests below to copy and damage."""
    run = tmp_path_factory.mktemp("saved") / "run"
    train(run, *TINY, "train.max_steps=4", "checkpoint.every=2")
    return run


def _copy_run(saved_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    return run, run / "checkpoints" / "step-2", run / "checkpoints" / "step-4"


def _overwrite(path, offset: int, data: bytes) -> None:
    """Replace bytes in place: the size stays, the content changes."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


HALVES = struct.pack("<1024f", *[0.5] * 1024)  # plausible floats: 1,024 values of 0.5


def test_bad_checkpoints_give_clear_errors(saved_run, tmp_path, capsys):
    """Damage is refused before DCP reads anything, naming the file and offering step-2."""
    run, step2, ckpt = _copy_run(saved_run, tmp_path)
    with pytest.raises(CheckpointError, match="no such file"):
        train(tmp_path / "other", *TINY, f"resume={tmp_path}/nope", "train.max_steps=5")
    shard = ckpt / "__0_0.distcp"
    intact = {f: f.read_bytes() for f in (shard, ckpt / "rng-rank0.pt", ckpt / "meta.json")}
    middle = len(intact[shard]) // 2
    damage = [  # (what, how, file named, reason)
        ("truncated", lambda: shard.write_bytes(intact[shard][:100]), shard, "truncated or replaced"),
        ("0.5s", lambda: _overwrite(shard, middle, HALVES), shard, "fails its checksum"),
        ("0xFF", lambda: _overwrite(shard, middle, b"\xff" * len(HALVES)), shard, "fails its checksum"),
        ("missing", lambda: (ckpt / "rng-rank0.pt").unlink(), ckpt / "rng-rank0.pt", "is missing"),
        ("extra", lambda: (ckpt / "notes.txt").write_text("hi"), ckpt / "notes.txt", "is not listed"),
        ("meta.json", lambda: (ckpt / "meta.json").write_text("{not json"), ckpt / "meta.json", "is corrupt"),
    ]
    for what, spoil, named, reason in damage:
        spoil()
        with pytest.raises(CheckpointError) as e:
            train(tmp_path / "other", *TINY, f"resume={ckpt}", "train.max_steps=5")
        msg = str(e.value)
        assert f"damaged: {named} " in msg and reason in msg and f"resume={step2}" in msg, (what, msg)
        assert "\n" not in msg and "could not be read" not in msg, (what, msg)  # refused before DCP read it
        if what == "0xFF":  # the export path verifies too
            with pytest.raises(CheckpointError, match=f"{shard} fails its checksum"):
                load_full_state(ckpt)
        (ckpt / "notes.txt").unlink(missing_ok=True)
        for f, data in intact.items():
            f.write_bytes(data)
    assert not (tmp_path / "other" / "metrics.jsonl").exists()  # nothing was trained from a damaged one
    assert resolve_resume(str(ckpt), run) == ckpt  # restored: intact again

    # Both damaged: resume=auto has nothing to fall back to.
    _overwrite(shard, middle, HALVES)
    _overwrite(step2 / "__0_0.distcp", middle, HALVES)
    with pytest.raises(CheckpointError, match=r"resume=auto: every checkpoint in .* is damaged \(step-4: __0_0"):
        resolve_resume("auto", run)

    # A checkpoint from before manifests: loads, with one line saying it was not verified.
    for f, data in intact.items():
        f.write_bytes(data)
    meta = json.loads((ckpt / "meta.json").read_text())
    del meta["manifest"]
    (ckpt / "meta.json").write_text(json.dumps(meta))
    (ckpt / "manifest.json").unlink()
    capsys.readouterr()
    assert "model.wte.weight" in load_full_state(ckpt)
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and f"checkpoint {ckpt} has no manifest.json" in out and "not be verified" in out


def test_resume_auto_falls_back_to_the_previous_intact_checkpoint(saved_run, tmp_path, capsys):
    run, step2, ckpt = _copy_run(saved_run, tmp_path)
    _overwrite(ckpt / "__0_0.distcp", 1000, b"\xff" * 4096)
    capsys.readouterr()
    s, rows = train(run, *TINY, "train.max_steps=4", "checkpoint.every=2")
    said = [ln for ln in capsys.readouterr().out.splitlines() if "damaged" in ln]
    assert len(said) == 1 and said[0].startswith(
        f"resume=auto: checkpoint step-4 is damaged ({ckpt / '__0_0.distcp'} fails its checksum (CRC-32 "), said
    assert said[0].endswith("its bytes changed after the save); falling back to step-2"), said
    assert s["resumed_from"] == str(step2) and s["steps"] == 4
    assert _values(rows) == _values(read_rows(saved_run))  # the same steps 3-4 as the first time
    assert verify(ckpt) is True  # step-4 saved again over the damaged one, intact


def _small_files_only():
    """In the child: files may not grow past 256 KiB (the metrics rows fit, a 1.7 MB
    shard does not). CPython ignores SIGXFSZ, so the write fails with EFBIG."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 << 10, resource.RLIM_INFINITY))


def test_save_error_keeps_the_last_checkpoint(saved_run, tmp_path):
    """A real OS error during a save: one line, exit code 2, step-4 intact, no step-6.tmp."""
    run, _, step4 = _copy_run(saved_run, tmp_path)
    before = {f.name: f.read_bytes() for f in step4.iterdir()}
    # the data caches exist already (built by saved_run), so the child writes only small files
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), *TINY, "train.max_steps=6", "checkpoint.every=2",
                        f"hydra.run.dir={run}"], capture_output=True, text=True, timeout=300,
                       preexec_fn=_small_files_only)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.strip().count("\n") == 0, r.stderr
    assert r.stderr.startswith(f"mptrain: save error: checkpoint step-6 was not saved: "
                               f"{run / 'checkpoints' / 'step-6.tmp'}/__0_0.distcp: File too large (EFBIG); "
                               f"the last complete checkpoint, {step4}, is intact"), r.stderr
    assert "ulimit -f" in r.stderr and "resumed from" in r.stdout  # the fix; it did train steps 5-6
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-2", "step-4"]  # no step-6.tmp
    assert {f.name: f.read_bytes() for f in step4.iterdir()} == before
    assert resolve_resume("auto", run) == step4 and verify(step4)  # still what a resume picks, and intact


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
