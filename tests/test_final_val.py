"""One validation figure per checkpoint, and every other figure saying its tokens.

The in-run evaluations read the ``train.eval_tokens`` subset and say so; the
closing line leads with the whole split's loss (``final/whole_val_loss``), the
figure ``python -m mptrain.evaluate`` prints for the final checkpoint; and
``evaluate`` prints the run's own figures beside its own, saying which were
measured on other tokens. One tiny run serves every test.
"""
from __future__ import annotations

import pytest

import mptrain.evaluate as evaluate_cmd

from .conftest import train

STEPS = 2
RUN = [f"train.max_steps={STEPS}", "train.eval_every=1", "train.sample_tokens=0", "monitor.enabled=false",
       "checkpoint.at_end=true"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("final-val") / "run"
    summary, _ = train(run_dir, *RUN)
    return run_dir, summary, (run_dir / "train.log").read_text().splitlines()


def test_in_run_evaluations_say_they_read_a_subset(run):
    _, s, log = run
    lines = [ln for ln in log if " step " in ln and "| train loss " in ln and "| val loss " in ln]
    assert len(lines) == STEPS, log
    words = f"on the train.eval_tokens subset ({s['eval/tokens']:,} of {s['eval/whole_tokens']:,} tokens)"
    assert s["eval/tokens"] < s["eval/whole_tokens"] and all(words in ln for ln in lines), lines


def test_the_closing_line_leads_with_the_whole_split(run):
    _, s, log = run
    (done,) = [ln for ln in log if "done in " in ln]
    val = done.split(" | val loss ", 1)[1]
    assert val.startswith(f"{s['final/whole_val_loss']:.4f} (ppl "), done
    assert (f"on the whole val split ({s['eval/whole_tokens']:,} tokens) | train.eval_tokens subset "
            f"{s['final/val_loss']:.4f} on {s['eval/tokens']:,} tokens") in val, done


def test_evaluate_prints_the_closing_figure_and_the_runs_own_beside_it(run, capsys):
    run_dir, s, log = run
    out = evaluate_cmd.run([str(run_dir)])
    printed = capsys.readouterr().out.splitlines()
    (done,) = [ln for ln in log if "done in " in ln]
    assert f"val loss {out['val/loss']:.4f} nats/token" in printed[2]
    assert f"| val loss {out['val/loss']:.4f} (ppl" in done  # the run's last line and evaluate agree
    assert printed[3] == (f"the run's own val loss at step {STEPS}: {s['final/whole_val_loss']:.4f} on the whole val "
                          f"split ({s['eval/whole_tokens']:,} tokens; the tokens above) | {s['final/val_loss']:.4f} "
                          f"on its train.eval_tokens subset ({s['eval/tokens']:,} tokens; other tokens than above, "
                          "so another mean)"), printed
    # on the subset's own tokens, that figure is the one measured on the tokens evaluated
    evaluate_cmd.run([str(run_dir), "--eval-tokens", str(s["eval/tokens"])])
    own = capsys.readouterr().out.splitlines()[3]
    assert own.endswith(f"{s['final/val_loss']:.4f} on its train.eval_tokens subset ({s['eval/tokens']:,} tokens; "
                        "the tokens above)"), own
    assert "whole val split" in own and "other tokens than above" in own
