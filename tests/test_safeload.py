"""Resuming or exporting a checkpoint never runs code from it."""
from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from mptrain.checkpoint.checkpointer import load_full_state
from mptrain.checkpoint.integrity import CheckpointError, reseal
from mptrain.checkpoint.safeload import OutsideCheckpoint, SafeReader, check_metadata, load_plain
from mptrain.sample import main as sample_main

from .aids import Plant
from .conftest import ROOT, train
from .test_export import _export_module


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


# ------------------------------------------------- reads stay inside the folder
_WATCHED: list[set] = []  # while non-empty: the real paths to record an open of, and the opens seen


def _audit(event: str, args) -> None:
    """Records every open() (Python's and os.open) of a watched path: the proof that
    a refused checkpoint never read the file outside it. Installed once; an
    audit hook cannot be removed, so it does nothing while nothing is watched."""
    if event == "open" and _WATCHED and isinstance(args[0], (str, bytes, os.PathLike)):
        watched, seen = _WATCHED[-1]
        if os.path.realpath(os.fsdecode(args[0])) in watched:
            seen.add(os.fsdecode(args[0]))


sys.addaudithook(_audit)


@contextlib.contextmanager
def _opens_of(path):
    """The set of opens of ``path`` (under any name) made inside the block."""
    seen: set = set()
    _WATCHED.append(({os.path.realpath(path)}, seen))
    try:
        yield seen
    finally:
        _WATCHED.pop()


def _point_outside(src, tmp_path, how: str):
    """A copy of checkpoint ``src`` whose weights file lies outside it, reached by
    a .metadata entry (``..`` or ``absolute``) or by a symbolic ``link`` in place
    of the shard; resealed, so that its manifest matches and only the new check
    can refuse it. Returns (checkpoint, outside file, the storage path named)."""
    ckpt, outside = tmp_path / "step-2", tmp_path / "outside.distcp"
    shutil.copytree(src, ckpt)
    shutil.move(ckpt / "__0_0.distcp", outside)
    rel = {"..": "../outside.distcp", "absolute": str(outside), "link": "__0_0.distcp"}[how]
    if how == "link":
        os.symlink(outside, ckpt / "__0_0.distcp")
    else:
        md = SafeReader(str(ckpt)).read_metadata()
        for info in md.storage_data.values():
            info.relative_path = rel
        with open(ckpt / ".metadata", "wb") as f:
            pickle.dump(md, f)
    reseal(ckpt)
    return ckpt, outside, rel


@pytest.mark.parametrize("how", ["..", "absolute", "link"])
def test_a_checkpoint_never_reads_a_file_outside_its_folder(checkpoint, tmp_path, how, capsys):
    """A checkpoint whose weights are another folder's file (a crafted .metadata
    path, or a shard that is a symlink) is refused in one line naming the entry
    by sample, export and resume, and by the loaders themselves, and the outside
    file is never opened; DCP's own reader would load it as the model."""
    ckpt, outside, rel = _point_outside(checkpoint, tmp_path, how)
    named = f"{ckpt}/__0_0.distcp is a link to {outside}" if how == "link" else f"{ckpt}/.metadata maps '"
    with _opens_of(outside) as opened:
        with pytest.raises(SystemExit) as e:
            sample_main([str(ckpt), "--tokens", "2"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("sample: "), err
        assert named in err and "outside the checkpoint" in err and (how == "link" or f"to {rel}," in err), err
        with pytest.raises(SystemExit) as e:
            _export_module().main([str(ckpt), str(tmp_path / "hf")])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and named in err, err
        with pytest.raises(CheckpointError, match="outside the checkpoint"):
            train(tmp_path / "run", "train.max_steps=4", f"resume={ckpt}")
        with pytest.raises(CheckpointError, match="outside the checkpoint"):
            load_full_state(ckpt)
        # the DCP reader itself, for a folder changed after verification
        with pytest.raises(OutsideCheckpoint, match=f"^refused to load {ckpt}/.metadata: it maps '.*' to {rel}"):
            check_metadata(ckpt)
    assert not opened and not (tmp_path / "hf").exists()
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # nothing trained
    with _opens_of(outside) as opened:  # the threat is real: DCP's own reader loads the outside file
        sd: dict = {}
        _load_state_dict(sd, storage_reader=FileSystemReader(str(ckpt)), planner=_EmptyStateDictLoadPlanner(),
                         no_dist=True)
    assert opened and "wte.weight" in sd["model"]
