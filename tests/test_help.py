"""``--help`` works everywhere: every command a user types prints its usage and
exits 0, without doing its work (the doctor used to run its probe; the memory
estimator handed ``--help`` to Hydra's override parser and printed a lexer error;
``gpu_wheels.sh --help`` downloaded wheels into .whl/, ``gpu_check.sh --help`` ran the check)."""
from __future__ import annotations

import os
import runpy
import shutil
import subprocess
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
# every script, found rather than listed, so that a new one is covered the day it is added
SCRIPTS = sorted(p.name for p in (ROOT / "scripts").glob("*.py"))
SHELL_SCRIPTS = sorted(p.name for p in (ROOT / "scripts").glob("*.sh"))


def _files_under(root) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


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


@pytest.mark.parametrize("flag", ["--help", "-h"])
@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_prints_its_usage_and_exits_0(script, flag, capsys, monkeypatch, tmp_path):
    path = ROOT / "scripts" / script
    monkeypatch.setattr(sys, "argv", [str(path), flag])
    monkeypatch.chdir(tmp_path)  # anything written to a relative path would land here
    assert _exit_code(lambda: runpy.run_path(str(path), run_name="__main__")) == 0
    out, err = capsys.readouterr()
    assert script in out or "usage" in out.lower(), out
    assert "Traceback" not in out + err and "Exception" not in out + err, err
    assert _files_under(tmp_path) == set()


def test_every_shell_script_prints_its_usage_and_does_nothing_else(tmp_path):
    """``bash scripts/X.sh --help`` / ``-h`` in a real bash, each script copied to a
    folder of its own (they cd to the folder above scripts/, where gpu_wheels.sh
    writes .whl/): the usage on stdout, exit 0, no file written, nothing run.
    PIP_NO_INDEX keeps a script that ignored --help from reaching the network."""
    assert SHELL_SCRIPTS == ["gpu_check.sh", "gpu_wheels.sh"], SHELL_SCRIPTS  # a new one: add what it must not do
    env = {**os.environ, "PIP_NO_INDEX": "1"}
    for script in SHELL_SCRIPTS:
        for flag in ("--help", "-h"):
            root = tmp_path / f"{script}{flag}"
            (root / "scripts").mkdir(parents=True)
            shutil.copy(ROOT / "scripts" / script, root / "scripts" / script)
            before = _files_under(root)
            p = subprocess.run(["bash", str(root / "scripts" / script), flag], capture_output=True, text=True,
                               env=env, timeout=60)
            assert (p.returncode, p.stderr) == (0, ""), (script, flag, p.stdout, p.stderr)
            assert p.stdout.startswith(f"usage: bash scripts/{script}"), (script, flag, p.stdout)
            assert "gpu_check: no CUDA" not in p.stdout and "driver:" not in p.stdout, p.stdout  # the check ran
            assert _files_under(root) == before, (script, flag)  # no .whl/ or anything else


def test_a_command_that_takes_no_arguments_refuses_one_in_one_line(capsys):
    assert doctor.main(["--fast"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("mptrain.doctor: takes no arguments (got --fast); run python -m mptrain.doctor, or "
                           "--help for what it prints."), err


# The commands and scripts whose --help is answered before torch's import: every one, found
# rather than listed (each mptrain/<command>.py with a __main__ block, train.py and scripts/*.py),
# so that a new one is covered the day it is added.
LIGHT_MODULES = tuple(sorted(p.stem for p in (ROOT / "mptrain").glob("*.py")
                             if 'if __name__ == "__main__":' in p.read_text()))
LIGHT_SCRIPTS = ("train.py", *(f"scripts/{s}" for s in SCRIPTS))
_NO_TORCH = r'''
import contextlib, io, os, runpy, sys
def _exit(code):  # mptrain's commands end through os._exit (core/process_exit.py): here, the next one goes on
    raise SystemExit(code)
os._exit = _exit
root, modules, scripts = sys.argv[1], sys.argv[2].split(","), sys.argv[3].split(",")
sys.path.insert(0, root)
for kind, name in [("m", m) for m in modules] + [("s", s) for s in scripts]:
    for flag in ("--help", "-h"):
        sys.argv = [name, flag]
        out = io.StringIO()
        code = None
        with contextlib.redirect_stdout(out):
            try:
                if kind == "m":
                    runpy.run_module(f"mptrain.{name}", run_name="__main__", alter_sys=True)
                else:
                    runpy.run_path(f"{root}/{name}", run_name="__main__")
            except SystemExit as e:
                code = e.code
        assert code in (0, None), (name, flag, code)
        text = out.getvalue()
        assert "usage" in text.lower() or os.path.basename(name).split(".")[0] in text, (name, text[:300])
        assert "torch" not in sys.modules, (name, flag, "imported torch")
print("ok", len(modules) + len(scripts))
'''


def test_help_answers_without_importing_torch():
    """``--help`` / ``-h`` of every ``python -m mptrain.<command>``, train.py and every
    script, run as ``__main__`` one after another in one fresh process: each prints
    its usage and exits 0, and torch is never imported (its import alone took 20 s on a
    busy machine). One process for all of them: a launch per command would add seconds each."""
    assert "train" in LIGHT_MODULES and "scripts/bench.py" in LIGHT_SCRIPTS, (LIGHT_MODULES, LIGHT_SCRIPTS)  # found
    p = subprocess.run([sys.executable, "-c", _NO_TORCH, str(ROOT), ",".join(LIGHT_MODULES), ",".join(LIGHT_SCRIPTS)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0 and p.stdout.strip().endswith(f"ok {len(LIGHT_MODULES) + len(LIGHT_SCRIPTS)}"), p.stderr[-3000:]
