"""What this machine can do with each format: ``python -m mptrain.doctor``.

    python -m mptrain.doctor

Prints the device, torch and torchao versions, which optimizers are
available, whether bf16 / fp16 / fp8 are native, emulated or unavailable here
(and why), the measured speed of a 512x512 bf16, fp16 and float8 matmul
against fp32 (float8 both ways: ``torch._scaled_mm`` and its fp32 emulation),
which of the two ``precision.fp8.matmul=auto`` picks here (measured at
256x256), and the precision it recommends. Every ratio names the size it was
taken at. On a CPU a half format with the instructions for it is called native
only where its matmul measured faster than fp32's; otherwise "supported".
Beside the figures: the load average and CPU steal over the measurement, and a
warning that the figures are unreliable when other processes competed (the
matmuls then take twice the repeats). Takes no arguments; ``--help`` prints this.
"""
from __future__ import annotations

from mptrain.core.usage import answer_help

answer_help(__name__, __doc__)  # --help before the imports below load torch (seconds; 20 s on a busy machine)

import sys

import torch

from mptrain.core.machine import LoadMeter
from mptrain.core.process_exit import run_then_leave
from mptrain.core.text import wants_help
from mptrain.precision.support import (MATMUL_KINDS, Verdict, choose_fp8_matmul, cpu_name, matmul_seconds,
                                       measure_fp8_matmul, optimizer_support, torchao_version, verdicts)

SIZE = 512
"""The side of the square matmuls whose times the doctor compares."""

REPS = 5
"""Timed calls of each matmul on an idle machine, the fastest kept (twice as many on a busy one)."""

FASTER = 0.9
"""A half format is native on a CPU only where its matmul took at most this share of
fp32's time: instructions that never beat fp32 (fp16 at 1.00x on an Intel Xeon with
avx512_fp16) are no reason to train in it, and 10% keeps noise at 1x from deciding."""


def measured_verdict(v: Verdict, ratio: float, device: torch.device) -> Verdict:
    """``v`` (from the hardware's flags) checked against the measured time ratio to fp32:
    on a CPU, "native" stays only where the format's matmul was faster; a GPU's
    tensor cores are not judged by a matmul this small."""
    if device.type != "cpu" or v.status != "native" or ratio <= FASTER:
        return v
    return Verdict("supported", f"{v.why}, yet its {SIZE}x{SIZE} matmul took {ratio:.2f}x fp32's time here: "
                                "instructions without a speed-up")


def recommend(device: torch.device, v: dict[str, Verdict]) -> str:
    if device.type == "cuda":
        if v["fp8"].status == "native":
            return "bf16; fp8 for large models (>= ~1B parameters), where its matmul speed-up outweighs the casts"
        if v["bf16"].status == "native":
            return "bf16"
        if v["fp16"].status == "native":
            return "fp16 (with dynamic loss scaling)"
        return "fp32"
    if v["bf16"].status == "native":
        return "bf16 (native bf16 matmul on this CPU); fp32 for exact reference runs"
    if v["bf16"].status == "supported":
        return "fp32 (bf16's matmul measured no faster than fp32's on this CPU)"
    return "fp32 (half precision is emulated on this CPU)"


def matmul_times(device: torch.device, reps: int) -> dict[str, float]:
    """Seconds per SIZE x SIZE matmul of each kind, fastest of ``reps`` (of REPS for
    ``torch._scaled_mm``: on a CPU whose float8 path is a reference loop it takes
    seconds a call and hundreds of times fp32's time, which no noise can hide)."""
    cheap = tuple(k for k in MATMUL_KINDS if k != "fp8_scaled_mm")
    t = dict(matmul_seconds(str(device), SIZE, SIZE, SIZE, reps=reps, kinds=cheap))
    t.update(matmul_seconds(str(device), SIZE, SIZE, SIZE, reps=REPS, kinds=("fp8_scaled_mm",)))
    return t


def measured_lines(device: torch.device, t: dict[str, float], reps: int) -> list[str]:
    """The ratios to fp32, each with the size it was taken at, and auto's float8 choice with its own size."""
    at = f"at {SIZE}x{SIZE}"
    lines = [f"measured {SIZE}x{SIZE} matmul, fastest of {reps} (relative to fp32; < 1 is faster):"]
    for fmt in ("bf16", "fp16"):
        lines.append(f"  {fmt:<5} {t[fmt] / t['fp32']:6.2f}x {at} ({t[fmt] * 1e3:.2f} ms vs {t['fp32'] * 1e3:.2f} ms)")
    if "fp8_emulated" in t:
        of = f", fastest of {REPS}" if reps != REPS else ""
        native = (f"{t['fp8_scaled_mm'] / t['fp32']:6.2f}x {at} (torch._scaled_mm{of}, "
                  f"{t['fp8_scaled_mm'] * 1e3:.2f} ms)" if "fp8_scaled_mm" in t
                  else "     -   (torch._scaled_mm cannot run here)")
        lines.append(f"  fp8   {native}; emulated in fp32 {t['fp8_emulated'] / t['fp32']:.2f}x {at} "
                     f"({t['fp8_emulated'] * 1e3:.2f} ms)")
    return lines


def report(device: torch.device | None = None) -> str:
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    meter = LoadMeter()  # before the first timed call: its steal share covers them all
    reps = meter.repeats(REPS)
    t = matmul_times(device, reps)
    v = {fmt: measured_verdict(x, t[fmt] / t["fp32"], device) if fmt in t else x
         for fmt, x in verdicts(device).items()}
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    lines = [
        f"device       {device} ({name})",
        f"torch        {torch.__version__}",
        f"torchao      {torchao_version() or 'not installed'}",
        f"optimizers   {optimizer_support()}",
        "formats:",
    ]
    for fmt in ("bf16", "fp16", "fp8"):
        lines.append(f"  {fmt:<5} {v[fmt].status:<12} {v[fmt].why}")
    # precision=nvfp4 / mxfp4 never need float4 hardware: their matmuls are fp32's (docs/fp4.md)
    lines.append(f"  {'fp4':<5} {'emulated':<12} nvfp4 and mxfp4 quantize exactly and multiply in fp32 on every "
                 "device (precision/labtrain.py)")
    lines += measured_lines(device, t, reps)
    if "fp8_emulated" in t and (v["fp8"].status != "unavailable" or device.type == "cuda"):
        path, why = choose_fp8_matmul("auto", device)
        if device.type == "cpu":  # auto measured its own, smaller product
            n = measure_fp8_matmul(str(device)).n
            why += f", at {n}x{n}"
        lines.append(f"fp8 matmul   {path} ({why})")
    lines.append(meter.read().report(f"each matmul took {reps} timed calls, the fastest kept; run the doctor "
                                     "again when the machine is idle", head="load         "))
    lines.append(f"recommended  precision={recommend(device, v)}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """Print the report; ``--help`` prints the usage instead. Exit code 2 for any other argument."""
    if wants_help(argv):
        print(__doc__.strip())
        return 0
    if argv:
        print(f"mptrain.doctor: takes no arguments (got {' '.join(argv)}); run python -m mptrain.doctor, "
              "or --help for what it prints.", file=sys.stderr)
        return 2
    print(report())
    return 0


if __name__ == "__main__":
    run_then_leave(main, sys.argv[1:])
