"""A run directory removed while its run trains (``rm -rf`` of a live run): one line,
exit code 2, and nothing made again in its place. Appends to the removed
metrics.jsonl and train.log would succeed into files no longer in any directory, and
a checkpoint's mkdir would make the directory again, so the run checks for its lock
file before each row and each save; TensorBoard's failed write says the same."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from mptrain.core import files
from mptrain.run.metrics import Metrics
from mptrain.run.rundir import RunDirGone, held, writing

from .conftest import ROOT, TINY, make_cfg


def _gone_line(run) -> str:
    return (f"the run directory {run} was removed while the run was training; nothing more can be saved there, so "
            "the run stopped. Start it again (the records and checkpoints that were in that directory went with it).")


def test_a_run_directory_removed_between_checkpoints_stops_the_run_in_one_line(tmp_path):
    """The process's view: removed once step-3 is saved (waited for on the file, the run
    frozen with SIGSTOP while it goes, so no save is cut in half), the run stops at its next
    save (step 6) with exit code 2 and one line, instead of training on into a directory
    its checkpoints make again."""
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *TINY, "precision=fp32", "train.max_steps=20",
         "train.log_every=1000", "checkpoint.every=3", "log.tensorboard=true", f"hydra.run.dir={run}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 240
        while not (run / "checkpoints" / "step-3").is_dir():  # published by one rename: whole when seen
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.02)
        proc.send_signal(signal.SIGSTOP)
        shutil.rmtree(run)
        proc.send_signal(signal.SIGCONT)
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert (proc.returncode, err.splitlines()) == (2, [f"mptrain: run directory removed: {_gone_line(run)}"]), out
    assert not run.exists()


def test_writes_into_a_removed_run_directory_say_so(tmp_path):
    """In this process: the next metrics row and a record replaced whole (summary.json)
    both raise the one-line error; closing the sinks afterwards stays quiet."""
    run = tmp_path / "run"
    with held(run):
        metrics = Metrics(run, make_cfg("log.tensorboard=true").log, 10, True)
        metrics.log(1, {"train/loss": 2.5})
        shutil.rmtree(run)
        with pytest.raises(RunDirGone) as e:
            metrics.log(2, {"train/loss": 2.4})
        assert str(e.value) == _gone_line(run)
        with pytest.raises(RunDirGone), writing(run):
            files.write_json(run / "summary.json", {})
        metrics.close()
    assert not run.exists()
