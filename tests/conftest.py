"""Shared test helpers: compose a real Hydra config, train in-process, read the run dir."""
from __future__ import annotations

import functools
import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import mptrain.config.schema  # noqa: F401  registers the schema in Hydra's ConfigStore

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "mptrain" / "configs"  # package data (mptrain.config.checks.CONFIG_DIR)

# Tiny and fast: byte tokenizer (no BPE training), gpt-nano, 8 sequences of 64 tokens.
# A suite started as a shell's background job (``pytest &``, nohup, CI runners) starts with
# SIGINT ignored, and every process it spawns inherits that: the tests that press Ctrl-C on a
# run would see nothing happen. Start from a terminal's handler instead (Python's own
# KeyboardInterrupt), which the children then start from too.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

TINY = [
    "model=gpt-nano",
    "data.tokenizer=byte",
    "data.max_chars=300000",
    "train.global_batch_size=8",
    "train.eval_every=0",
    "train.eval_tokens=4096",  # when a test turns evaluation on: 64 windows, not the default 256
    "train.log_every=1",
    "log.progress=false",
    "log.tensorboard=false",
    "optim.warmup_steps=5",
    "checkpoint.at_end=false",  # the default saves at the end; tests that need it ask for it
]


@pytest.fixture(scope="session", autouse=True)
def _hermetic_cache(tmp_path_factory):
    """Tokenizers and token caches go to a per-session folder, not ~/.cache."""
    os.environ["MPTRAIN_CACHE"] = str(tmp_path_factory.mktemp("mptrain-cache"))
    os.environ.setdefault("WANDB_SILENT", "true")
    # Tests are offline: the hub is never contacted (a hub name must be in the local cache).
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    # The GELU kernel (two kernels, one function, not the same bits) is chosen here, in this
    # process, before any test starts a subprocess: every run of the session, in this process
    # or launched from it, then reads the one kept choice (mptrain/model/common.py).
    from mptrain.model.common import cpu_gelu_kernel

    cpu_gelu_kernel.cache_clear()
    cpu_gelu_kernel()
    yield


def make_cfg(*overrides: str, tiny: bool = True):
    from mptrain.config.checks import expand_shorthands

    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose(config_name="config", overrides=expand_shorthands([*(TINY if tiny else []), *overrides]))


def make_plan(*overrides: str, tiny: bool = True, world: int = 1):
    """The plan (``mptrain/plan/``) of a composed config, as a run on ``world`` ranks would make it."""
    from mptrain.plan.build import build_plan
    from mptrain.plan.plan import Launch

    return build_plan(make_cfg(*overrides, tiny=tiny), Launch.planned(world))


def read_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train(run_dir: Path, *overrides: str, tiny: bool = True):
    """Run in this process; returns (summary, metrics rows)."""
    from mptrain.run.trainer import run

    summary = run(make_cfg(*overrides, tiny=tiny), run_dir=run_dir)
    return summary, read_rows(run_dir)


@functools.cache
def load_script(name: str):
    """``scripts/<name>.py`` as a module (the scripts are not a package), loaded once."""
    spec = importlib.util.spec_from_file_location(f"{name}_script", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_cli(*args: str, timeout: int = 300, env: dict | None = None, cwd: Path | None = None):
    """``python train.py ...`` as a user types it."""
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd or ROOT, env={**os.environ, **(env or {})})


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """parallel=none on the distributed tests' global batch, one run per precision (shared)."""
    from .test_distributed import COMMON

    out = {}
    for p in ("fp32", "bf16", "fp16"):
        _, rows = train(tmp_path_factory.mktemp(f"ref-{p}") / "run", *COMMON, f"precision={p}", tiny=False)
        out[p] = rows
    return out


@pytest.fixture(scope="session")
def two_rank_jobs(tmp_path_factory):
    """``two_rank_jobs(wrapper)`` -> {case: job directory}: every 2-rank case of
    ``test_distributed.CASES`` (and each wrapper's extra ones) under ddp, fsdp and fsdp1,
    as jobs of ONE torchrun launch, started on first use and shared by every file that
    reads a two-rank run. A failed launch fails every test that reads it, without
    relaunching."""
    from .test_distributed import launch_every_wrapper

    launch: list = []

    def jobs(wrapper: str) -> dict:
        if not launch:
            try:
                launch.append(launch_every_wrapper(tmp_path_factory.mktemp("two-ranks")))
            except Exception as e:  # remembered: the next test fails at once, with the same cause
                launch.append(e)
        if isinstance(launch[0], Exception):
            raise launch[0]
        return launch[0][wrapper]

    return jobs


@pytest.fixture(scope="session")
def four_rank_jobs(tmp_path_factory):
    """{case: job directory} of every 4-rank case of ``test_mesh.CASES``,
    ``test_mesh_observe.CASES`` (prefixed ``obs-``) and ``test_expert_parallel.CASES``
    (prefixed ``ep-``), as jobs of ONE torchrun launch shared by the three files: 4 processes importing torch and
    joining a group cost more than most of the tiny runs. A failed launch fails
    every test that reads it (pytest keeps a fixture's error), without relaunching."""
    from .test_distributed import sweep
    from .test_expert_parallel import CASES as EXPERTS
    from .test_expert_parallel import chain_first_leg
    from .test_mesh import CASES as MESH
    from .test_mesh_observe import CASES as OBSERVE

    first = tmp_path_factory.mktemp("ep-chain-first")
    experts = {**EXPERTS, **chain_first_leg(first)}  # a job resumes a one-process run made here
    cases = {**MESH, **{f"obs-{k}": v for k, v in OBSERVE.items()}, **{f"ep-{k}": v for k, v in experts.items()}}
    return {**sweep(tmp_path_factory.mktemp("four-ranks"), cases, nproc=4), "ep-chain-first": first}
