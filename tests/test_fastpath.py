"""The fast-path switches: activation checkpointing, torch.compile per block, fused AdamW."""
from __future__ import annotations

import yaml

from .conftest import train

STEPS = ["train.max_steps=5"]


def _losses(rows):
    return [r["train/loss"] for r in rows]


def test_activation_checkpointing_recomputes_the_same_numbers(tmp_path):
    _, plain = train(tmp_path / "a", *STEPS)
    s, ac = train(tmp_path / "b", *STEPS, "train.activation_checkpointing=block", "checkpoint.every=5")
    # the same math; only the order in which backward accumulates some gradients (e.g. the
    # tied embedding's two contributions) changes, so values agree to fp32 rounding
    assert _losses(ac)[0] == _losses(plain)[0]
    assert max(abs(a - b) for a, b in zip(_losses(ac), _losses(plain))) < 1e-4  # AdamW amplifies ulps a little
    for a, b in zip(ac, plain):
        assert abs(a["train/grad_norm"] - b["train/grad_norm"]) < 1e-4 * b["train/grad_norm"]
    info = yaml.safe_load((tmp_path / "b" / "config.yaml").read_text())["run_info"]
    assert info["activation_checkpointing"] == "block"
    # the wrapper does not leak into checkpoint keys: a run without it resumes from it
    s2, _ = train(tmp_path / "c", "train.max_steps=6", f"resume={tmp_path / 'b' / 'checkpoints' / 'step-5'}")
    assert s2["resumed_from"].endswith("step-5") and s2["steps"] == 6


def test_compiled_blocks_train_like_eager(tmp_path):
    _, eager = train(tmp_path / "a", *STEPS)
    _, comp = train(tmp_path / "b", *STEPS, "train.compile=true")
    info = yaml.safe_load((tmp_path / "b" / "config.yaml").read_text())["run_info"]
    assert info["compile"] is True
    # inductor fuses and reorders float ops: equal up to fp32 rounding, not bitwise
    assert max(abs(a - b) for a, b in zip(_losses(comp), _losses(eager))) < 1e-4


def test_fused_adamw(tmp_path):
    _, foreach = train(tmp_path / "a", *STEPS)
    _, fused = train(tmp_path / "b", *STEPS, "optim.fused=true")
    info = yaml.safe_load((tmp_path / "b" / "config.yaml").read_text())["run_info"]
    assert info["fused_adamw"] is True
    assert max(abs(a - b) for a, b in zip(_losses(fused), _losses(foreach))) < 1e-5


def test_fsdp_with_activation_checkpointing_two_ranks(tmp_path, reference):
    from .test_distributed import COMMON, TOL, only_run_dir, torchrun
    from .conftest import read_rows

    torchrun(tmp_path, *COMMON, "parallel=fsdp", "precision=fp32", "train.activation_checkpointing=block")
    rows = [r for r in read_rows(only_run_dir(tmp_path)) if "train/loss" in r]
    ref = [r for r in reference["fp32"] if "train/loss" in r]
    assert max(abs(a["train/loss"] - b["train/loss"]) for a, b in zip(rows, ref)) < TOL["fp32"]
