"""Nothing silently wrong around a checkpoint read from outside its run.

``scripts/export_hf.py``: a logits check that a NaN cannot pass, a full disk
said in one line with nothing left behind, ``--overwrite`` deleting only files
whose size and checksum are what the export wrote. The checkpoint readers: a
``<run>/checkpoints`` that is not a directory said as such (export, sample,
resume), ``load_full_state`` taking a ``str`` path.

Every test reads the one short run of ``trained`` (module-scoped); the
exports run in this process (``main([...])``): a launch would only add its
start-up.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import zlib
from pathlib import Path

import pytest
import torch

from mptrain.checkpoint.checkpointer import load_full_model_state, load_full_state
from mptrain.checkpoint.integrity import complete_checkpoints
from mptrain.core.errors import UserError
from mptrain.sample import main as sample_main

from .conftest import TINY, load_script, train

MARKER = "mptrain_export.json"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-step byte-tokenizer run that saved its final checkpoint (step-2)."""
    run_dir = tmp_path_factory.mktemp("export-safety") / "run"
    train(run_dir, *TINY, "train.max_steps=2", "checkpoint.at_end=true", tiny=False)
    return run_dir


def _one_line(capsys, e) -> str:
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_a_nan_difference_fails_the_logits_check(trained, tmp_path, monkeypatch, capsys):
    """A NaN compares false with the tolerance, so the check must fail on
    anything but a difference known to be within it. A real export whose
    transformers weights hold a NaN (mptrain's do not) fails and leaves nothing;
    a checkpoint whose own weights hold a NaN (a diverged run) is refused in one
    line naming the tensor, before anything is written."""
    export_hf = load_script("export_hf")
    real = export_hf.hf_model

    def poisoned(*args, **kwargs):
        hf = real(*args, **kwargs)
        with torch.no_grad():
            hf.get_output_embeddings().weight[0, 0] = float("nan")  # every position's logit of token 0
        return hf

    monkeypatch.setattr(export_hf, "hf_model", poisoned)
    out = tmp_path / "hf"
    with pytest.raises(SystemExit) as e:
        export_hf.main([str(trained), str(out)])
    assert "nan" in str(e.value.code) and "the export is wrong" in str(e.value.code), e.value.code
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no export, no staging directory left
    monkeypatch.undo()

    nan, x = float("nan"), torch.zeros(2, 3)
    with pytest.raises(SystemExit, match="nan"):
        export_hf.check_logits(torch.tensor([[nan, 0.0, 0.0]] * 2), x)
    with pytest.raises(SystemExit, match="inf"):
        export_hf.check_logits(torch.tensor([[float("inf"), 0.0, 0.0]] * 2), x)
    assert export_hf.check_logits(x + 1e-6, x) < export_hf.TOLERANCE

    weights = export_hf.model_weights

    def diverged(ckpt):
        sd = weights(ckpt)
        sd["blocks.1.mlp.fc.weight"][3, 4] = float("nan")
        return sd

    monkeypatch.setattr(export_hf, "model_weights", diverged)
    with pytest.raises(SystemExit) as e:
        export_hf.main([str(trained), str(out)])
    err = _one_line(capsys, e)
    assert "blocks.1.mlp.fc.weight" in err and "NaN" in err and "earlier checkpoint" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.fixture
def small_disk(tmp_path, monkeypatch):
    """A directory on a 64 KiB filesystem: a real tmpfs where this process may mount one
    (root); else the full disk is simulated (monkeypatched) at the lowest write Python
    sees, safetensors' serializer, raising what it raises on a full disk."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)],
                             capture_output=True).returncode == 0
    if not mounted:  # simulated: no mount permitted here
        import safetensors.torch
        from safetensors import SafetensorError

        def full(*args, **kwargs):
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

        monkeypatch.setattr(safetensors.torch, "serialize_file", full)
    try:
        yield disk
    finally:
        if mounted:
            subprocess.run(["umount", str(disk)], check=True)


def test_a_full_disk_is_one_line_and_leaves_nothing(trained, small_disk, capsys):
    """The weights do not fit (safetensors' own error, os error 28): one line naming
    the disk full at the output path and the fix, exit status 2, and nothing left
    on that disk (the half-written export is removed, and the line says so)."""
    out = small_disk / "hf"
    with pytest.raises(SystemExit) as e:
        load_script("export_hf").main([str(trained), str(out)])
    err = _one_line(capsys, e)
    assert err.startswith(f"export_hf: the disk is full at {out} ") and "free disk space" in err, err
    assert "nothing was left" in err, err
    assert list(small_disk.iterdir()) == []


def _entry(data: bytes) -> dict:
    return {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}


def test_overwrite_deletes_only_what_the_export_wrote(trained, tmp_path, capsys):
    """A marker planted in a folder of the user's, or one whose files were edited
    since, makes --overwrite refuse in one line and delete nothing: a marker of the
    previous version (no checksums: it cannot tell the export's files from the
    user's), a file whose size or checksum is not what the marker records, a name
    leading outside the folder (said as such, not as "no marker"), and a name no
    export writes even with the file's true size and CRC-32 (in the export's own
    list or in an interrupted overwrite's ``previous``): checksums only say a
    file is unchanged, and a planted marker can give a file of the user's its own."""
    out = tmp_path / "hf"
    out.mkdir()
    thesis, victim = out / "thesis.txt", tmp_path / "victim.txt"
    thesis.write_text("years of work")
    victim.write_text("keep")
    head = {"checkpoint": str(trained), "step": 2, "time": "2026-01-01T00:00:00+0000", "complete": True}
    cases = [
        ({"format": "mptrain-export-1", "files": ["thesis.txt"]}, "records no checksums"),
        ({"format": "mptrain-export-2", "files": {"config.json": _entry(b'{"edited": false}')}},
         "config.json is not the file the export wrote"),
        ({"format": "mptrain-export-2", "files": {"thesis.txt": _entry(b"years of work")}},
         "it lists thesis.txt, which is no file an export writes"),
        ({"format": "mptrain-export-2", "files": {"config.json": _entry(b"{}")}, "complete": False,
          "previous": {"thesis.txt": [_entry(b"years of work")]}}, "it lists thesis.txt, which is no file"),
        ({"format": "mptrain-export-1", "files": ["../victim.txt"]}, "../victim.txt, a path outside"),
        ({"format": "mptrain-export-2", "files": {"/tmp/../" + str(victim): _entry(b"keep")}}, "a path outside"),
    ]
    for record, phrase in cases:
        edited = "config.json" in record["files"]  # an export's file, edited since
        if edited:
            (out / "config.json").write_text('{"edited": true}')
        (out / MARKER).write_text(json.dumps({**head, **record}))
        with pytest.raises(SystemExit) as e:
            load_script("export_hf").main([str(trained), str(out), "--overwrite"])
        err = _one_line(capsys, e)
        assert phrase in err and "no previous export" not in err, err
        assert thesis.read_text() == "years of work" and victim.read_text() == "keep"
        assert sorted(p.name for p in out.iterdir()) == sorted(["thesis.txt", MARKER, *["config.json"] * edited])
        if edited:
            assert (out / "config.json").read_text() == '{"edited": true}'
            (out / "config.json").unlink()


def test_an_interrupted_overwrite_is_finished_by_the_next(tmp_path, monkeypatch):
    """publish() alone, on small files (no model): an overwrite interrupted while it
    moves files in leaves a marker that accepts both the previous export's files
    and the new ones, so the next --overwrite deletes them all, and a file of the
    user's beside them stays."""
    export_hf = load_script("export_hf")
    out, meta = tmp_path / "hf", {"step": 1}

    def staged(name: str, files: dict[str, str]) -> Path:
        d = tmp_path / name
        d.mkdir()
        for f, text in files.items():
            (d / f).write_text(text)
        return d

    export_hf.publish(staged("a", {"config.json": "A", "vocab.json": "A"}), out, tmp_path, meta)
    (out / "notes.md").write_text("mine")
    real = os.replace

    def interrupted(src, dst):  # the move of b's config.json (the last) fails; model.safetensors is in
        if Path(src).parent.name == "b" and Path(dst).name == "config.json":
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real(src, dst)

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(export_hf.ExportError, match="is incomplete .* with --overwrite to finish it"):
        export_hf.publish(staged("b", {"config.json": "BB", "model.safetensors": "BB"}), out, tmp_path, meta)
    monkeypatch.undo()
    marker = json.loads((out / MARKER).read_text())
    assert marker["complete"] is False and marker["previous"] == {"config.json": [_entry(b"A")],
                                                                  "vocab.json": [_entry(b"A")]}
    assert sorted(p.name for p in out.iterdir()) == sorted([MARKER, "model.safetensors", "notes.md"])
    export_hf.publish(staged("c", {"config.json": "CCC", "tokenizer.json": "CCC"}), out, tmp_path, meta)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", MARKER, "notes.md", "tokenizer.json"]
    assert (out / "config.json").read_text() == "CCC" and (out / "notes.md").read_text() == "mine"
    marker = json.loads((out / MARKER).read_text())
    assert marker["complete"] is True and marker["files"]["config.json"] == _entry(b"CCC")


def _snapshot(d: Path) -> dict:
    return {str(p.relative_to(d)): (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else None)
            for p in sorted(d.rglob("*"))}


def test_checkpoints_that_is_not_a_directory(trained, tmp_path, capsys):
    """``<run>/checkpoints`` replaced by a regular file is said to be that (not a run
    that saved no checkpoint), in one line, by export, sample and a resuming or
    fresh launch, before anything is trained or written."""
    run = tmp_path / "run"
    shutil.copytree(trained, run, ignore=shutil.ignore_patterns("checkpoints"))
    (run / "checkpoints").write_text("")
    before = _snapshot(run)
    for main, prog in ((load_script("export_hf").main, "export_hf"), (sample_main, "sample")):
        with pytest.raises(SystemExit) as e:
            main([str(run), str(tmp_path / "hf")] if prog == "export_hf" else [str(run), "--tokens", "2"])
        err = _one_line(capsys, e)
        assert err.startswith(f"{prog}: {run}/checkpoints is not a directory"), err
        assert "saved none" not in err and "at_end" not in err, err
    for resume in ("auto", "none"):
        with pytest.raises(UserError, match=f"resume={resume}: {run}/checkpoints is not a directory"):
            train(run, *TINY, "train.max_steps=4", "checkpoint.at_end=true", f"resume={resume}", tiny=False)
    after = _snapshot(run)
    log_before, log_after = before.pop("train.log")[1], after.pop("train.log")[1]
    assert log_after.startswith(log_before)  # the refusals added to the run's log; nothing else changed
    assert {k: v for k, v in after.items() if k != ".lock"} == {k: v for k, v in before.items() if k != ".lock"}
    assert not (tmp_path / "hf").exists()


def test_load_full_state_takes_a_str_path(trained):
    """As docs/checkpoints.md shows it: ``load_full_state(path)`` with a string."""
    ckpt = complete_checkpoints(trained / "checkpoints")[-1]
    state = load_full_state(str(ckpt))
    assert any(k.startswith("optim.") for k in state)
    weights = load_full_model_state(str(ckpt))
    assert weights.keys() == {k[len("model."):] for k in state if k.startswith("model.")}
    assert all(torch.equal(v, state[f"model.{k}"]) for k, v in weights.items())
