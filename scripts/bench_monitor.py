"""What the numerics monitor costs: the same run with the monitor off and at a cadence.

    python scripts/bench_monitor.py [overrides...]      (default: model=gpt-mini precision=fp32, 300 steps)

Prints training tokens/s (evaluation and checkpointing excluded; logging and
the monitor's own work included) for each setting and the monitor's overhead.
Each setting runs twice, interleaved, and the faster run counts, to damp
noise from a shared machine.
"""
from __future__ import annotations

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hydra import compose, initialize_config_dir  # noqa: E402

import mptrain.config  # noqa: E402,F401
from mptrain.trainer import run  # noqa: E402

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
DEFAULTS = ["model=gpt-mini", "precision=fp32", "train.max_steps=300", "train.eval_every=0",
            "log.progress=false", "log.tensorboard=false"]


def tokens_per_s(overrides: list[str]) -> float:
    with initialize_config_dir(config_dir=CONFIGS, version_base="1.3"):
        cfg = compose("config", overrides=[*DEFAULTS, *overrides])
    with tempfile.TemporaryDirectory() as d:
        return run(cfg, run_dir=d)["perf/tokens_per_s"]


def main() -> None:
    user = sys.argv[1:]
    settings = {"monitor off": ["monitor.enabled=false"], "monitor every 50 (default)": [],
                "monitor every 10": ["monitor.every=10"]}
    best = {k: 0.0 for k in settings}
    for _ in range(2):
        for name, ov in settings.items():
            best[name] = max(best[name], tokens_per_s([*ov, *user]))
    base = best["monitor off"]
    print(f"\nbench_monitor: {' '.join(DEFAULTS + user)}")
    for name, tps in best.items():
        print(f"  {name:<28} {tps:10,.0f} tokens/s   overhead {100 * (base / tps - 1):+5.1f}%")


if __name__ == "__main__":
    main()
