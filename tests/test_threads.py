"""The thread count as part of the run (train.threads): recorded in run_info, the
banner and summary.json; compared on resume by the count in use, refused where a
CPU run's bf16/fp16 bits depend on it; the busy-machine line, decided from given
load, steal and timings (nothing here depends on this machine being idle or busy,
nor on how fast a thread count is); the CPU kind as the README's table names it."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from .conftest import ROOT, make_plan, train
from mptrain.core.machine import (CPU_KINDS, FEWER_THREADS_AT, Load, cpu_kind, cpu_kind_text, seconds_at_threads,
                                  threads_notice, use_threads)
from mptrain.run.resume import ResumeRefused, compare, threads_guard

BUSY, IDLE = Load(5.5, 2, 0.0), Load(1.2, 2, 0.01)
TIMED = {2: 0.250, 1: 0.006}  # the 2-thread forward pass 40x the 1-thread one, as a shared 2-core host gave it


def test_the_busy_line_from_given_figures():
    assert threads_notice(IDLE, 2, TIMED, "its forward pass") is None  # nothing competes: nothing said
    line = threads_notice(BUSY, 2, TIMED, "its forward pass", bits=", in a new run")
    assert line == ("busy machine: the load average 5.50 is above the 2 cores this process may use, so other "
                    "processes compete for them; this uses 2 threads; its forward pass measured 250.0 ms at 2 "
                    "threads, 6.0 ms at 1: 1 thread is 41.7x faster now (train.threads=1, in a new run)")
    assert threads_notice(BUSY, 2, TIMED, "x", short=True) == (
        "busy: load 5.50 on 2 cores, 1 thread measured 41.7x faster (train.threads=1)")
    # steal alone makes it busy, and the progress line names it
    assert threads_notice(Load(0.5, 2, 0.2), 2, TIMED, "x", short=True).startswith("busy: load 0.50 on 2 cores, steal 20%")
    # one thread suggested only where it measured FEWER_THREADS_AT faster
    close = {2: 0.010, 1: 0.010 * FEWER_THREADS_AT * 0.99}
    assert threads_notice(BUSY, 2, close, "x").endswith(": no faster on 1 thread, keep 2")
    assert threads_notice(BUSY, 2, close, "x", short=True).endswith(", 1 thread no faster")
    assert threads_notice(BUSY, 2, None, "x").endswith("this uses 2 threads; one thread was not measured here")
    assert threads_notice(BUSY, 1, None, "x").endswith("this uses 1 thread already (the fewest)")


def test_threads_are_set_for_the_block_and_given_back():
    before = torch.get_num_threads()
    with use_threads(1) as n:
        assert n == torch.get_num_threads() == 1
        t = seconds_at_threads(lambda: torch.ones(8) @ torch.ones(8), (2, 1), rounds=1)
        assert set(t) == {1, 2} and min(t.values()) > 0 and torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with use_threads(0) as n:  # 0: torch's choice, untouched
        assert n == before
    with pytest.raises(Exception, match="train.threads=-1"):
        with use_threads(-1):
            pass


def test_cpu_kind_is_the_readme_row():
    readme = (ROOT / "README.md").read_text()
    for _vendor, row, _has, _lacks in CPU_KINDS:
        assert f"| {row} |" in readme, row  # the doctor names the table's rows verbatim
    intel = {"avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile"}
    assert cpu_kind(intel, "GenuineIntel") == "Intel Xeon | avx512_bf16, avx512_fp16, AMX"
    assert cpu_kind({"avx2", "fma", "avx512f", "avx512_bf16"}, "AuthenticAMD") == (
        "AMD EPYC | avx512f, avx512_bf16; no avx512_fp16, no AMX")
    assert cpu_kind({"avx2", "fma"}, "AuthenticAMD") == "AMD EPYC | avx2, fma; no avx512"
    assert cpu_kind({"avx2", "fma"}, "GenuineIntel") is None  # an Intel desktop is not the AMD row
    assert cpu_kind({"avx2", "fma", "avx512f"}, "AuthenticAMD") is None  # avx512 without bf16: no row
    assert cpu_kind_text({"neon"}, "ARM").startswith("unknown: not a row of the README's per-kind table (ARM; none of")
    assert cpu_kind_text() == (f"{cpu_kind()} (a row of the README's per-kind table)" if cpu_kind()
                               else cpu_kind_text())  # this machine: one or the other, whatever its kind


def test_which_runs_guard_the_count():
    assert threads_guard(make_plan("precision=fp32"), "cpu") == {}  # fp32: recorded, not refused
    assert threads_guard(make_plan("precision=bf16"), "cuda") == {}  # the math is on the device
    for precision in ("bf16", "fp16", "fp8"):
        assert "train.threads" in threads_guard(make_plan(f"precision={precision}"), "cpu"), precision
    saved, now = {"train": {"threads": 2}}, {"train": {"threads": 1}}
    guard = threads_guard(make_plan("precision=bf16"), "cpu")
    assert compare(saved, now, [])[1] == []  # unguarded: accepted into the history
    assert compare(saved, now, [])[0] == {"train.threads": [2, 1]}
    refused = compare(saved, now, [], guard=guard)[1]
    assert refused == ["train.threads: 2 -> 1 (the count in use; a CPU's bf16 matmuls round by how they split "
                       "over threads)"]
    assert compare(saved, now, ["train.threads"], guard=guard) == ({"train.threads": [2, 1]}, [])


def test_a_run_records_its_threads_and_a_bf16_resume_refuses_another_count(tmp_path: Path):
    before = torch.get_num_threads()
    run = tmp_path / "run"
    args = ["precision=bf16", "train.max_steps=2", "checkpoint.at_end=true"]
    summary, _ = train(run, *args, "train.threads=1")
    assert torch.get_num_threads() == before  # the run gave torch's count back
    info = yaml.safe_load((run / "config.yaml").read_text())["run_info"]["threads"]
    assert info["count"] == 1 and info["setting"] == 1 and info["source"] == "train.threads=1"
    assert summary["threads"] == 1
    assert "| threads 1 (train.threads=1) on " in (run / "train.log").read_text()
    # Another count in bf16 on a CPU: refused, naming the key, unless allowed by name
    with pytest.raises(ResumeRefused, match=r"train.threads: 1 -> 2 \(the count in use"):
        train(run, *args[:1], "train.max_steps=3", "train.threads=2")
    summary, _ = train(run, *args[:1], "train.max_steps=3", "train.threads=2", "resume.allow_changes=[train.threads]")
    assert summary["threads"] == 2 and summary["config_history"][0]["changes"]["train.threads"] == [1, 2]
    assert "train.threads: this launch computes with 2 threads, the steps before 2 with 1" in (
        run / "train.log").read_text()
