"""4-bit training linears, emulated: NVIDIA's NVFP4 recipe and OCP MXFP4
(``precision=nvfp4``, ``precision=mxfp4``; ``precision.fp4.*``; docs/fp4.md).

A converted linear runs its three matmuls on 4-bit operands, each quantized
along that matmul's contraction dimension by :func:`fp4.fake_quantize` (E2M1
values in scaled blocks, dequantized again) and multiplied in fp32: the
products a float4 tensor core forms, with fp32 accumulation, on any device.

- forward ``y = x W^T``: ``x`` in 1 x 16 (or 1 x 32) blocks along the input
  features, nearest rounding; ``W`` likewise, or in 16 x 16 tiles
  (``weight_2d``), one scale per tile;
- input gradient ``dx = dy W``: ``dy`` in blocks along the output features,
  stochastically rounded (``stochastic_rounding``); ``W`` along the output
  features, or the very same 16 x 16-tiled weight as the forward pass (a tile
  is a tile whichever way it is read: that is why the recipe tiles weights);
- weight gradient ``dW = dy^T x``: both operands along the tokens, after a
  random Hadamard transform of the tokens in blocks of 16 (``hadamard``;
  orthogonal, so the product is the same in exact arithmetic, while a
  block's outliers are spread over the block), ``dy`` stochastically rounded.

The bias and its gradient stay in fp32. Operands are first cast to the
autocast dtype, as autocast would cast them for an ``nn.Linear``, so a
sharding wrapper that gathers weights in bf16 hands the layer the same
values as the single-device run. Only the inputs and the (cast) weight are
saved for the backward pass, as for an autocast linear: the quantized copies
are made again there, so the memory estimate of a bf16 run holds.

Stochastic rounding draws from torch's default generator (the checkpoints
save its state: a resumed run repeats the draws). The Hadamard sign vector
is one fixed vector for every layer and rank, made from a constant seed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

from mptrain.core.errors import ConfigError
from mptrain.precision import fp4
from mptrain.precision.selection import LinearRules, check_blocks_left, excluded_because

HADAMARD_SIZE = 16  # the recipe's 16 x 16 transform
KEEP_SHARE = 0.15  # NVIDIA keeps about 15% of the linears, mostly the last ones, in higher precision


@dataclass(frozen=True)
class Fp4Recipe:
    """One linear's 4-bit recipe, from ``precision.fp4``."""

    fmt: str
    """``nvfp4`` or ``mxfp4``."""
    hadamard: bool
    stochastic: bool
    weight_2d: bool

    def describe(self) -> tuple[str, str]:
        """(forward, backward) in words, for the banner and run_info."""
        block = fp4.BLOCK[self.fmt]
        scales = "E4M3 block scales x one fp32 scale per tensor" if self.fmt == "nvfp4" else "E8M0 block scales"
        weight = "16x16 tiles" if self.weight_2d else f"1x{block} blocks"
        fwd = f"input E2M1 (1x{block} blocks), weight E2M1 ({weight}), {scales}, nearest"
        bwd = (f"grad_output E2M1 (1x{block} blocks, {'stochastic' if self.stochastic else 'nearest'} rounding); "
               f"weight-gradient operands {'after' if self.hadamard else 'without'} a 16x16 random Hadamard "
               "transform")
        return fwd, bwd


def _quantized_weight_for_dgrad(w: torch.Tensor, r: Fp4Recipe) -> torch.Tensor:
    """``W`` (out x in) as the input-gradient matmul multiplies it, blocked along
    the output features; with 16 x 16 tiles, the forward pass's own values."""
    if r.weight_2d:
        return fp4.fake_quantize(w, r.fmt, two_d=True)
    return fp4.fake_quantize(w.t().contiguous(), r.fmt).t()


class _Fp4Matmul(torch.autograd.Function):
    """``x W^T + b`` on 4-bit operands, for 2-D ``x`` (tokens x in features)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], r: Fp4Recipe):
        ctx.r, ctx.has_bias = r, bias is not None
        ctx.save_for_backward(x, w)
        with torch.autocast(x.device.type, enabled=False):  # the products are fp32's, not autocast's
            xq = fp4.fake_quantize(x, r.fmt)
            wq = fp4.fake_quantize(w, r.fmt, two_d=r.weight_2d)
            y = xq @ wq.t()
            if bias is not None:
                y = y + bias.float()
        return y.to(x.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy: torch.Tensor):
        x, w = ctx.saved_tensors
        r = ctx.r
        with torch.autocast(gy.device.type, enabled=False):
            g = gy.float()
            dx = fp4.fake_quantize(g, r.fmt, stochastic=r.stochastic) @ _quantized_weight_for_dgrad(w, r)
            # Weight gradient: both operands with the tokens as their last (contraction) dimension.
            a, b = g.t().contiguous(), x.float().t().contiguous()
            if r.hadamard:
                signs = fp4.fixed_signs(g.device)
                a, b = fp4.rht(a, signs), fp4.rht(b, signs)
            dw = fp4.fake_quantize(a, r.fmt, stochastic=r.stochastic) @ fp4.fake_quantize(b, r.fmt).t()
            db = g.sum(0) if ctx.has_bias else None
        return dx.to(x.dtype), dw.to(w.dtype), db, None


class Fp4Linear(nn.Linear):
    """An ``nn.Linear`` whose matmuls run on 4-bit operands (the module docstring);
    the same parameters and state_dict keys as the layer it replaces."""

    def __init__(self, in_features: int, out_features: int, recipe: Fp4Recipe, bias: bool = True,
                 device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recipe = recipe
        self.fp4_format = recipe.fmt  # what the dtype audit reports for this layer's matmuls

    @classmethod
    def from_linear(cls, mod: nn.Linear, recipe: Fp4Recipe) -> "Fp4Linear":
        """A 4-bit layer sharing ``mod``'s Parameter objects (no copy; on any
        device, the meta device included)."""
        new = cls(mod.in_features, mod.out_features, recipe, bias=mod.bias is not None, device="meta")
        new.weight = mod.weight
        new.bias = mod.bias
        new.train(mod.training)
        return new

    def cast_operands(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The input and weight as the 4-bit casts receive them: in the autocast
        dtype where autocast is on (as it would cast them for an ``nn.Linear``)."""
        w = self.weight
        dev = x.device.type
        if torch.is_autocast_enabled(dev):
            dt = torch.get_autocast_dtype(dev)
            x, w = x.to(dt), w.to(dt)
        return x, w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, w = self.cast_operands(x)
        y = _Fp4Matmul.apply(x.reshape(-1, self.in_features), w, self.bias, self.recipe)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp4={self.recipe.fmt}"


def kept_last_blocks(cfg, n_blocks: int) -> int:
    """``precision.fp4.bf16_last_blocks``, its null resolved to the recipe's 15% (rounded up)."""
    if cfg.bf16_last_blocks is None:
        return math.ceil(KEEP_SHARE * n_blocks)
    return int(cfg.bf16_last_blocks)


class Fp4Linears:
    """Converts ``nn.Linear`` layers to :class:`Fp4Linear`; the same interface as
    the float8 :class:`~mptrain.precision.policy.Fp8Linears` (``convert``,
    ``report``, ``cast_rules``, and the per-step calls, which have nothing to
    do here: the recipe keeps no state between steps)."""

    all_gather = False  # weights are gathered in the compute dtype, never in 4-bit
    matmul = "emulated"
    matmul_why = ("dequantized E2M1 values multiplied in fp32 on every device; torchao's float4 kernels "
                  "(Blackwell) run torchao's own recipe: precision=fp8 precision.fp8.recipe=nvfp4")

    def __init__(self, cfg):
        self.cfg = cfg
        self.recipe = cfg.format.value
        self.kind = Fp4Recipe(self.recipe, bool(cfg.hadamard), bool(cfg.stochastic_rounding), bool(cfg.weight_2d))
        self.report: dict = {}

    def convert(self, model: nn.Module) -> nn.Module:
        """Swap every linear the rules let through, in place; ``report`` says which and why not."""
        n_blocks = len(getattr(model, "blocks", ()))
        block = fp4.BLOCK[self.recipe]
        last = kept_last_blocks(self.cfg, n_blocks)
        rules = LinearRules("precision.fp4", "4-bit", tuple(self.cfg.exclude), 0, last, 0, block,
                            f"{self.recipe} blocks of {block}",
                            f"null: the recipe's {KEEP_SHARE:.0%} of {n_blocks} blocks, rounded up"
                            if self.cfg.bf16_last_blocks is None else "")
        problem = check_blocks_left(rules, n_blocks, "precision=bf16")
        if problem:
            raise ConfigError(problem)
        converted, excluded = [], {}
        for fqn, mod in list(model.named_modules()):
            if type(mod) is not nn.Linear:  # exactly nn.Linear: a converted layer is a subclass
                continue
            why = excluded_because(rules, mod, fqn, n_blocks)
            if why:
                excluded[fqn] = why
                continue
            parent, _, name = fqn.rpartition(".")
            setattr(model.get_submodule(parent), name, Fp4Linear.from_linear(mod, self.kind))
            converted.append(fqn)
        fwd, bwd = self.kind.describe()
        self.report = {"recipe": self.recipe, "converted": converted, "excluded": excluded, "forward": fwd,
                       "backward": bwd, "block_size": block, "hadamard": self.kind.hadamard,
                       "stochastic_rounding": self.kind.stochastic, "weight_2d": self.kind.weight_2d,
                       "bf16_last_blocks": rules.last_blocks, "fsdp_float8_all_gather": False,
                       "matmul": self.matmul, "matmul_why": self.matmul_why}
        return model

    def cast_rules(self, whatif: list[str]) -> tuple[str, dict[str, str], list[str]]:
        """The cast statistics' view of this run (``observe/fp8watch.py``): every
        operand in E2M1 under the format's 1-D blocks, and the what-ifs beside it.
        The statistics do not model the weight's 16x16 tiles nor the weight-gradient
        operands' transform and stochastic rounding: they measure each tensor as
        it arrives, nearest-rounded in blocks along its rows."""
        formats = {"input": "e2m1", "weight": "e2m1", "grad_output": "e2m1"}
        return self.recipe, formats, [r for r in whatif if r != self.recipe]

    def update_histories(self, reduce_max) -> None:
        """Nothing: no amax history."""

    def refresh_scales(self, model: nn.Module) -> None:
        """Nothing: no scales kept between steps."""
