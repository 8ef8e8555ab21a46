"""mptrain installs the ordinary way: the wheel built from this checkout holds every
config, and installed from it (not editable) its commands run from any directory,
on the installed copy's code and configs. What a run imports at start-up leaves
out the extras (wandb, datasets with pyarrow and pandas) that only W&B and
``data=hf`` need."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from .conftest import ROOT

PIP_ENV = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}


def _build_wheel(tmp_path: Path) -> Path:
    """The wheel of this checkout, built from a copy of it: an in-tree build would
    write build/ and mptrain.egg-info/ into the checkout."""
    src = tmp_path / "src"
    shutil.copytree(ROOT / "mptrain", src / "mptrain", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                        "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300,
                       env=PIP_ENV)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("mptrain-*.whl")
    return wheel


def test_the_wheel_installs_and_its_commands_run_outside_the_checkout(tmp_path):
    wheel = _build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as z:
        held = set(z.namelist())
        (meta,) = [n for n in held if n.endswith(".dist-info/METADATA")]
        requires = [line.split(":", 1)[1].strip() for line in z.read(meta).decode().splitlines()
                    if line.startswith("Requires-Dist:")]
    # The embedded default needs neither W&B nor datasets: each is an extra, and dev (the
    # README's install for the test suite) brings both.
    for package, extra in (("wandb", "wandb"), ("datasets", "hf")):
        markers = {r.partition(";")[2].replace(" ", "") for r in requires if r.startswith(package)}
        assert markers == {f'extra=="{extra}"', 'extra=="dev"'}, (package, requires)
    configs = {p.relative_to(ROOT).as_posix() for p in (ROOT / "mptrain" / "configs").rglob("*.yaml")}
    assert len(configs) > 50 and "mptrain/configs/config.yaml" in configs
    assert configs <= held, sorted(configs - held)
    assert {"mptrain/train.py", "mptrain/run/startup.py", "mptrain/run/launch.py"} <= held

    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--target",
                        str(site), str(wheel)], capture_output=True, text=True, timeout=300, env=PIP_ENV)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    # A preset only the installed copy has: the command that composes it ran that copy's code on its configs.
    shutil.copy(site / "mptrain" / "configs" / "model" / "gpt-nano.yaml",
                site / "mptrain" / "configs" / "model" / "gpt-installed.yaml")

    elsewhere = tmp_path / "elsewhere"  # no checkout here or above: the install alone is on the path
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}
    commands = {
        # what a run imports: its extras (pyproject.toml) must not be among them
        "where": ["-c", "import sys, mptrain, mptrain.train, mptrain.run.trainer; print(mptrain.__file__); "
                        "print(sorted({m.split('.')[0] for m in sys.modules} & {'wandb', 'datasets', 'pyarrow', "
                        "'pandas'}))"],
        "memory": ["-m", "mptrain.memory", "model=gpt-installed"],
        "train": ["-m", "mptrain.train", "model=gpt-installed", "--cfg", "job"],
        "advise": ["-m", "mptrain.advise", "--help"],
        "audit": ["-m", "mptrain.audit", "--help"],
    }
    procs = {name: subprocess.Popen([sys.executable, *args], cwd=elsewhere, env=env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for name, args in commands.items()}  # at once: each spends its time importing torch
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, (name, stderr[-3000:])
        out[name] = stdout
    where, extras_loaded = out["where"].strip().splitlines()
    assert Path(where) == site / "mptrain" / "__init__.py"
    assert extras_loaded == "[]"
    assert "memory per rank: model=gpt-nano" in out["memory"] and "GiB" in out["memory"]
    assert "name: gpt-nano" in out["train"] and "precision:" in out["train"]
    assert "python -m mptrain.advise" in out["advise"] and "python -m mptrain.audit" in out["audit"]
    assert sorted(p.name for p in elsewhere.iterdir()) == []  # --cfg and --help write nothing
