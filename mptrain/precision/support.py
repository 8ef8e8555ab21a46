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

import functools
import math
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from mptrain.core.errors import ConfigError
from mptrain.core.machine import cpu_flags, cpu_name, kept_choice, kept_choice_file  # noqa: F401 (the doctor and the advisor take cpu_name from here)

MIN_TORCHAO = (0, 10)

FP8_EMULATE_AT = 1.5
"""``precision.fp8.matmul=auto`` emulates the float8 matmuls on a CPU where
``torch._scaled_mm`` takes this many times as long as the emulation, measured
at the run's own matmul (:func:`fp8_matmul_shape`). A path measured 1.5x slower
is never taken (at 8x, auto had kept ``_scaled_mm`` on an AMD EPYC where it
took 2.8x the emulation's time at 512x512); closer than 1.5x the two paths
cost about the same, and the interleaved timings, slowed alike by a busy
host, rarely move by half. The Intel Xeon's oneDNN float8 path, a reference
loop at hundreds of times the emulation's time, is far from it."""

FP8_SETTLED_AT = 20.0
"""Once ``torch._scaled_mm`` has measured this many times the emulation's time, the
measurement stops calling it: a busy host's noise is far below such a gap, and
each call of a reference-loop float8 matmul costs a large share of a second."""

FP8_PROBE_MACS = 256 ** 3
"""The multiply-adds auto's measurement takes at most per call: rows of the run's
matmul are dropped down to this (both paths' time grows with the rows alike), so
the measurement stays a fraction of a second where ``_scaled_mm`` is a reference loop."""


@dataclass
class Verdict:
    status: str  # native | emulated | unavailable
    why: str


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
                                 "use precision=bf16, an Ada/Hopper/Blackwell GPU for fp8, or "
                                 "precision.fp8.matmul=emulated to study the casts at fp32 matmul speed")
        return out
    flags = cpu_flags()
    bf = sorted(flags & {"avx512_bf16", "amx_bf16"})
    fp = sorted(flags & {"avx512_fp16", "amx_fp16"})
    out["bf16"] = (Verdict("native", f"CPU has {', '.join(bf)}") if bf
                   else Verdict("emulated", "CPU has neither avx512_bf16 nor amx_bf16"))
    out["fp16"] = (Verdict("native", f"CPU has {', '.join(fp)}") if fp
                   else Verdict("emulated", "CPU has neither avx512_fp16 nor amx_fp16"))
    out["fp8"] = (Verdict("unavailable", sw) if sw else
                  Verdict("emulated", "no CPU has float8 matmul; torch._scaled_mm upcasts on CPU"))
    return out


def _seconds(fn: Callable[[], object], device: torch.device, reps: int, warm: bool = True) -> float:
    """The fastest of ``reps`` timed calls of ``fn`` after one warm-up call (``warm``;
    a caller that warmed it up already says False). A shared host adds time, never
    removes it, so the minimum is the estimate."""
    if warm:
        fn()
    best = float("inf")
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t)
    return best


def emulated_scaled_mm(a8: torch.Tensor, b8: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                       out_dtype: torch.dtype) -> torch.Tensor:
    """What ``torch._scaled_mm(a8, b8, scale_a, scale_b, out_dtype)`` computes,
    in fp32: every float8 value is exact in fp32, so the operands are widened,
    multiplied by their (dequantizing) scales, multiplied in fp32 and the
    product rounded once to ``out_dtype``. The float8 casts before it are the
    run's own; only the matmul's speed and accumulation order change."""
    return ((a8.float() * scale_a) @ (b8.float() * scale_b)).to(out_dtype)


MATMUL_KINDS = ("fp32", "bf16", "fp16", "fp8_scaled_mm", "fp8_emulated")


@functools.lru_cache(maxsize=None)
def matmul_seconds(device_str: str, m: int, k: int, n: int, reps: int = 3,
                   kinds: tuple[str, ...] = MATMUL_KINDS) -> dict[str, float]:
    """Seconds per ``(m x k) @ (k x n)`` product on ``device_str``, fastest of
    ``reps``, for each of ``kinds``: ``fp32``, ``bf16`` and ``fp16`` (both
    operands in that dtype), ``fp8_scaled_mm`` (``torch._scaled_mm`` of two E4M3
    operands, bf16 out; left out where it cannot run) and ``fp8_emulated``
    (:func:`emulated_scaled_mm` of the same). Once per process, shape and kinds;
    the random operands never touch the caller's generator."""
    device = torch.device(device_str)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        a = torch.randn(m, k, device=device)
        b = torch.randn(k, n, device=device)
    calls: dict[str, Callable[[], object]] = {}
    for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        a_, b_ = a.to(dt), b.to(dt)
        calls[name] = lambda a_=a_, b_=b_: a_ @ b_
    if hasattr(torch, "float8_e4m3fn"):
        a8 = a.to(torch.float8_e4m3fn)
        b8 = b.t().contiguous().to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm wants it on CUDA
        one = torch.ones((), device=device)
        calls["fp8_scaled_mm"] = lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
        calls["fp8_emulated"] = lambda: emulated_scaled_mm(a8, b8, one, one, torch.bfloat16)
    out: dict[str, float] = {}
    with torch.autocast(device.type, enabled=False):
        for name in kinds:
            if name not in calls:
                continue
            try:
                out[name] = _seconds(calls[name], device, reps)
            except RuntimeError:  # no float8 matmul on this device (a GPU before Ada): only the emulation
                pass
    return out


@dataclass(frozen=True)
class Fp8MatmulSpeed:
    """Seconds per float8 matmul (bf16 out) both ways, and fp32's, of an n x n x n
    product, or of ``shape`` (rows, k, n) where it is given."""

    n: int
    scaled_mm: float
    emulated: float
    fp32: float
    shape: tuple = ()

    @property
    def size(self) -> str:
        """The product's size as reports name it: ``512x512`` (square), ``256x128x512`` (rows x k x n)."""
        if not self.shape or len(set(self.shape)) == 1:
            return f"{self.n}x{self.n}"
        return "x".join(str(d) for d in self.shape)

    @property
    def slowdown(self) -> float:
        """``torch._scaled_mm``'s time over the emulation's (> 1: the emulation is faster)."""
        return self.scaled_mm / self.emulated


@functools.lru_cache(maxsize=None)
def measure_fp8_matmul(device_str: str = "cpu", n: int = 256, reps: int = 7,
                       shape: Optional[tuple[int, int, int]] = None) -> Fp8MatmulSpeed:
    """Time ``torch._scaled_mm`` and :func:`emulated_scaled_mm` on one float8
    product (per-tensor scales, bf16 out), and an fp32 matmul, in turns, keeping
    each one's fastest: a busy host slows all three alike. The product is n x n x n,
    or ``shape`` = (rows, k, n) where given. Once per process, device and size
    (about 0.2 s on a CPU whose ``_scaled_mm`` is slow)."""
    device = torch.device(device_str)
    rows, k, cols = shape or (n, n, n)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        a = torch.randn(rows, k, device=device)
        b = torch.randn(cols, k, device=device)
    a8 = a.to(torch.float8_e4m3fn)
    b8 = b.to(torch.float8_e4m3fn).t()  # column-major, as a linear's weight is and _scaled_mm wants it
    bt = b.t()
    one = torch.ones((), device=device)
    # the emulation first: once it has a time, a far slower _scaled_mm is settled after one call
    calls = {"emulated": lambda: emulated_scaled_mm(a8, b8, one, one, torch.bfloat16),
             "scaled_mm": lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
             "fp32": lambda: a @ bt}
    best = dict.fromkeys(calls, math.inf)
    with torch.autocast(device.type, enabled=False):
        for fn in calls.values():
            fn()  # warm-up, once: a call of a reference-loop _scaled_mm at 512x512 takes seconds
        for _ in range(reps):
            for name, fn in calls.items():
                settled = math.isfinite(best["scaled_mm"]) and best["scaled_mm"] >= FP8_SETTLED_AT * best["emulated"]
                if name == "scaled_mm" and settled:
                    continue  # no noise takes back a gap this wide: its further calls would only cost
                best[name] = min(best[name], _seconds(fn, device, 1, warm=False))
    return Fp8MatmulSpeed(n if shape is None else cols, **best, shape=tuple(shape or ()))


def fp8_matmul_shape(tokens: int, d_model: int, hidden: int) -> tuple[int, int, int]:
    """The product auto measures for a run: its largest float8 linear's (the MLP's
    up projection: ``tokens`` rows of ``d_model`` into ``hidden``), its rows cut to
    keep within :data:`FP8_PROBE_MACS`, in multiples of 16 (what ``_scaled_mm`` takes)."""
    rows = max(16, min(tokens, FP8_PROBE_MACS // max(1, d_model * hidden)) // 16 * 16)
    return rows, d_model, hidden


def fp8_auto_path(m: Fp8MatmulSpeed) -> tuple[str, str]:
    """``(path, why)`` auto takes on a CPU from the measurement ``m``: the one rule the
    run and the doctor both apply, worded with the figures and the size they were taken at."""
    ratio = f"{m.slowdown:,.0f}" if m.slowdown >= 100 else f"{m.slowdown:.3g}"
    said = (f"torch._scaled_mm measured {ratio}x the fp32 emulation's time at {m.size} "
            f"({m.scaled_mm * 1e3:.2f} ms vs {m.emulated * 1e3:.2f} ms) on this CPU")
    if m.slowdown >= FP8_EMULATE_AT:
        return "emulated", f"precision.fp8.matmul=auto: {said}, {FP8_EMULATE_AT:g}x or more: emulated"
    return "scaled_mm", f"precision.fp8.matmul=auto: {said}, under {FP8_EMULATE_AT:g}x: torch._scaled_mm"


def choose_fp8_matmul(setting: str, device: torch.device,
                      shape: Optional[tuple[int, int, int]] = None) -> tuple[str, str]:
    """``(path, why)`` for ``precision.fp8.matmul=setting`` on ``device``: path
    ``scaled_mm`` (``torch._scaled_mm``, float8 tensor cores on a GPU) or
    ``emulated`` (:func:`emulated_scaled_mm`). ``auto`` takes ``scaled_mm`` on a
    GPU, and on a CPU whichever :func:`fp8_auto_path` says of the measurement at
    ``shape`` (the run's, :func:`fp8_matmul_shape`; 256x256 where not given)."""
    if setting != "auto":
        return setting, f"precision.fp8.matmul={setting}"
    if device.type != "cpu":
        return "scaled_mm", "precision.fp8.matmul=auto on a GPU"
    return kept_fp8_path(shape)


@functools.lru_cache(maxsize=None)
def kept_fp8_path(shape: Optional[tuple[int, int, int]] = None) -> tuple[str, str]:
    """``(path, why)`` auto takes on this CPU for the product ``shape``: measured once per
    machine and size and kept (:func:`~mptrain.core.machine.kept_choice`), because the two
    paths accumulate in another order, so a choice a second timing flipped (a resume, another
    rank, on a busy host where the two are close) would change the run's bits without a word.
    ``python -m mptrain.doctor`` measures afresh and says what it would choose now."""
    size = "x".join(str(d) for d in shape) if shape else "256x256x256"

    def measure() -> dict:
        path, why = fp8_auto_path(measure_fp8_matmul("cpu", shape=shape))
        return {"path": path, "why": why}

    kept, where = kept_choice(kept_choice_file("fp8-matmul", size),
                              lambda c: c.get("path") in ("scaled_mm", "emulated") and "why" in c, measure)
    if where is None:
        return kept["path"], kept["why"]
    return kept["path"], f"{kept['why']} (kept in {where}, measured {kept.get('measured', '?')})"


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
    warnings: list[str] = []
    if want == "fp8":
        emulated = policy.fp8.matmul == "emulated"
        if v["fp8"].status == "unavailable":
            # A GPU without float8 tensor cores can still study the casts when the matmuls are
            # emulated; missing software cannot be worked around.
            if not (emulated and device.type == "cuda" and not fp8_software_problem()):
                raise ConfigError(f"precision=fp8 cannot run here: {v['fp8'].why}")
            warnings.append(f"fp8 matmuls are emulated in fp32 on this GPU ({v['fp8'].why.split(';')[0]}): "
                            "the casts and their statistics are float8's, the speed is not.")
        if device.type == "cpu" and policy.fp8.recipe in ("rowwise", "rowwise_with_gw_hp") and not emulated:
            why = cpu_rowwise_fp8_problem()
            if why:
                raise ConfigError(f"precision.fp8.recipe={policy.fp8.recipe} cannot run on this CPU: {why}; use "
                                  "precision.fp8.matmul=emulated, precision.fp8.recipe=tensorwise, torch>=2.13, "
                                  "or a GPU with float8 tensor cores.")
        if v["bf16"].status == "emulated" and policy.compute_dtype == torch.bfloat16:
            warnings.append(f"fp8 runs its other ops in bf16, which is emulated on this {device.type}: {v['bf16'].why}.")
    if v[want].status == "emulated":
        warnings.append(f"{want} is emulated on this {device.type} ({v[want].why}): expect it to be "
                        "slower than fp32. Run `python -m mptrain.doctor` for a measured comparison.")
    return warnings

