"""What the numerics monitor costs: the same run with the monitor off and at a cadence.

    python scripts/bench_monitor.py [overrides...]      (default: model=gpt-mini precision=fp32, 300 steps)

Prints training tokens/s (evaluation and checkpointing excluded; logging and
the monitor's own work included) for each setting and the monitor's overhead;
one setting turns off only ``monitor.stability`` (the attention probe, the
output-logit hook and Adam's figures), to show what those add.

    python scripts/bench_monitor.py --fp8-casts precision=fp8 [overrides...]

instead measures the float8 cast statistics (``fp8stats.CastWatch``) with
every step monitored, where their cost shows: monitor off, then monitored
with the statistics off, with the run's own casts only, and with the what-if
recipes too (the default).
Each setting runs twice, interleaved, and the faster run counts, to damp
noise from a shared machine. One banner comes first and one progress line per
run (as in ``scripts/bench.py``); the harness's own banner and messages are
hidden, its warnings passed on once.
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench.py's progress line and quiet runs

import torch  # noqa: E402
from bench import Progress, configured, following, machine, quiet_harness  # noqa: E402
from mptrain.config.checks import compose_checked  # noqa: E402
from mptrain.run.trainer import run  # noqa: E402

from mptrain.config.checks import CONFIG_DIR as CONFIGS  # noqa: E402  (mptrain/configs/, shipped in the package)
DEFAULTS = ["model=gpt-mini", "precision=fp32", "train.max_steps=300", "train.eval_every=0",
            "log.progress=false", "log.tensorboard=false", "checkpoint.at_end=false"]  # not what is measured
SETTINGS = {"monitor off": ["monitor.enabled=false"], "monitor every 50 (default)": [],
            "every 50, stability off": ["monitor.stability=false"],  # what the stability/* figures add
            "monitor every 10": ["monitor.every=10"]}
FP8_SETTINGS = {"monitor off": ["monitor.enabled=false"],  # --fp8-casts: what the fp8.* figures add
                "every step, fp8 casts off": ["monitor.every=1", "monitor.fp8_casts=false"],
                "every step, own casts only": ["monitor.every=1", "monitor.fp8_whatif=[]"],
                "every step, casts + what-ifs": ["monitor.every=1"]}


def compose_cfg(overrides: list[str]):
    """The run's config: DEFAULTS, then ``overrides`` (checked as train.py checks its own)."""
    return compose_checked([*DEFAULTS, *overrides], CONFIGS)


def tokens_per_s(overrides: list[str], progress: Progress) -> tuple[float, list[str]]:
    """One harness run, quiet, its steps reported to ``progress``: (tokens/s, its warning lines)."""
    cfg = compose_cfg(overrides)
    with tempfile.TemporaryDirectory() as d, following(Path(d) / "metrics.jsonl", progress), \
            quiet_harness(False) as warnings:
        tps = run(cfg, run_dir=d)["perf/tokens_per_s"]
    return tps, warnings


def fastest(names: list[str], repeats: int, steps: int, width: int,
            overrides: Callable[[str], list[str]]) -> dict[str, float]:
    """Each setting of ``names`` run ``repeats`` times, interleaved, with its
    ``overrides(name)``: one progress line per run, each new harness warning
    shown once, and the fastest tokens/s of each setting returned."""
    best = dict.fromkeys(names, 0.0)
    order = [name for _ in range(repeats) for name in names]
    seen: set[str] = set()
    for k, name in enumerate(order, 1):
        progress = Progress(sys.stdout, f"  [{k}/{len(order)}] {name:<{width}}", steps)
        try:
            tps, warnings = tokens_per_s(overrides(name), progress)
        except BaseException:
            progress.abandon()
            raise
        progress.finish(f"{tps:,.0f} tokens/s")
        for w in [w for w in warnings if w not in seen]:
            seen.add(w)
            print(f"    harness {w}")
        best[name] = max(best[name], tps)
    return best


def main() -> None:
    """Banner, each run with its progress line, then one line per setting."""
    user = sys.argv[1:]
    if any(a in ("-h", "--help") for a in user):
        print(__doc__)
        return
    fp8 = "--fp8-casts" in user
    user = [a for a in user if a != "--fp8-casts"]
    cfg, device = configured(compose_cfg, user, "bench_monitor")
    if fp8 and not cfg.precision.fp8.enabled:
        sys.exit("bench_monitor: --fp8-casts measures the float8 cast statistics; add precision=fp8 "
                 "(or another float8 preset).")
    settings = FP8_SETTINGS if fp8 else SETTINGS
    print(f"bench_monitor: {' '.join(DEFAULTS + user)} | {len(settings)} settings x 2, interleaved\n"
          f"  machine  {machine(device)} | torch {torch.__version__}", flush=True)
    best = fastest(list(settings), 2, cfg.train.max_steps, 28, lambda name: [*settings[name], *user])
    base = best["monitor off"]
    print(f"\nbench_monitor: {' '.join(DEFAULTS + user)}")
    for name, tps in best.items():
        print(f"  {name:<28} {tps:10,.0f} tokens/s   overhead {100 * (base / tps - 1):+5.1f}%")


if __name__ == "__main__":
    main()
