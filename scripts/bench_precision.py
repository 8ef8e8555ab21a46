"""Each precision's training speed against fp32's, on this machine.

    python scripts/bench_precision.py [overrides...] [--repeats R] [--only fp32,fp8-emulated,...]
    python scripts/bench_precision.py --casts [--repeats R]

(default: model=gpt-nano, 60 steps, monitor off, 2 repeats). Settings: fp32,
bf16, fp16, fp8 with ``torch._scaled_mm`` and fp8 with the emulated matmul
(``precision.fp8.matmul``), mxfp8, the emulated 4-bit recipes nvfp4 and
mxfp4, and the format lab (``precision=lab``) with its recipes nvfp4, mxfp4
and hybrid_mxfp8_nvfp4 (``lab-*``; ``precision=nvfp4`` and ``mxfp4`` are the
lab's named recipes, so ``lab-nvfp4`` against ``nvfp4`` shows the same code
path, and the lab's hybrid what a mixed recipe costs). Each runs ``--repeats`` times,
interleaved, and the fastest run counts (a shared machine adds time, never
speed). Prints one banner (CPU model and the instruction-set flags that decide
half-precision speed, Python, torch, torchao, date), a progress line per run,
then tokens/s per setting and its ratio to fp32's, what
``precision.fp8.matmul=auto`` would pick here, and the load average and CPU
steal over the runs, with a warning when other processes competed (without
``--repeats``, a machine busy at the start gets twice the runs).

A row that would take too long is capped: once a run has been going for
``--row-budget`` seconds past its first step (default 20), or its pace says it
will, it is stopped at the next step (the trainer's own stop, as on SIGTERM),
its tokens/s over the steps it ran is reported with ``capped`` and the steps
and seconds it was timed on, and that setting is not run again. Such a row is
what the setting costs, not a benchmark of it: on an Intel Xeon whose oneDNN
float8 path is a reference loop, ``fp8-scaled_mm`` ran at 0.009x fp32's
tokens/s and took ten minutes alone before the cap.

The figure the float8 emulation is judged by: fp8 at >= 0.3x fp32's tokens/s
on a CPU whose ``torch._scaled_mm`` is slow. On a CPU without native bf16 the
rest of an fp8 step (attention, the head, under bf16 autocast) is what costs,
whichever matmul the float8 linears use; the bf16 row shows that bound.

The figure the 4-bit emulation is judged by: an nvfp4 step at most ~3x a
bf16 step (``--only fp32,bf16,nvfp4,nvfp4-fp32 model=gpt-mini``); its ratio to
bf16 is printed when both ran. On a CPU without native bf16 the bf16 rest
of the model dominates both; ``nvfp4-fp32`` (the rest in fp32) against fp32
is the emulation's own cost, the same comparison on every CPU.

``--casts`` times one operand cast of each kind of lab spec instead (no
training): float8 per tensor and per row, MX in blocks of 32 (E4M3 and
E2M1), NVFP4's two-level 1x16 blocks, its 16x16 tiles, stochastic rounding,
the 16x16 Hadamard transform, and 4over6, each on the same fp32 tensor of
``--cast-shape`` (default 4096x1024, a gpt-mini activation's size), the
fastest of ``--repeats`` (default 5) calls: milliseconds per cast,
nanoseconds per element, and the ratio to an fp32 copy of the tensor.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import signal
import sys
import time

ROW_BUDGET_S = 20.0
"""Seconds a run may take past its first step before its row is capped (``--row-budget``):
every row of the default runs in a few seconds on a 2-core CPU, so only a pathological
one (a matmul path 100x slower than fp32) comes near it."""


def arguments(settings: str) -> argparse.ArgumentParser:
    """The flags (Hydra overrides are the rest); ``settings``: the names ``--only`` takes.
    Defined before any heavy import, so that ``--help`` answers without loading torch."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=None,
                    help="runs of each setting, interleaved; the fastest counts (default 2, 4 on a busy machine)")
    ap.add_argument("--only", default=settings, help=f"comma-separated settings ({settings.replace(',', ', ')})")
    ap.add_argument("--row-budget", type=float, default=ROW_BUDGET_S,
                    help=f"seconds a run may take past its first step before its row is capped (default {ROW_BUDGET_S:g})")
    ap.add_argument("--casts", action="store_true",
                    help="time one operand cast of each kind of lab spec instead of training (see above)")
    ap.add_argument("--cast-shape", default="4096x1024", help="rows x K of the tensor --casts casts (default 4096x1024)")
    return ap


SETTING_NAMES = ("fp32,bf16,fp16,fp8-scaled_mm,fp8-emulated,mxfp8,nvfp4,mxfp4,nvfp4-fp32,lab-nvfp4,lab-mxfp4,lab-hybrid,"
                 "lab-nvfp4-fp32")
"""SETTINGS' names, for ``--help`` before SETTINGS exists (a test checks they agree)."""

if __name__ == "__main__":
    arguments(SETTING_NAMES).parse_known_args()  # --help answered here, before torch's import (20 s when busy)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench.py's progress line and quiet runs

import torch  # noqa: E402
from bench import STOP_EXIT, configured, machine  # noqa: E402
from bench_monitor import fastest, over_budget  # noqa: E402,F401 (over_budget: the cap's rule, tested here)

from mptrain.config.checks import compose_checked  # noqa: E402
from mptrain.core.machine import LoadMeter, cpu_flags  # noqa: E402
from mptrain.precision import lab  # noqa: E402
from mptrain.precision.support import choose_fp8_matmul, torchao_version  # noqa: E402

from mptrain.config.checks import CONFIG_DIR as CONFIGS  # noqa: E402  (mptrain/configs/, shipped in the package)
DEFAULTS = ["model=gpt-nano", "train.max_steps=60", "monitor.enabled=false"]
SETTINGS = {
    "fp32": ["precision=fp32"],
    "bf16": ["precision=bf16"],
    "fp16": ["precision=fp16"],
    "fp8-scaled_mm": ["precision=fp8", "precision.fp8.matmul=scaled_mm"],
    "fp8-emulated": ["precision=fp8", "precision.fp8.matmul=emulated"],
    "mxfp8": ["precision=mxfp8"],
    "nvfp4": ["precision=nvfp4"],
    "mxfp4": ["precision=mxfp4"],
    # the 4-bit emulation's own cost, against fp32 on every CPU: the rest of the model in fp32
    "nvfp4-fp32": ["precision=nvfp4", "precision.compute_dtype=fp32", "precision.param_dtype=fp32"],
    "lab-nvfp4": ["precision=lab", "precision.lab.recipe=nvfp4"],
    "lab-mxfp4": ["precision=lab", "precision.lab.recipe=mxfp4"],
    "lab-hybrid": ["precision=lab", "precision.lab.recipe=hybrid_mxfp8_nvfp4"],
    "lab-nvfp4-fp32": ["precision=lab", "precision.lab.recipe=nvfp4", "precision.compute_dtype=fp32",
                       "precision.param_dtype=fp32"],
}
CASTS = {  # one of each kind of lab operand spec (mptrain/precision/lab.py)
    "float8 tensor": "e4m3/tensor/fp32/nearest",
    "float8 row": "e4m3/row/ue8m0-rceil/nearest",
    "MXFP8 1x32": "e4m3/1x32/ue8m0-rceil/nearest",
    "MXFP4 1x32": "e2m1/1x32/ue8m0/nearest",
    "NVFP4 1x16": "e2m1/1x16/e4m3/nearest",
    "NVFP4 16x16": "e2m1/16x16/e4m3/nearest",
    "NVFP4 stochastic": "e2m1/1x16/e4m3/stochastic",
    "NVFP4 hadamard": "e2m1/1x16/e4m3/nearest/hadamard",
    "NVFP4 4over6": "e2m1/1x16/e4m3-4over6/nearest",
}
LAB_PAIRS = (("lab-nvfp4", "nvfp4"), ("lab-mxfp4", "mxfp4"), ("lab-nvfp4-fp32", "nvfp4-fp32"), ("lab-hybrid", "nvfp4"))
SPEED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16", "amx_tile")


def header(device: str, overrides: list[str], repeats: int, names: list[str], what: str = "settings") -> str:
    """The command, the machine (with the flags that decide bf16/fp16 speed) and the software."""
    flags = sorted(cpu_flags() & set(SPEED_FLAGS)) if device == "cpu" else []
    return (f"bench_precision: {' '.join(overrides)} | {len(names)} {what} x {repeats}, interleaved\n"
            f"  machine  {machine(device)}" + (f" | flags {', '.join(flags) or 'none of ' + ', '.join(SPEED_FLAGS)}"
                                               if device == "cpu" else "") + "\n"
            f"  software Python {platform.python_version()}, torch {torch.__version__}, "
            f"torchao {torchao_version() or 'not installed'} | {datetime.date.today().isoformat()}")


def _seconds(fn, repeats: int) -> float:
    """The fastest of ``repeats`` calls of ``fn`` after one untimed call (a shared machine adds time)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def cast_costs(shape: tuple[int, int], repeats: int) -> list[tuple[str, str, float]]:
    """(kind, spec, seconds) of one :func:`lab.fake_quantize` of each :data:`CASTS` spec
    on one fp32 ``shape`` tensor (contraction dimension last), the first row an fp32
    copy of it (the floor any cast pays)."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    rows = [("fp32 copy", "", _seconds(x.clone, repeats))]
    for kind, spec in CASTS.items():
        op = lab.parse(spec)
        rows.append((kind, spec, _seconds(lambda op=op: lab.fake_quantize(x, op), repeats)))
    return rows


def print_casts(shape: tuple[int, int], repeats: int) -> None:
    """The ``--casts`` table."""
    rows = cast_costs(shape, repeats)
    n = shape[0] * shape[1]
    print(f"\none cast of a {shape[0]}x{shape[1]} fp32 tensor, fastest of {repeats} "
          f"({torch.get_num_threads()} threads)")
    print(f"{'kind':<17} {'spec':<32} {'ms':>8} {'ns/elem':>8} {'x copy':>7}")
    for kind, spec, sec in rows:
        print(f"{kind:<17} {spec:<32} {1e3 * sec:>8.2f} {1e9 * sec / n:>8.2f} {sec / rows[0][2]:>7.1f}")


def main() -> int:
    """The banner, each run's progress, the table; the exit code (0, or bench.py's
    :data:`STOP_EXIT` code for a stop by the user)."""
    a, user = arguments(",".join(SETTINGS)).parse_known_args()
    if a.casts:
        meter = LoadMeter()
        print(header("cpu", ["--casts", *user], a.repeats or 5, list(CASTS), "casts"), flush=True)
        print_casts(tuple(int(v) for v in a.cast_shape.split("x")), a.repeats or 5)
        print(meter.read().report(f"the fastest of {a.repeats or 5} casts of each kind counts"))
        return 0
    names = [n.strip() for n in a.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in SETTINGS]
    if unknown or "fp32" not in names:
        sys.exit(f"bench_precision: --only {a.only}: {'unknown ' + ', '.join(unknown) if unknown else 'no fp32'}; "
                 f"choose from {', '.join(SETTINGS)}, fp32 included (the ratios are to it).")
    overrides = [*DEFAULTS, *user]
    cfg, device = configured(lambda o: compose_checked(o, CONFIGS), overrides, "bench_precision")
    meter = LoadMeter()
    a.repeats = meter.repeats(2, a.repeats)
    print(header(device, overrides, a.repeats, names), flush=True)
    # the setting last: a user's precision=... would otherwise replace it
    timed, stopped = fastest(names, a.repeats, cfg.train.max_steps, 15, lambda name: [*overrides, *SETTINGS[name]],
                             a.row_budget)
    best = {name: t.tokens_per_s for name, t in timed.items()}
    print(f"\n{'setting':<15} {'tokens/s':>10} {'x fp32':>8}")
    for name in [n for n in names if n in timed]:
        ratio = f"{best[name] / best['fp32']:>8.3f}" if "fp32" in best else f"{'n/a':>8}"
        print(f"{name:<15} {best[name]:>10,.0f} {ratio}" + "".join(f"   {note}" for note in
                                                                   (timed[name].capped, timed[name].partial) if note))
    if stopped is not None:
        missing = [n for n in names if n not in timed]
        print(f"bench_precision: stopped by {signal.Signals(stopped).name}"
              + (f"; not measured: {', '.join(missing)}" if missing else ""))
    for name in ("nvfp4", "mxfp4"):
        if name in best and "bf16" in best:
            print(f"{name} step time / bf16's: {best['bf16'] / best[name]:.2f}x (the target: at most ~3x)")
    for lab_row, old in LAB_PAIRS:
        if lab_row in best and old in best:
            print(f"{lab_row} step time / {old}'s: {best[old] / best[lab_row]:.2f}x")
    if "nvfp4-fp32" in best:
        print(f"nvfp4-fp32 step time / fp32's: {best['fp32'] / best['nvfp4-fp32']:.2f}x (the emulation's own cost)")
    if device == "cpu":
        path, why = choose_fp8_matmul("auto", torch.device("cpu"))
        print(f"precision.fp8.matmul=auto here: {path} ({why})")
    print(meter.read().report(f"the fastest of {a.repeats} runs of each setting counts"))
    return 0 if stopped is None else STOP_EXIT.get(stopped, 128 + stopped)


if __name__ == "__main__":
    sys.exit(main())
