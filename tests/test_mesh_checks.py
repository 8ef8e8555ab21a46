"""Bad mesh input (issue #41) is refused in one sentence, exit code 2, before any work:
sizes that do not make the world size, mesh sizes on a wrapper without a mesh,
a tp that does not divide the heads, key/value heads, MLP width, vocabulary or
(with sequence parallelism) the training window, and block-scaled recipes whose
blocks would straddle a tensor-parallel shard. Most cases call the start-up
check in this process; two run ``train.py`` as a user types it."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import pytest

from mptrain.config.mesh import MeshShape
from mptrain.config.schema import ParallelMode
from mptrain.core.errors import ConfigError
from mptrain.distributed.parallel import DistContext
from mptrain.plan.build import build_plan
from mptrain.plan.plan import Launch
from mptrain.run.build import build_data

from .conftest import ROOT, make_cfg

TP4 = ["parallel=fsdp_tp", "parallel.tp=4", "model.n_head=4"]  # gpt-nano with a head per rank


def one_sentence(text: str) -> bool:
    """One line, one full stop at its end (``e.g.`` and ``4 x 2`` are no sentence breaks)."""
    return "\n" not in text and text.endswith(".") and not re.search(r"\.\s+[A-Z]", text)


def refusal(*overrides: str, world: int = 4) -> str:
    with pytest.raises(ConfigError) as e:
        build_plan(make_cfg(*overrides), Launch.planned(world))
    text = str(e.value)
    assert one_sentence(text), text
    return text


@pytest.fixture(autouse=True)
def _one_node(monkeypatch):
    """Every rank on one node: ``tp: 0`` (the fsdp_tp preset) is the world size."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)


MESH_SIZES = [
    (["parallel=fsdp_tp", "parallel.tp=2", "parallel.dp_shard=1"],
     "the mesh parallel.dp_replicate=1 x parallel.dp_shard=1 x parallel.tp=2 = 2 ranks, but the world size is 4: "
     "make the product equal 4, or set one size to -1 to take the rest."),
    (["parallel=fsdp_tp", "parallel.tp=3"],
     "parallel.dp_replicate=1 x parallel.tp=3 (= 3) does not divide the world size 4, so parallel.dp_shard=-1 has "
     "no whole size to take; use sizes whose product divides 4."),
    (["parallel=fsdp_tp", "parallel.tp=-1"],
     "parallel.dp_shard and parallel.tp are both -1 ('the rest'); set one of them."),
    (["parallel=fsdp_tp", "parallel.tp=-2"],
     "parallel.tp=-2 is out of range; set a positive size, -1 (the rest of the world) or 0 (dp_replicate: the "
     "number of nodes; dp_shard, tp: the ranks of one node)."),
    (["parallel=ddp", "parallel.tp=2"],
     "parallel.tp=2 needs an FSDP2 device mesh, and parallel=ddp keeps a whole model on every rank: use "
     "parallel=fsdp_tp parallel.tp=2, or leave parallel.tp at its default."),
    (["parallel=fsdp1", "parallel.dp_replicate=2"],
     "parallel.dp_replicate=2 needs an FSDP2 device mesh, and parallel=fsdp1 (FSDP1) takes no device mesh: use "
     "parallel=hsdp parallel.dp_replicate=2, or leave parallel.dp_replicate at its default."),
    (["parallel=none", "parallel.dp_replicate=2", "parallel.tp=2"],
     "parallel.dp_replicate=2 parallel.tp=2 needs an FSDP2 device mesh, and parallel=none runs one process without "
     "a wrapper: use parallel=fsdp_tp parallel.dp_replicate=2 parallel.tp=2, or leave parallel.dp_replicate and "
     "parallel.tp at their defaults."),
]


@pytest.mark.parametrize("overrides, said", MESH_SIZES, ids=["product", "rest", "two-rests", "negative", "ddp+tp",
                                                              "fsdp1+replicate", "none+both"])
def test_mesh_sizes_that_cannot_be_built_are_refused(overrides, said):
    assert refusal(*overrides) == said


def test_the_fixes_the_mesh_refusals_name_are_accepted():
    for ok in (["parallel=fsdp_tp", "parallel.tp=2"], ["parallel=fsdp_tp", "parallel.tp=2", "parallel.dp_shard=2"],
               ["parallel=hsdp", "parallel.dp_replicate=2", "parallel.dp_shard=2"], ["parallel=ddp"]):
        build_plan(make_cfg(*ok), Launch.planned(4))


DIVISIBILITY = [
    (["parallel=fsdp_tp"],  # the preset's tp 0: all 4 ranks of the node; gpt-nano has 2 heads
     "parallel.tp=0 (the ranks of one node: 4) does not divide model.n_head=2: each rank computes whole attention "
     "heads; use a parallel.tp that divides 2, or set model.n_head to a multiple of 4."),
    (["model=llama-nano", "parallel=fsdp_tp", "parallel.dp_shard=1", "parallel.tp=-1"],  # 4 query heads, 2 kv
     "parallel.tp=-1 (the rest of the world: 4) does not divide model.n_kv_head=2: each rank holds whole key/value "
     "heads; use a parallel.tp that divides 2, or set model.n_kv_head to a multiple of 4."),
    (["model=llama-nano", "parallel=fsdp_tp", "parallel.tp=4", "model.n_kv_head=4", "model.ffn_hidden=190"],
     "parallel.tp=4 does not divide the SwiGLU hidden size 190 (model.ffn_hidden, or Llama's rule): each rank holds "
     "an equal share of the MLP width; use a parallel.tp that divides 190, or set model.ffn_hidden to a multiple "
     "of 4."),
    ([*TP4, "model.vocab_size=321"],
     "parallel.tp=4 does not divide model.vocab_size=321: the embedding and the output head split their rows over "
     "the tp ranks; set model.vocab_size to a multiple of 4 of at least 321 (e.g. model.vocab_size=324), or use a "
     "parallel.tp that divides 321."),
    ([*TP4, "model.block_size=66"],
     "parallel.tp=4 does not divide model.block_size=66: sequence parallelism splits every training window over "
     "the tp ranks; use a parallel.tp that divides 66, or set parallel.sequence_parallel=false."),
]


@pytest.mark.parametrize("overrides, said", DIVISIBILITY, ids=["heads", "kv-heads", "ffn", "vocab", "window"])
def test_a_tp_that_does_not_divide_the_model_is_refused(overrides, said):
    assert refusal(*overrides) == said


def test_the_fixes_the_divisibility_refusals_name_are_accepted():
    for ok in (["parallel=fsdp_tp", "parallel.tp=2"], ["parallel=fsdp_tp", "model.n_head=4"],
               ["model=llama-nano", "parallel=fsdp_tp", "model.n_kv_head=4"],
               ["model=llama-nano", "parallel=fsdp_tp", "model.n_kv_head=4", "model.ffn_hidden=192"],
               [*TP4, "model.vocab_size=324"], [*TP4, "model.block_size=66", "parallel.sequence_parallel=false"]):
        build_plan(make_cfg(*ok), Launch.planned(4))


def test_the_tokenizers_vocabulary_is_checked_when_it_is_known():
    """``model.vocab_size=null`` takes the tokenizer's ids rounded up to 64, known only
    once the data is read: ``build_data`` refuses a tp that does not divide them
    before the model is built. Rank 0's context of a 3-rank tp mesh (no process
    group: ``build_data`` only waits at a barrier, a no-op without one)."""
    tp3 = ["parallel=fsdp_tp", "parallel.tp=3", "model.n_head=3", "model.d_model=96",
           "parallel.sequence_parallel=false"]
    ctx = DistContext(ParallelMode.fsdp_tp, world=3, shape=MeshShape(1, 1, 3))
    plan = build_plan(make_cfg(*tp3), Launch.planned(3))  # nothing at start-up can know the tokenizer's size
    with pytest.raises(ConfigError) as e:
        build_data(plan, ctx, say=lambda _: None)
    assert str(e.value) == (
        "parallel.tp=3 does not divide the vocabulary's 320 rows (the tokenizer's 257 ids rounded up to 64): the "
        "embedding and the output head split their rows over the tp ranks; set model.vocab_size to a multiple of 3 "
        "of at least 257 (e.g. model.vocab_size=258), or use a parallel.tp that divides 320.")
    fixed = build_plan(make_cfg(*tp3, "model.vocab_size=258"), Launch.planned(3))
    assert build_data(fixed, ctx, say=lambda _: None).vocab == 258


# A block-scaled recipe against each rank's part of the split linears. gpt-nano (d_model 64) on tp=4 gives a
# rank 48 of the fused qkv's 192 outputs: not whole in blocks of 32 (MXFP8, MXFP4, MXFP6), whole in NVFP4's 16.
BLOCKS = [
    ([*TP4, "precision=mxfp8"], 4,
     "precision.fp8.recipe=mxfp8 under parallel.tp=4: a rank holds attn.qkv (the attention's fused qkv projection, "
     "split by output features) as a 64 -> 48 linear, where dgrad_grad_output=e4m3/1x32/ue8m0-rceil/nearest needs "
     "its contraction dimension in multiples of 32, and attn.qkv's is 48, so the recipe's blocks would straddle the "
     "tensor-parallel shards; use parallel.tp=2, or a recipe with smaller blocks."),
    (["model=llama-nano", "parallel=fsdp_tp", "parallel.tp=2", "precision=mxfp8"], 4,  # 2 kv heads of 16: 16 each
     "precision.fp8.recipe=mxfp8 under parallel.tp=2: a rank holds attn.k (the attention's key projection, split "
     "by output features) as a 64 -> 16 linear, where dgrad_grad_output=e4m3/1x32/ue8m0-rceil/nearest needs its "
     "contraction dimension in multiples of 32, and attn.k's is 16, so the recipe's blocks would straddle the "
     "tensor-parallel shards; use parallel.tp=1, or a recipe with smaller blocks."),
    ([*TP4, "precision=mxfp4"], 4,
     "precision.fp4 (mxfp4) under parallel.tp=4: a rank holds attn.qkv (the attention's fused qkv projection, split "
     "by output features) as a 64 -> 48 linear, where dgrad_grad_output=e2m1/1x32/ue8m0/nearest needs its "
     "contraction dimension in multiples of 32, and attn.qkv's is 48, so the recipe's blocks would straddle the "
     "tensor-parallel shards; use parallel.tp=2, or a recipe with smaller blocks."),
    (["parallel=fsdp_tp", "parallel.tp=8", "model.n_head=8", "precision=nvfp4"], 8,  # 24 rows: not whole 16x16 tiles
     "precision.fp4 (nvfp4) under parallel.tp=8: a rank holds attn.qkv (the attention's fused qkv projection, split "
     "by output features) as a 64 -> 24 linear, where fwd_weight=e2m1/16x16/e4m3/nearest needs its rows in "
     "multiples of 16, and attn.qkv's are 24, so the recipe's blocks would straddle the tensor-parallel shards; use "
     "parallel.tp=4, or a recipe with smaller blocks."),
    ([*TP4, "precision=lab", "precision.lab.recipe=mxfp6_e2m3"], 4,
     "precision.lab (mxfp6_e2m3) under parallel.tp=4: a rank holds attn.qkv (the attention's fused qkv projection, "
     "split by output features) as a 64 -> 48 linear, where dgrad_grad_output=e2m3/1x32/ue8m0/nearest needs its "
     "contraction dimension in multiples of 32, and attn.qkv's is 48, so the recipe's blocks would straddle the "
     "tensor-parallel shards; use parallel.tp=2, or a recipe with smaller blocks."),
]


@pytest.mark.parametrize("overrides, world, said", BLOCKS, ids=["mxfp8-gpt", "mxfp8-llama-kv", "mxfp4", "nvfp4-tiles",
                                                                  "lab-mxfp6"])
def test_blocks_that_would_straddle_a_tp_shard_are_refused(overrides, world, said):
    assert refusal(*overrides, world=world) == said
    tp = int(re.search(r"use parallel\.tp=(\d+)", said).group(1))  # the tp the refusal offers fits
    build_plan(make_cfg(*overrides, f"parallel.tp={tp}"), Launch.planned(world))


@pytest.mark.parametrize("overrides", [
    [*TP4, "precision=nvfp4"],  # every per-rank width a multiple of 16 (qkv 48, the MLP's 64)
    [*TP4, "precision=fp8"], [*TP4, "precision=fp8-rowwise"],  # one scale over a tensor or a row: no blocks
    [*TP4, "precision=lab", "precision.lab.recipe=rowwise"],
    [*TP4, "precision=mxfp8", "precision.fp8.exclude=[lm_head,'*.attn.*']"],  # the split that does not fit stays bf16
], ids=["nvfp4-whole", "fp8-tensorwise", "fp8-rowwise", "lab-rowwise", "mxfp8-attn-excluded"])
def test_recipes_whose_blocks_stay_inside_a_shard_are_accepted(overrides):
    build_plan(make_cfg(*overrides), Launch.planned(4))


# ------------------------------------------------------------------ train.py as a user types it
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("overrides, said", [
    (["parallel=fsdp_tp"], DIVISIBILITY[0][1]),
    ([*TP4, "precision=mxfp8"], BLOCKS[0][2]),
], ids=["heads", "blocks"])
def test_train_py_refuses_before_any_process_group_or_data(tmp_path, overrides, said):
    """Rank 0 of a 4-rank launch as torchrun starts it (its environment), alone: had it
    reached the process group it would wait for 3 ranks that never come (the timeout
    fails the test); the refusal comes first, on one line, exit code 2, with nothing
    written to the run directory or the data cache."""
    env = {"WORLD_SIZE": "4", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "MPTRAIN_CACHE": str(tmp_path / "cache")}
    (tmp_path / "cache").mkdir()
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), "model=gpt-nano", "data.tokenizer=byte", *overrides,
                        f"hydra.run.dir={tmp_path}/run"], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                       env={**os.environ, **env})
    assert (r.returncode, r.stdout) == (2, ""), (r.returncode, r.stdout, r.stderr[-3000:])
    assert r.stderr.splitlines() == [f"mptrain: configuration error: {said}"], r.stderr[-3000:]
    assert not (tmp_path / "run").exists() and list((tmp_path / "cache").iterdir()) == []
