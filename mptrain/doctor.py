"""What this machine can do with each format: ``python -m mptrain.doctor``.

    python -m mptrain.doctor

Prints the device, which of the README's CPU kinds this is (an unknown kind
says so), torch and torchao versions, which optimizers are available, whether
bf16 / fp16 / fp8 are native, emulated or unavailable here (and why), the
measured speed of a 512x512 bf16, fp16 and float8 matmul against fp32 (float8
both ways: ``torch._scaled_mm`` and its fp32 emulation), which of the two
``precision.fp8.matmul=auto`` picks from those same float8 figures (a run
applies the same rule at its own matmul's size, named in its banner), and the
precision it recommends. Every ratio names the size it was taken at. On a CPU
a half format with the instructions for it is called native only where its
matmul measured faster than fp32's; otherwise "supported". Beside the figures:
the thread count torch uses with a 512x512 fp32 matmul timed at it and at 1
thread, the load average and CPU steal over the measurement, and a warning
that the figures are unreliable when other processes competed (the matmuls
then take twice the repeats), with what one thread does then. Takes no
arguments; ``--help`` prints this.
"""
from __future__ import annotations

from mptrain.core.usage import answer_help

answer_help(__name__, __doc__)  # --help before the imports below load torch (seconds; 20 s on a busy machine)

import sys

import torch

from mptrain.core.machine import LoadMeter, cpu_kind_text, seconds_at_threads, threads_notice
from mptrain.core.process_exit import run_then_leave
from mptrain.core.text import wants_help
from mptrain.precision.support import (MATMUL_KINDS, Fp8MatmulSpeed, Verdict, choose_fp8_matmul, cpu_name,
                                       fp8_auto_path, matmul_seconds, measure_fp8_matmul, optimizer_support,
                                       torchao_version, verdicts)

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


def matmul_times(device: torch.device, reps: int) -> tuple[dict[str, float], Fp8MatmulSpeed | None]:
    """Seconds per SIZE x SIZE matmul of fp32, bf16 and fp16, fastest of ``reps``;
    and the float8 measurement auto decides from (``support.measure_fp8_matmul``
    at SIZE: both float8 paths and fp32 in turns, fastest of REPS, since on a CPU
    whose float8 path is a reference loop ``torch._scaled_mm`` takes a large share
    of a second a call), None where float8 cannot run. The doctor prints the float8
    figures from that one measurement, so its ratios and auto's path cannot disagree."""
    plain = tuple(k for k in MATMUL_KINDS if not k.startswith("fp8"))
    t = dict(matmul_seconds(str(device), SIZE, SIZE, SIZE, reps=reps, kinds=plain))
    fp8 = None
    if hasattr(torch, "float8_e4m3fn"):
        try:
            fp8 = measure_fp8_matmul(str(device), n=SIZE, reps=REPS)
        except RuntimeError:  # no float8 matmul on this device (a GPU before Ada): the emulation alone
            fp8 = None
    return t, fp8


def measured_lines(device: torch.device, t: dict[str, float], fp8: Fp8MatmulSpeed | None, reps: int) -> list[str]:
    """The ratios to fp32, each with the size it was taken at; float8's two times are
    those auto decides from (``fp8 matmul``'s line)."""
    at = f"at {SIZE}x{SIZE}"
    lines = [f"measured {SIZE}x{SIZE} matmul, fastest of {reps} (relative to fp32; < 1 is faster):"]
    for fmt in ("bf16", "fp16"):
        lines.append(f"  {fmt:<5} {t[fmt] / t['fp32']:6.2f}x {at} ({t[fmt] * 1e3:.2f} ms vs {t['fp32'] * 1e3:.2f} ms)")
    if fp8 is not None:
        lines.append(f"  fp8   {fp8.scaled_mm / t['fp32']:6.2f}x {at} (torch._scaled_mm, {fp8.scaled_mm * 1e3:.2f} ms); "
                     f"emulated in fp32 {fp8.emulated / t['fp32']:.2f}x {at} ({fp8.emulated * 1e3:.2f} ms)")
    return lines


def threads_lines(device: torch.device, load) -> list[str]:
    """The thread count torch uses, a SIZE x SIZE fp32 matmul timed at it and at one
    thread, and on a busy machine the line a run would print (``machine.threads_notice``)."""
    n = torch.get_num_threads()
    if device.type != "cpu":
        return [f"threads      {n} (host threads; the matmuls run on the GPU)"]
    a = torch.randn(SIZE, SIZE, generator=torch.Generator().manual_seed(0))
    counts = (n, 1) if n > 1 else (1,)
    t = seconds_at_threads(lambda: a @ a, counts, rounds=REPS)
    timed = ", ".join(f"{t[c] * 1e3:.2f} ms at {c}" for c in counts)
    lines = [f"threads      {n} (torch's choice; train.threads sets a run's); {SIZE}x{SIZE} fp32 matmul {timed}"]
    notice = threads_notice(load, n, t, f"a {SIZE}x{SIZE} fp32 matmul")
    return lines + ([notice] if notice else [])


def report(device: torch.device | None = None) -> str:
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    meter = LoadMeter()  # before the first timed call: its steal share covers them all
    reps = meter.repeats(REPS)
    t, fp8 = matmul_times(device, reps)
    v = {fmt: measured_verdict(x, t[fmt] / t["fp32"], device) if fmt in t else x
         for fmt, x in verdicts(device).items()}
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    lines = [
        f"device       {device} ({name})",
        f"cpu kind     {cpu_kind_text()}",
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
    lines += measured_lines(device, t, fp8, reps)
    if fp8 is not None and (v["fp8"].status != "unavailable" or device.type == "cuda"):
        # the rule auto applies (support.fp8_auto_path), on the figures just printed
        path, why = fp8_auto_path(fp8) if device.type == "cpu" else choose_fp8_matmul("auto", device)
        lines.append(f"fp8 matmul   {path} ({why}; a run decides at its own matmul's size, named in its banner)")
    load = meter.read()
    lines += threads_lines(device, load)
    lines.append(load.report(f"each matmul took {reps} timed calls, the fastest kept; run the doctor "
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
