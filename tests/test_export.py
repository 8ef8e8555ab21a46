"""scripts/export_hf.py: the checkpoint as a transformers GPT-2, logits equal to mptrain's."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from mptrain.checkpoint import complete_checkpoints, load_full_model_state, read_meta
from mptrain.model import GPT, GPTShape

from .conftest import ROOT, TINY, train


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_export_round_trip(tmp_path, tokenizer):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    extra = ["data.tokenizer=bpe", "data.bpe_vocab_size=512", "data.max_chars=200000"] if tokenizer == "bpe" else []
    run_dir = tmp_path / "run"
    train(run_dir, *TINY, *extra, "train.max_steps=8", "checkpoint.every=4", tiny=False)
    out = tmp_path / "hf"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "export_hf.py"), str(run_dir), str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "logits max" in r.stdout

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


def test_export_of_a_dir_without_checkpoints_fails_clearly(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "export_hf.py"), str(tmp_path), str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "export_hf:" in r.stderr and "Traceback" not in r.stderr
