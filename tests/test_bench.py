"""scripts/bench.py runs and prints every column (no timing assertions: speed is a benchmark's job)."""
from __future__ import annotations

import importlib.util
import sys

from .conftest import ROOT


def test_bench_prints_the_table(monkeypatch, capsys):
    """bench.py's ``main`` in this process, with the command line a user would type:
    nothing in it depends on being a fresh process (it trains through
    ``mptrain.trainer.run`` like the in-process tests), and a new one would only add
    the start-up."""
    spec = importlib.util.spec_from_file_location("bench_script", ROOT / "scripts" / "bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(sys, "argv", ["bench.py", "model=gpt-nano", "data.tokenizer=byte", "data.max_chars=300000",
                                      "train.global_batch_size=8", "train.peak_tflops=1.0", "--steps", "3",
                                      "--repeats", "1"])
    bench.main()
    out = capsys.readouterr().out
    for col in ("tokens/s", "step ms", "MFU", "RSS GiB*", "vs bare"):
        assert col in out, col
    rows = [line for line in out.splitlines() if line.strip().startswith(("harness", "bare"))]
    assert len(rows) == 3
    for line in rows:
        cells = line.split()
        assert cells[-1].replace(".", "").isdigit() and cells[-3].endswith("%")  # ratio and MFU are numbers
    assert rows[-1].split()[-1] == "1.000"  # the bare loop is the reference
    assert "every setting eager" in out  # like with like: no compiled harness against an eager bare loop
