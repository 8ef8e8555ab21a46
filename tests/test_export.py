"""scripts/export_hf.py: the checkpoint as a transformers GPT-2, logits equal to mptrain's."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from mptrain.checkpoint.checkpointer import load_full_model_state
from mptrain.checkpoint.integrity import complete_checkpoints, file_crc32, read_meta
from mptrain.model.gpt import GPT, GPTShape

from .conftest import ROOT, TINY, train
from .test_tokens import make_remote_code_tokenizer


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.fixture(scope="module")
def byte_run(tmp_path_factory):
    """An 8-step byte-tokenizer run with checkpoints step-4 and step-8 (shared by the tests of this file)."""
    run_dir = tmp_path_factory.mktemp("export") / "run"
    train(run_dir, *TINY, "train.max_steps=8", "checkpoint.every=4", tiny=False)
    return run_dir


# A fresh python that cannot import torchao (as where it is not installed), nor mptrain:
# the export is transformers' GPT-2 and its tokenizer, nothing else.
LOAD_WITHOUT_TORCHAO = """
import sys
sys.modules["torchao"] = sys.modules["mptrain"] = None  # importing either raises ImportError
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
hf = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
tok = AutoTokenizer.from_pretrained(sys.argv[1])
with torch.no_grad():
    logits = hf(torch.tensor([tok("def fib(n):")["input_ids"]])).logits
print(type(hf).__name__, logits.shape[-1], tok.decode(tok("def fib(n):")["input_ids"]))
"""


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_export_round_trip(tmp_path, tokenizer, monkeypatch, capsys, request):
    """The export loads in transformers and computes mptrain's logits. Launched as a
    user runs them, export_hf prints its own lines only (no progress bars, no
    torchao kernel or torch pytree messages), the export loads in a python
    without torchao, and ``python -m mptrain.sample`` on the BPE run (the one whose
    tokenizer comes through transformers) prints nothing on stderr."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if tokenizer == "byte":
        run_dir = request.getfixturevalue("byte_run")
    else:
        run_dir = tmp_path / "run"
        train(run_dir, *TINY, "data.tokenizer=bpe", "data.bpe_vocab_size=512", "data.max_chars=200000",
              "train.max_steps=8", "checkpoint.every=4", tiny=False)
        r = subprocess.run([sys.executable, "-m", "mptrain.sample", str(run_dir), "--prompt", "def", "--tokens", "5"],
                           capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert r.returncode == 0 and r.stderr == "" and r.stdout.startswith("def"), r.stderr[-3000:]
    out = tmp_path / "hf"
    if tokenizer == "byte":  # the script as a user runs it
        r = subprocess.run([sys.executable, str(ROOT / "scripts" / "export_hf.py"), str(run_dir), str(out)],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        assert r.stderr == "", r.stderr[-3000:]  # transformers' bars were "Writing model shards", "Loading weights"
        assert [line.split(" ")[0] for line in r.stdout.splitlines()] == ["export_hf:"] * 2, r.stdout
        stdout = r.stdout
    else:  # the same main() in this process: a second launch would only add its start-up
        monkeypatch.setattr(sys, "argv", ["export_hf.py", str(run_dir), str(out)])
        capsys.readouterr()
        _export_module().main()
        stdout = capsys.readouterr().out
    assert "logits max" in stdout
    # every file of the export (model.safetensors included) has an ordinary file's mode under the umask
    want = 0o666 & ~_umask()
    modes = {f.name: oct(f.stat().st_mode & 0o777) for f in out.rglob("*") if f.is_file()}
    assert "model.safetensors" in modes and set(modes.values()) == {oct(want)}, modes

    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    tok = AutoTokenizer.from_pretrained(out)
    ckpt = complete_checkpoints(run_dir / "checkpoints")[-1]
    assert ckpt.name == "step-8"  # the newest checkpoint of the run was exported
    meta = read_meta(ckpt)
    m = meta["config"]["model"]
    ours = GPT(GPTShape(meta["vocab_size"], m["n_layer"], m["n_head"], m["d_model"], m["block_size"]))
    ours.load_state_dict(load_full_model_state(ckpt))
    ours.eval()
    text = "def main(argv):\n    return len(argv)  # héllo\n"
    ids = tok(text)["input_ids"]
    if tokenizer == "byte":
        assert ids == list(text.encode("utf-8"))  # the exported tokenizer is mptrain's byte tokenizer
    assert tok.decode(ids) == text
    x = torch.tensor([ids])
    with torch.no_grad():
        diff = (hf(x).logits - ours(x)).abs().max().item()
    assert diff < 1e-4, diff
    # the trained weights, not a fresh init, were exported
    assert not torch.allclose(hf.transformer.h[0].mlp.c_fc.weight, torch.zeros(1))
    if tokenizer == "byte":  # the BPE export's files are the same kinds
        r = subprocess.run([sys.executable, "-c", LOAD_WITHOUT_TORCHAO, str(out)], capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        assert r.stdout == f"GPT2LMHeadModel {meta['vocab_size']} def fib(n):\n", r.stdout + r.stderr[-3000:]


def test_export_of_a_dir_without_checkpoints_fails_clearly(tmp_path, capsys):
    """One line on stderr, exit status 2, no traceback, speaking of the export's own
    argument and the fix (not of the trainer's resume=). In this process: a launch
    would only add its start-up."""
    (tmp_path / "metrics.jsonl").write_text("")  # a run directory whose run saved no checkpoint
    with pytest.raises(SystemExit) as e:
        _export_module().main([str(tmp_path), str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"export_hf: {tmp_path} holds no checkpoint") and "checkpoint.every=" in err, err
    assert "resume=" not in err, err


def test_export_never_deletes_what_it_did_not_write(byte_run, tmp_path, monkeypatch, capsys):
    """The output directory: one holding a user's files (``.`` included) is refused,
    one line, and left as it was; a new one gets the export and its marker,
    renamed into place from a hidden sibling; a previous export is replaced only
    with --overwrite, and then only its own files; an export that fails its
    check (the real check, its tolerance made impossible) leaves nothing and
    replaces nothing. In this process: a launch per export would only add its
    start-up."""
    export_hf = _export_module()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    monkeypatch.chdir(mine)
    for out in (".", str(mine)):
        with pytest.raises(SystemExit) as e:
            export_hf.main([str(byte_run), out])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1, err
        assert err.startswith(f"export_hf: the output directory {out} is not empty") and "empty it yourself" in err
    assert [p.name for p in mine.iterdir()] == ["notes.txt"] and (mine / "notes.txt").read_text() == "keep"

    from transformers.utils import logging as hf_logging

    out = tmp_path / "exports" / "hf"  # as the README's exports/my-model: the folder above is made too
    bars = hf_logging.is_progress_bar_enabled()
    export_hf.main([str(byte_run), str(out)])
    captured = capsys.readouterr()
    assert "it/s" not in captured.err and captured.out.count("export_hf: ") == 2, captured  # its own lines alone
    assert hf_logging.is_progress_bar_enabled() == bars  # transformers' bars as they were, for this process
    marker = json.loads((out / export_hf.MARKER).read_text())
    assert marker["checkpoint"] == str((byte_run / "checkpoints" / "step-8").resolve()) and marker["step"] == 8
    assert sorted(marker["files"]) == sorted(p.name for p in out.iterdir() if p.name != export_hf.MARKER)
    assert "model.safetensors" in marker["files"] and marker["complete"] is True
    # each file with what --overwrite checks before it deletes it: its size and CRC-32
    assert all(entry == {"size": (out / name).stat().st_size, "crc32": file_crc32(out / name)}
               for name, entry in marker["files"].items())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exports", "mine"]
    assert [p.name for p in out.parent.iterdir()] == ["hf"]  # no staging directory left beside it

    (out / "NOTES.md").write_text("mine")
    with pytest.raises(SystemExit) as e:
        export_hf.main([str(byte_run), str(out)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "holds an export of" in err and "--overwrite" in err, err
    step4 = str(byte_run / "checkpoints" / "step-4")
    monkeypatch.setattr(export_hf, "TOLERANCE", -1.0)  # no export can pass: the check fails after the write
    for argv in ([step4, str(out), "--overwrite"], [step4, str(tmp_path / "hf2")]):
        with pytest.raises(SystemExit, match="the export is wrong"):
            export_hf.main(argv)
    assert json.loads((out / export_hf.MARKER).read_text()) == marker  # the previous export is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exports", "mine"]
    monkeypatch.undo()
    export_hf.main([step4, str(out), "--overwrite"])
    assert json.loads((out / export_hf.MARKER).read_text())["step"] == 4
    assert (out / "NOTES.md").read_text() == "mine"  # not the export's: kept
    assert sorted(p.name for p in out.iterdir()) == sorted([*marker["files"], export_hf.MARKER, "NOTES.md"])


def _export_module():
    spec = importlib.util.spec_from_file_location("export_hf", ROOT / "scripts" / "export_hf.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_export_refuses_a_tokenizer_with_custom_code(tmp_path, monkeypatch, capsys):
    """The checkpoint names a tokenizer that ships Python code: the export stops
    with one line naming --trust-remote-code before it reads any weights (the
    checkpoint here is a meta.json alone), and the code never runs."""
    from mptrain.checkpoint.integrity import FORMAT

    tok_dir, marker = make_remote_code_tokenizer(tmp_path)
    ckpt = tmp_path / "step-1"
    ckpt.mkdir()
    (ckpt / "meta.json").write_text(json.dumps({
        "format": FORMAT, "step": 1, "vocab_size": 320,
        "config": {"model": {"n_layer": 1, "n_head": 1, "d_model": 8, "block_size": 8, "bias": True}},
        "tokenizer": {"name": tok_dir.name, "path": str(tok_dir)}}))
    export_hf = _export_module()
    with pytest.raises(SystemExit) as e:
        export_hf.main([str(ckpt), str(tmp_path / "hf")])
    msg = capsys.readouterr().err
    assert e.value.code == 2 and msg.startswith("export_hf: ") and "--trust-remote-code" in msg, msg
    assert msg.count("\n") == 1, msg
    assert not marker.exists() and not (tmp_path / "hf").exists()

    # the flag, and only the flag, reaches transformers as trust_remote_code=True
    import transformers

    seen = []

    def fake(path, **kw):
        seen.append(kw["trust_remote_code"])
        raise OSError("stop here")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fake)
    for argv in ([], ["--trust-remote-code"]):
        with pytest.raises(SystemExit):  # a tokenizer that cannot be loaded is one line too
            export_hf.main([str(ckpt), str(tmp_path / "hf"), *argv])
        assert "could not be loaded (OSError: stop here)" in capsys.readouterr().err
    assert seen == [False, True]
