"""Sinks: TensorBoard events read back by TensorBoard itself, metrics.jsonl keys, W&B offline run."""
from __future__ import annotations

import json

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from .conftest import read_rows, train

CONTRACT_KEYS = {"train/loss", "train/lr", "train/grad_norm", "perf/tokens_per_s", "perf/step_time_s"}
AMP_KEYS = {"amp/loss_scale", "amp/skipped_steps", "amp/skip_rate"}


def test_jsonl_tensorboard_and_wandb(tmp_path):
    run_dir = tmp_path / "run"
    summary, rows = train(run_dir, "precision=fp16", "train.max_steps=6", "train.log_every=2",
                          "train.eval_every=3", "log.tensorboard=true", "log.wandb.enabled=true",
                          "log.wandb.group=tests")
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
    tb_loss = [e.value for e in acc.Scalars("train/loss")]
    assert tb_loss == [float(f"{r['train/loss']:.7g}") or r["train/loss"] for r in rows if "train/loss" in r] \
        or all(abs(a - r["train/loss"]) < 1e-5 for a, r in zip(tb_loss, [r for r in rows if "train/loss" in r]))
    assert [e.step for e in acc.Scalars("amp/loss_scale")] == [1, 2, 4, 6]

    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list((run_dir / "wandb").iterdir())
    assert any(runs[0].glob("*.wandb")), "offline run has no .wandb data file"

    s = json.loads((run_dir / "summary.json").read_text())
    assert s["amp/skipped_steps"] == 0 and s["steps"] == 6


def test_metric_that_does_not_apply_is_absent(tmp_path):
    _, rows = train(tmp_path / "run", "precision=bf16", "train.max_steps=2")
    assert all(not k.startswith("amp/") for r in rows for k in r)
    assert all("perf/mfu" not in r for r in rows)  # no known peak for a CPU: left out, not faked
    assert rows == read_rows(tmp_path / "run")
