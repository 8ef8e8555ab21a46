"""Block-scaled low-precision training through torchao: MXFP8, and NVFP4 where it can run.

``mxfp8``: every converted linear runs its three matmuls (output, input
gradient, weight gradient) on MXFP8 operands: E4M3 elements in blocks of 32
consecutive elements along the matmul's contraction dimension, each block
sharing one power-of-two scale stored as E8M0. Each operand is cast twice,
once per matmul it enters, because the two matmuls contract it along
different axes. For ``y = x @ W.T`` with ``x`` (tokens, in), ``W`` (out, in)
and ``dy`` (tokens, out):

======================  =========================  =============================
matmul                  operands                   blocks of 32 run along
======================  =========================  =============================
output  y = x W^T       x, W                       in_features (the last dim of both)
grad_in dx = dy W       dy; W                      out_features (dy's last dim; W's dim 0)
grad_w  dW = dy^T x     dy; x                      tokens (dim 0 of both, flattened batch x seq)
======================  =========================  =============================

The recipe ``mxfp8``'s spec, ``e4m3/1x32/ue8m0-rceil/nearest``
(:mod:`mptrain.precision.recipe`), blocks along the last dimension as the lab
casts it: it describes the output matmul's ``x`` and ``W`` and grad_in's
``dy`` as they are, and grad_in's ``W`` and grad_w's ``dy`` and ``x`` on the
transposed tensor (``W.t()``, ``dy.t()``, ``x.t()``). Hence every
converted linear needs in and out features that are multiples of 32, and a
training micro-batch needs batch x sequence divisible by 32 (checked in the
forward pass; evaluation and sampling without gradients are not limited).

Scale rounding (torchao's ``ScaleCalculationMode``): ``rceil`` by default,
the rule torchao's MXFP8 training recipes use and Blackwell's
``cvt.rp.satfinite.ue8m0`` instruction implements: the scale is 2 to the
power ceil(log2(amax / 448)), the smallest power of two with which the
block's largest magnitude fits, so nothing saturates. ``mx_rounding="floor"``
is the OCP MX specification's rule (2 to the power floor(log2 amax) - 8),
which can clamp a block's largest values by up to 2x. These are the lab's
``ue8m0-rceil`` and ``ue8m0`` scales exactly (``tests/test_fp8mx.py`` compares
torchao's own cast with them; the cast statistics measure with the lab's).

Kernels (torchao ``KernelPreference``): ``AUTO`` on a Blackwell GPU (compute
capability >= 10.0): Triton and CUDA cast kernels and the hardware's MX
matmul, which needs triton. ``EMULATED`` everywhere else, the CPU included:
the casts are real, but each matmul runs on the dequantized operands in the
input's precision. That costs more than the plain linear it replaces and is
only good for checking numerics, never for speed.

Under autocast both operands are cast to the autocast dtype before the MX
casts, as autocast itself would for a linear (the real kernels take bf16
operands: FSDP2 gathers bf16 weights); only bf16 autocast is supported
(torchao's MX casts take bf16 or fp32). The output is bf16 under autocast.

Conversion swaps each accepted ``nn.Linear`` for an :class:`MXLinear` that
shares its ``weight`` and ``bias`` parameters: plain tensors, so
``state_dict`` keys and values are those of ``nn.Linear`` (checkpoints move
freely between mxfp8 and the other precisions), FSDP2 shards them as any
other parameter, and a model on the meta device converts without storage.
torchao's own ``quantize_(model, MXFP8TrainingOpConfig(...))`` path was not
used: in torchao 0.18 it wraps every parameter of the layer in a tensor
subclass whose linear override drops the bias (outputs off by the bias, no
bias gradient), and ``state_dict`` returns those subclasses.

``nvfp4``: torchao 0.18 has an NVFP4 training recipe
(``NVFP4TrainingConfig``: E2M1 elements in blocks of 16 with E4M3 block
scales and an fp32 tensor scale, a random Hadamard transform on the
weight-gradient operands, stochastic rounding of gradients). It runs only
through Triton kernels and the float4 matmul of a Blackwell GPU; there is no
emulated path, so :func:`problem` refuses it on the CPU and on older GPUs.
Its layers (torchao's ``NVFP4Linear``) need in and out features and the
tokens of a micro-batch divisible by 128, and add two buffers to
``state_dict`` (``_sr_seed``, ``_rht_sign_vector``). Those buffers are drawn
when the layer is built, so a model on the meta device is refused: nothing
would fill them after materialization. This path has not run here (no
Blackwell GPU); :func:`problem` runs one small layer before saying yes.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn as nn

from mptrain.core.errors import ConfigError
from mptrain.precision.support import fp8_software_problem, torchao_version

KINDS = ("mxfp8", "nvfp4")
MX_BLOCK = 32  # MXFP8: elements per E8M0 scale
NVFP4_MULTIPLE = 128  # NVFP4: torchao's kernels need M, K and N divisible by 128
ROUNDINGS = ("rceil", "floor")

# torchao's training casts along each operand's axes, for the report (see the module docstring).
_MX_CASTS = {
    "output": "input and weight, blocks along in_features",
    "grad_input": "grad_output along out_features, weight along out_features",
    "grad_weight": "grad_output and input along tokens (batch x sequence)",
}


def _blackwell(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (10, 0)


def _has_triton() -> bool:
    try:
        from torch.utils._triton import has_triton
    except ImportError:
        return False
    return has_triton()


def problem(kind: str, device, matmul: str = "auto") -> Optional[str]:
    """Why training with ``kind`` (one of :data:`KINDS`) cannot run on
    ``device`` with ``precision.fp8.matmul=matmul``, as one sentence naming
    the fix; None when it can."""
    if kind not in KINDS:
        return f"unknown block-scaled format {kind!r}; use one of {', '.join(KINDS)}."
    device = torch.device(device)
    base = fp8_software_problem()
    if base:
        return base
    v = torchao_version()
    if kind == "mxfp8":
        if not hasattr(torch, "float8_e8m0fnu"):
            return f"torch {torch.__version__} has no float8_e8m0fnu dtype for MX scales; install torch>=2.7."
        try:
            from torchao.prototype.moe_training.mxfp8_linear import _to_mxfp8_then_scaled_mm  # noqa: F401
            from torchao.prototype.mx_formats.config import ScaleCalculationMode  # noqa: F401
        except ImportError as e:
            return f"torchao {v} has no MXFP8 training linear ({e}); install torchao>=0.18."
        if matmul == "scaled_mm" and not _blackwell(device):
            return ("precision.fp8.matmul=scaled_mm: an MXFP8 matmul needs a Blackwell GPU (compute capability "
                    ">= 10.0); use precision.fp8.matmul=auto or emulated here.")
        if _blackwell(device) and matmul != "emulated":
            if not _has_triton():
                return "MXFP8 on a Blackwell GPU needs triton for torchao's cast kernels; pip install triton."
            return _trial(kind, device)
        return None  # EMULATED: plain torch ops, anywhere
    if matmul == "emulated":
        return (f"precision.fp8.matmul=emulated: torchao {v}'s NVFP4 training has no emulated matmul; use "
                "precision.fp8.matmul=auto on a Blackwell GPU, or precision=mxfp8 here.")
    try:
        from torchao.prototype.moe_training.nvfp4_training.nvfp4_training import NVFP4TrainingConfig  # noqa: F401
    except ImportError as e:
        return f"torchao {v} has no NVFP4 training recipe ({e}); install torchao>=0.18."
    if not _blackwell(device):
        where = "this CPU" if device.type != "cuda" else (
            "compute capability %d.%d" % torch.cuda.get_device_capability(device))
        return (f"NVFP4 training in torchao {v} runs only through Triton kernels and the float4 matmul "
                f"of a Blackwell GPU (compute capability >= 10.0), with no emulation for {where}; "
                "use mxfp8 here, or a Blackwell GPU.")
    if not _has_triton():
        return "NVFP4 training needs triton for torchao's kernels; pip install triton."
    if not hasattr(torch.nn.functional, "scaled_mm"):
        return f"torch {torch.__version__} has no torch.nn.functional.scaled_mm for float4 matmuls; upgrade torch."
    return _trial(kind, device)


def _trial(kind: str, device: torch.device) -> Optional[str]:
    """Run one small converted linear forward and backward with the real
    kernels: torchao's compiled extensions and Triton kernels can be missing
    or built for another torch in ways no import reveals."""
    n = MX_BLOCK if kind == "mxfp8" else NVFP4_MULTIPLE
    # Its random numbers must not shift those of the run that asked.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        try:
            model = nn.Sequential(nn.Linear(n, n)).to(device)
            _convert(model, kind, device, None, "rceil")
            x = torch.randn(n, n, device=device, requires_grad=True)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                y = model(x)
            y.float().sum().backward()
        except Exception as e:  # any failure means the format cannot run here; say which
            first = (str(e).strip().splitlines() or [""])[0][:200]
            return (f"a {kind} test matmul failed on {device} ({type(e).__name__}: {first}); "
                    "install the torchao and triton builds that match this torch and CUDA.")
    return None


def kernel(kind: str, device, matmul: str = "auto") -> str:
    """The torchao ``KernelPreference`` name ``kind`` uses on ``device`` under
    ``precision.fp8.matmul=matmul`` (already checked by :func:`problem`)."""
    if kind == "nvfp4":
        return "TRITON"  # the only one torchao 0.18's NVFP4 training accepts
    if matmul == "auto":
        return "AUTO" if _blackwell(torch.device(device)) else "EMULATED"
    return "EMULATED" if matmul == "emulated" else "AUTO"


def matmul_path(kind: str, device, matmul: str = "auto") -> tuple[str, str]:
    """``(path, why)`` as ``support.choose_fp8_matmul`` gives them for the other
    recipes: ``emulated`` where torchao's EMULATED kernel multiplies the
    dequantized blocks in the operands' dtype, else ``scaled_mm``."""
    k = kernel(kind, device, matmul)
    return ("emulated" if k == "EMULATED" else "scaled_mm"), f"precision.fp8.matmul={matmul}: torchao kernel {k}"


class MXLinear(nn.Linear):
    """An ``nn.Linear`` whose three matmuls run in MXFP8 through torchao
    (its ``MXFP8Linear`` math), made to follow autocast like a linear does
    and to fail early on a token count its weight gradient cannot block.

    ``kernel_preference`` and ``scale_calculation_mode`` are torchao's
    ``KernelPreference`` and ``ScaleCalculationMode``; :func:`convert` builds
    these layers, sharing the parameters of the linears they replace."""

    token_multiple = MX_BLOCK
    """The weight gradient's blocks run along the tokens: a caller whose token count
    varies (a mixture's experts) pads its rows with zeros to a multiple of this."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, kernel_preference,
                 scale_calculation_mode, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.kernel_preference = kernel_preference
        self.scale_calculation_mode = scale_calculation_mode

    def cast_operands(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The input and weight as the MX casts receive them. torchao's emulated
        matmul needs both operands in one dtype, and its casts take bf16 or fp32;
        under autocast both become the autocast dtype, as for a plain linear."""
        dev = x.device.type
        dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        if dt not in (torch.bfloat16, torch.float32):
            raise RuntimeError(f"mxfp8 linears run in bf16 or fp32 (bf16 autocast or none), not {dt}; "
                               "torchao's MX casts take bf16 or fp32 operands.")
        return x.to(dt), self.weight.to(dt)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, w = self.cast_operands(x)
        tokens = x.numel() // max(x.shape[-1], 1)
        if tokens % MX_BLOCK and torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
            raise RuntimeError(
                f"mxfp8 needs the tokens of a micro-batch (batch x sequence) to be a multiple of {MX_BLOCK}, "
                f"since the weight gradient's blocks run along tokens; got {tokens}, "
                "change the batch or sequence length.")
        from torchao.prototype.moe_training.mxfp8_linear import _to_mxfp8_then_scaled_mm

        y = _to_mxfp8_then_scaled_mm(x, w, kernel_preference=self.kernel_preference,
                                     scale_calculation_mode=self.scale_calculation_mode)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, mxfp8 {self.kernel_preference.name}, "
                f"scale {self.scale_calculation_mode.value}")


def _swap(model: nn.Module, fqn: str, new: nn.Module) -> None:
    parent, _, name = fqn.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, new)


def convert(model: nn.Module, kind: str, device,
            module_filter_fn: Optional[Callable[[nn.Module, str], bool]] = None, mx_rounding: str = "rceil",
            matmul: str = "auto") -> dict:
    """Convert, in place, the ``nn.Linear`` layers of ``model`` that
    ``module_filter_fn(module, fqn)`` accepts (all of them when None) to
    ``kind`` training, and return a report of what was done.

    ``device`` is where the model will run, which picks the kernels; the
    model itself may be there already or on the meta device (mxfp8 only).
    Linears whose dimensions the format cannot block are left as they are and
    listed under ``excluded`` with the reason (the filter is asked first).
    ``mx_rounding``: the E8M0 scale rule for mxfp8, ``rceil`` (torchao's
    training default) or ``floor`` (the OCP MX rule). ``matmul``:
    ``precision.fp8.matmul``, which picks torchao's kernel (:func:`kernel`).
    Raises :class:`ConfigError` when :func:`problem` says it cannot run.
    """
    if mx_rounding not in ROUNDINGS:
        raise ConfigError(f"mx_rounding={mx_rounding!r} is not one of {', '.join(ROUNDINGS)}; "
                          "use rceil (torchao's default).")
    why = problem(kind, device, matmul)
    if why:
        raise ConfigError(f"{kind} training cannot run: {why}")
    return _convert(model, kind, torch.device(device), module_filter_fn, mx_rounding, matmul)


def _convert(model: nn.Module, kind: str, device: torch.device, module_filter_fn, mx_rounding: str,
             matmul: str = "auto") -> dict:
    import torchao

    multiple = MX_BLOCK if kind == "mxfp8" else NVFP4_MULTIPLE
    excluded: dict[str, str] = {}
    targets: list[tuple[str, nn.Linear]] = []
    for fqn, mod in model.named_modules():
        if type(mod) is not nn.Linear:  # exactly nn.Linear: a converted layer is a subclass
            continue
        if module_filter_fn is not None and not module_filter_fn(mod, fqn):
            continue
        if not fqn:
            excluded[fqn] = "the model itself is a linear: convert works in place, on submodules"
            continue
        if mod.in_features % multiple or mod.out_features % multiple:
            excluded[fqn] = f"{mod.in_features}x{mod.out_features} not multiples of {multiple} ({kind} blocks)"
            continue
        targets.append((fqn, mod))

    pref = kernel(kind, device, matmul)
    if kind == "mxfp8":
        from torchao.prototype.mx_formats.config import ScaleCalculationMode
        from torchao.quantization.quantize_.common import KernelPreference

        for fqn, mod in targets:
            new = MXLinear(mod.in_features, mod.out_features, bias=mod.bias is not None, device="meta",
                           kernel_preference=KernelPreference[pref],
                           scale_calculation_mode=ScaleCalculationMode(mx_rounding))
            # The same Parameter objects: no copy, any device, and state_dict keys unchanged.
            new.weight = mod.weight
            new.bias = mod.bias
            new.train(mod.training)
            _swap(model, fqn, new)
        info = {"block_size": MX_BLOCK, "elem_dtype": "e4m3", "scale_dtype": "e8m0",
                "scale_rounding": mx_rounding, "casts": dict(_MX_CASTS)}
    else:
        if any(p.is_meta for _, m in targets for p in m.parameters()):
            # NVFP4Linear draws a Hadamard sign vector and a rounding seed into buffers;
            # on the meta device they stay empty and nothing would fill them after to_empty.
            raise ConfigError("nvfp4 cannot convert a model on the meta device (its layers' random "
                              "buffers would never be filled); convert after materializing, "
                              "or use parallel=ddp.")
        from torchao import quantize_
        from torchao.prototype.moe_training.nvfp4_training.nvfp4_training import NVFP4TrainingConfig

        chosen = {id(m) for _, m in targets}
        # One sign vector for every layer and rank: reproducible, and equal across replicas.
        sign = torch.randint(0, 2, (16,), generator=torch.Generator().manual_seed(0)) * 2 - 1
        quantize_(model, NVFP4TrainingConfig(rht_sign_vector=tuple(sign.tolist())),
                  filter_fn=lambda m, fqn: id(m) in chosen)
        for fqn, _ in targets:  # torchao's layers need the tokens in multiples of 128 (as MXLinear's 32)
            model.get_submodule(fqn).token_multiple = NVFP4_MULTIPLE
        info = {"block_size": 16, "elem_dtype": "e2m1", "scale_dtype": "e4m3 per block, fp32 per tensor",
                "scale_rounding": "nearest; gradients stochastically rounded after a random Hadamard transform"}
    return {"recipe": kind, "kernel": pref, "torchao": torchao.__version__, **info,
            "converted": [fqn for fqn, _ in targets], "excluded": excluded}
