"""What a resume may change: every schema key declares it (guarded, recorded or
harmless), and the resume reads those markers; a rerun past ``train.stop_after``
or ``train.max_steps`` trains nothing and says why; a folder that is no
checkpoint is named when it is passed over."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import typing
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from mptrain.config.schema import GUARDED, HARMLESS, RECORDED, Config, on_resume
from mptrain.checkpoint.checkpointer import flatten
from mptrain.run.resume import ResumeRefused

from .conftest import TINY, train
from .test_rundir import _tree


def _leaves(cls: type, prefix: str = ""):
    """(dotted key, dataclass field) of every leaf of the schema, walked section by section."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _leaves(hints[f.name], f"{prefix}{f.name}.")
        else:
            yield prefix + f.name, f


def test_every_schema_key_says_what_a_resume_may_do_with_it():
    leaves = dict(_leaves(Config))
    assert len(leaves) > 100 and "train.z_loss" in leaves and "precision.loss_scale.init_scale" in leaves
    unmarked = [k for k, f in leaves.items() if f.metadata.get("on_resume") not in (GUARDED, RECORDED, HARMLESS)]
    assert not unmarked, f"declare these with guarded(), recorded() or harmless(): {unmarked}"
    unexplained = [k for k, f in leaves.items()
                   if f.metadata["on_resume"] == HARMLESS and len(f.metadata["why"].strip()) < 10]
    assert not unexplained, f"a harmless key says why in its marker: {unexplained}"
    # what resume.py reads is every key a config holds, no more, no less
    assert on_resume().keys() == leaves.keys() == flatten(OmegaConf.to_container(OmegaConf.structured(Config))).keys()
    kinds = {k: kind for k, (kind, _) in on_resume().items()}
    assert kinds["train.z_loss"] == kinds["train.micro_batch_size"] == kinds["optim.lr"] == GUARDED
    assert kinds["train.max_steps"] == kinds["parallel.name"] == kinds["train.eval_tokens"] == RECORDED
    assert kinds["train.log_every"] == kinds["train.stop_after"] == kinds["data.cache_dir"] == HARMLESS


def test_resume_reads_the_markers_and_reruns_say_why_nothing_trains(tmp_path, capsys):
    run = tmp_path / "run"
    train(run, "train.max_steps=6", "train.stop_after=2")
    # The same stop_after command again: the slice is done, nothing trains (it used to train step 3).
    records = _tree(run)
    capsys.readouterr()
    again, _ = train(run, "train.max_steps=6", "train.stop_after=2")
    said = capsys.readouterr().out
    assert "step-2 is at step 2 and train.stop_after=2: nothing to train in this launch" in said, said
    assert _tree(run) == records and again["steps"] == 2
    # An empty step-N folder is passed over with a line naming it.
    (run / "checkpoints" / "step-9").mkdir()
    # z-loss changes the loss the model learns from: refused, nothing written.
    with pytest.raises(ResumeRefused, match=r"train.z_loss: 0.0 -> 0.001\). .*allow_changes=\[train.z_loss\]"):
        train(run, "train.max_steps=6", "train.z_loss=0.001")
    assert f"{run / 'checkpoints' / 'step-9'} is not a checkpoint (it is empty), skipped" in capsys.readouterr().out
    assert _tree(run) == records
    # Named, it trains on and is recorded; a lower max_steps shortens the schedule and says so.
    s, _ = train(run, "train.max_steps=5", "train.z_loss=0.001", "resume.allow_changes=[train.z_loss]",
                 "train.stop_after=3")
    assert "train.max_steps 6 -> 5 shortens the learning-rate schedule" in capsys.readouterr().out
    history = [{"from_step": 2, "changes": {"train.max_steps": [6, 5], "train.z_loss": [0.0, 0.001]}}]
    assert s["steps"] == 3 and s["config_history"] == history  # stop_after 2 -> 3: harmless, not recorded
    assert json.loads((run / "summary.json").read_text())["config_history"] == history
    assert yaml.safe_load((run / "config.yaml").read_text())["run_info"]["config_history"] == history
    assert json.loads((run / "checkpoints" / "step-3" / "meta.json").read_text())["history"] == history
    # max_steps lowered to the step reached: nothing to train, and the line says so.
    records = _tree(run)
    train(run, "train.max_steps=3", "train.z_loss=0.001")
    said = capsys.readouterr().out
    assert ("step-3 is at step 3 and train.max_steps=3 (lowered from 5; steps already trained are not undone): "
            "nothing to train") in said, said
    assert _tree(run) == records


def test_resume_latest_picks_the_newest_run_and_a_finished_one_leaves_no_directory(tmp_path, monkeypatch, capsys):
    """``resume=latest``: the newest run under ``outputs/`` of the launch's folder with a
    complete checkpoint, named in one line; none there is one line naming where it looked.
    A launch that resumes a finished run trains nothing and leaves no new run directory,
    lock or date folder behind (it used to leave an empty run directory). In-process
    launches, as ``python train.py`` runs them; one tiny run trains, a copy of it is the older run."""
    from mptrain.run.launch import launch

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr(sys, "argv", ["train.py"])  # launch() puts the overrides there for Hydra
    outputs, base = tmp_path / "outputs", [*TINY, "train.max_steps=2", "checkpoint.at_end=true"]

    def runs() -> list[Path]:
        return sorted(p.parent for p in outputs.rglob("checkpoints"))

    assert launch([*base, "resume=latest"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"mptrain: checkpoint error: resume=latest: no run under {outputs} holds a complete checkpoint "
        "(runs started from this folder with the default hydra.run.dir go there); train one first, or name a "
        "run directory or checkpoint with resume=<path>."]
    assert not outputs.exists()  # nor its date folder
    assert launch(base) == 0
    (first,) = runs()
    shutil.copytree(first, outputs / "older")  # another run, its checkpoint saved long ago
    os.utime(outputs / "older" / "checkpoints" / "step-2" / "meta.json", (0, 0))
    capsys.readouterr()
    # The finished run, by latest and by its path, into a new dated directory: nothing trains, nothing stays.
    fresh = tmp_path / "fresh"
    for source in ("latest", str(first)):
        assert launch([*base, f"resume={source}", "hydra.run.dir=${mptrain_new_dir:fresh/day/run}"]) == 0
        out = capsys.readouterr().out
        assert "nothing to train" in out, out
        assert not fresh.exists()
    assert launch([*base, "resume=latest"]) == 0
    out = capsys.readouterr().out
    picked = [line for line in out.splitlines() if line.startswith("resume=latest:")]
    assert len(picked) == 1 and picked[0].startswith(f"resume=latest: {first} (checkpoint step-2, saved ") and \
        picked[0].endswith(f"), the newest complete checkpoint under {outputs}"), out
    assert runs() == [first, outputs / "older"]  # the finished run's resume left no directory of its own
    assert [p for p in outputs.rglob("*") if p.is_dir() and not any(p.iterdir())] == []
