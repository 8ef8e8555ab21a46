"""``--help`` works everywhere: every command a user types prints its usage and
exits 0, without doing its work (the doctor used to run its probe; the memory
estimator handed ``--help`` to Hydra's override parser and printed a lexer error)."""
from __future__ import annotations

import runpy
import sys

import pytest

from mptrain import advise, audit, doctor, formats, memory, sample

from .conftest import ROOT

COMMANDS = {  # name -> main(argv), returning an exit code or raising SystemExit
    "mptrain.doctor": doctor.main,
    "mptrain.memory": memory.main,
    "mptrain.audit": audit.main,
    "mptrain.formats": formats.main,
    "mptrain.sample": lambda argv: sample.main(argv),
    "mptrain.advise": advise.main,
}
SCRIPTS = ["export_hf.py", "compare.py", "bench.py", "prepare_data.py", "bench_monitor.py", "bench_checkpoint.py",
           "bench_nanogpt.py", "gpu_check.py", "bench_precision.py", "fp4_grad_noise.py", "rope_error.py"]


def _exit_code(call) -> int:
    try:
        code = call()
    except SystemExit as e:
        code = e.code
    if isinstance(code, dict):  # runpy's globals: a script that ended without sys.exit
        code = None
    return 0 if code is None else code


@pytest.mark.parametrize("flag", ["--help", "-h"])
@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_prints_its_usage_and_exits_0(name, flag, capsys):
    assert _exit_code(lambda: COMMANDS[name]([flag])) == 0
    out, err = capsys.readouterr()
    assert f"python -m {name}" in out, out  # its own usage line
    assert "Exception" not in out + err and "mptrain:" not in err, err
    assert "measured 512x512" not in out and "memory per rank: model=" not in out  # the usage, not the work


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_prints_its_usage_and_exits_0(script, capsys, monkeypatch):
    path = ROOT / "scripts" / script
    monkeypatch.setattr(sys, "argv", [str(path), "--help"])
    assert _exit_code(lambda: runpy.run_path(str(path), run_name="__main__")) == 0
    out, err = capsys.readouterr()
    assert script in out or "usage" in out.lower(), out
    assert "Traceback" not in out + err and "Exception" not in out + err, err


def test_a_command_that_takes_no_arguments_refuses_one_in_one_line(capsys):
    assert doctor.main(["--fast"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("mptrain.doctor: takes no arguments (got --fast); run python -m mptrain.doctor, or "
                           "--help for what it prints."), err
