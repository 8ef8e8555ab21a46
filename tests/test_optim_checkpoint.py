"""Checkpoints of every optimizer the harness builds (torchao's AdamW with stochastic
rounding, bf16 or quantized moments; torch-optimi's with Kahan buffers): a resume is
bitwise, the state comes back as it was saved, the files hold plain tensors only,
and a resume that would change the state's layout is refused."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from mptrain.checkpoint.optim_layout import quantized_layout_refusal
from mptrain.checkpoint.checkpointer import load_full_state
from mptrain.checkpoint.integrity import complete_checkpoints, read_meta
from mptrain.precision.optimizers import state_parts, stored_as
from mptrain.distributed.parallel import setup
from mptrain.run.resume import ResumeRefused, compare
from mptrain.run.resume import decide
from mptrain.core.shards import local_shard
from mptrain.run.trainer import Trainer

from .conftest import TINY, make_plan, read_rows, train

STEPS, STOP = 4, 2
# d_model 32: torchao's eager CPU quantization dominates a quantized run's time, and
# at this width 5 tensors are still quantized (the embedding and the MLPs' weights).
BASE = [f"train.max_steps={STEPS}", "model.d_model=32"]
OPTIMIZERS = {  # what each run is for
    "sr": ["precision=bf16-pure-sr"],  # torchao: bf16 moments, weights rounded stochastically
    "kahan": ["precision=bf16-pure-kahan"],  # torch-optimi: Kahan buffers, the step in the param group
    "8bit": ["optim.state_dtype=8bit"],  # torchao's quantized moments beside fp32 weights
    "4bit": ["optim.state_dtype=4bit"],
    "fp8": ["precision=bf16-pure-sr", "optim.state_dtype=fp8"],  # quantized moments and stochastic rounding
    "bf16": ["optim.state_dtype=bf16"],  # plain bf16 moments beside fp32 weights (torch's load casts them)
}
VOLATILE = ("perf/", "mem/")


def _values(rows):
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def _snapshot(optimizer) -> dict:
    """Every value of the optimizer's state and param groups, tensors cloned as the
    plain tensors they are made of (a quantized moment: its codes, scale, qmap),
    keyed by the parameter's position (two trainers hold different parameter objects)."""
    out = {}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        for k, v in optimizer.state.get(p, {}).items():
            if not torch.is_tensor(v):
                out[f"state.{i}.{k}"] = v
                continue
            out[f"state.{i}.{k}:type"] = (type(local_shard(v)).__name__, stored_as(v))
            for part, t in state_parts(v):
                out[f"state.{i}.{k}" + (f".{part}" if part else "")] = t.detach().clone()
    for g, group in enumerate(optimizer.param_groups):
        for k, v in group.items():
            if k != "params":
                out[f"group.{g}.{k}"] = v.detach().clone() if torch.is_tensor(v) else v
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def _assert_bitwise_equal(loaded: dict, saved: dict) -> None:
    assert loaded.keys() == saved.keys()
    for k, v in saved.items():
        if torch.is_tensor(v):
            w = loaded[k]
            assert torch.is_tensor(w) and w.dtype == v.dtype and w.shape == v.shape, (k, w, v)
            assert torch.equal(_bits(w), _bits(v)), k
        else:
            assert loaded[k] == v, k


def _trainer_run(run_dir, *overrides: str):
    """A launch as ``trainer.run`` makes it (the resume plan, then the Trainer),
    keeping the optimizer: its state as loaded, and as it was at the end, and which
    AdamW the Trainer built (``optimizers.Choice``)."""
    plan = make_plan(*BASE, *overrides)
    ctx = setup(plan)
    try:
        t = Trainer(plan.decided(decide(plan, run_dir, ctx, print)), ctx, run_dir)
        loaded = _snapshot(t.optimizer)
        t.train()
        return t.optimizer, loaded, _snapshot(t.optimizer), t.built.opt_choice
    finally:
        ctx.shutdown()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(name)``: the straight run and the stopped-then-resumed run of one
    optimizer (each made once per module)."""
    done: dict = {}

    def get(name: str) -> dict:
        if name not in done:
            extra = OPTIMIZERS[name]
            root = tmp_path_factory.mktemp(f"optim-{name}")
            _, straight = train(root / "straight", *BASE, *extra)
            _, _, saved, _ = _trainer_run(root / "resumed", *extra, f"train.stop_after={STOP}")
            _, loaded, _, choice = _trainer_run(root / "resumed", *extra)
            done[name] = {"straight": straight, "resumed": read_rows(root / "resumed"), "saved": saved,
                          "loaded": loaded, "choice": choice, "run": root / "resumed",
                          "ckpt": root / "resumed" / "checkpoints" / f"step-{STOP}"}
        return done[name]

    return get


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_resume_is_bitwise(runs, name):
    r = runs(name)
    assert [r["step"] for r in r["resumed"]] == list(range(1, STEPS + 1))
    assert _values(r["resumed"]) == _values(r["straight"])  # every loss, lr and grad norm


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_loaded_state_is_the_saved_state(runs, name):
    """Right after the load, every tensor of the optimizer (each part of a quantized
    moment, Kahan buffers, step counts, torchao's lr) is the one saved, bit for bit."""
    r = runs(name)
    saved, loaded, choice = r["saved"], r["loaded"], r["choice"]
    _assert_bitwise_equal(loaded, saved)
    kinds = {v[1] for k, v in loaded.items() if k.endswith(":type")}
    if choice.state in ("8bit", "4bit", "fp8"):
        assert choice.state in kinds and any(k.endswith(".codes") for k in loaded)  # some moment is quantized
    if name == "bf16":
        assert kinds == {"bf16", "fp32"}  # bf16 moments kept their dtype; fp32 step counts
    lrs = [v for k, v in loaded.items() if k.endswith(".lr")]
    if choice.impl == "torchao":
        assert all(torch.is_tensor(v) and v.dim() == 0 for v in lrs)  # its step refuses a float lr
    if choice.kahan:
        comp = [v for k, v in loaded.items() if ".kahan_comp" in k and torch.is_tensor(v) and v.numel() > 1]
        assert comp and any(bool(c.any()) for c in comp)  # real compensation came back, not zeros
        steps = [v for k, v in loaded.items() if k.startswith("group.") and k.endswith(".step")]
        assert steps and all(int(s) == STOP for s in steps)
    else:
        steps = [v for k, v in loaded.items() if k.startswith("state.") and k.endswith(".step")]
        assert steps and all(float(s) == STOP for s in steps)


def _assert_no_torchao_pickled(ckpt) -> None:
    """No pickle in ``ckpt`` (DCP's shards and .metadata, train_state, rng) names a
    torchao module: torch.save stores pickles uncompressed, so a class reference
    would show as its module path."""
    pickled = [f for f in ckpt.iterdir() if f.suffix != ".json"]
    assert any(f.suffix == ".distcp" for f in pickled)
    for f in pickled:
        assert b"torchao." not in f.read_bytes(), f.name


@pytest.mark.parametrize("name", ["sr", "kahan", "8bit", "4bit", "fp8"])
def test_checkpoint_holds_plain_tensors_only(runs, name):
    """No torchao class is pickled into a checkpoint: quantized moments are saved as
    their parts and read back as plain data."""
    ckpt = runs(name)["ckpt"]
    _assert_no_torchao_pickled(ckpt)
    state = load_full_state(ckpt)  # mptrain.run.safeload's readers
    optim = {k: v for k, v in state.items() if k.startswith("optim.state.")}
    assert optim and all(type(v) is torch.Tensor for v in optim.values() if torch.is_tensor(v))
    if name in ("8bit", "4bit", "fp8"):
        assert "optim.state.wte.weight.exp_avg.codes" in optim and "optim.state.wte.weight.exp_avg.scale" in optim
    meta = read_meta(ckpt)
    assert meta["optimizer"] == {"impl": runs(name)["choice"].impl, "state": runs(name)["choice"].state,
                                 "rounding": runs(name)["choice"].rounding}


def _tree(root) -> dict:
    """Every file under ``root`` but the lock (which a refused launch may rewrite), with its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != ".lock"}


def _one_sentence(message: str) -> bool:
    return message.endswith(".") and ". " not in message


def test_a_change_of_optimizer_structure_is_refused(runs, tmp_path):
    """Stochastic rounding, Kahan buffers, quantized or bf16 moments: a resume cannot
    switch them, even when the user allows the section to change."""
    cases = [
        ("sr", ["precision=bf16-pure", "resume.allow_changes=[precision]"],
         "precision.update_rounding: 'stochastic' -> 'nearest' changes the layout"),
        ("kahan", ["precision=bf16-pure-sr", "resume.allow_changes=[precision]"],
         "precision.update_rounding: 'kahan' -> 'stochastic' changes the layout"),
        ("sr", ["optim.state_dtype=8bit", "resume.allow_changes=[optim]"],
         "optim.state_dtype: None -> '8bit' changes the layout"),
        ("8bit", ["optim.state_dtype=4bit", "resume.allow_changes=[optim]"],
         "optim.state_dtype: '8bit' -> '4bit' changes the layout"),
        # state_dtype=bf16 is torchao's AdamW beside fp32 weights, torch's beside bf16 ones
        ("bf16", ["precision=bf16-pure", "resume.allow_changes=[precision]"],
         "written by torchao's AdamW and this launch's precision=bf16-pure"),
    ]
    for name, change, said in cases:
        run = runs(name)["run"]
        before = _tree(run)
        with pytest.raises(ResumeRefused) as e:
            train(run, *BASE, *OPTIMIZERS[name], *change)
        assert said in str(e.value) and _one_sentence(str(e.value)), str(e.value)
        assert _tree(run) == before  # a refused resume writes nothing
    # Another precision preset with the same rounding and moments still resumes (recorded).
    run = tmp_path / "run"
    shutil.copytree(runs("8bit")["run"], run)
    s, _ = train(run, *BASE, *OPTIMIZERS["8bit"], "precision=bf16", "resume.allow_changes=[precision]",
                 f"train.max_steps={STEPS + 1}")
    assert s["steps"] == STEPS + 1 and s["config_history"][0]["changes"]["precision.name"] == ["fp32", "bf16"]


def test_whole_quantized_moments_do_not_go_into_fsdp_shards(runs):
    """The other direction: moments quantized over whole tensors (one process, or DDP)
    cannot become per-rank blocks of FSDP2 shards; any unsharded world size takes them."""
    ckpt = runs("8bit")["ckpt"]
    meta = read_meta(ckpt)
    fsdp = [*BASE, *OPTIMIZERS["8bit"], "parallel=fsdp"]
    said = quantized_layout_refusal(ckpt, meta, make_plan(*fsdp, world=2))
    assert _one_sentence(said) and "over whole tensors" in said and "parallel=none on 1 rank," in said, said
    assert quantized_layout_refusal(ckpt, meta, make_plan(*BASE, *OPTIMIZERS["8bit"], "parallel=ddp", world=2)) is None
    assert quantized_layout_refusal(ckpt, meta, make_plan(*fsdp)) is None  # FSDP2 on one rank holds whole tensors


def test_a_checkpoint_from_before_the_keys_had_their_defaults():
    """A checkpoint saved before ``precision.update_rounding`` existed used round to
    nearest: switching to stochastic rounding is refused like any other switch."""
    with pytest.raises(ResumeRefused, match="precision.update_rounding: 'nearest' -> 'stochastic'"):
        compare({"precision": {"name": "bf16-pure"}},
                {"precision": {"name": "bf16-pure-sr", "update_rounding": "stochastic"}}, ["precision"])
    accepted, refused = compare({"precision": {"name": "fp32"}},
                                {"precision": {"name": "bf16", "update_rounding": "nearest"}}, ["precision"])
    assert accepted == {"precision.name": ["fp32", "bf16"]} and not refused


# ------------------------------------------------------------------ FSDP2, 2 ranks
FSDP_8BIT = [*TINY, *BASE, "parallel=fsdp", "optim.state_dtype=8bit", f"checkpoint.every={STOP}",
             "checkpoint.keep_last=0"]


def test_fsdp_quantized_moments_save_and_resume_per_rank(tmp_path):
    """2-rank FSDP2 with 8-bit moments (one torchrun launch, two jobs): the run saves
    at steps 2 and 4; the second job resumes from its step 2 into its own directory
    and trains steps 3 and 4 bitwise as the first did. Each rank's codes and scales are
    saved under its own key; a launch on another world size or wrapper is refused
    before anything is loaded."""
    from .test_distributed import torchrun

    sweep = tmp_path / "sweep"
    ckpt = sweep / "0" / "checkpoints" / f"step-{STOP}"
    torchrun(tmp_path, "-m", *FSDP_8BIT, f"hydra.sweep.dir={sweep}", f"resume=auto,{ckpt}")
    straight, resumed = read_rows(sweep / "0"), read_rows(sweep / "1")
    assert [r["step"] for r in resumed] == list(range(STOP + 1, STEPS + 1))
    assert _values(resumed) == _values(straight[STOP:])
    assert json.loads((sweep / "1" / "summary.json").read_text())["resumed_from"] == str(ckpt)

    _assert_no_torchao_pickled(ckpt)
    state = load_full_state(ckpt)
    for rank in (0, 1):  # each rank's half of the embedding (320 x 32), in its own blocks
        codes = state[f"optim.state.wte.weight.exp_avg.rank{rank}of2.codes"]
        assert codes.dtype == torch.uint8 and codes.shape == (160, 32)
        assert state[f"optim.state.wte.weight.exp_avg.rank{rank}of2.scale"].shape == (160 * 32 // 256,)
    assert not torch.equal(state["optim.state.wte.weight.exp_avg.rank0of2.codes"],
                           state["optim.state.wte.weight.exp_avg.rank1of2.codes"])

    plan = make_plan(*FSDP_8BIT, "parallel=none", "train.max_steps=8")
    ctx = setup(plan)
    try:
        with pytest.raises(ResumeRefused) as e:
            decide(plan, sweep / "0", ctx, print)
    finally:
        ctx.shutdown()
    said = str(e.value)
    assert _one_sentence(said) and "within each of its 2 ranks' FSDP shards" in said, said
    assert "resume it with parallel=fsdp on 2 ranks" in said
    ddp = make_plan(*FSDP_8BIT, "parallel=ddp", world=2)
    assert "parallel=ddp on 2 ranks" in quantized_layout_refusal(ckpt, read_meta(ckpt), ddp)
    assert quantized_layout_refusal(ckpt, read_meta(ckpt), make_plan(*FSDP_8BIT, world=2)) is None
    saved = [p.name for p in complete_checkpoints(sweep / "0" / "checkpoints")]
    assert saved == [f"step-{STOP}", f"step-{STEPS}"]


def test_per_rank_quantized_moments_follow_the_mesh(tmp_path):
    """Moments quantized per rank on a mesh load only on the same mesh: 2 x 2
    (dp_shard x tp) and 4-way FSDP both have 4 ranks but split the tensors
    otherwise. A checkpoint from before the mesh was recorded counts as FSDP over
    every rank."""
    meta = {"config": {"optim": {"state_dtype": "8bit"}}, "parallel": "fsdp_tp", "world_size": 4,
            "mesh": {"dp_replicate": 1, "dp_shard": 2, "tp": 2}}
    same = make_plan(*BASE, *OPTIMIZERS["8bit"], "parallel=fsdp_tp", "parallel.tp=2", world=4)
    fsdp4 = make_plan(*BASE, *OPTIMIZERS["8bit"], "parallel=fsdp", world=4)
    assert quantized_layout_refusal(tmp_path, meta, same) is None
    said = quantized_layout_refusal(tmp_path, meta, fsdp4)
    assert _one_sentence(said) and "mesh 1 x 2 x 2" in said and "mesh 1 x 4 x 1" in said, said
    old = {k: v for k, v in meta.items() if k != "mesh"} | {"parallel": "fsdp"}
    assert quantized_layout_refusal(tmp_path, old, fsdp4) is None
    assert quantized_layout_refusal(tmp_path, old, same) is not None


def test_a_lab_checkpoint_from_before_the_one_vocabulary_resumes_under_the_new_name():
    """``precision.lab.recipe=fp8_rowwise`` was renamed ``rowwise`` (the same casts): a
    checkpoint saved under the old name is no config change; another recipe still is."""
    accepted, refused = compare({"precision": {"lab": {"recipe": "fp8_rowwise"}}},
                                {"precision": {"lab": {"recipe": "rowwise"}}}, [])
    assert accepted == {} and refused == []
    _, refused = compare({"precision": {"lab": {"recipe": "fp8_rowwise"}}},
                         {"precision": {"lab": {"recipe": "tensorwise"}}}, [])
    assert refused == ["precision.lab.recipe: 'rowwise' -> 'tensorwise'"]
