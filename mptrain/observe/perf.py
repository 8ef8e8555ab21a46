"""Model FLOPs and device peaks: the arithmetic behind ``perf/mfu``.

FLOPs per token (training, forward + backward) follow the standard estimate
(Kaplan et al. 2020; PaLM appendix B):

    6 * N  +  12 * n_layer * d_model * T

``N`` counts the parameters that take part in matmuls (every parameter but the
position embedding; the tied head is counted once, as a matmul, and its
embedding lookup is free), and the second term is the attention score and
value matmuls (2 matmuls of T x T x d per layer, x3 for the backward pass,
x2 FLOPs per multiply-add). MFU is achieved model FLOPs per second over the
device's dense peak for the run's matmul dtype.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass
from typing import Optional

from torch.overrides import TorchFunctionMode

from mptrain.core.text import duration
from mptrain.precision.support import matmul_seconds

# Dense (no sparsity) peak TFLOPS per device and matmul kind, from the vendors'
# data sheets. "tf32" is what fp32 matmuls run at with TF32 allowed.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "V100": {"fp32": 15.7, "tf32": 15.7, "fp16": 125.0},
    "A100": {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},
    "A10G": {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0},
    "L4": {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0, "fp8": 242.5},
    "L40S": {"fp32": 91.6, "tf32": 183.0, "bf16": 362.05, "fp16": 362.05, "fp8": 733.0},
    "H100 PCIe": {"fp32": 51.2, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0, "fp8": 1513.0},
    "H100 SXM": {"fp32": 66.9, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9},
    "H200": {"fp32": 66.9, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9},
    "B200": {"fp32": 80.0, "tf32": 1100.0, "bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0},
}

# Substrings of torch.cuda.get_device_name() -> table key, most specific first.
_NAME_PATTERNS = [
    ("H100 PCIe", "H100 PCIe"), ("H100 NVL", "H100 PCIe"), ("H100", "H100 SXM"), ("H200", "H200"),
    ("GH200", "H200"), ("B200", "B200"), ("A100", "A100"), ("A10G", "A10G"), ("L40S", "L40S"),
    ("L4", "L4"), ("V100", "V100"),
]


def flops_per_token(n_params_matmul: int, n_layer: int, d_model: int, seq_len: int) -> float:
    """Training FLOPs per token: 6N plus the attention term (see module docstring)."""
    return 6.0 * n_params_matmul + 12.0 * n_layer * d_model * seq_len


def device_key(device_name: str) -> Optional[str]:
    """The peak-table entry for a CUDA device name, or None when unknown."""
    for pattern, key in _NAME_PATTERNS:
        if pattern in device_name:
            return key
    return None


def matmul_kind(compute: str, fp8: bool, tf32: bool) -> str:
    """Which peak applies: fp8 runs are bounded by the fp8 peak, bf16/fp16 by
    theirs, fp32 by tf32 when TF32 matmuls are allowed."""
    if fp8:
        return "fp8"
    if compute in ("bf16", "fp16"):
        return compute
    return "tf32" if tf32 else "fp32"


def peak_flops(device_name: str, kind: str, override_tflops: Optional[float] = None) -> Optional[float]:
    """Peak FLOP/s for one device, from the override or the table; None when unknown."""
    if override_tflops:
        return override_tflops * 1e12
    key = device_key(device_name)
    if key is None or kind not in PEAK_TFLOPS[key]:
        return None
    return PEAK_TFLOPS[key][kind] * 1e12


def mfu(tokens_per_s: float, flops_per_tok: float, peak_per_device: float, world_size: int) -> float:
    """Model FLOPs utilisation of the whole job (all ranks' tokens over all ranks' peak)."""
    return tokens_per_s * flops_per_tok / (peak_per_device * world_size)


SLOW_AT = 3.0
"""The banner predicts the run time where this run's matmuls are predicted to
take this many times as long as fp32's on the same CPU."""


@dataclass(frozen=True)
class Pace:
    """A run's matmul time predicted before it starts, against fp32's on the
    same device: FLOPs per token by dtype, at speeds measured on a product of
    the model's own shape (:func:`predict_pace`)."""

    slowdown: float
    """Predicted matmul time over fp32's (> 1: slower)."""
    seconds_per_token: float
    """Predicted matmul seconds per trained token."""
    fp32_seconds_per_token: float
    """The same in fp32."""
    slowest: str
    """The dtype that costs the most, with its measured ratio, for the message."""

    def message(self, steps: int, tokens_per_step: int, faster: str) -> str:
        """The banner's line: the estimate for ``steps`` more steps, and ``faster``."""
        tokens = steps * tokens_per_step
        return (f"this run's matmuls are predicted {self.slowdown:.0f}x slower than fp32's here ({self.slowest}): "
                f"about {duration(tokens * self.seconds_per_token)} for {steps} step{'s' * (steps != 1)}, against "
                f"{duration(tokens * self.fp32_seconds_per_token)} in fp32 (matmul FLOPs at speeds measured "
                f"at this model's shape; the rest of each step comes on top). Faster: {faster}.")


def predict_pace(device_str: str, flops_by_dtype: dict[str, float], tokens: int, d_model: int) -> Pace:
    """The :class:`Pace` of a run whose training FLOPs per token are
    ``flops_by_dtype`` (keys: ``fp32``, ``bf16``, ``fp16``, ``fp8_scaled_mm``,
    ``fp8_emulated``), timed on one ``tokens x d_model @ d_model x 4 d_model``
    product in each (the MLP's first matmul; ``tokens`` capped at 2048)."""
    m, k, n = min(max(tokens, 16), 2048), d_model, 4 * d_model
    t = matmul_seconds(device_str, m, k, n, kinds=("fp32", *sorted(set(flops_by_dtype) - {"fp32"})))
    flops = 2.0 * m * k * n
    rate = {name: flops / sec for name, sec in t.items()}
    total = sum(flops_by_dtype.values())
    s = sum(f / rate[name] for name, f in flops_by_dtype.items())
    s32 = total / rate["fp32"]
    worst = max(flops_by_dtype, key=lambda name: flops_by_dtype[name] / rate[name])
    label = {"fp8_scaled_mm": "float8 torch._scaled_mm", "fp8_emulated": "float8 emulated in fp32"}.get(worst, worst)
    return Pace(s / s32, s, s32, f"{label} matmuls measured {t[worst] / t['fp32']:.0f}x fp32's time")


class HostSyncCounter(TorchFunctionMode):
    """Counts the calls that copy a device value to the host (``.item()``,
    ``bool(t)``, ``float(t)``, ``.tolist()``, ``.cpu()``, ...) made through
    torch's Python API while active: on a GPU each one waits for every queued
    kernel. A check that works on CPU too, where nothing actually waits;
    ``torch.cuda.set_sync_debug_mode`` is the GPU-only counterpart (it also sees
    syncs inside C++ code, which this cannot).

    ``calls`` lists ``(name, where)`` with ``where`` the innermost mptrain
    frame that made the call, so a failing check says which line synced.
    """

    NAMES = frozenset({"item", "__bool__", "__float__", "__int__", "__index__", "tolist", "cpu", "numpy",
                       "__format__", "nonzero"})

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.NAMES:
            self.calls.append((func.__name__, _caller_in_package()))
        return func(*args, **(kwargs or {}))


def _caller_in_package() -> str:
    """``file.py:line`` of the innermost mptrain frame on the stack, or "?"."""
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # mptrain/
    f = sys._getframe(2)  # skip this function and __torch_function__ (which lives in the package)
    while f is not None and not f.f_code.co_filename.startswith(pkg):
        f = f.f_back
    return f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno}" if f else "?"


class Throughput:
    """Training time and steps between logging points, excluding evaluation and
    checkpointing. Everything else a step costs (logging, the numerics monitor)
    counts. Time and steps are counted over the same span, so the run's figure
    (:meth:`tokens_per_s`) divides the steps that were timed by their time.
    """

    def __init__(self, tokens_per_step: int):
        self.tokens_per_step = tokens_per_step
        self.mark = time.perf_counter()
        self.pending_steps = 0     # steps since the last lap
        self.excluded = 0.0        # seconds of eval/checkpoint since the last lap
        self.total_time = 0.0
        self.total_steps = 0

    def step(self) -> None:
        self.pending_steps += 1

    @contextlib.contextmanager
    def paused(self):
        """Time spent inside is not training time."""
        t = time.perf_counter()
        try:
            yield
        finally:
            self.excluded += time.perf_counter() - t

    def lap(self) -> tuple[float, int]:
        """``(seconds, steps)`` of training since the previous lap."""
        now = time.perf_counter()
        elapsed, steps = now - self.mark - self.excluded, self.pending_steps
        self.mark, self.excluded, self.pending_steps = now, 0.0, 0
        self.total_time += elapsed
        self.total_steps += steps
        return elapsed, steps

    def tokens_per_s(self) -> Optional[float]:
        """Over every lap of the run; None before the first."""
        if not self.total_time:
            return None
        return self.total_steps * self.tokens_per_step / self.total_time
