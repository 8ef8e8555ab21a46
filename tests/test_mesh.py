"""The mesh on 4 real gloo ranks: HSDP (2 x 2), FSDP x TP (2 x 2), 4-way TP and
4-way FSDP, each equal to one process that splits the batch as the
data-parallel ranks see it; checkpoints resharded across layouts; a two-agent
(two "nodes") launch.

Every layout case is a job of ONE torchrun launch (a Hydra multirun: the 4
processes start once), read by the tests below; the one-process references
run in this process.
"""
from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from .conftest import ROOT, TINY, read_rows, train
from .test_distributed import torchrun

STEPS = 4
# gpt-nano has 2 heads and llama-nano 2 key/value heads: 4 of each, so that tp=4 divides them.
FAMILIES = {"gpt": ["model=gpt-nano", "model.n_head=4"], "llama": ["model=llama-nano", "model.n_kv_head=4"]}
# name -> (overrides, data-parallel ranks: the one-process reference takes as many micro-batches)
LAYOUTS = {
    "hsdp": (["parallel=hsdp", "parallel.dp_shard=2"], 4),
    "fsdp_tp": (["parallel=fsdp_tp", "parallel.tp=2"], 2),
    "tp4": (["parallel=fsdp_tp", "parallel.tp=4"], 1),
    "fsdp": (["parallel=fsdp"], 4),
}
PRECISIONS = ("fp32", "bf16")
COMMON = [*TINY, f"train.max_steps={STEPS}", "train.log_every=1", "monitor.every=100"]
# Max |loss - one process| over the steps, per precision:
# - fp32: the layouts compute the same operations on the same values; only the order
#   of sums differs (a row-split matmul's partial sums added by the TP reduction, the
#   data-parallel gradient sum). That is ~1e-7 relative per step, carried on by AdamW;
#   at a loss of ~5.5 a few fp32 ulps (4.8e-7 each). Bound: 2e-5, 40 ulps.
# - bf16: as tests/test_distributed.py's bf16 bound (6e-4: a gradient rounded per rank
#   flips later bf16 roundings by one ulp, 2^-8), plus what TP adds: a row-split
#   matmul's output is rounded to bf16 on each rank before the ranks' sum, one process
#   rounds the whole sum once, so those outputs may differ by a bf16 ulp from the first
#   step on. Bound: 2e-3.
TOL = {"fp32": 2e-5, "bf16": 2e-3}


def _case(family: str, layout: str, precision: str) -> list[str]:
    return [*COMMON, *FAMILIES[family], *LAYOUTS[layout][0], f"precision={precision}"]


# 4-way FSDP (today's layout) in fp32 only: its bf16 is test_distributed.py's on 2 ranks.
CASES = {f"{f}-{l}-{p}": _case(f, l, p) for f in FAMILIES for l in LAYOUTS for p in PRECISIONS
         if (l, p) != ("fsdp", "bf16")}
# The low-precision presets as shipped, through the trainer (its monitors, what-ifs and
# FSDP's float8 all-gather included) on 2 x 2 FSDP x TP. That each recipe's scales are
# the logical tensor's, and what breaks without it, tests/test_tp_precision.py shows
# layer by layer; here the whole run must work and stay near one process's loss.
LOWP = ("fp8", "nvfp4")
CASES.update({f"{f}-fsdp_tp-{p}": _case(f, "fsdp_tp", p) for f in FAMILIES for p in LOWP})
# Their bound: the bf16 rounding TP adds (see TOL) moves some values across a float8 or
# float4 rounding boundary, a whole e4m3 ulp (2^-3 relative) or e2m1 ulp (2^-1), and
# NVFP4's stochastic rounding draws differ per TP rank by construction. Measured after 4
# steps: fp8 8.4e-5 (gpt) and 9.9e-4 (llama), nvfp4 4.0e-4 and 1.7e-4; bound 1e-2, 10x the
# worst: a smoke bound for the trainer's path, not a proof of the scales.
LOWP_TOL = 1e-2
# test_a_phase_switch_on_the_mesh_equals_one_process: plain bf16 linears, then NVFP4's lab linears from step 2
PHASE = ["precision=bf16", "precision.phases=[{start: 2, precision: nvfp4}]"]
CASES.update({f"phase_switch_{layout}": [*_case("gpt", layout, "bf16")[:-1], *PHASE] for layout in ("fsdp_tp", "hsdp")})
# The reshard chain (test_checkpoint_reshards_across_layouts): llama on 2 x 2 (dp_shard x tp)
# for 2 of 8 steps, then 4-way FSDP, then one process, then 2 x 2 again. Its first leg is a
# job of the shared launch; the straight run is CHAIN in one process.
CHAIN = [*TINY, "model=llama-nano", "train.max_steps=8", "train.log_every=1", "monitor.every=100",
         "checkpoint.every=2", "checkpoint.keep_last=0", "precision=fp32"]
CASES["chain"] = [*CHAIN, "parallel=fsdp_tp", "parallel.tp=2", "train.stop_after=2"]


@pytest.fixture(scope="module")
def mesh_jobs(four_rank_jobs):
    """{case: job directory} of this file's cases in the shared 4-rank launch (conftest.py)."""
    return four_rank_jobs


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """(family, precision, data-parallel ranks) -> one process's loss per step, with
    the batch split in as many micro-batches as the layout has data-parallel ranks."""
    out = {}
    wanted = [(f, p, dp) for f in FAMILIES for p in PRECISIONS for dp in sorted({dp for _, dp in LAYOUTS.values()})]
    wanted += [(f, p, LAYOUTS["fsdp_tp"][1]) for f in FAMILIES for p in LOWP]
    for family, precision, dp in wanted:
        d = tmp_path_factory.mktemp(f"ref-{family}-{precision}-{dp}")
        _, rows = train(d, *COMMON, *FAMILIES[family], f"precision={precision}", f"train.micro_batch_size={8 // dp}")
        out[family, precision, dp] = [r["train/loss"] for r in rows if "train/loss" in r]
    return out


@pytest.mark.parametrize("precision", LOWP)
@pytest.mark.parametrize("family", FAMILIES)
def test_low_precision_presets_train_under_fsdp_tp(mesh_jobs, references, family, precision):
    run = mesh_jobs[f"{family}-fsdp_tp-{precision}"]
    got, ref = losses(run), references[family, precision, LAYOUTS["fsdp_tp"][1]]
    diff = max(abs(a - b) for a, b in zip(got, ref, strict=True))
    assert diff < LOWP_TOL, f"{family} fsdp_tp {precision}: max |loss - one process| = {diff:.2e}"
    assert got[-1] < got[0] - 0.1


@pytest.mark.parametrize("layout", ["fsdp_tp", "hsdp"])
def test_a_phase_switch_on_the_mesh_equals_one_process(mesh_jobs, tmp_path, layout):
    """2 x 2 ranks (dp_shard x tp, or replicate x shard) rebuild the model as NVFP4 lab linears
    before step 3, all at that step, and follow one process (the batch in as many
    micro-batches as there are data-parallel ranks) across the boundary."""
    run = mesh_jobs[f"phase_switch_{layout}"]
    dp = LAYOUTS[layout][1]
    _, ref = train(tmp_path / "ref", *COMMON, *FAMILIES["gpt"], *PHASE, f"train.micro_batch_size={8 // dp}")
    got, want = losses(run), [r["train/loss"] for r in ref if "train/loss" in r]
    diff = max(abs(a - b) for a, b in zip(got, want, strict=True))
    assert diff < LOWP_TOL, f"{layout} phase switch: max |loss - one process| = {diff:.2e}"
    rows = [r for r in read_rows(run) if "train/loss" in r]
    assert all(r["dist/rank_mismatch"] == 0 for r in rows)
    info = yaml.safe_load((run / "config.yaml").read_text())["run_info"]
    assert info["phases"][1]["began_at"] == 2 and info["phases"][1]["recipe"]["name"] == "nvfp4"


def losses(run_dir: Path) -> list[float]:
    return [r["train/loss"] for r in read_rows(run_dir) if "train/loss" in r]


@pytest.mark.parametrize("case", [c for c in CASES if c.count("-") == 2 and not c.endswith(LOWP)])
def test_layout_equals_one_process(mesh_jobs, references, case):
    family, layout, precision = case.split("-")
    run = mesh_jobs[f"{family}-{layout}-{precision}"]
    got, ref = losses(run), references[family, precision, LAYOUTS[layout][1]]
    assert len(got) == len(ref) == STEPS
    diff = max(abs(a - b) for a, b in zip(got, ref))
    assert diff < TOL[precision], f"{family} {layout} {precision}: max |loss - one process| = {diff:.2e}"
    assert got[-1] < got[0] - 0.1  # it learns
    rows = [r for r in read_rows(run) if "train/loss" in r]
    assert all(r["dist/rank_mismatch"] == 0 for r in rows)  # every rank saw the same loss and grad norm


def test_checkpoint_reshards_across_layouts(mesh_jobs, tmp_path):
    """Saved on 2 x 2 (dp_shard x tp), resumed on 4-way FSDP, on one process, and on
    2 x 2 again: the loss curve is the straight one-process run's. DCP reshards the
    weights and optimizer state; the checkpoint's manifest and optimizer layout follow.
    The last checkpoint, written by 2 x 2 ranks, exports to a transformers Llama."""
    run = tmp_path / "chain"
    (mesh_jobs["chain"]).rename(run)  # the shared launch's first leg, moved to a path of its own
    resume = [*CHAIN, f"resume={run}", f"hydra.run.dir={run}"]
    torchrun(tmp_path, *resume, "parallel=fsdp", "train.stop_after=4", nproc=4)
    train(run, *CHAIN, "train.stop_after=6", f"resume={run}")
    torchrun(tmp_path, *resume, "parallel=fsdp_tp", "parallel.tp=2", nproc=4)
    _, straight = train(tmp_path / "straight", *CHAIN)
    want = [r["train/loss"] for r in straight if "train/loss" in r]
    got = losses(run)
    assert [r["step"] for r in read_rows(run) if "train/loss" in r] == list(range(1, 9))
    # fp32, and each leg equals one process up to summation order (TOL["fp32"])
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < TOL["fp32"], (got, want)
    # the last checkpoint, saved on 2 x 2, exports to transformers (export_hf checks the logits itself)
    from .test_export import _export_module

    _export_module().main([str(run), str(tmp_path / "hf")])
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_agents_form_one_job(mesh_jobs, tmp_path):
    """Two torchrun agents (--nnodes=2, two ranks each) on 127.0.0.1 make one 4-rank
    job: HSDP's replicate dimension spans the two "nodes" (dp_shard 0 = the ranks of one
    node), one run directory is written, and the loss is the one-launch 2 x 2 HSDP run's."""
    port, run = _free_port(), tmp_path / "run"
    agent = ("--nnodes=2", "--nproc_per_node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
             f"--rdzv-id=mesh-{port}")
    args = [str(ROOT / "train.py"), *COMMON, *FAMILIES["gpt"], "parallel=hsdp", "precision=fp32", f"hydra.run.dir={run}"]
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *agent, f"--node-rank={n}", *args],
                              cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for n in (0, 1)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    info = json.loads((run / "summary.json").read_text())
    assert info["world_size"] == 4
    assert "2 x 2 x 1" in outs[0]  # the mesh the banner states: replicate across the agents
    assert losses(run) == pytest.approx(losses(mesh_jobs["gpt-hsdp-fp32"]), abs=TOL["fp32"])
    assert not (tmp_path / "outputs").exists()  # one run directory, the one named
