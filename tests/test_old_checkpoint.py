"""Checkpoints written by earlier layouts of the package still resume exactly.

Each fixture holds a run that older code stopped at step 10 of 20, and the
metric rows that code wrote continuing it to step 20 (see each README):

- ``fixtures/old_layout/``: the flat layout (commit 4b839fd), before the
  package was split into layers;
- ``fixtures/layout_2026_12/``: the layered package before checkpointing got
  its own layer (commit 8f147b4), with dropout, the inf/nan guard's ``skip``
  after one skipped step and the stability warnings fired, so the RNG, the
  guard's count and the warnings' state all decide what the continuation does;
- ``fixtures/layout_plan/``: the package before "the plan of the run" (commit
  cff3261), layout_2026_12's run in precision=fp8-delayed, so each float8
  linear's amax histories and delayed scales also decide it. Made
  single-threaded, with its machine's signature: on a machine of that kind its
  continuation must come back bit for bit.

All go through the same checks. The corpus is regenerated here, so the resume
allows ``data.paths`` to change (same tokens, another directory).
"""
from __future__ import annotations

import json
import math
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

from mptrain.checkpoint.checkpointer import flatten, load_full_state
from mptrain.checkpoint.safeload import load_plain
from mptrain.distributed.parallel import setup
from mptrain.run.resume import decide
from mptrain.run.trainer import Trainer

from .aids import VOLATILE
from .conftest import make_plan, read_rows, train
from .test_bitwise import mf as before_plan  # the machine signature and its comparison
from .test_golden import _corpus

FIXTURES = Path(__file__).parent / "fixtures"
# fixture -> whether its old code evaluated on the same validation windows as
# today's (the flat layout read the split's first windows, later code windows
# spread over all of it; test_data.py compares those)
SAME_VAL = {"old_layout": False, "layout_2026_12": True, "layout_plan": True}
STOP, STEPS = 10, 20
# fp32 on CPU differs in the last bits between CPU kinds (another BLAS kernel);
# a wrong data position, RNG or optimizer state moves the loss by far more.
# layout_plan's fp8-delayed run (bf16 autocast, float8 casts) moves further on
# another kind: its continuation, rerun on the recording machine with the kernels
# held to the other kinds' instruction sets (fixtures/layout_plan/README.md),
# differed by up to 2.3e-4 in the train and validation losses and 3.1e-4
# (relative) in the gradient norm; the tolerances are about 4x those. On the
# fixture's own kind it is compared bit for bit as well.
LOSS_ATOL = {"old_layout": 2e-5, "layout_2026_12": 2e-5, "layout_plan": 1e-3}
GRAD_NORM_RTOL = {"old_layout": 1e-4, "layout_2026_12": 1e-4, "layout_plan": 1.5e-3}


@pytest.fixture(params=sorted(SAME_VAL))
def fixture(request) -> Path:
    """The directory of one old run (each test runs once per fixture)."""
    return FIXTURES / request.param


def _launch(fixture: Path, tmp_path: Path, name: str) -> tuple[Path, list[str]]:
    """A copy of the old run directory, and the old run's overrides with the
    corpus regenerated under ``tmp_path``."""
    run_dir = tmp_path / name
    shutil.copytree(fixture / "run", run_dir)
    corpus = _corpus(tmp_path / "corpus")
    args = json.loads((fixture / "continuation.json").read_text())["args"]
    args = [f"data.paths=[{corpus}]" if a.startswith("data.paths=") else a for a in args]
    # train.eval_batches=2 (2 batches of 8 windows of 64) was replaced by train.eval_tokens: as many tokens
    args = ["train.eval_tokens=1024" if a == "train.eval_batches=2" else a for a in args]
    return run_dir, [*args, "resume.allow_changes=[data.paths]"]


def test_old_checkpoint_continues_as_the_old_code_did(fixture, tmp_path):
    run_dir, args = _launch(fixture, tmp_path, "run")
    before = read_rows(run_dir)
    recorded = json.loads((fixture / "continuation.json").read_text())
    machine = recorded.get("machine")  # layout_plan's; the older fixtures did not record theirs
    threads = torch.get_num_threads()
    # a fixture made single-threaded resumes single-threaded: the thread count changes bf16's bits
    torch.set_num_threads(machine["threads"] if machine else threads)
    try:
        summary, rows = train(run_dir, *args, tiny=False)
    finally:
        torch.set_num_threads(threads)
    assert summary["resumed_from"] == str(run_dir / "checkpoints" / f"step-{STOP}")
    assert summary["steps"] == STEPS
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # one row per step, none twice
    assert rows[:STOP] == before  # the old rows are kept as the old code wrote them

    old = recorded["rows"]
    assert [r["step"] for r in old] == list(range(1, STEPS + 1))
    for new_row, old_row in zip(rows[STOP:], old[STOP:], strict=True):
        step = old_row["step"]
        assert new_row["step"] == step
        # The schedule and the token count are integer and closed-form arithmetic: exact.
        assert new_row["train/lr"] == old_row["train/lr"], step
        assert new_row["train/tokens"] == old_row["train/tokens"], step
        # Counters restored from the checkpoint go on from the saved count (absent in both when off).
        for key in ("train/nonfinite_skipped", "amp/skipped_steps"):
            assert new_row.get(key) == old_row.get(key), (step, key)
        assert abs(new_row["train/loss"] - old_row["train/loss"]) <= LOSS_ATOL[fixture.name], (step, new_row, old_row)
        # Every metric the old code logged at this step is still logged (monitored
        # steps fall on the same steps), and the warnings fire at the same steps:
        # a warning state that was not restored would warn again, or not at all.
        assert old_row.keys() <= new_row.keys(), (step, old_row.keys() - new_row.keys())
        assert _events(new_row) == _events(old_row), step
        # evaluated at the same steps; on the same text only where SAME_VAL says so
        assert ("val/loss" in new_row) == ("val/loss" in old_row), step
        if "val/loss" in old_row and SAME_VAL[fixture.name]:
            assert abs(new_row["val/loss"] - old_row["val/loss"]) <= LOSS_ATOL[fixture.name], (step, new_row, old_row)
        assert math.isclose(new_row["train/grad_norm"], old_row["train/grad_norm"],
                            rel_tol=GRAD_NORM_RTOL[fixture.name], abs_tol=0), \
            (step, new_row["train/grad_norm"], old_row["train/grad_norm"])
    assert sum("val/loss" in r for r in rows[STOP:]) == 2  # evaluations at 15 and 20 were compared
    if machine is None:
        return
    same, why = before_plan.same_cpu_kind(machine, before_plan.signature())
    if not same:
        warnings.warn(f"{fixture.name}: bit-for-bit continuation NOT checked on this machine (another CPU kind "
                      f"than the fixture's: {why}); held to the tolerances above instead", UserWarning)
        return
    # The fixture's own CPU kind: every value of every continued row, bit for bit (timings aside).
    for new_row, old_row in zip(rows[STOP:], old[STOP:], strict=True):
        new_row, old_row = (_without_timings(r) for r in (new_row, old_row))
        # the quantization signals (numerics/quant*) are newer than the fixture: only in the new rows
        new_row = {k: v for k, v in new_row.items() if not re.match(r"numerics/quant[/.]", k)}
        assert new_row.keys() == old_row.keys(), (new_row["step"], new_row.keys() ^ old_row.keys())
        # the attention probe's entropies: their last bits moved on purpose (make_fixture.CHANGES)
        moved = {k: (old_row[k], new_row[k]) for k in old_row if not before_plan.same_value(old_row[k], new_row[k])
                 and not (re.match(before_plan.ATTN_ENTROPY, k) and math.isclose(new_row[k], old_row[k], rel_tol=1e-6))}
        assert not moved, (new_row["step"], len(moved), dict(list(moved.items())[:5]))


def test_old_checkpoint_loads_bit_for_bit(fixture, tmp_path):
    """What the new code loads into the model, the optimizer and the loop's
    states is, tensor by tensor, what the old checkpoint holds."""
    run_dir, args = _launch(fixture, tmp_path, "loaded")
    ckpt = run_dir / "checkpoints" / f"step-{STOP}"
    saved = load_full_state(ckpt, log=lambda _: None)
    saved_states = load_plain(ckpt / "train_state.pt")
    saved_rng = load_plain(ckpt / "rng-rank0.pt")["torch"]

    plan = make_plan(*args, tiny=False)
    ctx = setup(plan)
    try:
        plan = plan.decided(decide(plan, run_dir, ctx, print))
        assert plan.resume.path == ckpt and plan.resume.step == STOP
        t = Trainer(plan, ctx, run_dir)
        rng = torch.get_rng_state()
        model_sd, optim_sd = get_state_dict(t.model, t.optimizer)
        loaded = flatten({"model": model_sd, "optim": optim_sd})
        states = {name: obj.state_dict() for name, obj in t.states.items()}
    finally:
        ctx.shutdown()

    assert loaded.keys() == saved.keys()
    tensors = [k for k, v in saved.items() if torch.is_tensor(v)]
    assert any(k.endswith(".exp_avg_sq") for k in tensors) and any(k.startswith("model.") for k in tensors)
    if fixture.name == "layout_plan":  # delayed scaling's state is in it, and was in use at the save
        histories = [k for k in tensors if k.endswith("_amax_history")]
        assert len(histories) == 8 * 3 and all(saved[k].abs().max() > 0 for k in histories), histories
    for k in tensors:
        a, b = loaded[k], saved[k]
        assert a.dtype == b.dtype and a.shape == b.shape, k
        assert torch.equal(_bits(a), _bits(b)), k
    assert {k: v for k, v in loaded.items() if k not in tensors} == {k: v for k, v in saved.items() if k not in tensors}
    assert states["progress"] == saved_states["progress"] == {"step": STOP, "tokens": STOP * 512}
    for name, sd in saved_states.items():
        assert _plain(states[name]) == _plain(sd), name
    # The RNG continues where the old run left it. (old_layout's run, without
    # dropout, draws nothing after the init, so there the state also matches
    # without the restore; layout_2026_12's dropout masks make it count, and
    # its continuation's losses show it was applied.)
    assert torch.equal(rng, saved_rng)


def _without_timings(row: dict) -> dict:
    """A metric row without its wall-clock and memory figures (``aids.VOLATILE``)."""
    return {k: v for k, v in row.items() if not k.startswith(VOLATILE)}


def _events(row: dict) -> set[str]:
    """The warnings a row reports (``events/*`` metrics)."""
    return {k for k in row if k.startswith("events/")}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor (NaNs and signed zeros compare as what they are)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _plain(x):
    """A state dict with its tensors as lists, to compare with ==."""
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x.tolist() if torch.is_tensor(x) else x
