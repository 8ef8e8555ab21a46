"""``python -m mptrain.doctor``: this machine's report (each ratio with its size,
native only where faster on a CPU, auto's float8 path from the very figures it
prints, the CPU kind as the README names it, the threads, the load) and the
rules it applies, from given figures."""
from __future__ import annotations

import re

import torch

from mptrain.core.machine import cpu_kind_text
from mptrain.precision.support import FP8_EMULATE_AT, Fp8MatmulSpeed, fp8_auto_path


def test_doctor_on_this_machine(capsys):
    # main() is all ``python -m mptrain.doctor`` runs; called here, without the start-up of a launch
    from mptrain.doctor import FASTER, SIZE, main

    assert main([]) == 0
    stdout = capsys.readouterr().out
    out = {line.split()[0]: line.split()[1] for line in stdout.splitlines()
           if line.startswith("  ") and line.split()[1] in ("native", "supported", "emulated", "unavailable")}
    flags = {f for line in open("/proc/cpuinfo") if line.startswith("flags") for f in line.split(":", 1)[1].split()}
    # Every measured ratio names the size it was taken at: one size, SIZE, for auto's float8 choice too
    measured = stdout.split("measured ", 1)[1].split("\nthreads ", 1)[0].splitlines()
    ratios = {line.split()[0]: float(line.split()[1].rstrip("x")) for line in measured if line.startswith("  ")}
    assert set(ratios) == {"bf16", "fp16", "fp8"}
    for line in measured[1:]:
        assert line.count(f"x at {SIZE}x{SIZE}") == line.count("x at ") >= 1 or line.startswith("fp8 matmul"), line
    # auto's line quotes the float8 line's own two times, and takes the path the rule gives on them
    fp8 = next(line for line in measured if line.startswith("  fp8 "))
    scaled, emulated = (float(x) for x in re.findall(r"([\d.]+) ms\)", fp8))
    auto = measured[-1]
    assert auto.startswith("fp8 matmul") and f"at {SIZE}x{SIZE} ({scaled:.2f} ms vs {emulated:.2f} ms)" in auto, auto
    assert auto.split()[2] == ("emulated" if scaled >= FP8_EMULATE_AT * emulated else "scaled_mm"), auto
    # the CPU kind as the README's table names it (or says it is not there), the threads with both timings
    assert f"cpu kind     {cpu_kind_text()}" in stdout
    threads = next(line for line in stdout.splitlines() if line.startswith("threads "))
    n = torch.get_num_threads()
    assert threads.startswith(f"threads      {n} (torch's choice") and (f"ms at {n}, " in threads if n > 1 else True)
    # The verdict follows the CPU's own instruction-set flags, read independently here, and on a CPU
    # "native" only where the measured matmul was faster than fp32's (fp16 at 1.00x was called native).
    for fmt, cpu_has in (("bf16", {"avx512_bf16", "amx_bf16"}), ("fp16", {"avx512_fp16", "amx_fp16"})):
        assert out[fmt] == ("emulated" if not flags & cpu_has else "native" if ratios[fmt] <= FASTER
                            else "supported"), (fmt, stdout)
    assert out["fp8"] == "emulated"  # torchao is installed; no CPU has float8 matmul
    # The load beside the figures, and the warning exactly when it says others competed.
    load = next(line for line in stdout.splitlines() if line.startswith("load "))
    assert " usable core" in load and "over the measurement" in load and float(load.split()[3]) >= 0
    assert ("warning: these figures are unreliable: " in stdout) == ("is above the" in stdout or "steal)" in stdout)
    assert f"torch        {torch.__version__}" in stdout and "device       cpu" in stdout
    assert "recommended  precision=" in stdout and "measured 512x512 matmul" in stdout
    # the optimizers behind stochastic rounding, Kahan and quantized moments (both installed by .[dev])
    assert "optimizers   torchao _AdamW, AdamW8bit, AdamW4bit, AdamWFp8; torch-optimi " in stdout


def test_doctor_calls_a_cpu_format_native_only_where_it_was_faster():
    from mptrain.doctor import FASTER, measured_verdict, recommend
    from mptrain.precision.support import Verdict

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    has = Verdict("native", "CPU has avx512_fp16, amx_fp16")
    assert measured_verdict(has, 0.28, cpu) is has and measured_verdict(has, FASTER, cpu) is has
    slow = measured_verdict(has, 1.01, cpu)  # the Intel Xeon's fp16: instructions, never faster
    assert slow.status == "supported" and "yet its 512x512 matmul took 1.01x fp32's time here" in slow.why
    assert measured_verdict(has, 1.01, gpu) is has  # tensor cores are not judged on one small matmul
    emulated = Verdict("emulated", "CPU has neither")
    assert measured_verdict(emulated, 0.5, cpu) is emulated
    v = {"bf16": measured_verdict(has, 1.2, cpu), "fp16": slow, "fp8": emulated}
    assert recommend(cpu, v).startswith("fp32 (bf16's matmul measured no faster")


def test_auto_takes_the_path_its_figures_say():
    """The AMD EPYC's doctor printed _scaled_mm at 2.8x the emulation's time at 512x512 while
    auto kept _scaled_mm: the path is the faster one beyond FP8_EMULATE_AT, worded with the
    figures and the size it decided on."""
    amd = Fp8MatmulSpeed(512, scaled_mm=0.27876, emulated=0.09910, fp32=0.0377)
    path, why = fp8_auto_path(amd)
    assert path == "emulated" and why == (
        "precision.fp8.matmul=auto: torch._scaled_mm measured 2.81x the fp32 emulation's time at 512x512 "
        "(278.76 ms vs 99.10 ms) on this CPU, 1.5x or more: emulated")
    close = Fp8MatmulSpeed(256, scaled_mm=0.0011, emulated=0.0010, fp32=0.0005)
    assert fp8_auto_path(close)[0] == "scaled_mm" and "1.1x" in fp8_auto_path(close)[1]
    run = Fp8MatmulSpeed(512, scaled_mm=1.0, emulated=0.1, fp32=0.05, shape=(256, 128, 512))
    assert "at 256x128x512 " in fp8_auto_path(run)[1]  # a run's own product, rows x k x n
