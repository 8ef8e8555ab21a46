"""What this machine can do with each format: ``python -m mptrain.doctor``.

For the device a run would use, each of bf16 / fp16 / fp8 is ``native`` (the
hardware has matmul instructions or tensor cores for it), ``emulated`` (it
runs, through conversions or generic kernels, usually much slower than
fp32) or ``unavailable`` (it cannot run: the reason says why and what to do).

The verdict comes from what the hardware reports (CUDA compute capability;
the CPU's instruction-set flags), and the doctor also *measures* a matmul in
each dtype against fp32, so a surprising verdict can be checked on the spot.
``trainer.run`` uses :func:`check_precision` to warn about emulated formats and
to refuse impossible ones before anything is built.
"""
from __future__ import annotations

import platform
from dataclasses import dataclass
from typing import Optional

import torch

from mptrain.core.errors import ConfigError

MIN_TORCHAO = (0, 10)


@dataclass
class Verdict:
    status: str  # native | emulated | unavailable
    why: str


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def torchao_version() -> str | None:
    try:
        import torchao
    except ImportError:
        return None
    return getattr(torchao, "__version__", "unknown")


def optimizer_support() -> str:
    """Which of the optimizers behind stochastic rounding, Kahan summation and
    ``optim.state_dtype`` import here (optimizers.py refuses the others at start)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        import torchao.optim as ao

        names = [n for n in ("_AdamW", "AdamW8bit", "AdamW4bit", "AdamWFp8") if hasattr(ao, n)]
        torchao = "torchao " + (", ".join(names) or "none of its AdamWs")
    except Exception:  # missing, or failing to import against this torch
        torchao = "torchao optimizers unavailable (stochastic rounding, optim.state_dtype refused)"
    try:
        optimi = f"torch-optimi {version('torch-optimi')} (Kahan summation)"
    except PackageNotFoundError:
        optimi = "torch-optimi not installed (precision=bf16-pure-kahan refused)"
    return f"{torchao}; {optimi}"


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split("+")[0].split(".")[:2]:
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits or 0))
    return tuple(out)


def fp8_software_problem() -> str | None:
    """Why float8 training cannot run with this software, or None when it can."""
    if not (hasattr(torch, "float8_e4m3fn") and hasattr(torch, "float8_e5m2")):
        return f"torch {torch.__version__} has no float8 dtypes; install torch>=2.6."
    v = torchao_version()
    if v is None:
        return "torchao is not installed; install it with pip install -e \".[fp8]\" (or pip install torchao)."
    if _version_tuple(v) < MIN_TORCHAO:
        return (f"torchao {v} is too old for float8 training here (need >= "
                f"{'.'.join(map(str, MIN_TORCHAO))}); pip install -U torchao.")
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # noqa: F401
    except ImportError as e:
        return f"torchao {v} has no usable torchao.float8 ({e}); pip install -U torchao."
    return None


def verdicts(device: torch.device, check_fp8: bool = True) -> dict[str, Verdict]:
    """native / emulated / unavailable for bf16, fp16 and fp8 on ``device``.
    ``check_fp8=False`` skips importing torchao (slow, noisy) when fp8 is not wanted."""
    out: dict[str, Verdict] = {}
    sw = fp8_software_problem() if check_fp8 else None
    if device.type == "cuda":
        cc = torch.cuda.get_device_capability(device)
        name = f"compute capability {cc[0]}.{cc[1]}"
        out["bf16"] = (Verdict("native", f"{name} >= 8.0 has bf16 tensor cores") if cc >= (8, 0)
                       else Verdict("emulated", f"{name} < 8.0: no bf16 tensor cores"))
        out["fp16"] = (Verdict("native", f"{name} >= 7.0 has fp16 tensor cores") if cc >= (7, 0)
                       else Verdict("emulated", f"{name} < 7.0: no fp16 tensor cores"))
        if sw:
            out["fp8"] = Verdict("unavailable", sw)
        elif cc >= (8, 9):
            out["fp8"] = Verdict("native", f"{name} >= 8.9 has float8 tensor cores")
        else:
            out["fp8"] = Verdict("unavailable", f"{name} < 8.9 has no float8 matmul (torch._scaled_mm); "
                                 "use precision=bf16, or an Ada/Hopper/Blackwell GPU for fp8")
        return out
    flags = _cpu_flags()
    bf = sorted(flags & {"avx512_bf16", "amx_bf16"})
    fp = sorted(flags & {"avx512_fp16", "amx_fp16"})
    out["bf16"] = (Verdict("native", f"CPU has {', '.join(bf)}") if bf
                   else Verdict("emulated", "CPU has neither avx512_bf16 nor amx_bf16"))
    out["fp16"] = (Verdict("native", f"CPU has {', '.join(fp)}") if fp
                   else Verdict("emulated", "CPU has neither avx512_fp16 nor amx_fp16"))
    out["fp8"] = (Verdict("unavailable", sw) if sw else
                  Verdict("emulated", "no CPU has float8 matmul; torch._scaled_mm upcasts on CPU"))
    return out


def cpu_rowwise_fp8_problem() -> Optional[str]:
    """Why this torch cannot run a float8 matmul with per-row scales on the CPU
    (torch before 2.13 takes per-tensor scales only there), or None. Tried on
    a 16 x 16 product: what the recipe would fail on at its first step."""
    a = torch.zeros(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError:
        return f"torch {torch.__version__}'s CPU float8 matmul takes per-tensor scales only"
    return None


def check_precision(policy, device: torch.device) -> list[str]:
    """Warnings for the run's precision on ``device``; ConfigError when impossible."""
    v = verdicts(device, check_fp8=policy.fp8_enabled)
    want = "fp8" if policy.fp8_enabled else {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(policy.compute_dtype)
    if want is None:
        return []
    warnings = []
    if want == "fp8":
        if v["fp8"].status == "unavailable":
            raise ConfigError(f"precision=fp8 cannot run here: {v['fp8'].why}")
        if device.type == "cpu" and policy.fp8.recipe in ("rowwise", "rowwise_with_gw_hp"):
            why = cpu_rowwise_fp8_problem()
            if why:
                raise ConfigError(f"precision.fp8.recipe={policy.fp8.recipe} cannot run on this CPU: {why}; use "
                                  "precision.fp8.recipe=tensorwise, torch>=2.13, or a GPU with float8 tensor cores.")
        if v["bf16"].status == "emulated":
            warnings.append(f"fp8 runs its other ops in bf16, which is emulated on this {device.type}: {v['bf16'].why}.")
    if v[want].status == "emulated":
        warnings.append(f"{want} is emulated on this {device.type} ({v[want].why}): expect it to be "
                        "slower than fp32. Run `python -m mptrain.doctor` for a measured comparison.")
    return warnings

