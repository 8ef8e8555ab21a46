"""The console and train.log: third-party import noise is filtered narrowly,
while warnings (the project's and other libraries') reach both the console and the log."""
from __future__ import annotations

import logging
import subprocess
import sys
import warnings

from mptrain.run.console import RunLog, plain_cadence

from .conftest import ROOT


def test_import_noise_is_filtered_narrowly_and_project_warnings_are_kept(tmp_path, capsys):
    log = RunLog(tmp_path / "train.log")
    log.keep()
    with log.capturing():
        # the messages torchao and torch log at import on a CPU machine: filtered at their loggers
        logging.getLogger("torchao").warning("Failed to load /x/site-packages/torchao/_C_mxfp8.cpython-311-x86_64"
                                             "-linux-gnu.so: Could not load this library")
        logging.getLogger("torchao.kernel.intmm").warning("Warning: Detected no triton, on systems without ...")
        # the same loggers' other messages, and the project's own warnings, pass
        logging.getLogger("torchao").warning("float8 weights disagree across ranks")
        logging.getLogger("mptrain.precision").warning("Failed to load /x/torchao/_C_mxfp8.so: in mptrain's words")
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("bf16 is emulated here", UserWarning, stacklevel=1)
        log.say("step 1 | a console line")
    log.close()
    kept = (tmp_path / "train.log").read_text()
    assert "_C_mxfp8.cpython" not in kept and "no triton" not in kept
    for line in ("WARNING: torchao: float8 weights disagree across ranks",
                 "WARNING: mptrain.precision: Failed to load /x/torchao/_C_mxfp8.so: in mptrain's words",
                 "WARNING: UserWarning: bf16 is emulated here", "step 1 | a console line"):
        assert line in kept, kept
    shown = capsys.readouterr()  # (pytest itself records the UserWarning instead of printing it)
    assert "step 1 | a console line" in shown.out
    assert "_C_mxfp8.cpython" not in shown.err and "no triton" not in shown.err


def test_importing_the_fp8_path_prints_nothing():
    """What a new user saw on every fp8 run: torchao's kernel-loading and Triton messages."""
    code = "import mptrain.run.trainer, mptrain.precision.policy, torchao.float8"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout == "" and r.stderr == "", r.stderr


def test_plain_progress_cadence():
    assert plain_cadence(None, 10, 500) == 30  # ~20 lines, on logging steps
    assert plain_cadence(None, 1, 40) == 2
    assert plain_cadence(7, 5, 500) == 10 and plain_cadence(3, 10, 50) == 10
