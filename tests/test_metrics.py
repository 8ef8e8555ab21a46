"""Sinks: TensorBoard events read back by TensorBoard itself, metrics.jsonl keys, W&B offline run."""
from __future__ import annotations

import json

import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from .conftest import read_rows, train

CONTRACT_KEYS = {"train/loss", "train/lr", "train/grad_norm", "perf/tokens_per_s", "perf/step_time_s"}
AMP_KEYS = {"amp/loss_scale", "amp/skipped_steps", "amp/skip_rate"}


def test_jsonl_tensorboard_and_wandb(tmp_path, capsys):
    run_dir = tmp_path / "run"
    summary, rows = train(run_dir, "precision=fp16", "train.max_steps=6", "train.log_every=2",
                          "train.eval_every=3", "log.tensorboard=true", "log.wandb.enabled=true",
                          "log.wandb.group=tests", "log.progress=true", "log.plain_every=4",
                          "train.sample_tokens=8")
    console = capsys.readouterr()
    # metrics.jsonl: every line parses, carries the step and the documented metric names.
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 6]  # log at 1, every 2, last; eval at 3 and 6
    for r in rows:
        if "train/loss" in r:
            assert CONTRACT_KEYS | AMP_KEYS <= r.keys(), r.keys()
    assert "val/loss" in rows[2] and "train/loss" not in rows[2]
    assert "val/loss" in rows[-1] and "train/loss" in rows[-1]

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert CONTRACT_KEYS | AMP_KEYS | {"val/loss"} <= tags
    # Every logged loss, at its step, equal to the JSONL value as TensorBoard stores it (float32).
    logged = [r for r in rows if "train/loss" in r]
    assert [e.step for e in acc.Scalars("train/loss")] == [r["step"] for r in logged] == [1, 2, 4, 6]
    assert [e.value for e in acc.Scalars("train/loss")] == [float(np.float32(r["train/loss"])) for r in logged]
    assert [e.step for e in acc.Scalars("amp/loss_scale")] == [1, 2, 4, 6]

    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((run_dir / "wandb").iterdir())
    assert any(runs[0].glob("*.wandb")), "offline run has no .wandb data file"

    s = json.loads((run_dir / "summary.json").read_text())
    assert s["amp/skipped_steps"] == 0 and s["steps"] == 6

    # Samples of the fixed prompt after each evaluation: console, TensorBoard text, W&B media.
    said = [ln for ln in console.out.splitlines() if "| sample: 'def " in ln]
    assert [ln.split("|")[0].split()[1] for ln in said] == ["3", "6"], console.out
    texts = acc.Tensors("samples/text/text_summary")  # add_text's tag
    assert [e.step for e in texts] == [3, 6]
    assert texts[-1].tensor_proto.string_val[0].decode() == eval(said[-1].split("sample: ", 1)[1])  # noqa: S307
    assert len(list(runs[0].glob("files/media/html/samples/text_*.html"))) == 2

    # Not a terminal: plain progress lines (first logged step, every 4, the last), no bar redraws.
    progress = [ln.split("|")[0].split()[1] for ln in console.out.splitlines() if ln.startswith("step ") and "/6 " in ln]
    assert progress == ["1/6", "4/6", "6/6"], console.out
    assert "\r" not in console.out + console.err and "loss scale" not in console.err
    # train.log keeps every console line (timestamped), the banner through the final line.
    kept = [ln[20:] for ln in (run_dir / "train.log").read_text().splitlines()]
    assert kept == console.out.splitlines(), (kept, console.out)
    assert any(k.startswith("mptrain | gpt-nano") for k in kept) and kept[-3].startswith("done in ")
    # An offline W&B run ends with the command that uploads it, naming its own folder.
    assert kept[-1] == f"W&B run saved offline; upload it with: wandb sync {runs[0]}", kept[-2:]


def test_metric_that_does_not_apply_is_absent(tmp_path):
    _, rows = train(tmp_path / "run", "precision=bf16", "train.max_steps=2")
    assert all(not k.startswith("amp/") for r in rows for k in r)
    assert all("perf/mfu" not in r for r in rows)  # no known peak for a CPU: left out, not faked
    assert rows == read_rows(tmp_path / "run")
