"""The process's start-up state (``mptrain/run/startup.py``): nothing happens on import;
the resolvers, the signal handling and Hydra's error mode come from explicit calls of
one object per process; a refused run directory gets past Hydra's callback runner to
the entry point; a rank above 0 waits for rank 0's line through torchrun's store
instead of sleeping; a stop before training undoes the launch and exits 0; and the
process's end (``mptrain/core/process_exit.py``) does what Python's exit would."""
from __future__ import annotations

import datetime
import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from mptrain.core.errors import ConfigError
from mptrain.distributed.store import TorchrunStore
from mptrain.run.rundir import Claim, RunDirCallback, RunDirError, held
from mptrain.run.startup import REFUSAL_WAIT_S, Agreement, Claims, HydraErrorMode, RunRefused, Startup

from .conftest import ROOT, TINY, run_cli

# Imports every module of the package in a fresh process, then reports what the process looks like.
IMPORT_ALL = """
import importlib, json, os, pkgutil, signal, threading
# SIGINT as this process started with it: Python's KeyboardInterrupt handler, or SIG_IGN
# when the suite runs as a background job (a shell starts those with SIGINT ignored)
sigint_at_start = signal.getsignal(signal.SIGINT)
import mptrain
names = sorted(m.name for m in pkgutil.walk_packages(mptrain.__path__, "mptrain."))
for name in names:
    importlib.import_module(name)
from omegaconf import OmegaConf
print(json.dumps({
    "modules": names,
    "threads": [t.name for t in threading.enumerate()],
    "resolvers": [r for r in ("mptrain_now", "mptrain_new_dir") if OmegaConf.has_resolver(r)],
    "sigterm_default": signal.getsignal(signal.SIGTERM) is signal.SIG_DFL,
    "sigint_default": signal.getsignal(signal.SIGINT) is sigint_at_start,
    "wakeup_fd": signal.set_wakeup_fd(-1),
    "env": [k for k in ("HYDRA_FULL_ERROR", "MPTRAIN_LAUNCH") if k in os.environ],
}))
"""


def test_importing_every_module_registers_nothing_and_starts_nothing():
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "MPTRAIN_LAUNCH")}
    r = subprocess.run([sys.executable, "-c", IMPORT_ALL], capture_output=True, text=True, timeout=300,
                       env={**env, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr[-3000:]
    seen = json.loads(r.stdout.splitlines()[-1])
    assert {"mptrain.train", "mptrain.run.startup", "mptrain.run.launch", "mptrain.run.rundir",
            "mptrain.distributed.store", "mptrain.advise", "mptrain.audit"} <= set(seen["modules"])
    assert seen["resolvers"] == [] and seen["threads"] == ["MainThread"], seen
    assert seen["sigterm_default"] and seen["sigint_default"] and seen["wakeup_fd"] == -1, seen
    assert seen["env"] == [], seen


@pytest.fixture
def resolvers():
    """Each test starts and ends without the resolvers (OmegaConf's registry is
    process-wide: a launch that an earlier test ran in this process registered them)."""
    names = ("mptrain_now", "mptrain_new_dir")
    for name in names:
        OmegaConf.clear_resolver(name)
    yield
    for name in names:
        OmegaConf.clear_resolver(name)


def test_resolvers_come_from_an_explicit_call_with_that_launchs_agreement(tmp_path, monkeypatch, resolvers):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MPTRAIN_LAUNCH", raising=False)
    cfg = OmegaConf.create({"dir": "${mptrain_new_dir:out/${mptrain_now:%Y-%m-%d}/${mptrain_now:%H-%M-%S}}"})
    first = Startup()
    assert not OmegaConf.has_resolver("mptrain_new_dir")  # creating the object registers nothing
    first.register_resolvers()
    a = cfg.dir
    assert cfg.dir == a and Path(a).is_dir()  # agreed once: resolving again is the same directory
    assert first.agreement.created_dirs == [Path(a)]
    second = Startup()  # another launch in the same process: its own directory, never the first's
    second.register_resolvers()
    b = cfg.dir
    assert b != a and Path(b).is_dir() and second.agreement.created_dirs == [Path(b)]
    if Path(b).parent == Path(a).parent and Path(b).name.startswith(Path(a).name):
        assert b == f"{a}-2"  # the same second: the next free suffix
    assert json.loads(os.environ["MPTRAIN_LAUNCH"])[f"dir:out/{second.agreement.stamp():%Y-%m-%d/%H-%M-%S}"] == b


def test_the_resolvers_travel_to_a_submitit_job_with_their_launchs_values(tmp_path, monkeypatch, resolvers):
    """Hydra hands OmegaConf's resolvers to each submitit job by pickling them (cloudpickle,
    as submitit does): they must pickle while the launch holds its signals, and resolve to
    the directory the launching process created."""
    import cloudpickle
    from omegaconf.basecontainer import BaseContainer

    monkeypatch.chdir(tmp_path)
    cfg = OmegaConf.create({"dir": "${mptrain_new_dir:multirun/${mptrain_now:%H-%M-%S}}"})
    with Startup() as launching:
        launching.stop.install()  # a lock and a thread of its own: not part of what the resolvers carry
        launching.register_resolvers()
        made = cfg.dir
        shipped = cloudpickle.loads(cloudpickle.dumps(BaseContainer._resolvers))
    here = BaseContainer._resolvers
    BaseContainer._resolvers = shipped  # what Hydra's Singleton.set_state does in the job's process
    try:
        assert cfg.dir == made  # the launching process's directory, not a second one
    finally:
        BaseContainer._resolvers = here
    assert sorted(p.name for p in (tmp_path / "multirun").iterdir()) == [Path(made).name]


def test_hydra_error_mode_is_set_while_composing_and_a_users_own_is_left_alone(monkeypatch):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    mode = HydraErrorMode()
    mode.raise_while_composing()
    assert os.environ["HYDRA_FULL_ERROR"] == "1" and mode.composing
    mode.give_back()
    assert "HYDRA_FULL_ERROR" not in os.environ and not mode.composing
    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")
    mode.raise_while_composing()
    assert not mode.composing
    mode.give_back()
    assert os.environ["HYDRA_FULL_ERROR"] == "0"


def test_the_stop_before_training_is_installed_and_given_back():
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    running = set(threading.enumerate())  # an earlier test's watchdog may still be on its way out
    startup = Startup()
    startup.stop.install()
    watchdogs = [t for t in threading.enumerate() if t.name == "mptrain-stop-watch" and t not in running]
    assert len(watchdogs) == 1 and signal.getsignal(signal.SIGTERM) is not before[signal.SIGTERM]
    startup.close()
    assert {sig: signal.getsignal(sig) for sig in before} == before
    watchdogs[0].join(timeout=10)
    assert not watchdogs[0].is_alive() and signal.set_wakeup_fd(-1) == -1


def test_a_refused_directory_is_raised_past_hydras_callback_runner(tmp_path):
    """Hydra turns a callback's Exception into a warning and writes its files anyway:
    the refusal is a BaseException that reaches the entry point."""
    run_dir = tmp_path / "run"
    holder = Claim(run_dir)
    holder.acquire()
    claims = Claims()
    try:
        with RunDirCallback.lent(claims), pytest.raises(RunRefused) as e:
            RunDirCallback().on_run_start(config=OmegaConf.create({"hydra": {"run": {"dir": str(run_dir)}}}))
    finally:
        holder.release()
    assert not isinstance(e.value, Exception)
    assert isinstance(e.value.error, RunDirError) and "is in use by" in str(e.value.error)
    assert run_dir.resolve() not in claims and RunDirCallback.claims is None


def test_the_claims_are_handed_on_not_looked_up(tmp_path):
    """The claim Hydra's callback takes goes into the claims the launch lent it, and the
    run finds it there (a second lock would be refused by flock, even in this process);
    outside a launch the callback takes none, and a run holds its directory in claims of
    its own."""
    run_dir = tmp_path / "run"
    config = OmegaConf.create({"hydra": {"run": {"dir": str(run_dir)}}})
    RunDirCallback().on_run_start(config=config)  # no launch lent it claims: nothing locked
    assert not run_dir.exists()
    claims = Claims()
    with RunDirCallback.lent(claims):
        RunDirCallback().on_run_start(config=config)
    taken = claims[run_dir.resolve()]
    with held(run_dir, claims) as claim:
        assert claim is taken
    assert not claims and not run_dir.exists()  # released, and undone: the run never started
    with held(run_dir) as claim:  # no launch: claims of its own
        assert claim is not None and (run_dir / ".lock").is_file()
    assert not run_dir.exists()


def test_a_busy_directory_is_refused_in_one_line_before_hydra_writes(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    fd = os.open(run_dir / ".lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another run holds it
        r = run_cli(*TINY, f"hydra.run.dir={run_dir}", cwd=tmp_path)
    finally:
        os.close(fd)
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.splitlines() == [f"mptrain: run directory error: run directory {run_dir} is in use by another "
                                     "process: one run per directory. Wait for that run to end (or stop it), or "
                                     "pick another hydra.run.dir."], r.stderr
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock"]  # no .hydra/, no log


@pytest.fixture
def stores():
    """A real TCPStore as torchrun's agent hosts it; each call, a client of it as one rank has."""
    from torch.distributed import TCPStore

    host = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=30))

    def client() -> TorchrunStore:
        return TorchrunStore(TCPStore("127.0.0.1", host.port, is_master=False,
                                      timeout=datetime.timedelta(seconds=30)), "test-run")

    yield client


def test_the_store_agrees_claims_and_marks(stores, monkeypatch):
    rank0, rank1 = stores(), stores()
    assert not rank1.wait("said", 0.2)  # nothing marked: the wait times out, and says so
    assert rank1.claim("line") and not rank0.claim("line")  # the first claim only
    monkeypatch.setenv("RANK", "0")
    assert rank0.first_value("stamp", lambda: "rank 0's") == "rank 0's"
    assert rank0.first_value("stamp", lambda: "a restart's") == "rank 0's"  # kept across restarts
    rank0.mark("said")
    monkeypatch.setenv("RANK", "1")
    assert rank1.wait("said", 5) and rank1.first_value("stamp", lambda: "rank 1's") == "rank 0's"


def test_a_rank_above_0_waits_for_rank_0s_line_instead_of_sleeping(stores, monkeypatch, capsys):
    """A refused command line under torchrun: rank 0 prints it and marks it said; a rank
    above 0 prints nothing and leaves once the mark is there, not after a fixed sleep."""
    error = ConfigError("Unknown config key 'precison'.")
    monkeypatch.setenv("RANK", "1")
    waiting = Startup(Agreement(connect=stores))
    done = threading.Event()
    threading.Thread(target=lambda: (waiting.refuse(error), done.set()), daemon=True).start()
    assert not done.wait(1.0)  # rank 0 has not spoken: rank 1 is still waiting
    monkeypatch.setenv("RANK", "0")
    assert Startup(Agreement(connect=stores)).refuse(error) == 2
    said = time.monotonic()
    assert done.wait(REFUSAL_WAIT_S) and time.monotonic() - said < REFUSAL_WAIT_S / 2  # woken by the mark
    assert capsys.readouterr().err == "mptrain: configuration error: Unknown config key 'precison'.\n"


def test_a_stop_before_training_undoes_the_launch_and_exits_0(tmp_path):
    """SIGTERM while the run trains its tokenizer (before its first step): exit 0 with
    one line, and no trace of the launch (not even the outputs/<date>/ made for it)."""
    log = tmp_path / "launch.log"
    cmd = [sys.executable, str(ROOT / "train.py"), *TINY, "data.tokenizer=bpe", "data.bpe_vocab_size=613"]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 240
    while "613-token byte-level BPE" not in log.read_text():
        assert proc.poll() is None, f"exited {proc.returncode} before it trained its tokenizer:\n{log.read_text()}"
        assert time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(0.02)
    assert list((tmp_path / "outputs").glob("*/*/.lock"))
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0, log.read_text()[-4000:]
    said = log.read_text()
    assert "mptrain: stopped by SIGTERM before training started: nothing was written" in said, said[-3000:]
    assert "Traceback" not in said and not (tmp_path / "outputs").exists(), said[-3000:]


# A process that leaves through core/process_exit.py with work still pending at exit.
LEAVE = """
import atexit, sys, threading, time
from mptrain.core.process_exit import leave, run_then_leave
out = sys.argv[1]
atexit.register(lambda: open(out + "/atexit", "w").write("ran"))
def late():
    time.sleep(0.3)
    open(out + "/thread", "w").write("finished")
threading.Thread(target=late).start()  # not a daemon: Python's exit waits for it, so must leave()
sys.stdout.write("no newline, still buffered")
buffered = open(out + "/closed-by-handler", "w")
atexit.register(buffered.close)
buffered.write("written")
if sys.argv[2] == "raise":
    run_then_leave(lambda: sys.exit("a message for stderr"))
leave(int(sys.argv[2]))
"""


@pytest.mark.parametrize("how, code", [("3", 3), ("0", 0), ("raise", 1)])
def test_leaving_does_what_pythons_exit_does(tmp_path, how, code):
    """Threads finish, atexit handlers run (in the order Python runs them), buffered
    output reaches the pipe, and the code is the one asked for (a non-int as sys.exit
    takes it: printed, status 1)."""
    r = subprocess.run([sys.executable, "-c", LEAVE, str(tmp_path), how], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == code, r.stderr
    assert r.stdout == "no newline, still buffered"
    assert r.stderr == ("a message for stderr\n" if how == "raise" else ""), r.stderr
    assert (tmp_path / "atexit").read_text() == "ran" and (tmp_path / "thread").read_text() == "finished"
    assert (tmp_path / "closed-by-handler").read_text() == "written"
