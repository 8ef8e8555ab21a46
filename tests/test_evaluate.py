"""Validation figures: ``checkpoint.keep_best``, perplexity and bits per byte in the
run's outputs, and ``python -m mptrain.evaluate`` on the whole validation split.

One tiny run serves every test: its validation loss falls, then rises (a high
constant learning rate), so the best checkpoint is not the newest.
"""
from __future__ import annotations

import json
import math

import pytest

import mptrain.evaluate as evaluate_cmd
from mptrain.checkpoint.integrity import complete_checkpoints
from mptrain.checkpoint.readers import find_checkpoint

from .conftest import train

STEPS = 4
RUN = [f"train.max_steps={STEPS}", "train.eval_every=1", "train.sample_tokens=0",
       "monitor.enabled=false",
       # lr 0.02 without decay: the val loss falls for ~3 steps, then climbs by ~0.2 nats
       "optim.lr=0.02", "optim.warmup_steps=1", "optim.decay_fraction=0",
       "checkpoint.keep_last=1", "checkpoint.keep_best=true", "checkpoint.at_end=true"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("evaluate") / "run"
    summary, rows = train(run_dir, *RUN)
    val = {r["step"]: r for r in rows if "val/loss" in r}
    return run_dir, summary, val


def test_keep_best_keeps_the_lowest_val_loss_beside_the_newest(run):
    run_dir, summary, val = run
    best = min(val, key=lambda s: val[s]["val/loss"])
    assert best < STEPS, f"the recipe no longer makes the last step worse than the best: {val}"
    kept = [p.name for p in complete_checkpoints(run_dir / "checkpoints")]
    assert kept == [f"step-{best}", f"step-{STEPS}"]  # keep_last=1 pruned the rest, never the best
    assert summary["best/step"] == best and summary["best/val_loss"] == val[best]["val/loss"]
    assert summary["best/checkpoint"] == str(run_dir / "checkpoints" / f"step-{best}")
    assert f"best checkpoint: step {best} " in (run_dir / "train.log").read_text()
    assert find_checkpoint(run_dir, log=lambda _: None).name == f"step-{STEPS}"  # resume and tools: the newest


def test_perplexity_and_bits_per_byte_beside_the_loss(run):
    run_dir, summary, val = run
    nbytes, tokens = summary["eval/bytes"], summary["eval/tokens"]
    assert 0.99 * tokens < nbytes <= tokens  # byte tokenizer: every token a byte but end-of-text
    for r in val.values():
        assert r["val/ppl"] == pytest.approx(math.exp(r["val/loss"]), rel=1e-12)
        assert r["val/bpb"] == pytest.approx(r["val/loss"] * tokens / math.log(2) / nbytes, rel=1e-12)
    last = val[STEPS]
    assert (summary["final/val_loss"], summary["final/val_ppl"], summary["final/val_bpb"]) == (
        last["val/loss"], last["val/ppl"], last["val/bpb"])
    log = (run_dir / "train.log").read_text()
    ppl = f"(ppl {last['val/ppl']:.4g}, {last['val/bpb']:.4f} bits/byte)"
    assert f"step {STEPS:>6} | train loss" in log and f"val loss {last['val/loss']:.4f} {ppl}" in log
    done = next(ln for ln in log.splitlines() if "done in" in ln)  # the end-of-run line: both figures, each set
    assert (f"val loss {summary['final/whole_val_loss']:.4f} (ppl {summary['final/whole_val_ppl']:.4g}, "
            f"{summary['final/whole_val_bpb']:.4f} bits/byte) on the whole val split "
            f"({summary['eval/whole_tokens']:,} tokens) | train.eval_tokens subset {last['val/loss']:.4f} on "
            f"{tokens:,} tokens") in done


def test_whole_split_set_is_not_measured_twice(tmp_path):
    """An ``eval_tokens`` set that already is the whole split: its figures are the whole
    split's, said once; ``eval_whole_split=false`` leaves the whole figures out."""
    summary, _ = train(tmp_path / "all", "train.max_steps=1", "train.eval_every=1", "train.eval_tokens=1000000",
                       "train.sample_tokens=0", "monitor.enabled=false")
    assert summary["eval/whole_windows"] == summary["eval/windows"]
    assert summary["final/whole_val_loss"] == summary["final/val_loss"]
    assert "tokens (the whole val split) | unigram" in (tmp_path / "all" / "train.log").read_text()
    summary, _ = train(tmp_path / "off", "train.max_steps=1", "train.eval_every=1", "train.eval_whole_split=false",
                       "train.sample_tokens=0", "monitor.enabled=false")
    assert "final/val_loss" in summary and not any("whole" in k for k in summary)


def test_evaluate_measures_the_whole_split_as_the_trainer_does(run, tmp_path, capsys, monkeypatch):
    run_dir, summary, val = run
    monkeypatch.setattr(evaluate_cmd, "PROGRESS_EVERY_S", 0.0)  # a line per batch: the progress is seen
    out = evaluate_cmd.run([str(run_dir), "--json", str(tmp_path / "eval.json"), "--batch-size", "64"])
    printed = capsys.readouterr()
    assert json.loads((tmp_path / "eval.json").read_text()) == out
    assert out["step"] == STEPS and out["checkpoint"] == str(run_dir / "checkpoints" / f"step-{STEPS}")
    # every window of the split, each a byte a token but end-of-text
    assert out["eval/whole_split"] and out["eval/windows"] == (out["eval/split_tokens"] - 1) // 64
    assert out["eval/tokens"] == 64 * out["eval/windows"] > 3 * summary["eval/tokens"]
    assert 0.99 * out["eval/tokens"] < out["eval/bytes"] <= out["eval/tokens"]
    assert out["val/ppl"] == pytest.approx(math.exp(out["val/loss"]), rel=1e-12)
    # the run's own whole-split figure (train.eval_whole_split), at the checkpoint of its last step
    assert (summary["eval/whole_tokens"], summary["eval/whole_windows"], summary["eval/whole_bytes"]) == (
        out["eval/tokens"], out["eval/windows"], out["eval/bytes"])
    for key in ("loss", "ppl", "bpb"):
        assert summary[f"final/whole_val_{key}"] == pytest.approx(out[f"val/{key}"], rel=1e-6), key
    assert f"val loss {out['val/loss']:.4f} nats/token | perplexity {out['val/ppl']:.4g}" in printed.out
    assert f"{out['eval/windows']:,} windows of 64 tokens" in printed.out
    assert "evaluate: " in printed.err and " tokens (" in printed.err
    # the trainer's own set (train.eval_tokens=4096, TINY's): its figures, from the same code
    same = evaluate_cmd.run([str(run_dir), "--eval-tokens", "4096"])
    assert (same["eval/tokens"], same["eval/windows"], same["eval/bytes"]) == (
        summary["eval/tokens"], summary["eval/windows"], summary["eval/bytes"])
    for key in ("val/loss", "val/ppl", "val/bpb"):
        assert same[key] == pytest.approx(val[STEPS][key], rel=1e-5), key  # other micro-batches: last bits only
    best = evaluate_cmd.run([str(run_dir / "checkpoints" / f"step-{summary['best/step']}"), "--eval-tokens", "4096"])
    assert best["val/loss"] == pytest.approx(summary["best/val_loss"], rel=1e-5)
    # the command itself ends with status 0 (its figures are output, not an exit message)
    assert evaluate_cmd.main([str(run_dir), "--eval-tokens", "1024"]) == 0


def test_evaluate_bad_input_is_one_line(run, tmp_path, capsys):
    run_dir, _, _ = run
    with pytest.raises(SystemExit) as exit_:
        evaluate_cmd.main(["--help"])
    assert exit_.value.code == 0 and "python -m mptrain.evaluate" in capsys.readouterr().out  # the usage, no work
    (tmp_path / "empty").mkdir()
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "checkpoints").write_text("not a directory")
    cases = {
        str(tmp_path / "nope"): "does not exist",
        str(tmp_path / "empty"): "not a run directory or a checkpoint",
        str(tmp_path / "odd"): "checkpoints is not a directory",
        str(run_dir / "checkpoints" / f"step-{STEPS}" / "meta.json"): "not a run directory or a checkpoint",
    }
    for src, words in cases.items():
        with pytest.raises(SystemExit) as exit_:
            evaluate_cmd.main([src])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.startswith("evaluate: ") and err.count("\n") == 1, (src, err)
        assert words in err, (src, err)
    for args, words in ((["--batch-size", "0"], "--batch-size 0"), (["--json", str(tmp_path / "no" / "x.json")],
                                                                     "is not a directory")):
        with pytest.raises(SystemExit) as exit_:
            evaluate_cmd.main([str(run_dir), *args])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.startswith("evaluate: ") and words in err, err


def test_whole_split_draws_none_of_the_runs_random_numbers(tmp_path):
    """A lab recipe that rounds the forward's input stochastically draws from the default
    generator in every forward, evaluation's too: the whole-split evaluation puts it back,
    so the final checkpoint holds the generator a run without it holds."""
    import torch

    rng = {}
    for whole in ("true", "false"):
        run_dir = tmp_path / whole
        summary, _ = train(run_dir, "precision=lab", "precision.lab.fwd_input=e2m1/1x16/e4m3/stochastic",
                           "precision.lab.allow_forward_stochastic=true",
                           "train.max_steps=1", "train.eval_every=1", "train.sample_tokens=0", "monitor.enabled=false",
                           "checkpoint.at_end=true", f"train.eval_whole_split={whole}")
        assert ("final/whole_val_loss" in summary) == (whole == "true")
        rng[whole] = torch.load(run_dir / "checkpoints" / "step-1" / "rng-rank0.pt", weights_only=True)["torch"]
    assert torch.equal(rng["true"], rng["false"])
