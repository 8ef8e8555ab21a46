"""End-to-end runs: the loss falls in every precision and the dtypes stay what each precision preset promises."""
from __future__ import annotations

import json
import os

import pytest
import yaml

from .conftest import run_cli, train


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_30_steps_lower_the_loss_and_keep_fp32_state(tmp_path, precision):
    summary, rows = train(tmp_path / "run", f"precision={precision}", "train.max_steps=30")
    losses = [r["train/loss"] for r in rows]
    assert len(losses) == 30
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first - 0.5, f"{precision}: loss went {first:.3f} -> {last:.3f}"
    d = summary["dtypes"]
    # Observed on the live objects at the end of the run (trainer.observed_dtypes).
    assert d["parameters"] == "fp32"
    assert d["gradients"] == "fp32"
    assert d["optimizer_state"] == "fp32"
    assert d["compute_observed"] == {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}[precision]
    if precision == "fp16":
        assert "amp/loss_scale" in rows[-1] and rows[-1]["amp/skipped_steps"] >= 0
    else:
        assert not any(k.startswith("amp/") for r in rows for k in r), "scaler metrics in a run without a scaler"


def test_default_run_dir_layout_and_learning(tmp_path):
    """The user command, through Hydra, writes the documented run directory and beats the unigram baseline."""
    run_dir = tmp_path / "run"
    # A small BPE vocabulary and few steps: the default path (a tokenizer trained and
    # cached, BPE tokens) at a third of the cost of the default's.
    r = run_cli("model=gpt-nano", "train.max_steps=80", "train.eval_every=40", "train.log_every=20",
                "data.max_chars=200000", "data.bpe_vocab_size=1024", "optim.warmup_steps=8", "optim.lr=3e-3",
                f"hydra.run.dir={run_dir}", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    for name in ("config.yaml", "metrics.jsonl", "summary.json", "tensorboard", "checkpoints/step-80/manifest.json"):
        assert (run_dir / name).exists(), name  # a checkpoint at the end by default: sample and export work
    # The console, piped here as on a cluster: plain progress lines, and all of it kept in train.log.
    assert "\r" not in r.stdout + r.stderr and "step     80/80 | loss" in r.stdout
    log = (run_dir / "train.log").read_text()
    assert [ln[20:] for ln in log.splitlines()] == r.stdout.splitlines(), log
    assert "step     40 | sample: 'def " in log and "done in " in log
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert cfg["run_info"]["dtypes"]["parameters"] == "fp32"
    assert cfg["data"]["cache_dir"] == os.environ["MPTRAIN_CACHE"]  # the cache it used, not the key's ~/.cache
    assert cfg["run_info"]["versions"]["torch"] and cfg["run_info"]["git_commit"]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["final/val_loss"] < s["baseline/unigram_val_loss"] - 0.3
    assert s["final/train_loss"] < s["baseline/unigram_val_loss"]
    out = r.stdout + r.stderr
    assert "unigram baseline" in out and "val loss" in out
    assert "parameters" in out and "loss_scaling" in out  # the dtype banner
