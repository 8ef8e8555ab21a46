"""Resuming or exporting a checkpoint never runs code from it."""
from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch

from mptrain.run.checkpoint import load_full_state
from mptrain.run.integrity import CheckpointError, reseal
from mptrain.run.safeload import load_plain

from .conftest import ROOT, train


class Plant:
    """Unpickled, it creates a directory: a stand-in for any code an attacker would run."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    run = tmp_path_factory.mktemp("safe") / "run"
    train(run, "train.max_steps=2", "checkpoint.every=2")
    return run / "checkpoints" / "step-2"


def _craft(src, tmp_path, name: str):
    ckpt = tmp_path / "step-2"
    shutil.copytree(src, ckpt)
    marker = tmp_path / "code-ran"
    if name == ".metadata":
        with open(ckpt / name, "wb") as f:
            pickle.dump(Plant(str(marker)), f)
    else:
        torch.save({"scaler": Plant(str(marker))}, ckpt / name)
    reseal(ckpt)  # a crafted checkpoint whose manifest matches: the loader, not the checksum, must refuse it
    return ckpt, marker


def _ran_when_loaded_unsafely(path, marker) -> bool:
    """The crafted file is a real threat: plain unpickling runs its code."""
    with open(path, "rb") as f:
        if path.name == ".metadata":
            pickle.load(f)
        else:
            torch.load(f, weights_only=False)
    return marker.exists()


def test_every_file_a_checkpoint_holds_is_plain_data(checkpoint):
    for name in ("train_state.pt", "rng-rank0.pt"):
        assert isinstance(load_plain(checkpoint / name), dict), name  # weights_only=True
    full = load_full_state(checkpoint)
    assert "model.wte.weight" in full and "optim.param_groups" in full


@pytest.mark.parametrize("name", ["train_state.pt", "rng-rank0.pt", ".metadata"])
def test_resume_refuses_a_crafted_file(checkpoint, tmp_path, name):
    ckpt, marker = _craft(checkpoint, tmp_path, name)
    with pytest.raises(CheckpointError) as e:
        train(tmp_path / "run", "train.max_steps=4", f"resume={ckpt}")
    msg = str(e.value)
    assert msg.startswith(f"refused to load {ckpt / name}") and "\n" not in msg, msg
    assert not marker.exists()
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # nothing trained
    assert _ran_when_loaded_unsafely(ckpt / name, marker)


@pytest.mark.parametrize("name", ["train_state.pt", "rng-rank0.pt"])
def test_export_path_refuses_a_checkpoint_holding_code_anywhere(checkpoint, tmp_path, name):
    """The export reads the weights through load_full_state, which checks the other files too."""
    ckpt, marker = _craft(checkpoint, tmp_path, name)
    with pytest.raises(CheckpointError, match=f"^refused to load {ckpt / name}"):
        load_full_state(ckpt)
    assert not marker.exists()


def test_export_refuses_crafted_metadata(checkpoint, tmp_path):
    ckpt, marker = _craft(checkpoint, tmp_path, ".metadata")
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "export_hf.py"), str(ckpt), str(tmp_path / "hf")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "refused to load" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert not marker.exists() and not (tmp_path / "hf").exists()


def test_no_unrestricted_torch_load_in_the_project():
    """No call in the project passes weights_only=False (docs may describe DCP's)."""
    import ast

    found = []
    for path in [*ROOT.glob("mptrain/*.py"), *ROOT.glob("scripts/*.py"), ROOT / "train.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                for kw in node.keywords:
                    if kw.arg == "weights_only" and not (isinstance(kw.value, ast.Constant) and kw.value.value):
                        found.append(f"{path.name}:{node.lineno}")
    assert not found, found
