"""A multirun sweep runs every job whatever the others' outcomes, and ends with a table of them.

One real ``python train.py -m`` of three tiny jobs, swept over ``debug.nan_in_module``:
no fault (the job finishes), a module the model does not have (a user error that the
command-line check cannot see: only the built model knows its modules) and a NaN
planted at step 1 with ``train.on_nonfinite=abort`` (numerics stop the job).
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

from mptrain.run.launch import launch

from .conftest import TINY, run_cli

SWEPT = ["debug.nan_in_module=null", "debug.nan_in_module=blocks.9.attn", "debug.nan_in_module=blocks.0.attn"]
OUTCOMES = [("ok", "0"), ("user error", "2"), ("numerics stop", "3")]


def _table_rows(text: str) -> list[list[str]]:
    """The body rows of the markdown table in ``text``, as lists of stripped cells."""
    rows = [line.strip().strip("|").split("|") for line in text.splitlines() if line.startswith("|")]
    return [[c.strip() for c in row] for row in rows[2:]]


def test_a_failing_job_neither_stops_the_sweep_nor_goes_unsaid(tmp_path):
    r = run_cli("-m", *TINY, "train.max_steps=3", f"debug.nan_in_module=null,blocks.9.attn,blocks.0.attn",
                "debug.nan_at_steps=[1]", "train.on_nonfinite=abort", cwd=tmp_path)
    # the worst outcome is the sweep's: a user error (2) outranks a numerics stop (3)
    assert r.returncode == 2, (r.returncode, r.stdout[-3000:], r.stderr[-3000:])
    sweeps = [p for p in (tmp_path / "multirun").glob("*/*") if p.is_dir()]
    assert len(sweeps) == 1, sweeps
    sweep = sweeps[0]
    # every job ran: the first finished, the third trained until numerics stopped it
    assert (sweep / "0" / "summary.json").is_file()
    assert (sweep / "2" / "metrics.jsonl").is_file() and not (sweep / "2" / "summary.json").exists()
    # the refused job leaves nothing behind, its lock file included (Hydra had made the directory for it)
    assert not (sweep / "1").exists(), sorted(p.name for p in (sweep / "1").iterdir())
    # each job's line was said when it ended, once
    assert r.stderr.count("mptrain: configuration error: debug.nan_in_module='blocks.9.attn'") == 1, r.stderr
    assert r.stderr.count("mptrain: training stopped: step 2") == 1, r.stderr
    # the table, in the sweep directory and at the end of the output
    rows = _table_rows((sweep / "outcomes.md").read_text())
    assert [row[:4] for row in rows] == [[str(i), s, o, c] for i, (s, (o, c)) in enumerate(zip(SWEPT, OUTCOMES))]
    assert rows[1][4].startswith("configuration error: debug.nan_in_module='blocks.9.attn'"), rows[1]
    assert rows[2][4].startswith("training stopped: step 2"), rows[2]
    tail = r.stdout[r.stdout.rindex("job | overrides"):].splitlines()
    for line, (swept, (outcome, code)) in zip(tail[2:5], zip(SWEPT, OUTCOMES), strict=True):
        assert [c.strip() for c in line.split(" | ")[1:4]] == [swept, outcome, code], line
    summary = [line for line in r.stdout.splitlines() if line.startswith("sweep ")]
    assert summary and summary[-1].endswith(
        "3 jobs: 1 ok, 1 user error, 1 numerics stop; exit code 2 (the worst outcome)"), summary
    assert str(Path(sweep.relative_to(tmp_path)) / "outcomes.md") in r.stdout


def test_a_signal_stops_the_sweep_at_the_job_it_reached(tmp_path, capsys):
    """Ctrl-C asks the whole command to stop: the job it reaches saves and stops, no later job
    starts, and the table says so. In this process (a real SIGINT to it), to spare a start-up."""
    sweep = tmp_path / "sweep"
    metrics = sweep / "0" / "metrics.jsonl"

    def interrupt_once_training():
        deadline = time.monotonic() + 300
        while not (metrics.exists() and metrics.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGINT)

    sender = threading.Thread(target=interrupt_once_training)
    sender.start()
    code = launch(["-m", *TINY, "train.max_steps=400", "train.seed=1,2", f"hydra.sweep.dir={sweep}"])
    sender.join()
    out = capsys.readouterr().out
    assert code == 0, out[-3000:]
    summary = json.loads((sweep / "0" / "summary.json").read_text())
    assert summary["stopped_early"] == "SIGINT" and summary["steps"] < 400, summary
    assert not (sweep / "1").exists()  # the second job never started
    rows = _table_rows((sweep / "outcomes.md").read_text())
    # one job in the table, so no override varies: the table shows them all
    assert rows[0][1].endswith("train.seed=1") and rows[0][2:4] == ["stopped (SIGINT)", "0"], rows
    assert rows[0][4] == f"stopped by SIGINT at step {summary['steps']} (checkpoint saved)", rows
    assert f"the sweep stopped at job 0: SIGINT asked the command to stop; the later jobs did not run" in out, out
