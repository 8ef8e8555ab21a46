"""A recorded fp32 loss trace: a silent change in the numerics (init, schedule, model,
data order, loss) fails here. Regenerate deliberately with MPTRAIN_UPDATE_GOLDEN=1
(it writes the file and fails, having checked nothing; then rerun without the variable)."""
from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from .conftest import train

GOLDEN = Path(__file__).parent / "golden" / "fp32_nano_loss.json"


def _corpus(path: Path) -> Path:
    """A deterministic synthetic corpus (independent of the Python version's stdlib)."""
    rng = random.Random(1234)
    words = ["the", "model", "loss", "scale", "gradient", "bf16", "fp16", "step", "skip", "norm",
             "token", "batch", "rank", "shard", "weight", "update", "master", "range", "bits", "mantissa"]
    path.mkdir(parents=True, exist_ok=True)
    for d in range(20):
        lines = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 12))) + "." for _ in range(300)]
        (path / f"doc{d:02d}.txt").write_text("\n".join(lines))
    return path


def test_golden_loss_trace(tmp_path):
    corpus = _corpus(tmp_path / "corpus")
    _, rows = train(tmp_path / "run", "data=text", f"data.paths=[{corpus}]", "data.tokenizer=byte",
                    "precision=fp32", "train.max_steps=20", "train.seed=7")
    trace = [round(r["train/loss"], 6) for r in rows]
    if os.environ.get("MPTRAIN_UPDATE_GOLDEN"):
        # Never compared against what was just written: that would pass whatever the trace is.
        GOLDEN.write_text(json.dumps({"train/loss": trace}, indent=1) + "\n")
        pytest.fail(f"MPTRAIN_UPDATE_GOLDEN is set: wrote {GOLDEN.name} ({len(trace)} steps, last loss {trace[-1]}); "
                    "nothing was checked. Review the diff, then rerun without MPTRAIN_UPDATE_GOLDEN.", pytrace=False)
    golden = json.loads(GOLDEN.read_text())["train/loss"]
    assert len(trace) == len(golden) == 20
    # fp32 on CPU is reproducible to the last bit on one machine; 2e-5 leaves room for
    # a different BLAS build while any real change (init, lr, data order) moves it by >1e-3.
    bad = [(i + 1, a, b) for i, (a, b) in enumerate(zip(trace, golden, strict=True)) if abs(a - b) > 2e-5]
    assert not bad, f"loss trace moved (step, now, golden): {bad[:5]}"
    assert golden[-1] < golden[0] - 1.0
