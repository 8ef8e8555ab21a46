"""Real 2-rank runs: torchrun + gloo process groups, for ddp, fsdp (FSDP2) and fsdp1.

Each run is launched exactly as a user would (``torchrun --standalone
--nproc_per_node=2 train.py ...``) and read back from its run directory.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from .conftest import ROOT, TINY, read_rows, train

STEPS = 20
# The same global batch (8 sequences) as one process with no wrapper.
COMMON = [*TINY, f"train.max_steps={STEPS}", "train.eval_every=10", "train.eval_batches=2"]
# Loss-curve tolerance against parallel=none, per precision (max abs difference in nats):
# - fp32: the ranks' mean of two half-batch gradients equals the full-batch gradient up
#   to summation order (~1e-7 relative per step); 20 AdamW steps keep it ~1e-5.
# - bf16: the same math, but each matmul rounds to bf16 (8 significant bits, relative
#   step 2^-8 = 0.4%). Where a half-batch and a full batch (or FSDP's bf16 gathered
#   weights and autocast's per-op casts) round a value to different sides, the loss
#   moves by up to a few bf16 ulps of ~5 nats; 20 steps of AdamW amplify that to ~1e-2.
# - fp16: 11 significant bits, 8x finer than bf16, and loss scaling does not change the
#   rounding of normal values: a quarter of the bf16 budget is ample.
TOL = {"fp32": 2e-4, "bf16": 3e-2, "fp16": 8e-3}


def torchrun(cwd: Path, *overrides: str, nproc: int = 2, timeout: int = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(ROOT / "train.py"), *overrides]
    cwd.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env={**os.environ})
    if r.returncode:
        (cwd / "torchrun.stderr").write_text(r.stderr)
    assert r.returncode == 0, f"torchrun failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    return r


def only_run_dir(cwd: Path) -> Path:
    runs = [p for p in (cwd / "outputs").glob("*/*") if p.is_dir()]
    assert len(runs) == 1, f"expected exactly one run directory, got {runs}"
    return runs[0]


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("parallel", ["ddp", "fsdp", "fsdp1"])
def test_two_ranks_match_single_process(tmp_path, reference, parallel, precision):
    torchrun(tmp_path, *COMMON, f"parallel={parallel}", f"precision={precision}")
    run_dir = only_run_dir(tmp_path)
    rows = [r for r in read_rows(run_dir) if "train/loss" in r]
    ref = [r for r in reference[precision] if "train/loss" in r]
    assert len(rows) == len(ref) == STEPS
    diffs = [abs(a["train/loss"] - b["train/loss"]) for a, b in zip(rows, ref)]
    assert max(diffs) < TOL[precision], f"max |loss - none| = {max(diffs):.2e} (step {diffs.index(max(diffs)) + 1})"
    assert rows[-1]["train/loss"] < rows[0]["train/loss"] - 0.3
    # every rank saw the same global grad norm and skip count at every logged step
    assert all(r["dist/rank_mismatch"] == 0 for r in rows)
    if precision == "fp32":
        # and that grad norm is the single-process one
        for a, b in zip(rows, ref):
            assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-4), a["step"]
        # the numerics monitor describes the whole model (shards reduced), as one process sees it
        a, b = rows[0], ref[0]
        for key in ("numerics/grad_norm/all", "numerics/grad_norm/block1", "numerics/weight_norm/embed",
                    "numerics/weight_absmax/head", "numerics/grad_underflow/e4m3", "numerics/update_underflow/bf16"):
            assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-6), key
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["world_size"] == 2 and s["dist/replicas_identical"] is True
    assert s["dtypes"]["parameters"] == "fp32" and s["dtypes"]["optimizer_state"] == "fp32"


@pytest.mark.parametrize("parallel", ["ddp", "fsdp", "fsdp1"])
def test_gradient_accumulation_across_ranks(tmp_path, reference, parallel):
    """2 ranks x 2 micro-batches of 2 (gradients reduced once, on the last
    micro-batch) = the single-process batch of 8."""
    torchrun(tmp_path, *COMMON, f"parallel={parallel}", "precision=fp32", "train.micro_batch_size=2")
    run_dir = only_run_dir(tmp_path)
    cfg = (run_dir / "config.yaml").read_text()
    assert "grad_accum_steps: 2" in cfg
    rows = [r for r in read_rows(run_dir) if "train/loss" in r]
    ref = [r for r in reference["fp32"] if "train/loss" in r]
    assert max(abs(a["train/loss"] - b["train/loss"]) for a, b in zip(rows, ref)) < TOL["fp32"]


@pytest.mark.parametrize("parallel", ["ddp", "fsdp", "fsdp1"])
def test_inf_on_one_rank_makes_every_rank_skip(tmp_path, parallel):
    torchrun(tmp_path, *TINY, "train.max_steps=6", "precision=fp16", f"parallel={parallel}",
             "debug.inject_inf_grad_steps=[2]", "debug.inject_inf_grad_rank=1")
    run_dir = only_run_dir(tmp_path)
    rows = read_rows(run_dir)
    assert [r["amp/skipped_steps"] for r in rows] == [0, 0, 1, 1, 1, 1]
    assert [r["amp/loss_scale"] for r in rows] == [65536, 65536, 32768, 32768, 32768, 32768]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["dist/skipped_steps_per_rank"] == [1, 1]  # rank 0's gradients were finite; it skipped anyway
    assert s["dist/replicas_identical"] is True  # same, finite parameters on both ranks
    # Sharded wrappers all-reduce the norm, so it is inf on both ranks; under DDP only
    # rank 1 holds the injected inf (real DDP overflows reach every replica through the
    # all-reduce), so the norms differ on that one step and agree on every other.
    mism = [r["dist/rank_mismatch"] for r in rows]
    assert mism == ([0, 0, 1, 0, 0, 0] if parallel == "ddp" else [0] * 6)


def test_one_run_directory_only_rank0_files(tmp_path):
    torchrun(tmp_path, *TINY, "train.max_steps=3", "parallel=ddp", "log.tensorboard=true")
    run_dir = only_run_dir(tmp_path)
    names = sorted(p.name for p in run_dir.iterdir())
    assert names == [".hydra", "config.yaml", "metrics.jsonl", "summary.json", "tensorboard", "train.log"]
    assert len(list((run_dir / "tensorboard").iterdir())) == 1  # one writer: rank 0's
    assert len(read_rows(run_dir)) == 3  # rows not doubled by a second rank


def _sweep_jobs(cwd: Path) -> list[Path]:
    sweeps = [p for p in (cwd / "multirun").glob("*/*") if p.is_dir()]
    assert len(sweeps) == 1, sweeps
    return sorted((p for p in sweeps[0].iterdir() if p.is_dir()), key=lambda p: int(p.name))


def test_multirun_under_torchrun_and_ddp_gradient_bytes(tmp_path):
    """A sweep under torchrun (one directory per job, every rank in step); the jobs
    differ in the gradient all-reduce dtype, which the comm counter must see:
    DDP's fp32 reduction comes from its C++ reducer, the bf16 one from the comm hook."""
    torchrun(tmp_path, "-m", *TINY, "train.max_steps=3", "parallel=ddp", "precision=fp32",
             "precision.reduce_dtype=fp32,bf16", timeout=400)
    jobs = _sweep_jobs(tmp_path)
    assert [j.name for j in jobs] == ["0", "1"]
    summaries = []
    for job in jobs:
        for name in ("config.yaml", "metrics.jsonl", "summary.json"):
            assert (job / name).exists(), (job, name)
        s = json.loads((job / "summary.json").read_text())
        assert s["precision"] == "fp32" and s["world_size"] == 2 and s["steps"] == 3
        summaries.append(s)
    fp32, bf16 = (s["comm/all_reduce/fp32_bytes"] for s in summaries[:1]), summaries[1]
    fp32 = next(fp32)
    assert "comm/all_reduce/fp32_bytes" not in bf16  # nothing left in fp32 when reducing in bf16
    assert bf16["comm/all_reduce/bf16_bytes"] * 2 == fp32
    # one fp32 all-reduce of every gradient: 4 bytes per parameter, in DDP's buckets
    total_params = summaries[0]["params"] + 64 * 64  # + the position embedding (left out of N)
    assert fp32 == 4 * total_params


def test_fsdp_collective_bytes_follow_param_and_reduce_dtypes(tmp_path):
    """2-rank FSDP2: gradients reduce-scattered in bf16 move half the bytes of fp32;
    parameters all-gathered in bf16 half those of fp32; float8 all-gather less than bf16."""
    torchrun(tmp_path, "-m", *TINY, "train.max_steps=2", "parallel=fsdp", "precision=fp32,bf16,fp8",
             "precision.reduce_dtype=fp32,bf16", "train.audit=true", timeout=500)
    comm = {}
    for job in _sweep_jobs(tmp_path):
        s = json.loads((job / "summary.json").read_text())
        cfg = yaml.safe_load((job / "config.yaml").read_text())
        # the dtype audit of step 1 under FSDP2 (DTensor shards, gathered weights): clean,
        # fp32 gradients and updates whatever the reduce dtype, and the float8 linears seen
        audit = json.loads((job / "audit.json").read_text())
        assert audit["flags"] == [], audit["flags"]
        mods = audit["modules"]
        assert mods["blocks.0.mlp.fc"]["grad"] == mods["blocks.0.mlp.fc"]["update"] == "fp32"
        assert mods["blocks.0.mlp.fc"]["matmul"] == {"fp32": "fp32", "bf16": "bf16", "fp8": "e4m3"}[s["precision"]]
        assert audit["comm"] == {k: v for k, v in s.items() if k.startswith("comm/")}
        comm[(s["precision"], cfg["precision"]["reduce_dtype"])] = {
            k[len("comm/"):-len("_bytes")]: v for k, v in s.items() if k.startswith("comm/") and k != "comm/total_bytes"}
    assert len(comm) == 6, comm.keys()
    for p in ("fp32", "bf16", "fp8"):
        assert comm[(p, "bf16")]["reduce_scatter/bf16"] * 2 == comm[(p, "fp32")]["reduce_scatter/fp32"]
        assert "reduce_scatter/fp32" not in comm[(p, "bf16")]
    assert comm[("bf16", "fp32")]["all_gather/bf16"] * 2 == comm[("fp32", "fp32")]["all_gather/fp32"]

    def gathered(c):
        return sum(v for k, v in c.items() if k.startswith("all_gather/"))

    fp8, bf16 = comm[("fp8", "fp32")], comm[("bf16", "fp32")]
    # the float8 weights travel as raw bytes: FSDP2 gathers a group whose shards differ in
    # dtype (float8 data beside bf16 norms) as one uint8 buffer
    assert fp8.get("all_gather/uint8", 0) > 0, fp8
    assert gathered(fp8) < 0.8 * gathered(bf16), (fp8, bf16)


def test_parallel_none_under_torchrun_is_refused(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "train.py"), *TINY, "train.max_steps=2"]
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    assert "parallel=none" in r.stderr and "parallel=ddp" in r.stderr


def test_batch_that_does_not_divide_by_world_size(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "train.py"), *TINY, "train.max_steps=2", "parallel=ddp", "train.global_batch_size=7"]
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    assert "global_batch_size=7 does not divide by the world size 2" in r.stderr


@pytest.mark.parametrize("parallel", ["ddp", "fsdp", "fsdp1"])
def test_single_process_with_a_wrapper(tmp_path, parallel):
    """python train.py parallel=X without torchrun: a one-rank group, same code path."""
    s, rows = train(tmp_path / "run", "train.max_steps=3", f"parallel={parallel}")
    assert s["world_size"] == 1 and len(rows) == 3


# case -> (compute dtype, FSDP param dtype, reduce dtype, buffer dtype); see tests/dist_probe.py
PROBE_CASES = {
    "fp32": ("fp32", "fp32", "fp32", "fp32"),
    "fp32+reduce_bf16": ("fp32", "fp32", "bf16", "fp32"),
    "bf16+buffer_bf16": ("bf16", "bf16", "fp32", "bf16"),
    "fp16+reduce_fp16": ("fp16", "fp16", "fp16", "fp32"),
}


def test_dtypes_inside_each_wrapper_are_the_configured_ones(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "dist_probe.py"), str(tmp_path), "ddp", "fsdp", "fsdp1"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-4000:]
    records = [json.loads(line) for rank in (0, 1) for line in (tmp_path / f"probe-rank{rank}.jsonl").read_text().splitlines()]
    assert len(records) == 2 * 3 * len(PROBE_CASES)
    for rec in records:
        compute, param, reduce, buffer = PROBE_CASES[rec["case"]]
        where = f"{rec['mode']}/{rec['case']}/rank{rec['rank']}"
        assert rec["storage"] == "fp32" and rec["grad_dtype"] == "fp32", where  # fp32 master weights and grads
        # FSDP all-gathers a param_dtype copy for compute; DDP keeps fp32 weights and autocast casts per op.
        assert rec["compute_weight"] == ("fp32" if rec["mode"] == "ddp" else param), where
        assert rec["compute_out"] == compute, where
        assert rec["buffer"] == buffer, where
        # A gradient reduced in bf16/fp16 comes back holding only values that format can
        # represent; reduced in fp32 (the sum of two ranks' values) it does not.
        assert rec["grads_in_bf16"] == (reduce == "bf16"), where
        assert rec["grads_in_fp16"] == (reduce == "fp16"), where
        assert rec["declared"]["grad_reduce"].startswith(reduce), where


def test_nccl_without_cuda_is_refused(tmp_path):
    from mptrain.config import ConfigError

    with pytest.raises(ConfigError, match="nccl needs CUDA"):
        train(tmp_path / "run", "train.max_steps=1", "parallel=ddp", "parallel.backend=nccl")


def test_slurm_launcher_config_composes():
    from hydra import compose, initialize_config_dir

    from .conftest import CONFIGS

    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose("config", overrides=["hydra/launcher=slurm", "hydra.launcher.partition=gpu"],
                      return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert launcher.tasks_per_node == launcher.gpus_per_node == 8 and launcher.partition == "gpu"


def test_submitit_sweep_with_two_tasks_per_job(tmp_path):
    """The Slurm path rehearsed with submitit's local executor: each sweep job is
    a 2-task job whose tasks become ranks 0 and 1 of one gloo group."""
    from .conftest import run_cli

    r = run_cli("-m", "hydra/launcher=local_tasks", *TINY, "train.max_steps=3", "parallel=ddp",
                "precision=fp32,bf16", cwd=tmp_path, timeout=400)
    assert r.returncode == 0, r.stderr[-4000:]
    sweeps = [p for p in (tmp_path / "multirun").glob("*/*") if p.is_dir()]
    assert len(sweeps) == 1, sweeps  # the jobs used the directory the launcher announced
    for job, precision in (("0", "fp32"), ("1", "bf16")):
        s = json.loads((sweeps[0] / job / "summary.json").read_text())
        assert s["world_size"] == 2 and s["precision"] == precision and s["dist/replicas_identical"]
