"""What a run under a device mesh says about itself, on 4 real gloo ranks.

Every case is a job of ONE torchrun launch (a Hydra multirun, as
test_distributed.py's ``sweep``): 2x2 HSDP and 1x2x2 FSDP + TP with sequence
parallelism, gpt-nano, 3 steps, the numerics monitor and the dtype audit on
step 1. The tests read back what each job wrote:

- the per-dimension collective accounting of step 1 (``comm/<dim>/...``) against
  the bytes the parameter shapes predict (computed here from a model of the same
  shape, not read from any output);
- the dtype of each gradient reduction against ``precision.reduce_dtype``, and the
  audit's verdict: nothing flagged on a correct run, the TP all-reduce of the norms'
  gradients flagged where it runs in bf16 under an fp32 reduce dtype;
- the mesh in the banner and run_info;
- the numerics monitor's sums: the weight norm of step 1 equals one process's
  (replicas counted once).
"""
from __future__ import annotations

import json
import math

import pytest
import yaml

from mptrain.model.gpt import GPT, GPTShape

from .conftest import TINY, read_rows, train

# monitor.every=1: step 1 is audited (its attention probes are paused for the audit), step 2 probed
COMMON = [*TINY, "train.max_steps=3", "train.audit=true", "monitor.every=1"]
HSDP = ["parallel=hsdp", "parallel.dp_replicate=2", "parallel.dp_shard=2"]
TP = ["parallel=fsdp_tp", "parallel.tp=2"]  # dp_shard = the rest: 2
CASES = {
    "hsdp-fp32": [*COMMON, *HSDP, "precision=fp32"],
    "hsdp-bf16pure": [*COMMON, *HSDP, "precision=bf16-pure"],  # reduce_dtype bf16: gradient bytes halve
    "tp-fp32": [*COMMON, *TP, "precision=fp32"],
    # The reduce dtype on TP's gradient all-reduce (the norms' partial sums under sequence
    # parallelism), with and without gradient accumulation (2 micro-batches of 2 per rank):
    # bf16 in an fp32 run, fp32 in a bf16-pure one...
    **{f"tp-reduce-bf16{a}": [*COMMON, *TP, "precision=fp32", "precision.reduce_dtype=bf16", *m]
       for a, m in (("", []), ("-accum", ["train.micro_batch_size=2"]))},
    "tp-bf16pure-fp32reduce": [*COMMON, *TP, "precision=bf16-pure", "precision.reduce_dtype=fp32"],
    # ... and with the guard off, FSDP2 runs it in the gradients' bf16 (pytorch #190626): flagged
    "tp-bf16pure-fp32reduce-unguarded": [*COMMON, *TP, "precision=bf16-pure", "precision.reduce_dtype=fp32",
                                         "debug.unguarded=[tp_reduce_dtype]"],
}
BYTES = {"fp32": 4, "bf16": 2}
# TP splits these (tensor_parallel.py's plan for GPT): column-split qkv and fc (weights
# and biases), row-split output projections (weights only: their biases stay whole),
# the vocabulary of the tied embedding/head. Everything else is whole on each TP rank.
TP_SPLIT = ("attn.qkv.weight", "attn.qkv.bias", "mlp.fc.weight", "mlp.fc.bias", "attn.proj.weight",
            "mlp.proj.weight", "wte.weight")


@pytest.fixture(scope="module")
def runs(four_rank_jobs) -> dict:
    """name -> (step-1 metrics row, run_info, audit.json, train.log, job directory) of every
    case, from the 4-rank launch this file shares with test_mesh.py (conftest.py)."""
    out = {}
    for name in CASES:
        job = four_rank_jobs[f"obs-{name}"]
        info = yaml.safe_load((job / "config.yaml").read_text())["run_info"]
        out[name] = (read_rows(job)[0], info, json.loads((job / "audit.json").read_text()),
                     (job / "train.log").read_text(), job)
    return out


def _params(vocab: int) -> list[tuple[str, int]]:
    """(name, elements) of every parameter of gpt-nano with this vocabulary (the tied
    head once), from a model of that shape built here."""
    model = GPT(GPTShape(vocab_size=vocab, n_layer=2, n_head=2, d_model=64, block_size=64))
    return [(n, p.numel()) for n, p in model.named_parameters()]


ROOT = ("wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias")  # the root FSDP unit's parameters


def _gathered(params: list[tuple[str, int]]) -> int:
    """Elements FSDP2 all-gathers in one step of one micro-batch: every unit in
    the forward, and again in the backward all but the root, which FSDP2 keeps
    unsharded after the forward (it is needed at once)."""
    return 2 * sum(n for _, n in params) - sum(n for name, n in params if name in ROOT)


def _dim_bytes(row: dict, dim: str, kind: str) -> dict[str, int]:
    """dtype -> bytes of the step's ``kind`` collectives on mesh dimension ``dim``."""
    head = f"comm/{dim}/{kind}/"
    return {k[len(head):-len("_bytes")]: v for k, v in row.items() if k.startswith(head)}


@pytest.mark.parametrize("case,reduce", [("hsdp-fp32", "fp32"), ("hsdp-bf16pure", "bf16")])
def test_hsdp_bytes_per_dimension(runs, case, reduce):
    """FSDP reduce-scatters every gradient whole on dp_shard; HSDP all-reduces the
    half each rank keeps on dp_replicate; both in the reduce dtype."""
    row, info, _, _, _ = runs[case]
    params = _params(info["vocab_size"])
    total = sum(n for _, n in params)
    # every dim 0 here is even: FSDP pads nothing. bf16-pure stores (and gathers) bf16.
    assert _dim_bytes(row, "dp_shard", "all_gather") == {reduce: _gathered(params) * BYTES[reduce]}
    assert _dim_bytes(row, "dp_shard", "reduce_scatter") == {reduce: total * BYTES[reduce]}
    assert _dim_bytes(row, "dp_replicate", "all_reduce") == {reduce: total // 2 * BYTES[reduce]}
    assert not any(k.startswith("comm/other/") or k.startswith("comm/tp/") for k in row), row
    # the per-dimension figures split the per-kind ones, which stay as they were
    per_dim = sum(v for k, v in row.items() if k.startswith("comm/") and k.endswith("/total_bytes") and k.count("/") == 2)
    assert per_dim == row["comm/total_bytes"]


def test_tp_bytes_per_dimension(runs):
    """Under FSDP + TP, FSDP's reduce-scatter on dp_shard carries each gradient's TP
    part: half of what TP splits, all of what it does not."""
    row, info, _, _, _ = runs["tp-fp32"]
    local = [(name, n // 2 if name.endswith(TP_SPLIT) else n) for name, n in _params(info["vocab_size"])]
    assert _dim_bytes(row, "dp_shard", "all_gather") == {"fp32": _gathered(local) * 4}
    assert _dim_bytes(row, "dp_shard", "reduce_scatter") == {"fp32": sum(n for _, n in local) * 4}
    # sequence parallelism: activations gathered and scattered along the sequence on tp, in fp32 here
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        assert set(_dim_bytes(row, "tp", kind)) == {"fp32"}, kind
    assert not any(k.startswith("comm/other/") or k.startswith("comm/dp_replicate/") for k in row), row


def test_audit_clean_on_correct_runs(runs):
    """Every gradient reduction ran in the reduce dtype and nothing is flagged (the
    bf16-pure run's own flags are its bf16 weight updates, nothing about reductions)."""
    for case in ("hsdp-fp32", "tp-fp32", "hsdp-bf16pure"):
        _, _, audit, _, _ = runs[case]
        grads = [c for c in audit["collectives"] if c["gradient"]]
        assert grads and {c["dtype"] for c in grads} == {audit["reduce_dtype"]}, (case, grads)
        flags = audit["flags"] if case != "hsdp-bf16pure" else [f for f in audit["flags"] if "update" not in f["problem"]]
        assert flags == [], (case, flags)
    dims = {c["dim"] for c in runs["tp-fp32"][2]["collectives"] if c["gradient"]}
    assert dims == {"dp_shard", "tp"}  # FSDP's reduce-scatter, TP's all-reduce of the norms' partial gradients
    dims = {c["dim"] for c in runs["hsdp-fp32"][2]["collectives"] if c["gradient"]}
    assert dims == {"dp_shard", "dp_replicate"}


def _norm_values(info) -> int:
    """Values of the parameters TP holds whole but feeds a split input: the norms."""
    return sum(n for name, n in _params(info["vocab_size"]) if ".ln_" in f".{name}")


def test_tp_gradient_all_reduce_runs_in_the_reduce_dtype(runs):
    """TP's gradient all-reduce follows precision.reduce_dtype, with and without
    gradient accumulation: bf16 in an fp32 run (its bytes: the norms' values x 2
    bytes, once per micro-batch; half what the fp32-reduce run sends), fp32 in a
    bf16-pure run; nothing flagged. Every other tp all-reduce carries activations,
    in the compute dtype, and does not move."""
    fp32_row, info, _, _, _ = runs["tp-fp32"]
    norms = _norm_values(info)
    for case, micro in (("tp-reduce-bf16", 1), ("tp-reduce-bf16-accum", 2)):
        row, _, audit, _, _ = runs[case]
        grads = {(c["dim"], c["dtype"]) for c in audit["collectives"] if c["gradient"]}
        assert grads == {("dp_shard", "bf16"), ("tp", "bf16")}, (case, grads)
        assert [f for f in audit["flags"] if "reduce_dtype" in f["problem"]] == [], case
        assert _dim_bytes(row, "tp", "all_reduce")["bf16"] == norms * 2 * micro, case
    bf16 = _dim_bytes(runs["tp-reduce-bf16"][0], "tp", "all_reduce")
    assert 2 * bf16["bf16"] == _dim_bytes(fp32_row, "tp", "all_reduce")["fp32"] - bf16["fp32"]  # bytes halve
    row, _, audit, _, _ = runs["tp-bf16pure-fp32reduce"]
    assert {c["dtype"] for c in audit["collectives"] if c["gradient"]} == {"fp32"}
    assert [f for f in audit["flags"] if "reduce_dtype" in f["problem"]] == []
    assert _dim_bytes(row, "tp", "all_reduce")["fp32"] == norms * 4


def test_audit_flags_tp_reduction_outside_reduce_dtype(runs):
    """The guard off (debug.unguarded=[tp_reduce_dtype]): bf16 gradients, fp32 reduce
    dtype, FSDP's reduce-scatter still in fp32 but TP's all-reduce of the norms'
    gradients in bf16, and only that is flagged."""
    row, _, audit, log, _ = runs["tp-bf16pure-fp32reduce-unguarded"]
    assert _dim_bytes(row, "dp_shard", "reduce_scatter").keys() == {"fp32"}
    reduce_flags = [f for f in audit["flags"] if "reduce_dtype" in f["problem"]]
    assert len(reduce_flags) == 1, audit["flags"]
    assert "all_reduce on tp ran in bf16" in reduce_flags[0]["problem"]
    assert "gradient all_reduce on tp ran in bf16" in log


def test_banner_and_run_info_state_the_mesh(runs):
    _, info, _, log, _ = runs["hsdp-fp32"]
    assert "mesh 2 x 2 x 1 (dp_replicate x dp_shard x tp), sequence parallel off" in log
    assert info["mesh"]["dp_replicate"] == 2 and info["mesh"]["sequence_parallel"] is False
    assert set(info["mesh"]["collectives"]) == {"dp_shard", "dp_replicate"}
    assert "all-reduce of the shards on dp_replicate" in info["dtypes"]["grad_reduce"]
    assert "collectives of one step on this rank: dp_replicate: all_reduce fp32" in log
    _, info, _, log, _ = runs["tp-fp32"]
    assert "mesh 1 x 2 x 2 (dp_replicate x dp_shard x tp), sequence parallel on" in log
    assert set(info["mesh"]["collectives"]) == {"dp_shard", "tp"}
    assert "; tp: all_gather fp32" in log


def test_monitor_sums_equal_one_process(runs, tmp_path):
    """The weight norm of step 1 (the initial weights) is one process's: each value of
    a replicated parameter counted once. Squares summed in float64 and rounded once to
    fp32, so the partition over ranks moves it by at most an fp32 rounding (6e-8
    relative); 1e-6 allows for it and catches a replica counted twice (sqrt 2 off).
    The attention probes of step 2 (TP ranks hold one head each of gpt-nano's two):
    the largest logit is a max over every rank, the entropy a mean over both heads.
    Near its initial weights each head attends almost uniformly: one head's entropy
    is only 6e-6 (relative) off the two heads' mean here, so the bound must sit
    below that. The entropy is an fp32 mean over 2 x 4 x 64 = 512 (one process: 1024)
    rows per call; a pairwise sum's rounding is at most log2(1024) = 10 fp32 ulps
    (6e-7 relative), measured 1e-7, as is the weights' difference after one fp32
    step (summation order): 1e-6. The largest logit is a max (exact) of logits that
    moved by that order: 1e-5 (measured 3e-7)."""
    _, one = train(tmp_path / "one", "train.max_steps=2", "precision=fp32", "monitor.every=1")
    for case in ("hsdp-fp32", "tp-fp32"):
        got = runs[case][0]["numerics/weight_norm/all"]
        assert math.isclose(got, one[0]["numerics/weight_norm/all"], rel_tol=1e-6), (case, got)
        step2 = read_rows(runs[case][4])[1]
        probes = [k for k in one[1] if k.startswith(("stability/attn_entropy/", "stability/attn_logit_max/"))]
        assert len(probes) == 4, probes  # two blocks, two figures
        for k in probes:
            tol = 1e-6 if "entropy" in k else 1e-5
            assert math.isclose(step2[k], one[1][k], rel_tol=tol), (case, k, step2[k], one[1][k])
