"""Real 2-rank runs: torchrun + gloo process groups, for ddp, fsdp (FSDP2) and fsdp1.

Each run is launched as a user would (``torchrun --standalone
--nproc_per_node=2 train.py ...``) and read back from its run directory. The
runs that only differ in configuration share a launch per wrapper, as the jobs
of one Hydra multirun (``sweep``): starting torchrun's 3 processes costs several
times more than a tiny run, and multirun under torchrun is itself under test.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from mptrain.advice.answer import experiment_yaml
from mptrain.plan.build import build_plan

from .conftest import ROOT, TINY, read_rows, train
from .test_data import SAME_WEIGHTS_VAL

STEPS = 20
# The same global batch (8 sequences) as one process with no wrapper.
COMMON = [*TINY, f"train.max_steps={STEPS}", "train.eval_every=10", "train.eval_tokens=1024"]
# test_preempt.py's run (under parallel=fsdp). No checkpoint.every: the only checkpoint is the one the signal makes.
PREEMPT = [*TINY, "train.max_steps=20", "train.eval_every=5", "train.eval_tokens=1024"]
# Loss-curve tolerance against parallel=none, per precision (max abs difference in nats
# over the 20 steps). Two ranks each compute a half-batch gradient; the wrapper reduces
# them in fp32 and the mean equals the full-batch gradient up to summation order
# (~1e-7 relative). That is the only difference a preset allows: every wrapper computes
# the same ops in the same dtypes as parallel=none (the dtype probe below checks it).
# Figures measured on a 2-core CPU, torch 2.13, gloo. fsdp and fsdp1 train bit for bit
# as ddp does (test_wrapper_parity.py), so the three measure one figure per precision.
# - fp32: the order difference stays at the loss's own fp32 ulp (~5e-7 at ~5 nats).
#   Measured: 4.8e-7. Bound: 20 ulps.
# - bf16: each rank rounds its half-batch's weight-gradient matmul to bf16 before the
#   fp32 sum, one process the whole batch's once (~1e-3 relative in the gradients; ddp
#   equals one process with 2 micro-batches bit for bit, on as many threads). That
#   flips the bf16 rounding of the next steps' matmul inputs wherever a value sits
#   that close to a rounding boundary; each flip moves that value by a whole bf16 ulp
#   (2^-8 relative), and AdamW's normalised updates carry the difference on.
#   Measured: 1.40e-4 (before the gradient norm summed its squares in float64, fsdp
#   and fsdp1 left ddp after 3 steps: 1.31e-4 and 2.01e-4 against ddp's 1.25e-4).
#   Bound: 4x that; ddp's own figure, which no wrapper can beat, leaves no room for a
#   tighter one with a margin for other CPUs. (With FSDP gathering embeddings and
#   norms in bf16 and casting the residual stream to bf16, as it once did, fsdp and
#   fsdp1 measured 2.8e-3: different numerics, not summation order.)
# - fp16: the same mechanism with 8x finer ulps (2^-11), so fewer and smaller flips.
#   Measured: 2.7e-5 (the old FSDP casts: 1.5e-4). Bound: 3x that.
TOL = {"fp32": 1e-5, "bf16": 6e-4, "fp16": 8e-5}


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


def _sweep_jobs(cwd: Path) -> list[Path]:
    sweeps = [p for p in (cwd / "multirun").glob("*/*") if p.is_dir()]
    assert len(sweeps) == 1, sweeps
    return sorted((p for p in sweeps[0].iterdir() if p.is_dir()), key=lambda p: int(p.name))


def sweep(cwd: Path, cases: dict[str, list[str]], timeout: int = 900, nproc: int = 2) -> dict[str, Path]:
    """Every case (name -> overrides) as one job of a single torchrun launch: a Hydra
    multirun over experiment files written for the purpose, so the 3 processes start
    (and import torch) once for all of them. Returns name -> job directory."""
    exp = cwd / "experiments"
    (exp / "experiment").mkdir(parents=True)
    for name, overrides in cases.items():
        (exp / "experiment" / f"{name}.yaml").write_text(experiment_yaml(overrides))
    torchrun(cwd, "-m", f"hydra.searchpath=[file://{exp}]", f"experiment={','.join(cases)}", nproc=nproc,
             timeout=timeout)
    jobs = _sweep_jobs(cwd)
    assert [j.name for j in jobs] == [str(i) for i in range(len(cases))]  # one directory per job
    for name, job in zip(cases, jobs, strict=True):
        assert f"experiment={name}" in (job / ".hydra" / "overrides.yaml").read_text(), (name, job)
    return dict(zip(cases, jobs, strict=True))


WRAPPERS = ("ddp", "fsdp", "fsdp1")  # parallel= values that run on 2 ranks here

# What every wrapper runs on 2 ranks. Each list is the command line a user would type
# for that run; every wrapper's cases are jobs of one launch (``two_rank_jobs`` in
# conftest.py), since starting 3 processes costs far more than a 20-step tiny run.
CASES = {
    **{p: [*COMMON, f"precision={p}"] for p in ("fp32", "bf16", "fp16")},
    # 2 ranks x 2 micro-batches of 2 = the single-process batch of 8
    "accum": [*COMMON, "precision=fp32", "train.micro_batch_size=2"],
    # every stability switch at once (test_stability_switches_match_single_process)
    "switches": [*COMMON, "precision=fp32", "model.qk_norm=true", "train.z_loss=1e-4", "optim.update_clip=1.0"],
    # (not named "inf": Hydra would read that sweep value as a float)
    "inf-on-rank1": [*TINY, "train.max_steps=6", "precision=fp16", "debug.inject_inf_grad_steps=[2]",
                     "debug.inject_inf_grad_rank=1"],
}
# The optimizers other than torch's AdamW (test_new_optimizers_match_single_process).
OPTIMIZER_CASES = {"8bit": ["precision=fp32", "optim.state_dtype=8bit"], "sr": ["precision=bf16-pure-sr"],
                   "kahan": ["precision=bf16-pure-kahan"]}
# Their bounds (max |loss - one process| over 20 steps), measured on a 2-core CPU, torch 2.13, gloo:
# - 8bit: torchao quantizes a moment only when this rank's part has >= 4096 elements. The
#   64x64 tensors (attention projections, position embedding) are quantized in one process
#   and stay fp32 as 2048-element halves under FSDP2: the runs differ by those tensors'
#   8-bit rounding. Measured: fsdp 5.1e-5, ddp 9.5e-7 (whole tensors: summation order
#   only). Bound 2e-4: 4x the worst, and 3x below what 8-bit moments change against fp32
#   moments (6.4e-4), so a run that did not quantize would fail.
# - sr: each rank draws its own shard's random roundings (the same seed on every rank), so
#   the runs are two samples of stochastic rounding. Measured: fsdp 2.5e-3. Bound 8e-3:
#   3x that, and 3x below the difference from round-to-nearest (2.6e-2).
# - kahan: deterministic; the bf16 gradient reduction and summation order move bf16
#   roundings as in the bf16 row of TOL. Measured: ddp 4.2e-4, fsdp 5.7e-4. Bound 1.5e-3:
#   2.6x the worst, 19x below the difference from round-to-nearest (2.8e-2).
OPTIMIZER_TOL = {"8bit": 2e-4, "sr": 8e-3, "kahan": 1.5e-3}
# Cases only one wrapper runs, each for the test named beside it.
BYTES = [(p, r) for p in ("fp32", "bf16", "fp8") for r in ("fp32", "bf16")]
EXTRA_CASES = {
    "ddp": {  # test_multirun_under_torchrun_and_ddp_gradient_bytes
        f"reduce-{r}": [*TINY, "train.max_steps=3", "precision=fp32", f"precision.reduce_dtype={r}"]
        for r in ("fp32", "bf16")},
    "fsdp": {
        **{f"bytes-{p}-{r}": [*TINY, "train.max_steps=2", f"precision={p}", f"precision.reduce_dtype={r}",
                              "train.audit=true"]  # test_fsdp_collective_bytes_follow_param_and_reduce_dtypes
           for p, r in BYTES},
        # test_fastpath.py::test_fsdp_with_activation_checkpointing_two_ranks
        "ckpt": [*COMMON, "precision=fp32", "train.activation_checkpointing=block"],
        "fp8": [*COMMON, "precision=fp8"],  # test_fp8.py::test_fsdp2_fp8_two_ranks
        "fp8-delayed": [*COMMON, "precision=fp8-delayed"],  # likewise
        "nvfp4": [*TINY, "train.max_steps=8", "precision=nvfp4"],  # test_fp4train.py::test_two_rank_fsdp2
        # test_preempt.py::test_two_rank_fsdp_sigterm_exits_0_and_resumes_exactly: the uninterrupted run
        "preempt": PREEMPT,
        "val-same-weights": [*TINY, *SAME_WEIGHTS_VAL],  # test_validation_loss_is_the_same_on_two_ranks
        **{f"opt-{name}": [*COMMON, *ov] for name, ov in OPTIMIZER_CASES.items()},  # test_new_optimizers_...
    },
}
EXTRA_CASES["ddp"].update({f"opt-{name}": [*COMMON, *OPTIMIZER_CASES[name]] for name in ("8bit", "kahan")})
# test_phases_switch_as_one_process: a bf16-pure-sr run's fp32 tail (weights and moments widen at step 10)
PHASED = [*TINY, "train.max_steps=8", "precision=bf16-pure-sr", "precision.phases=[{start: 4, precision: bf16}]"]
for _wrapper in ("ddp", "fsdp"):
    EXTRA_CASES[_wrapper]["phased"] = PHASED
# test_llama.py::test_two_ranks_follow_one_process_with_the_configured_dtypes, under every wrapper
# (the same command line as its one-process bf16 run)
LLAMA_CASE = [*TINY, "model=llama-nano", "monitor.every=100", "monitor.fp8_whatif=[]", "precision=bf16",
              "train.max_steps=3", "train.audit=true"]
for _wrapper in WRAPPERS:
    EXTRA_CASES.setdefault(_wrapper, {})["llama"] = LLAMA_CASE
# test_moe.py::test_two_ranks_move_the_bias_as_one_process: the mixture's balancing bias and capacity under ddp
# (against one process with the ranks' micro-batches), and the bias's fp32 storage under fsdp1's bf16 buffers
MOE_CASE = [*TINY, "model=moe-nano", "monitor.enabled=false", "train.threads=1", "train.max_steps=4",
            "model.moe.balance=bias", "model.moe.capacity_factor=1.0", "checkpoint.at_end=true"]
EXTRA_CASES["ddp"]["moe"] = MOE_CASE
EXTRA_CASES["fsdp1"]["moe-pure"] = [*MOE_CASE, "precision=bf16-pure"]


def launch_every_wrapper(cwd: Path) -> dict[str, dict[str, Path]]:
    """One launch for all three wrappers: every case in CASES and each wrapper's
    EXTRA_CASES, under that wrapper, as jobs of one multirun (the process group outlives
    the jobs, so one job's wrapper follows another's in the same ranks). Returns
    wrapper -> {case: job directory}."""
    cases = {(w, name): ov for w in WRAPPERS for name, ov in {**CASES, **EXTRA_CASES.get(w, {})}.items()}
    jobs = sweep(cwd, {f"{w}-{name}": [*ov, f"parallel={w}"] for (w, name), ov in cases.items()})
    out: dict[str, dict[str, Path]] = {w: {} for w in WRAPPERS}
    for (w, name), job in zip(cases, jobs.values(), strict=True):
        out[w][name] = job
    return out


def _matches_one_process(run_dir: Path, reference: list[dict], tol: float) -> tuple[list[dict], list[dict]]:
    """The 2-rank run's loss rows against one process's: within ``tol`` at every
    step, learning, and every rank in agreement. Returns both lists of rows."""
    rows = [r for r in read_rows(run_dir) if "train/loss" in r]
    ref = [r for r in reference if "train/loss" in r]
    assert len(rows) == len(ref) == STEPS
    diffs = [abs(a["train/loss"] - b["train/loss"]) for a, b in zip(rows, ref, strict=True)]
    assert max(diffs) < tol, f"max |loss - none| = {max(diffs):.2e} (step {diffs.index(max(diffs)) + 1})"
    assert rows[-1]["train/loss"] < rows[0]["train/loss"] - 0.3
    # every rank saw the same global grad norm and skip count at every logged step
    assert all(r["dist/rank_mismatch"] == 0 for r in rows)
    return rows, ref


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("parallel", WRAPPERS)
def test_two_ranks_match_single_process(two_rank_jobs, reference, parallel, precision):
    run_dir = two_rank_jobs(parallel)[precision]
    rows, ref = _matches_one_process(run_dir, reference[precision], TOL[precision])
    if precision == "fp32":
        # and that grad norm is the single-process one
        for a, b in zip(rows, ref, strict=True):
            assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-4), a["step"]
        # the numerics monitor describes the whole model (shards reduced), as one process sees it
        a, b = rows[0], ref[0]
        for key in ("numerics/grad_norm/all", "numerics/grad_norm/block1", "numerics/weight_norm/embed",
                    "numerics/weight_absmax/head", "numerics/grad_underflow/e4m3", "numerics/update_underflow/bf16"):
            assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-6), key
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["world_size"] == 2 and s["dist/replicas_identical"] is True
    assert s["dtypes"]["parameters"] == "fp32" and s["dtypes"]["optimizer_state"] == "fp32"


@pytest.fixture(scope="module")
def switches_reference(tmp_path_factory):
    _, rows = train(tmp_path_factory.mktemp("ref-switches") / "run", *CASES["switches"], tiny=False)
    return rows


@pytest.mark.parametrize("parallel", WRAPPERS)
def test_stability_switches_match_single_process(two_rank_jobs, switches_reference, parallel):
    """QK-layernorm, z-loss and update clipping under each wrapper train as one process
    does (update clipping's per-tensor RMS is over the whole tensor, shards summed), and
    the stability monitor reports what one process sees."""
    rows = [r for r in read_rows(two_rank_jobs(parallel)["switches"]) if "train/loss" in r]
    ref = [r for r in switches_reference if "train/loss" in r]
    assert len(rows) == len(ref) == STEPS
    for key in ("train/loss", "train/z_loss", "train/update_clip_max"):
        diffs = [abs(a[key] - b[key]) for a, b in zip(rows, ref, strict=True)]
        assert max(diffs) < TOL["fp32"] * max(1.0, abs(ref[0][key])), (key, max(diffs))
    assert rows[-1]["train/loss"] < rows[0]["train/loss"] - 0.3
    for key in ("stability/attn_logit_max/block0", "stability/attn_entropy/block1", "stability/output_log_z",
                "stability/act_rms/block1", "stability/adam_update_rms/block0"):
        assert rows[0][key] == pytest.approx(ref[0][key], rel=1e-4), key


@pytest.fixture(scope="module")
def optimizer_references(tmp_path_factory):
    root = tmp_path_factory.mktemp("ref-optimizers")
    return {name: train(root / name, *COMMON, *ov, tiny=False)[1] for name, ov in OPTIMIZER_CASES.items()}


@pytest.mark.parametrize("parallel, name", [("fsdp", "8bit"), ("fsdp", "sr"), ("fsdp", "kahan"),
                                            ("ddp", "8bit"), ("ddp", "kahan")])
def test_new_optimizers_match_single_process(two_rank_jobs, optimizer_references, parallel, name):
    """torchao's AdamW (8-bit moments; stochastic rounding) and torch-optimi's (Kahan)
    on 2 ranks train as one process does, within the bounds OPTIMIZER_TOL justifies;
    under FSDP2 they step DTensor shards."""
    run_dir = two_rank_jobs(parallel)[f"opt-{name}"]
    _matches_one_process(run_dir, optimizer_references[name], OPTIMIZER_TOL[name])
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["dist/replicas_identical"] is True
    expected = {"8bit": "8bit,fp32", "sr": "bf16", "kahan": "bf16"}[name]
    assert s["dtypes"]["optimizer_state"] == expected


@pytest.fixture(scope="module")
def phased_reference(tmp_path_factory):
    return train(tmp_path_factory.mktemp("ref-phased") / "run", *PHASED, tiny=False)[1]


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_phases_switch_as_one_process(two_rank_jobs, phased_reference, parallel):
    """A precision phase on 2 ranks (bf16-pure-sr's bf16 weights and moments widened into an
    fp32 tail at step 4): both ranks switch at the same step, the curve follows one
    process across the boundary within the stochastic-rounding bound, replicas stay equal."""
    run_dir = two_rank_jobs(parallel)["phased"]
    rows = [r for r in read_rows(run_dir) if "train/loss" in r]
    ref = [r for r in phased_reference if "train/loss" in r]
    diffs = [abs(a["train/loss"] - b["train/loss"]) for a, b in zip(rows, ref, strict=True)]
    assert len(rows) == 8 and max(diffs) < OPTIMIZER_TOL["sr"], diffs
    assert all(r["dist/rank_mismatch"] == 0 for r in rows)  # every rank saw the same loss, on both sides
    info = yaml.safe_load((run_dir / "config.yaml").read_text())["run_info"]
    assert info["phases"][1]["began_at"] == 4 and info["phases"][1]["dtypes"]["parameters"] == "fp32"
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["dist/replicas_identical"] is True
    log = (run_dir / "train.log").read_text()
    assert log.count("phase 1 'phases[0]' begins before step 5") == 1  # rank 0's line, once


@pytest.mark.parametrize("parallel", WRAPPERS)
def test_gradient_accumulation_across_ranks(two_rank_jobs, reference, parallel):
    """2 ranks x 2 micro-batches of 2 (gradients reduced once, on the last
    micro-batch) = the single-process batch of 8."""
    run_dir = two_rank_jobs(parallel)["accum"]
    cfg = (run_dir / "config.yaml").read_text()
    assert "grad_accum_steps: 2" in cfg
    rows = [r for r in read_rows(run_dir) if "train/loss" in r]
    ref = [r for r in reference["fp32"] if "train/loss" in r]
    assert max(abs(a["train/loss"] - b["train/loss"]) for a, b in zip(rows, ref, strict=True)) < TOL["fp32"]


@pytest.mark.parametrize("parallel", WRAPPERS)
def test_inf_on_one_rank_makes_every_rank_skip(two_rank_jobs, parallel):
    run_dir = two_rank_jobs(parallel)["inf-on-rank1"]
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
    assert names == [".hydra", ".lock", "config.yaml", "metrics.jsonl", "summary.json", "tensorboard", "train.log"]
    assert len(list((run_dir / "tensorboard").iterdir())) == 1  # one writer: rank 0's
    assert len(read_rows(run_dir)) == 3  # rows not doubled by a second rank


def test_multirun_under_torchrun_and_ddp_gradient_bytes(two_rank_jobs):
    """A sweep under torchrun (one directory per job, every rank in step: the ddp
    launch of ``two_rank_jobs`` is one); two jobs differ in the gradient all-reduce
    dtype, which the comm counter must see: DDP's fp32 reduction comes from its C++
    reducer, the bf16 one from the comm hook."""
    by_case = two_rank_jobs("ddp")
    jobs = _sweep_jobs(by_case["reduce-fp32"].parents[3])
    # the launch's jobs: the ddp cases first, then fsdp's and fsdp1's
    assert jobs[:len(by_case)] == list(by_case.values()) and len(by_case) == len(CASES) + len(EXTRA_CASES["ddp"])
    assert jobs == [job for w in WRAPPERS for job in two_rank_jobs(w).values()]
    summaries = {}
    for case, job in by_case.items():
        for name in ("config.yaml", "metrics.jsonl", "summary.json"):
            assert (job / name).exists(), (job, name)
        s = json.loads((job / "summary.json").read_text())
        steps = yaml.safe_load((job / "config.yaml").read_text())["train"]["max_steps"]
        assert s["world_size"] == 2 and s["steps"] == steps, (case, s["steps"], steps)
        summaries[case] = s
    fp32, bf16 = summaries["reduce-fp32"], summaries["reduce-bf16"]
    assert fp32["precision"] == bf16["precision"] == "fp32" and fp32["steps"] == bf16["steps"] == 3
    fp32 = fp32["comm/all_reduce/fp32_bytes"]
    assert "comm/all_reduce/fp32_bytes" not in bf16  # nothing left in fp32 when reducing in bf16
    assert bf16["comm/all_reduce/bf16_bytes"] * 2 == fp32
    # one fp32 all-reduce of every gradient: 4 bytes per parameter, in DDP's buckets
    total_params = summaries["reduce-fp32"]["params"] + 64 * 64  # + the position embedding (left out of N)
    assert fp32 == 4 * total_params


def _fsdp2_gathered_numel(model_cfg: dict, vocab_size: int, world: int) -> tuple[int, int]:
    """Elements one training step all-gathers under FSDP2, split as the units are
    gathered: (linear layers, embeddings + norms). Each parameter is padded on dim 0
    to a multiple of the world size. A block's units (its linears, its norms) are
    gathered twice per step, for forward and again for backward (non-root units
    reshard after forward); the root (embeddings, tied head, final norm) once: it
    keeps its parameters from forward through backward."""
    from mptrain.model.gpt import GPT, GPTShape, LayerNorm

    m = GPT(GPTShape(vocab_size=vocab_size, n_layer=model_cfg["n_layer"], n_head=model_cfg["n_head"],
                     d_model=model_cfg["d_model"], block_size=model_cfg["block_size"], bias=model_cfg["bias"]))

    def padded(params) -> int:
        return sum(-(-p.shape[0] // world) * world * (p.numel() // p.shape[0]) for p in params)

    linear = kept = 0
    for blk in m.blocks:
        for mod in blk.modules():
            n = 2 * padded(mod.parameters(recurse=False))
            kept, linear = (kept + n, linear) if isinstance(mod, LayerNorm) else (kept, linear + n)
    kept += padded(m.parameters()) - padded(m.blocks.parameters())  # parameters() lists the tied weight once
    return linear, kept


def test_fsdp_collective_bytes_follow_param_and_reduce_dtypes(two_rank_jobs):
    """2-rank FSDP2: gradients reduce-scattered in bf16 move half the bytes of fp32;
    under bf16 the linear layers are all-gathered in bf16 (half the bytes of fp32) while
    embeddings and norms stay fp32, to the byte; float8 all-gather less than bf16."""
    by_case = two_rank_jobs("fsdp")
    comm = {}
    for job in (by_case[f"bytes-{p}-{r}"] for p, r in BYTES):
        s = json.loads((job / "summary.json").read_text())
        cfg = yaml.safe_load((job / "config.yaml").read_text())
        # the dtype audit of step 1 under FSDP2 (DTensor shards, gathered weights): clean,
        # fp32 gradients and updates whatever the reduce dtype, and the float8 linears seen
        audit = json.loads((job / "audit.json").read_text())
        assert audit["flags"] == [], audit["flags"]
        mods = audit["modules"]
        assert mods["blocks.0.mlp.fc"]["grad"] == mods["blocks.0.mlp.fc"]["update"] == "fp32"
        # fp8: precision.fp8.matmul=auto multiplies through torch._scaled_mm or, on a CPU where that
        # is slow (an Intel Xeon), in the fp32 emulation; the audit names the operands' format either way
        emulated = cfg["run_info"].get("fp8", {}).get("matmul") == "emulated"
        want = {"fp32": "fp32", "bf16": "bf16", "fp8": "e4m3 (emulated in fp32)" if emulated else "e4m3"}
        assert mods["blocks.0.mlp.fc"]["matmul"] == want[s["precision"]]
        assert audit["comm"] == {k: v for k, v in s.items() if k.startswith("comm/")}
        comm[(s["precision"], cfg["precision"]["reduce_dtype"])] = {
            k[len("comm/"):-len("_bytes")]: v for k, v in s.items() if k.startswith("comm/") and k != "comm/total_bytes"}
    assert len(comm) == 6, comm.keys()
    for p in ("fp32", "bf16", "fp8"):
        assert comm[(p, "bf16")]["reduce_scatter/bf16"] * 2 == comm[(p, "fp32")]["reduce_scatter/fp32"]
        assert "reduce_scatter/fp32" not in comm[(p, "bf16")]
    linear, kept = _fsdp2_gathered_numel(cfg["model"], cfg["run_info"]["vocab_size"], world=2)
    for reduce in ("fp32", "bf16"):  # what is gathered does not depend on the reduce dtype
        fp32, bf16 = comm[("fp32", reduce)], comm[("bf16", reduce)]
        assert fp32["all_gather/fp32"] == 4 * (linear + kept)
        assert bf16["all_gather/bf16"] == 2 * linear  # exactly half the fp32 bytes of the linears
        assert bf16["all_gather/fp32"] == 4 * kept  # embeddings (tied head) and norms as stored

    def gathered(c):
        return sum(v for k, v in c.items() if k.startswith("all_gather/"))

    fp8, bf16 = comm[("fp8", "fp32")], comm[("bf16", "fp32")]
    # the float8 weights travel as raw bytes: FSDP2 gathers a group whose shards differ in
    # dtype (float8 weights beside bf16 biases) as one uint8 buffer
    assert fp8.get("all_gather/uint8", 0) > 0, fp8
    assert fp8["all_gather/fp32"] == 4 * kept  # the float8 recipe leaves embeddings and norms alone too
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


@pytest.mark.parametrize("parallel", WRAPPERS)
def test_single_process_with_a_wrapper(tmp_path, parallel):
    """python train.py parallel=X without torchrun: a one-rank group, same code path."""
    s, rows = train(tmp_path / "run", "train.max_steps=3", f"parallel={parallel}")
    assert s["world_size"] == 1 and len(rows) == 3


# case -> (compute dtype, FSDP param dtype, reduce dtype, buffer dtype); see tests/dist_probe.py
PROBE_CASES = {
    "fp32": ("fp32", "fp32", "fp32", "fp32"),
    "bf16": ("bf16", "bf16", "fp32", "fp32"),
    "fp16": ("fp16", "fp16", "fp32", "fp32"),
    "fp32+reduce_bf16": ("fp32", "fp32", "bf16", "fp32"),
    "bf16+buffer_bf16": ("bf16", "bf16", "fp32", "bf16"),
    "fp16+reduce_fp16": ("fp16", "fp16", "fp16", "fp32"),
}


def _expected_acts(compute: str) -> dict:
    """What autocast leaves in each dtype (fp32 master weights): only the matmuls'
    outputs (here the logits) are in the compute dtype; the embedding output, the
    residual stream, the norms' inputs and the loss stay fp32."""
    acts = {"wte": "fp32", "ln_f.input": "fp32", "logits": compute, "loss": "fp32"}
    for i in range(2):
        acts.update({f"blocks.{i}": "fp32", f"blocks.{i}.ln_1.input": "fp32", f"blocks.{i}.ln_2.input": "fp32"})
    return acts


def _one_process_probes() -> list[dict]:
    """In this process (no launch, ~5 s): parallel=none for every case (the reference),
    and each wrapper over a one-rank group for the two half-precision presets."""
    from .dist_probe import CASES, probe

    return ([probe("none", case, ov) for case, ov in CASES.items()]
            + [probe(mode, case, CASES[case]) for mode in WRAPPERS for case in ("bf16", "fp16")])


@pytest.fixture(scope="module")
def probe_launch(tmp_path_factory) -> Path:
    """One 2-rank launch of tests/dist_probe.py for every wrapper; its directory
    holds each rank's probe records and initial-weight digests."""
    out = tmp_path_factory.mktemp("probe")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "dist_probe.py"), str(out), *WRAPPERS]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=out)
    assert r.returncode == 0, r.stderr[-4000:]
    return out


def test_dtypes_inside_each_wrapper_are_the_configured_ones(probe_launch):
    """One launch, every wrapper and setting: what runs in which dtype inside the
    wrapper is what was configured, and a preset's activations are the same under
    every wrapper, on 2 ranks and on 1, as under parallel=none."""
    records = [json.loads(line) for rank in (0, 1)
               for line in (probe_launch / f"probe-rank{rank}.jsonl").read_text().splitlines()]
    assert len(records) == 2 * len(WRAPPERS) * len(PROBE_CASES)
    local = _one_process_probes()
    none = {rec["case"]: rec for rec in local if rec["mode"] == "none"}
    for case, rec in none.items():  # the reference itself is what autocast promises
        assert rec["acts"] == _expected_acts(PROBE_CASES[case][0]), case
    for rec in records + [rec for rec in local if rec["mode"] != "none"]:
        compute, param, reduce, buffer = PROBE_CASES[rec["case"]]
        where = f"{rec['mode']}/{rec['case']}/rank{rec['rank']}of{rec['world']}"
        assert rec["storage"] == "fp32" and rec["grad_dtype"] == "fp32", where  # fp32 master weights and grads
        # The same dtype at the embedding output, every block output, every norm input,
        # the logits and the loss as one process without a wrapper.
        assert rec["acts"] == none[rec["case"]]["acts"], where
        # FSDP all-gathers the linears in param_dtype (autocast would cast them to it
        # anyway), embeddings (so the tied head) and norms in fp32 as stored; DDP keeps
        # fp32 weights and autocast casts per op.
        sharded = rec["mode"] != "ddp"
        assert rec["compute_weight"] == (param if sharded else "fp32"), where
        assert rec["gathered"] == {"wte": "fp32", "blocks.0.ln_1": "fp32", "lm_head": "fp32",
                                   "blocks.0.mlp.fc": param if sharded else "fp32"}, where
        assert rec["compute_out"] == compute, where
        assert rec["buffer"] == buffer, where
        if sharded:  # the banner says what was gathered in which dtype
            assert rec["declared"]["compute_params"].startswith(param), where
            if param != "fp32":
                assert rec["declared"]["norm_emb_params"].startswith("fp32 (all-gathered: embeddings"), where
        if rec["world"] == 2:
            # A gradient reduced in bf16/fp16 comes back holding only values that format can
            # represent; reduced in fp32 (the sum of two ranks' values) it does not.
            assert rec["grads_in_bf16"] == (reduce == "bf16"), where
            assert rec["grads_in_fp16"] == (reduce == "fp16"), where
            assert rec["declared"]["grad_reduce"].startswith(reduce), where


def test_initial_weights_do_not_depend_on_world_size(probe_launch):
    """The probe launch above also built the trainer's way (meta device, sharded
    by FSDP2 across 2 ranks, then materialized): its full initial weights are,
    bit for bit, those of the plain model built on the CPU in one process and
    reset with the same seed, in fp32 and with float8 linears."""
    from mptrain.model.gpt import GPT

    from .dist_probe import INIT_SEED, INIT_SHAPE, digest, init_digest

    model = GPT(INIT_SHAPE)
    model.reset_parameters(torch.Generator().manual_seed(INIT_SEED))
    plain = digest(list(model.named_parameters()))
    launched = [json.loads((probe_launch / f"init-rank{r}.json").read_text()) for r in (0, 1)]
    for precision in ("fp32", "fp8"):
        assert launched[0][precision] == launched[1][precision] == plain, precision
        assert init_digest("fsdp", precision) == plain, precision  # one rank, same path
        assert init_digest("none", precision) == plain, precision  # materialized before wrapping
    model.reset_parameters(torch.Generator().manual_seed(INIT_SEED + 1))
    assert digest(list(model.named_parameters())) != plain  # the digest can tell seeds apart


def test_fsdp1_grad_norm_is_fp32_with_half_precision_grads():
    """FSDP1's own clip_grad_norm_ returns the norm cast to the gradients' dtype; with
    bf16 gradients (bf16-pure stores them so) the logged norm and the inf/nan guard
    would see a value rounded to 8 bits. The context's norm is fp32, the exact norm
    of the bf16 gradients, and the clip scales them by it."""
    from mptrain.model.gpt import GPT, GPTShape
    from mptrain.distributed.parallel import setup, wrap
    from mptrain.precision.policy import PrecisionPolicy
    from mptrain.precision.recipe import precision_plan

    from .conftest import make_cfg

    cfg = make_cfg("parallel=fsdp1", "precision=bf16-pure")
    ctx = setup(build_plan(cfg))  # a one-rank group, made and destroyed here
    try:
        policy = PrecisionPolicy(precision_plan(cfg.precision), ctx.device)
        torch.manual_seed(0)
        model = wrap(GPT(GPTShape(vocab_size=128, n_layer=2, n_head=2, d_model=64, block_size=32)), policy, ctx)
        x = torch.randint(0, 128, (4, 33), generator=torch.Generator().manual_seed(1))
        with policy.autocast():
            _, loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert grads and all(g.dtype == torch.bfloat16 for g in grads)  # half precision indeed
        exact = torch.cat([g.double().reshape(-1) for g in grads]).norm()
        before = [g.clone() for g in grads]
        norm = ctx.clip_grad_norm(model, max_norm=0.5)
        assert norm.dtype == torch.float32
        assert float(norm) == pytest.approx(float(exact), rel=1e-6)
        assert float(norm) != float(norm.bfloat16())  # the bf16-rounded value would differ
        # and clipping used that norm: every gradient scaled by 0.5 / norm (in bf16)
        coef = 0.5 / (float(exact) + 1e-6)
        assert coef < 1
        for g, b in zip(grads, before, strict=True):
            torch.testing.assert_close(g.float(), (b.float() * coef), rtol=2 ** -7, atol=1e-8)
    finally:
        ctx.shutdown()


def test_nccl_without_cuda_is_refused(tmp_path):
    from mptrain.core.errors import ConfigError

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


def test_validation_loss_is_the_same_on_two_ranks(two_rank_jobs, tmp_path):
    """One set of weights measured by 2 FSDP2 ranks gives the single process's validation
    loss (the run's set and the whole split): the same 9 windows, shared 4 and 5 (one rank evaluates a filler that counts for
    nothing, so both make the same forwards), the token-weighted sums added over ranks."""
    two = json.loads((two_rank_jobs("fsdp")["val-same-weights"] / "summary.json").read_text())
    one, _ = train(tmp_path / "one", *TINY, *SAME_WEIGHTS_VAL, tiny=False)
    assert two["world_size"] == 2 and two["eval/windows"] == one["eval/windows"] == 9
    assert abs(two["final/val_loss"] - one["final/val_loss"]) <= 1e-6 * one["final/val_loss"], (two, one)
    # the last step's whole split (train.eval_whole_split): the same evaluate() on every window, 261 shared 130/131
    assert two["eval/whole_windows"] == one["eval/whole_windows"] > 9
    assert abs(two["final/whole_val_loss"] - one["final/whole_val_loss"]) <= 1e-6 * one["final/whole_val_loss"]


# ------------------------------------------ python -m mptrain.torchrun: exit codes, a stop while starting
def mptrain_torchrun(*overrides: str) -> list[str]:
    """The command line of ``python -m mptrain.torchrun`` on 2 ranks."""
    return [sys.executable, "-m", "mptrain.torchrun", "--standalone", "--nproc_per_node=2", str(ROOT / "train.py"),
            *overrides]


# The launcher is started as a module from a temporary folder (its run directory's parent): it needs this checkout.
LAUNCH_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


@pytest.mark.parametrize("code, overrides, said", [
    (2, ["parallel=ddp", "train.max_steps=2", "train.global_batch_size=7"],
     "mptrain: configuration error: train.global_batch_size=7 does not divide by the world size 2"),
    (3, ["parallel=ddp", "train.max_steps=4", "debug.nan_in_module=blocks.0.attn", "debug.nan_at_steps=[1]",
         "train.on_nonfinite=abort"],
     "mptrain: training stopped: step 2: the forward pass produced a non-finite loss"),
], ids=["user-error", "numerics"])
def test_mptrain_torchrun_exits_with_the_ranks_code_and_line(tmp_path, code, overrides, said):
    """A rank's exit code 2 (a user error found in the run, past the command-line
    check) or 3 (numerics stopped the run) is the launcher's, with the rank's one
    line printed once for both ranks, and no failure report of torch's agent
    (its error line and ChildFailedError traceback, exit 1)."""
    r = subprocess.run(mptrain_torchrun(*TINY, *overrides), cwd=tmp_path, capture_output=True, text=True,
                       timeout=300, env=LAUNCH_ENV)
    ours = [line for line in r.stderr.splitlines() if line.startswith("mptrain")]
    assert r.returncode == code and len(ours) == 1 and ours[0].startswith(said), (r.returncode, r.stderr[-4000:])
    for noise in ("Traceback", "ChildFailedError", "failed (exitcode"):
        assert noise not in r.stderr, r.stderr[-4000:]


def test_the_headline_launcher_answers_a_bad_override_with_its_one_line_alone(tmp_path):
    """The multi-process command the README leads with, ``python -m mptrain.torchrun``, on a
    misspelt key: exit code 2 and rank 0's line, nothing else on either stream (torch's
    OMP_NUM_THREADS banner is silenced the way a user silences it, by setting the
    variable), nothing written. Plain ``torchrun`` cannot be made this quiet from inside
    the ranks: its agent reports every non-zero exit with a ChildFailedError and exits 1
    (docs/distributed.md says why the README leads with this launcher instead)."""
    r = subprocess.run(mptrain_torchrun("parallel=ddp", "train.max_stpes=3"), cwd=tmp_path, capture_output=True,
                       text=True, timeout=300, env={**LAUNCH_ENV, "OMP_NUM_THREADS": "1"})
    assert (r.returncode, r.stdout) == (2, ""), (r.returncode, r.stdout, r.stderr[-4000:])
    (line,) = r.stderr.splitlines()
    assert line.startswith("mptrain: configuration error: Unknown config key 'train.max_stpes'. Did you mean "
                           "'train.max_steps'?"), r.stderr
    assert list(tmp_path.iterdir()) == []


def test_sigterm_while_the_ranks_start_leaves_no_trace(tmp_path):
    """SIGTERM to the launcher while the ranks are starting: rank 0 has locked the
    run directory, Hydra has written its files there, and it is training a BPE
    tokenizer (in native code) while rank 1 waits for it in a gloo barrier. Both
    exit 0 at once, the launcher exits 0 without a traceback, and the run
    directory (with the outputs/<date>/ folders made for it) is gone."""
    import time

    outputs, log = tmp_path / "outputs", tmp_path / "launch.log"
    # a vocabulary no other test asks for: the tokenizer is trained here, not found in the session's cache
    cmd = mptrain_torchrun(*TINY, "parallel=ddp", "train.max_steps=50", "data.tokenizer=bpe", "data.bpe_vocab_size=777")
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
                                env={**LAUNCH_ENV, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 240
    while "777-token byte-level BPE" not in log.read_text():
        assert proc.poll() is None, f"exited {proc.returncode} before it trained its tokenizer:\n{log.read_text()}"
        assert time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(0.02)
    assert list(outputs.glob("*/*/.lock")) and list(outputs.glob("*/*/.hydra")), list(outputs.rglob("*"))
    assert not list(outputs.glob("*/*/metrics.jsonl"))  # still starting
    proc.send_signal(signal.SIGTERM)  # to the launcher only, as a scheduler or `kill <pid>` does
    assert proc.wait(timeout=120) == 0, log.read_text()[-4000:]
    said = log.read_text()
    assert "SIGTERM forwarded to workers" in said and "Traceback" not in said, said[-4000:]
    assert not outputs.exists(), list(outputs.rglob("*"))
