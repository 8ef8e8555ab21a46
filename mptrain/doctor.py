"""What this machine can do with each format: ``python -m mptrain.doctor``.

    python -m mptrain.doctor

Prints the device, torch and torchao versions, which optimizers are
available, whether bf16 / fp16 / fp8 are native, emulated or unavailable here
(and why), the measured speed of a 512x512 bf16, fp16 and float8 matmul
against fp32 (float8 both ways: ``torch._scaled_mm`` and its fp32 emulation),
which of the two ``precision.fp8.matmul=auto`` picks here, and the precision
it recommends. Takes no arguments; ``--help`` prints this.
"""
from __future__ import annotations

import sys

import torch

from mptrain.core.process_exit import run_then_leave
from mptrain.core.text import wants_help
from mptrain.precision.support import (Verdict, choose_fp8_matmul, cpu_name, matmul_seconds, optimizer_support,
                                       torchao_version, verdicts)


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
    return "fp32 (half precision is emulated on this CPU)"


def report(device: torch.device | None = None) -> str:
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    v = verdicts(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    t = matmul_seconds(str(device), 512, 512, 512, reps=5)
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
                 "device (precision/fp4train.py)")
    lines.append("measured 512x512 matmul (relative to fp32; < 1 is faster):")
    for fmt in ("bf16", "fp16"):
        lines.append(f"  {fmt:<5} {t[fmt] / t['fp32']:6.2f}x  ({t[fmt] * 1e3:.2f} ms vs {t['fp32'] * 1e3:.2f} ms)")
    if "fp8_emulated" in t:
        native = (f"{t['fp8_scaled_mm'] / t['fp32']:6.2f}x  (torch._scaled_mm, {t['fp8_scaled_mm'] * 1e3:.2f} ms)"
                  if "fp8_scaled_mm" in t else "     -   (torch._scaled_mm cannot run here)")
        lines.append(f"  fp8   {native}; emulated in fp32 {t['fp8_emulated'] / t['fp32']:.2f}x "
                     f"({t['fp8_emulated'] * 1e3:.2f} ms)")
        if v["fp8"].status != "unavailable" or device.type == "cuda":
            path, why = choose_fp8_matmul("auto", device)
            lines.append(f"fp8 matmul   {path} ({why})")
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
