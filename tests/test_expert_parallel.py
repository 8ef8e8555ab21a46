"""Expert parallelism (``parallel.ep``) on 4 real gloo ranks, equal to one process.

Every 4-rank case is a job of the ONE torchrun launch this file shares with
test_mesh.py and test_mesh_observe.py (conftest.py's ``four_rank_jobs``, names
prefixed ``ep-``): moe-nano (4 experts, top-2, 2 routed layers), 4 steps of
8 x 64 tokens, the numerics monitor on every step (its ``moe/load_*`` figures
are counts of token choices, summed over the ranks). Each is compared with one
process that splits the batch in 4 micro-batches, as the 4 data-parallel ranks
see it (expert parallelism splits experts, not data).

Tolerances (max |loss - one process| over the steps):

- Until a routing choice flips: test_mesh.py's ``TOL`` (fp32 2e-5: the layouts
  compute the same values in another order of sums, an expert's weight gradient
  over the tokens of several ranks in one GEMM, the data-parallel averages;
  bf16 2e-3, on top of which an expert's bf16 weight gradient is rounded once
  over every rank's tokens instead of once per rank).
- A router choosing between two near-equal experts flips once the weights differ
  by ulps, and the runs then part as two trainings do (bf16 with ep=2 on an Intel
  Xeon, 2026-12-05: a flip at step 2, the losses 2.3e-4 apart by step 4). A flip
  shows in the expert loads (token counts, every step); from the first step whose
  loads differ, the bound is test_mesh.py's smoke bound ``LOWP_TOL`` (1e-2).
- fp8 and nvfp4: ``LOWP_TOL`` from the start: a tensorwise (or NVFP4's per-tensor)
  scale of an expert's input spans the rows it receives from every rank of its
  group, one process's the rows of one micro-batch.

Routing: on the first step (the same weights on both sides) every choice is one
process's for fp32 and bf16: the expert loads of every routed layer are equal,
count for count. Under fp8 and nvfp4 the casts' scales span other rows than one
process's (the experts' input, and FSDP's float8 weight gathers), so a router
input moves by a float8 step now and then and a near-tie may flip: their first
step's loads stay within 1% of the 1,024 token choices (measured: one choice).

The reshard chain routes every token to every expert (top_k = n_experts: no
choice to flip), so it is held to ``TOL["fp32"]`` throughout.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml

from mptrain.core.errors import ConfigError
from mptrain.distributed import expert_parallel
from mptrain.model.moe import ExpertSlice, MoE, MoEShape
from mptrain.observe.traffic import traffic

from .conftest import TINY, make_plan, read_rows, train
from .test_mesh import LOWP_TOL, TOL

STEPS = 4
# monitor.fp8_whatif=[]: the casts the run makes are measured, not the what-ifs (more than half a float8 job)
MOE = ["model=moe-nano", f"train.max_steps={STEPS}", "monitor.every=1", "monitor.fp8_whatif=[]",
       "train.micro_batch_size=2"]
COMMON = [*TINY, *MOE]
EP4 = ["parallel=fsdp", "parallel.ep=4"]  # every rank one expert; FSDP shards the rest over 4
EP2 = ["parallel=fsdp", "parallel.ep=2"]  # 2 experts per rank, FSDP of the experts over the 2 that share them
HSDP_EP2 = ["parallel=hsdp", "parallel.dp_shard=2", "parallel.ep=2"]  # 2 replicas of 2 ranks, each an EP group
PRECISIONS = ("fp32", "bf16", "fp8", "nvfp4")
BEFORE_A_FLIP = {"fp32": TOL["fp32"], "bf16": TOL["bf16"], "fp8": LOWP_TOL, "nvfp4": LOWP_TOL}
# |first step's block gradient norm / one process's - 1|: fp32 the order of sums (a few ulps of
# a norm); bf16 one bf16 rounding of the experts' weight gradients (2^-8); float8 and 4-bit a
# cast's scale over other rows (module docstring), up to one e4m3 step (2^-3) of some values.
GRAD_REL = {"fp32": 1e-6, "bf16": 2.0 ** -8, "fp8": 2.0 ** -3, "nvfp4": 2.0 ** -3}
FP8_DISPATCH = ["parallel.ep_dispatch=fp8"]
# The reshard chain: one process for 2 of 6 steps (chain_first_leg, before the shared launch),
# then ep=4 on 4 ranks to step 4 (a job of the launch), then one process again to step 6.
# Every token to all 4 experts: no routing choice to flip (module docstring).
CHAIN = [*TINY, "model=moe-nano", "model.moe.top_k=4", "train.max_steps=6", "train.micro_batch_size=2",
         "monitor.every=100", "checkpoint.every=2", "checkpoint.keep_last=0", "precision=fp32"]
CASES = {
    **{f"ep4-{p}": [*COMMON, *EP4, f"precision={p}"] for p in PRECISIONS},
    **{f"ep2-{p}": [*COMMON, *EP2, f"precision={p}"] for p in ("bf16", "fp8", "nvfp4")},
    "hsdp-ep2-fp32": [*COMMON, *HSDP_EP2, "precision=fp32"],
    "ep2-fp8dispatch": [*COMMON, *EP2, "precision=fp32", *FP8_DISPATCH],
}


def chain_first_leg(tmp: Path) -> dict[str, list[str]]:
    """The reshard chain's first leg, one process to step 2 in ``tmp``, and the shared launch's
    job that resumes it on ep=4 to step 4 (conftest.py runs this before the launch)."""
    train(tmp, *CHAIN, "train.stop_after=2")
    return {"chain": [*CHAIN, *EP4, f"resume.source={tmp}", "train.stop_after=4"]}  # resume= as a file sets it


@pytest.fixture(scope="module")
def jobs(four_rank_jobs):
    return {name: four_rank_jobs[f"ep-{name}"] for name in CASES}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """precision (or ``fp8dispatch``) -> one process's rows, the batch in 4 micro-batches."""
    out = {}
    for name, extra in [*((p, [f"precision={p}"]) for p in PRECISIONS),
                        ("fp8dispatch", ["precision=fp32", *FP8_DISPATCH])]:
        _, out[name] = train(tmp_path_factory.mktemp(f"ep-ref-{name}"), *COMMON, *extra)
    return out


def _steps(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "train/loss" in r]


def _loads(row: dict, blocks=("block0", "block1")) -> dict:
    return {k: v for k, v in row.items() if k.startswith("moe/load_m") and k.endswith(blocks)}


@pytest.mark.parametrize("case,ref", [*((f"ep4-{p}", p) for p in PRECISIONS),
                                      *((f"ep2-{p}", p) for p in ("bf16", "fp8", "nvfp4")),
                                      ("hsdp-ep2-fp32", "fp32"), ("ep2-fp8dispatch", "fp8dispatch")])
def test_expert_parallel_equals_one_process(jobs, references, case, ref):
    got, want = _steps(read_rows(jobs[case])), _steps(references[ref])
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, STEPS + 1))
    precision = "fp32" if ref == "fp8dispatch" else ref
    flip = next((i for i, (a, b) in enumerate(zip(got, want)) if _loads(a) != _loads(b)), len(got))
    diffs = [abs(a["train/loss"] - b["train/loss"]) for a, b in zip(got, want)]
    before = max(diffs[:flip], default=0.0)
    assert before < BEFORE_A_FLIP[precision], f"{case}: max |loss - one process| before a flip = {before:.2e}"
    assert max(diffs) < LOWP_TOL, f"{case}: max |loss - one process| = {max(diffs):.2e}"
    # The gradients of the first step (the same weights): each block's norm is one process's. Adam
    # hides a constant factor on the experts' gradients from the loss; this does not.
    for block in ("block0", "block1"):
        key = f"numerics/grad_norm/{block}"
        rel = abs(got[0][key] / want[0][key] - 1)
        assert rel < GRAD_REL[precision], f"{case}: {key} {got[0][key]} vs one process {want[0][key]}"
    first, ref_first = _loads(got[0]), _loads(want[0])
    assert first and set(first) == set(ref_first)
    if precision in ("fp32", "bf16"):
        assert first == ref_first  # the same choices, count for count
    else:  # a float8 cast's scale spans other rows under FSDP: near-ties may flip (module docstring)
        assert max(abs(first[k] - ref_first[k]) for k in first) <= 0.01 * 8 * 64 * 2, (first, ref_first)
    assert got[-1]["train/loss"] < got[0]["train/loss"] - 0.1
    assert all(r["dist/rank_mismatch"] == 0 for r in got)  # the weights every rank holds alike, and the experts summed


def test_each_experts_cast_statistics_come_from_the_rank_that_holds_it(jobs, references):
    """Under ep=4 each rank holds one expert of each layer, yet every expert's float8 figures are
    there, and they are that expert's: its weight's amax is one process's (to the bf16 rounding
    of FSDP's gathered copy, which the attention's weights show alike), not another expert's
    reduced into the same slot."""
    got = next(r for r in read_rows(jobs["ep4-fp8"]) if r.get("step") == 1 and "train/loss" in r)
    want = next(r for r in references["fp8"] if r.get("step") == 1 and "train/loss" in r)
    keys = {k for k in want if k.startswith(("fp8.", "numerics/quant"))}
    assert keys and {k for k in got if k.startswith(("fp8.", "numerics/quant"))} == keys
    amax = [k for k in keys if k.endswith("/weight/amax") and ".experts." in k]
    assert len(amax) == 2 * (4 + 1) * 3  # 2 layers x (4 experts + their group) x 3 matrices
    for k in amax:
        assert abs(got[k] - want[k]) <= 2.0 ** -8 * want[k], (k, got[k], want[k])
    spread = sorted(want[k] for k in amax if ".experts.all." not in k)
    assert spread[-1] - spread[0] > 2.0 ** -6 * spread[-1]  # the experts' weights differ more than that


def test_expert_parallel_is_stated_and_traffic_matches_the_estimate(jobs):
    """The banner and run_info name the split and the dispatch dtype; the bytes the step's
    collectives moved on ``ep`` and ``edp`` are the estimator's (``memory --comm``): the
    counts and the experts' FSDP exactly, the rows within the routing's imbalance."""
    job = jobs["ep2-bf16"]
    info = yaml.safe_load((job / "config.yaml").read_text())["run_info"]
    mesh = info["mesh"]
    assert mesh["ep"] == 2 and "experts over ep=2 of the dp_shard ranks" in mesh["text"]
    assert "rows in bf16 (parallel.ep_dispatch=compute)" in mesh["collectives"]["ep"]
    assert "edp" in mesh["collectives"]
    log = (job / "train.log").read_text()
    assert "experts over ep=2" in log and "ep: all_to_all" in log
    row = read_rows(job)[0]
    plan = make_plan(*COMMON, *EP2, "precision=bf16", world=4)
    est = {(f.dim, f.kind, f.dtype): 0 for f in traffic(plan, info["vocab_size"])}
    for f in traffic(plan, info["vocab_size"]):
        est[f.dim, f.kind, f.dtype] += f.payload
    measured = {(k.split("/")[1], k.split("/")[2], k.split("/")[3][:-len("_bytes")]): v for k, v in row.items()
                if k.startswith(("comm/ep/", "comm/edp/")) and not k.endswith("total_bytes")}
    assert set(measured) == {k for k in est if k[0] in ("ep", "edp")}
    for key, b in measured.items():
        if key[2] == "int64" or key[0] == "edp":
            assert b == est[key], key
        else:  # a rank sends its own choices, but receives (and sends back) what the routing gives it
            assert 0.75 * est[key] < b < 1.25 * est[key], (key, b, est[key])


def test_an_expert_parallel_checkpoint_reshards_to_one_process_and_back(four_rank_jobs, tmp_path):
    """One process to step 2, resumed on ep=4 (every rank reads its own expert of the
    one-process checkpoint) to step 4, resumed on one process again (reading every rank's
    experts) to step 6: the losses follow the straight one-process run (``TOL["fp32"]``)."""
    first, ep = four_rank_jobs["ep-chain-first"], four_rank_jobs["ep-chain"]
    meta = json.loads((ep / "checkpoints" / "step-4" / "meta.json").read_text())
    assert meta["mesh"]["ep"] == 4 and meta["world_size"] == 4
    _, last = train(tmp_path / "last", *CHAIN, f"resume={ep}")
    _, straight = train(tmp_path / "straight", *CHAIN)
    got, want = [*_steps(read_rows(first)), *_steps(read_rows(ep)), *_steps(last)], _steps(straight)
    assert [r["step"] for r in got] == list(range(1, 7))
    diff = max(abs(a["train/loss"] - b["train/loss"]) for a, b in zip(got, want, strict=True))
    assert diff < TOL["fp32"], (diff, [r["train/loss"] for r in got], [r["train/loss"] for r in want])


# ---------------------------------------------------------------- without ranks


def test_a_rank_draws_its_experts_as_one_process_does():
    """An :class:`~mptrain.model.moe.ExpertSlice` draws the whole layer's initial values in
    order and keeps its own: rank 1 of ep=2's experts 2 and 3 equal one process's."""
    s = MoEShape(vocab_size=64, n_layer=2, n_head=2, d_model=64, block_size=64, n_kv_head=2, ffn_hidden=128,
                 n_experts=4, top_k=2)
    whole = MoE(s)
    whole.reset_parameters(torch.Generator().manual_seed(3))
    part = MoE(s)
    for layer in part.moe_layers():
        layer.experts = ExpertSlice(layer.experts, 2, 2)
    part.reset_parameters(torch.Generator().manual_seed(3))
    held = dict(part.named_parameters())
    assert "blocks.0.mlp.experts.2.gate.weight" in held and "blocks.0.mlp.experts.0.gate.weight" not in held
    for name, p in whole.named_parameters():
        if name in held:
            assert torch.equal(p, held[name]), name
    assert len(held) == len(dict(whole.named_parameters())) - 2 * 2 * 3  # 2 layers x 2 experts x 3 matrices


def test_fp8_dispatch_rounds_each_tile_to_e4m3():
    """One fp32 scale per token and 128 features (the whole row when narrower); each value
    within half an e4m3 step (2^-4 relative) of itself, the tile's largest kept (to the
    fp32 rounding of dividing by its scale and multiplying back)."""
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(0)) * torch.tensor([1e-3, 1.0, 1e3, 7.0, 0.1])[:, None]
    q, scale = expert_parallel.fp8_rows(x)
    assert q.dtype == torch.uint8 and scale.shape == (5, 2)
    back = expert_parallel.fp8_values(q, scale, torch.float32)
    assert torch.all((back - x).abs() <= x.abs() * 2.0 ** -4 + scale.repeat_interleave(128, dim=1) * 2.0 ** -9)
    tiles = x.view(5, 2, 128).abs().amax(-1)
    assert torch.allclose(back.view(5, 2, 128).abs().amax(-1), tiles, rtol=2.0 ** -22, atol=0)
    narrow = torch.randn(3, 64)
    assert expert_parallel.fp8_rows(narrow)[1].shape == (3, 1)
    assert expert_parallel.rounds("fp8", torch.bfloat16) and expert_parallel.rounds("bf16", torch.float32)
    assert not expert_parallel.rounds("compute", torch.bfloat16) and not expert_parallel.rounds("fp32", torch.bfloat16)


REFUSALS = {
    # experts not divisible by ep (6 ranks: ep=3 divides dp_shard, not the 4 experts)
    ("model=moe-nano", "parallel=fsdp", "parallel.ep=3", "train.global_batch_size=12", 6):
        "model.moe.n_experts=4 is not divisible by parallel.ep=3: each of the ep ranks holds n_experts / ep whole "
        "experts; use an ep that divides 4 (1, 2, 4), or change model.moe.n_experts.",
    ("model=moe-nano", "parallel=fsdp_tp", "parallel.tp=2", "parallel.ep=2", 4):
        "parallel.ep=2 with parallel.tp=2: expert parallelism is not built beside tensor parallelism (the "
        "mixture's blocks have no tensor-parallel layout); use parallel.tp=1.",
    ("model=moe-nano", "parallel=hsdp", "parallel.dp_shard=2", "parallel.ep=4", 4):
        "parallel.ep=4 does not divide parallel.dp_shard=2: the experts are split over ep of the dp_shard ranks, "
        "in groups of 4; use an ep that divides 2.",
    ("model=moe-nano", "parallel=ddp", "parallel.ep=2", 2):
        "parallel.ep=2 needs an FSDP2 device mesh, and parallel=ddp keeps a whole model on every rank: use "
        "parallel=fsdp parallel.ep=2, or leave parallel.ep at its default.",
    ("model=moe-nano", "parallel=fsdp", "parallel.ep=2", "precision=fp16", "precision.reduce_dtype=fp16", 2):
        "parallel.ep=2 leaves each rank alone with its experts (ep = parallel.dp_shard), where FSDP2 divides an "
        "fp16-reduced expert gradient by the data-parallel size twice; use precision.reduce_dtype=fp32 (or bf16), "
        "or an ep below dp_shard.",
    ("model=llama-nano", "parallel=fsdp", "parallel.ep=2", 2):
        "parallel.ep=2 applies to a mixture's routed experts, and this is a llama model (model.family=llama), "
        "which has none; pick a moe preset (model=moe-nano, ...) or leave parallel.ep at its default.",
    ("model=gpt-nano", "parallel.ep_dispatch=fp8", 1):
        "parallel.ep_dispatch=fp8 applies to a mixture's routed experts, and this is a gpt model "
        "(model.family=gpt), which has none; pick a moe preset (model=moe-nano, ...) or leave "
        "parallel.ep_dispatch at its default.",
}


@pytest.mark.parametrize("case", REFUSALS, ids=lambda c: "-".join(c[1:-1]))
def test_refusals_name_the_problem_and_the_fix(case):
    *overrides, world = case
    with pytest.raises(ConfigError) as e:
        make_plan(*overrides, world=world)
    assert str(e.value) == REFUSALS[case]


def test_traffic_on_paper_has_the_expert_dimensions():
    """The estimator's ep flows: every routed layer's dispatch, combine and their gradients
    per micro-batch (rows = tokens x top_k, d_model wide), the counts before each dispatch."""
    plan = make_plan(*COMMON, *EP2, "precision=fp32", world=4)
    flows = {(f.dim, f.kind, f.dtype, f.what[:20]): f for f in traffic(plan, 320)}
    rows, d, layers = 2 * 64 * 2, 64, 2  # micro-batch 2 x 64 tokens, top-2; 2 routed layers, one micro-batch
    counts = [f for k, f in flows.items() if k[2] == "int64"]
    assert len(counts) == 1 and counts[0].payload == layers * 4 * 8
    fp32 = sum(f.payload for k, f in flows.items() if k[:3] == ("ep", "all_to_all", "fp32"))
    assert fp32 == 4 * layers * rows * d * 4  # rows out, outputs back, and both gradients
    assert math.isclose(sum(f.payload for k, f in flows.items() if k[0] == "edp" and k[1] == "all_gather"),
                        2 * 2 * layers * 3 * 64 * 32 * 4)  # 2 held experts of 3 matrices, forward + backward
