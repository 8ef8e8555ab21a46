"""Which AdamW runs, and what its state is made of.

Three implementations of the same update rule (AdamW, decoupled weight decay),
chosen by two settings, ``precision.update_rounding`` and ``optim.state_dtype``:

==========================  ==========================  ==========================
what the run asks for       optimizer                   where the update is done
==========================  ==========================  ==========================
moments in the parameters'  ``torch.optim.AdamW``       in the parameters' dtype
dtype, round to nearest     (fused on CUDA)             (bf16 in ``bf16-pure``)
stochastic rounding, or     torchao's AdamW             fp32, then stored: moments
moments in another dtype    (``AdamW8bit`` etc.)        as configured, weights
                                                        rounded (stochastically
                                                        under ``stochastic``)
Kahan-compensated updates   torch-optimi's AdamW        the parameters' dtype,
                            (``kahan_sum=True``)        with a compensation buffer
==========================  ==========================  ==========================

Everything else in the harness reaches the optimizer through this module:
:func:`set_lr` (torchao keeps the learning rate as a tensor), :func:`moments`
(optimi stores the moments already bias-corrected), :func:`intended_update`
(what the rule meant to add, for the numerics monitor), :func:`state_parts`
(the tensors a state entry is really made of, for memory figures and
checkpoints), :func:`check` (the combinations that cannot run, refused in one
sentence before anything is built).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Union

import torch

from mptrain.config.mesh import MESH_MODES
from mptrain.core.errors import ConfigError
from mptrain.core.shards import local_shard
from mptrain.precision.formats import dtype_name
from mptrain.precision.support import torchao_version

QUANTIZED = ("8bit", "4bit", "fp8")
"""``optim.state_dtype`` values that are torchao's block-quantized moments."""

BLOCK = {"8bit": 256, "4bit": 128, "fp8": 256}
"""torchao's default block sizes: one fp32 scale per this many moment elements."""

MIN_QUANTIZED = 4096
"""torchao quantizes a moment only with at least this many elements (and a
size that divides by the block); smaller ones stay plain tensors."""


@dataclass(frozen=True)
class Choice:
    """The optimizer a config gets: ``impl`` (``torch``, ``torchao`` or
    ``optimi``), what the moments are stored as (``fp32``, ``bf16``, ``8bit``,
    ``4bit``, ``fp8``), how updates are rounded into the weights, and whether
    there is a compensation buffer."""

    impl: str
    state: str
    rounding: str
    param_dtype: str

    @property
    def kahan(self) -> bool:
        return self.rounding == "kahan"

    def describe(self) -> str:
        """The banner's line: ``torchao AdamW8bit: moments 8bit (blocks of 256), weights bf16, stochastic rounding``."""
        name = {"torch": "torch AdamW", "optimi": "torch-optimi AdamW (kahan_sum)",
                "torchao": f"torchao {_torchao_name(self.state)}"}[self.impl]
        state = self.state + (f" (blocks of {BLOCK[self.state]}, fp32 scales)" if self.state in QUANTIZED else "")
        rounding = {"nearest": "round to nearest", "stochastic": "stochastic rounding",
                    "kahan": "Kahan-compensated"}[self.rounding]
        updates = "fp32 master weights" if self.param_dtype == "fp32" else f"{self.param_dtype} weights, {rounding}"
        return f"{name}: moments {state}, {updates}"


def _torchao_name(state: str) -> str:
    return {"8bit": "AdamW8bit", "4bit": "AdamW4bit", "fp8": "AdamWFp8"}.get(state, "AdamW")


def _enum_value(v: Any) -> Optional[str]:
    return None if v is None else getattr(v, "value", v)


def choose(p: Any, o: Any, parallel: str) -> Choice:
    """The optimizer for the ``precision`` section ``p`` and the ``optim`` section ``o``
    under wrapper ``parallel`` (``parallel.name``), or one :class:`ConfigError` naming
    the combination that cannot run and the fix. The plan's builder calls it once; the
    run reads the choice from the plan."""
    param = "fp32" if p.master_weights else p.compute_dtype.name
    rounding = _enum_value(p.update_rounding) or "nearest"
    state = _enum_value(o.state_dtype) or param
    if rounding != "nearest" and p.master_weights:
        raise ConfigError(
            f"precision.update_rounding={rounding} changes how updates reach weights stored in bf16, but "
            f"precision={p.name} keeps fp32 master weights, where every update lands exactly; use "
            f"precision=bf16-pure-{'sr' if rounding == 'stochastic' else 'kahan'}, or "
            "precision.update_rounding=nearest.")
    if rounding == "kahan" and state != param:
        raise ConfigError(
            f"optim.state_dtype={state} cannot go with precision.update_rounding=kahan: torch-optimi keeps "
            f"Adam's moments in the parameters' dtype ({param}); leave optim.state_dtype unset, or use "
            "precision=bf16-pure-sr, whose torchao AdamW stores moments in any of them.")
    impl = "optimi" if rounding == "kahan" else ("torch" if rounding == "nearest" and state == param else "torchao")
    if impl != "torch":
        why = (f"precision.update_rounding={rounding}" if rounding != "nearest"
               else f"optim.state_dtype={state}")
        if o.update_clip:
            raise ConfigError(
                f"optim.update_clip={o.update_clip:g} is implemented for torch's AdamW only, and {why} runs "
                f"{'torch-optimi' if impl == 'optimi' else 'torchao'}'s; set optim.update_clip=0 or drop {why}.")
        if o.fused:
            raise ConfigError(f"optim.fused=true selects torch's fused AdamW, but {why} runs "
                              f"{'torch-optimi' if impl == 'optimi' else 'torchao'}'s own kernels; "
                              "leave optim.fused unset.")
        if parallel == "fsdp1":
            raise ConfigError(
                f"{why} is not supported under parallel=fsdp1: FSDP1 hands the optimizer flattened shards that "
                "span several tensors, and its optimizer checkpointing gathers plain tensors only, not "
                "quantized moments or compensation buffers; use parallel=fsdp (FSDP2), ddp or none.")
    if state in QUANTIZED and param != "fp32" and parallel in MESH_MODES:
        # torchao 0.18's step fails on such a shard (its fp32 upcast of a bf16-typed
        # quantized DTensor meets fp32 operands in lerp); fp32 weights work.
        raise ConfigError(
            f"optim.state_dtype={state} with {param} weights (precision={p.name}) fails inside torchao's "
            "optimizer step under parallel=fsdp (FSDP2); keep fp32 master weights (precision=bf16) with "
            f"optim.state_dtype={state}, or use parallel=ddp.")
    if o.compile_step and impl != "torchao":
        raise ConfigError(
            "optim.compile_step=true compiles torchao's optimizer step, but this run uses "
            f"{'torch-optimi' if impl == 'optimi' else 'torch'}'s AdamW; leave optim.compile_step unset.")
    return Choice(impl, state, rounding, param)


def check_installed(choice: Choice) -> None:
    """ConfigError when the package ``choice`` needs is missing or too old."""
    if choice.impl == "optimi":
        try:
            import optimi  # noqa: F401
        except ImportError:
            raise ConfigError("precision.update_rounding=kahan needs torch-optimi, which is not installed; "
                              "pip install torch-optimi (or pip install -e \".[optim]\").") from None
    elif choice.impl == "torchao":

        try:
            import torchao.optim as ao  # noqa: F401
        except Exception as e:  # torchao missing, or failing to import against this torch
            raise ConfigError(f"{_asked(choice)} needs torchao's optimizers, which do not import here "
                              f"({type(e).__name__}: {str(e)[:120]}); pip install torchao.") from None
        name = "_AdamW" if choice.state in ("fp32", "bf16") else _torchao_name(choice.state)
        if not hasattr(ao, name):
            raise ConfigError(f"{_asked(choice)} needs torchao.optim.{name}, which torchao "
                              f"{torchao_version()} lacks; install a torchao that has it (0.18 is tested).")


def _asked(choice: Choice) -> str:
    return (f"precision.update_rounding={choice.rounding}" if choice.rounding != "nearest"
            else f"optim.state_dtype={choice.state}")


# ------------------------------------------------------------------ building
def make(groups: list[dict], ocfg, choice: Choice, device: torch.device) -> torch.optim.Optimizer:
    """The optimizer ``choice`` names, over ``groups`` (each with its ``weight_decay``).
    The choice travels beside it (``build.RunModel.opt_choice``), never on it: what
    needs to know which AdamW runs (the monitor, a checkpoint's meta.json) is handed it."""
    betas, kw = (ocfg.beta1, ocfg.beta2), dict(lr=ocfg.lr, eps=ocfg.eps)
    if choice.impl == "torch":
        fused = ocfg.fused if getattr(ocfg, "fused", None) is not None else device.type == "cuda"
        kernel = {"fused": True} if fused else {"foreach": device.type == "cuda" or None}
        opt = torch.optim.AdamW(groups, betas=betas, **kw, **kernel)
    elif choice.impl == "optimi":
        check_installed(choice)
        from optimi import AdamW as OptimiAdamW

        # foreach left to optimi: Triton on CUDA, its for-loop on CPU (naming
        # foreach=True is deprecated there and warns on every run).
        opt = OptimiAdamW(groups, betas=betas, kahan_sum=True, **kw)
    else:
        check_installed(choice)
        compiled = ocfg.compile_step if getattr(ocfg, "compile_step", None) is not None else device.type == "cuda"
        opt = _torchao_class(choice.state)(groups, betas=betas, **kw,
                                           bf16_stochastic_round=choice.rounding == "stochastic")
        opt.compile_step = compiled
    return opt


_CLASSES: dict[str, type] = {}


def _torchao_class(state: str) -> type:
    """torchao's AdamW for ``state``, made to run eagerly unless ``compile_step``
    and to keep its moments' dtype across a checkpoint load (once per state kind)."""
    if state in _CLASSES:
        return _CLASSES[state]
    import torchao.optim as ao

    base = getattr(ao, "_AdamW") if state in ("fp32", "bf16") else getattr(ao, _torchao_name(state))
    plain = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(state)

    class Optimizer(base):
        compile_step = False

        def _new_buffer(self, p, signed):
            out = super()._new_buffer(p, signed)
            return out.to(plain) if plain is not None else out  # moments in the configured dtype

        @torch.no_grad()
        def step(self, closure=None):
            # torchao compiles its per-parameter update; the stance runs it as
            # plain eager torch instead (same arithmetic, no compile time).
            stance = contextlib.nullcontext() if self.compile_step else torch.compiler.set_stance("force_eager")
            with stance:
                return super().step(closure)

        def load_state_dict(self, state_dict):
            super().load_state_dict(state_dict)
            # torch's loader casts floating state to the parameter's dtype: put
            # plain moments back into theirs (an exact cast: they were saved in it).
            if plain is not None:
                for st in self.state.values():
                    for k in ("exp_avg", "exp_avg_sq"):
                        if torch.is_tensor(st.get(k)) and st[k].dtype != plain:
                            st[k] = st[k].to(plain)

    Optimizer.__name__ = Optimizer.__qualname__ = f"Mptrain{base.__name__.lstrip('_')}"
    _CLASSES[state] = Optimizer
    return Optimizer


TORCH_ADAMW = Choice("torch", "fp32", "nearest", "fp32")
"""torch's AdamW over fp32 weights: what an optimizer built without a choice is."""


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Every group's learning rate to ``lr``. torchao reads it as a 0-d tensor
    (changing it must not retrace its compiled step), the others as a float."""
    for g in optimizer.param_groups:
        if torch.is_tensor(g["lr"]):
            g["lr"].fill_(lr)
        else:
            g["lr"] = lr


# ------------------------------------------------------------------ reading the state
def dequantized(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a state tensor as plain fp32 (torchao's quantized
    moments dequantized; DTensors reduced to their local shard)."""
    t = local_shard(t.detach())
    if hasattr(t, "dequantize") and type(t) is not torch.Tensor:
        return t.dequantize().float()
    return t.float()


def moments(optimizer: torch.optim.Optimizer, p: torch.Tensor, group: dict,
            choice: Choice) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """Bias-corrected ``(m_hat, v_hat)`` of ``p`` (this rank's shard, fp32), or
    None before its first step. ``choice``: what the optimizer was built as
    (:func:`make`). torch-optimi keeps them bias-corrected already (its betas
    are debiased each step); torch and torchao keep the raw averages and a
    per-parameter step count."""
    state = optimizer.state.get(p)
    if not state or state.get("exp_avg_sq") is None:
        return None
    m, v = dequantized(state["exp_avg"]), dequantized(state["exp_avg_sq"])
    if choice.impl == "optimi":
        return m, v
    if "step" not in state:
        return None
    beta1, beta2 = group["betas"]
    return m / bias_correction(beta1, state["step"]), v / bias_correction(beta2, state["step"])


def intended_update(optimizer: torch.optim.Optimizer, p: torch.Tensor, group: dict,
                    before: torch.Tensor, choice: Choice) -> Optional[torch.Tensor]:
    """What the step just taken meant to add to ``p`` (fp32, this rank's shard),
    from the moments as stored after it and the weights ``before`` it:
    ``-lr * (m_hat / (sqrt(v_hat) + eps) + weight_decay * before)``. None when
    ``p`` has no state yet. With quantized or bf16 moments this is the update
    their stored values give, within their rounding of the fp32 values the
    step used; the lr is the group's (update clipping's per-step factor is not in it)."""
    mv = moments(optimizer, p, group, choice)
    if mv is None:
        return None
    m_hat, v_hat = mv
    lr = group["lr"]
    lr = float(lr) if torch.is_tensor(lr) else lr  # torchao's 0-d host tensor: no device sync
    step = m_hat / (v_hat.sqrt() + group["eps"])  # out of place: m_hat may be the state tensor itself
    if group["weight_decay"]:
        step.add_(before, alpha=group["weight_decay"])
    return step.mul_(-lr)


def compensation(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> Optional[torch.Tensor]:
    """The Kahan compensation buffer of ``p`` (this rank's shard), or None."""
    state = optimizer.state.get(p) or {}
    comp = state.get("kahan_comp")
    if comp is None or comp.dim() == 0 or comp.numel() != p.numel():
        return None
    return local_shard(comp.detach())


def stored_as(t: torch.Tensor) -> str:
    """What a state tensor is stored as: a dtype name, or torchao's quantized kind."""
    t = local_shard(t)
    kind = type(t).__name__
    if kind.startswith("OptimState"):
        return {"OptimState8bit": "8bit", "OptimState4bit": "4bit", "OptimStateFp8": "fp8"}.get(kind, kind)
    return dtype_name(t.dtype)


def state_parts(t: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """The plain tensors a state entry is made of, with their names: a plain
    tensor is itself (``""``); torchao's quantized moments are their codes,
    block scales and quantization map (``codes``, ``scale``, ``qmap``)."""
    t = local_shard(t)
    if type(t) is torch.Tensor or not hasattr(t, "__tensor_flatten__"):
        yield "", t
        return
    names, _ = t.__tensor_flatten__()
    for n in names:
        yield n, getattr(t, n)


def moment_bytes(numel: int, state: str, param_bytes: int) -> int:
    """Bytes of one Adam moment of a tensor of ``numel`` elements (this rank's
    part) stored as ``state``; exact against torchao's layout (tests)."""
    if state in QUANTIZED:
        block = BLOCK[state]
        if numel >= MIN_QUANTIZED and numel % block == 0:
            codes = {"8bit": numel, "4bit": numel // 2, "fp8": numel}[state]
            qmap = {"8bit": 256 * 4, "4bit": 16 * 4, "fp8": 0}[state]
            return codes + numel // block * 4 + qmap
        return numel * param_bytes  # torchao keeps small tensors plain, in the parameter's dtype
    return numel * {"fp32": 4, "bf16": 2, "fp16": 2}[state]  # plain (fp16: moments of fp16 weights)


def bias_correction(beta: float, step) -> Union[float, torch.Tensor]:
    """``1 - beta ** step`` in float64, as torch's AdamW computes it (in fp32,
    ``1 - 0.999 ** t`` of a short run is off by 1e-5). AdamW keeps ``step`` as a
    0-d tensor (on the host, or on the device for the fused kernel): the result
    stays a tensor where it is, never read back, so there is no host sync."""
    if isinstance(step, torch.Tensor):
        return 1.0 - torch.pow(beta, step.detach().double())
    return 1.0 - beta ** float(step)
