"""What a run writes into its directory: never through a planted symbolic link,
never a half row in metrics.jsonl that stops a later launch, and no room left on
the disk (here: a file-size limit) as one line that says what is kept."""
from __future__ import annotations

import os
import re
import resource
import shutil
import subprocess
import sys

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from mptrain.run.metrics import TensorBoardSink
from mptrain.run.rundir import RunDirError

from .conftest import ROOT, TINY, read_rows, run_cli, train


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A run of 2 steps with its checkpoint, step-2, for the tests below to copy
    (it also builds the token cache, which a size-limited child could not write)."""
    run = tmp_path_factory.mktemp("saved") / "run"
    train(run, "train.max_steps=2", "checkpoint.every=2")
    return run


def _copy(saved, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(saved, run)
    return run


def test_planted_links_are_never_written_through(tmp_path):
    """A link in place of a file the run appends to is refused, naming it; one in
    place of a file it replaces whole (or of its temporary name) is replaced. The
    files outside stay as they were, byte for byte."""
    run, outside = tmp_path / "run", tmp_path / "outside"
    run.mkdir()
    outside.mkdir()
    pid = os.getpid()  # the temporary names of this process's atomic writes
    names = [".lock", "train.log", "metrics.jsonl", "config.yaml", "summary.json",
             f"config.yaml.tmp{pid}", f"summary.json.tmp{pid}"]
    for name in names:
        (outside / name).write_bytes(f"precious, not the run's: {name}\n".encode())
        (run / name).symlink_to(outside / name)
    before = {name: (outside / name).read_bytes() for name in names}
    for name in (".lock", "train.log", "metrics.jsonl"):  # in the order the run opens them
        link = re.escape(f"{run / name} is a symbolic link (to {outside / name}): ")
        with pytest.raises(RunDirError, match=link + ".* Remove the link, or pick another hydra.run.dir"):
            train(run, "train.max_steps=2")
        (run / name).unlink()  # the user's fix
    (outside / "tensorboard").mkdir()
    (run / "tensorboard").symlink_to(outside / "tensorboard")
    with pytest.raises(RunDirError, match=re.escape(f"{run / 'tensorboard'} is a symbolic link")):
        TensorBoardSink(run / "tensorboard")
    summary, rows = train(run, "train.max_steps=2")
    assert [r["step"] for r in rows] == [1, 2] and summary["steps"] == 2
    assert {name: (outside / name).read_bytes() for name in names} == before
    assert list((outside / "tensorboard").iterdir()) == []
    for name in ("config.yaml", "summary.json"):  # the run's own files now, in place of the links
        assert not (run / name).is_symlink() and b"precious" not in (run / name).read_bytes()
    assert not any(p.name.startswith(("config.yaml.tmp", "summary.json.tmp")) for p in run.iterdir())


@pytest.mark.parametrize("link", [".hydra", ".hydra/config.yaml"])
def test_hydra_never_writes_through_a_planted_link(tmp_path, link):
    """Hydra saves .hydra/*.yaml with a plain open, which follows links: the
    launch is refused before Hydra writes, in one line, and the outside is untouched."""
    run, outside = tmp_path / "run", tmp_path / "outside"
    (run / ".hydra").mkdir(parents=True)
    outside.mkdir()
    if link == ".hydra":
        (run / ".hydra").rmdir()
        (run / ".hydra").symlink_to(outside, target_is_directory=True)
    else:
        (outside / "config.yaml").write_text("precious\n")
        (run / link).symlink_to(outside / "config.yaml")
    before = {p.name: p.read_bytes() for p in outside.iterdir()}
    r = run_cli(*TINY, "train.max_steps=1", f"hydra.run.dir={run}")
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == (f"mptrain: run directory error: {run / link} is a symbolic link (to "
                                f"{outside / 'config.yaml' if link != '.hydra' else outside}): a run writes its "
                                "records only into files of its own directory, never through a link. Remove the "
                                "link, or pick another hydra.run.dir."), r.stderr
    assert {p.name: p.read_bytes() for p in outside.iterdir()} == before


def test_a_partial_last_row_is_cut_back(saved, tmp_path, capsys):
    """A write of metrics.jsonl cut short (disk full, a size limit, a kill) left half
    a row, and every later launch died in json.loads. Now the row is dropped, in
    one line, and the run continues from its checkpoint."""
    run = _copy(saved, tmp_path)
    half = b'{"step": 3, "train/loss": 4.12'
    with open(run / "metrics.jsonl", "ab") as f:
        f.write(half)
    capsys.readouterr()
    _, rows = train(run, "train.max_steps=4", "checkpoint.every=2")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    said = [ln for ln in capsys.readouterr().out.splitlines() if "dropped a partial" in ln]
    assert said == [f"{run / 'metrics.jsonl'}: dropped a partial last row ({len(half)} bytes after the row of "
                    "step 2: a write cut short by a full disk, a size limit or a kill); the complete rows before "
                    "it are kept"], said
    assert said[0] in (run / "train.log").read_text()


def _files_up_to_12k():
    """In the child: no file may grow past 12 KiB. CPython ignores SIGXFSZ, so the
    write that would pass it fails with EFBIG instead of killing the process."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (12 << 10, resource.RLIM_INFINITY))


@pytest.mark.parametrize("sink", ["metrics.jsonl", "tensorboard"])
def test_no_room_for_a_record_is_one_line(saved, tmp_path, sink):
    """A metric sink that meets a file-size limit (as it would a full disk): exit
    code 2 and one line naming the file and what is kept, instead of a traceback;
    the rows and events written are whole, and the run resumes."""
    run = _copy(saved, tmp_path)
    step2 = run / "checkpoints" / "step-2"
    checkpoint = {f.name: f.read_bytes() for f in step2.iterdir()}
    only = ["log.jsonl=false", "log.tensorboard=true"] if sink == "tensorboard" else []
    # No checkpoint to save (that would meet the limit first): the sink meets it, after 10-20 steps.
    # One torch thread: on a busy machine two spinning threads make each step ten times slower.
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), *TINY, "train.max_steps=400", "checkpoint.every=0",
                        *only, f"hydra.run.dir={run}"], capture_output=True, text=True, timeout=300,
                       preexec_fn=_files_up_to_12k, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.strip().count("\n") == 0, r.stderr
    assert r.stderr.startswith(f"mptrain: disk error: {run / sink} could not be written: File too large (EFBIG); ")
    assert f"the last complete checkpoint, {step2}, is intact; raise the file-size limit (ulimit -f)" in r.stderr
    assert {f.name: f.read_bytes() for f in step2.iterdir()} == checkpoint
    assert f"run ended by DiskError: {run / sink} could not be written" in (run / "train.log").read_text()
    if sink == "tensorboard":  # the events up to the failure read back, a truncated last record aside
        acc = EventAccumulator(str(run / "tensorboard"))
        acc.Reload()
        steps = [e.step for e in acc.Scalars("train/loss")]
        assert steps == list(range(3, 3 + len(steps))) and len(steps) >= 5, steps
        return
    steps = [row["step"] for row in read_rows(run)]  # every row whole: read_rows parses each line
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 5, steps
    assert f"metrics.jsonl holds every row up to step {steps[-1]} and the last complete checkpoint" in r.stderr
    _, rows = train(run, "train.max_steps=4")  # resumable: from step-2, its later rows dropped
    assert [row["step"] for row in rows] == [1, 2, 3, 4]


def test_no_room_for_hydras_own_files_is_one_line_and_undone(tmp_path):
    """Hydra writes .hydra/*.yaml before the task starts: a file-size limit there
    (as a full disk) was an OSError traceback through Hydra. Now one line, exit
    2, and the new run directory is removed again."""
    run = tmp_path / "parent" / "run"
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), *TINY, "train.max_steps=1", f"hydra.run.dir={run}"],
                       capture_output=True, text=True, timeout=300,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (600, resource.RLIM_INFINITY)))
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith(f"mptrain: disk error: Hydra could not write its .hydra/ files in {run}: "
                               "File too large; raise the file-size limit (ulimit -f)"), r.stderr
    assert not run.exists()
