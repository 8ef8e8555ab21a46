"""Training linears whose three matmuls run on lab-quantized operands, per GEMM role
(``precision=lab``, ``precision=nvfp4``, ``precision=mxfp4``; docs/formats.md, docs/fp4.md).

A recipe (:class:`~mptrain.precision.recipe.Recipe`, backend ``lab``) gives each
operand of each matmul an operand spec (:mod:`mptrain.precision.lab`), or none
(the operand stays as autocast hands it over). For ``y = x W^T`` with ``x`` (tokens, in), ``W`` (out, in), ``dy`` (tokens, out):

==============  ============================  ======================================
role            operands (keys)               contraction dimension (blocks run along)
==============  ============================  ======================================
forward         x (fwd_input), W (fwd_weight)  in features
input gradient  dy (dgrad_grad_output),        out features
                W (dgrad_weight)
weight gradient dy (wgrad_grad_output),        tokens (batch x sequence)
                x (wgrad_input)
==============  ============================  ======================================

Each operand is cast with its contraction dimension last (``W`` transposed for
the input gradient, ``dy`` and ``x`` for the weight gradient), dequantized and
multiplied in fp32: the products a tensor core forms for those formats, with
fp32 accumulation, on any device. A square-tiled weight (``16x16``) is the same
set of tiles whichever way it is read, so both matmuls multiply the very same
quantized weight, as NVIDIA's NVFP4 recipe intends. A transform (Hadamard) must
be on both operands of its matmul, which it leaves unchanged in exact
arithmetic; ``hadamard-random`` draws one sign vector per matmul for both.

The bias and its gradient stay in fp32. Operands are first cast to the
autocast dtype, as autocast would cast them for an ``nn.Linear``. Only the
inputs and the (cast) weight are saved for the backward pass: the quantized
copies are made again there, so a bf16 run's memory estimate holds.
Stochastic rounding draws from torch's default generator (checkpoints save
its state: a resumed run repeats the draws), the input gradient's operands
before the weight gradient's; a tensor-parallel part from a stream of its own
seeded from it (``_TP.own_stream``).

``precision=nvfp4`` and ``precision=mxfp4`` are the named recipes ``nvfp4``
and ``mxfp4`` with ``precision.fp4``'s switches applied
(:func:`~mptrain.precision.recipe.fp4_recipe`): one implementation of 4-bit training.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import ContextManager, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from mptrain.core.errors import ConfigError
from mptrain.precision import lab
from mptrain.precision.recipe import GEMMS, ROLES, Recipe, build_recipe
from mptrain.precision.selection import LinearRules, check_blocks_left, excluded_because


def shape_problem(r: Recipe, fqn: str, in_f: int, out_f: int, tokens: Optional[int]) -> Optional[str]:
    """Why ``r``'s blocks do not fit a linear ``in_f -> out_f`` (``tokens`` per
    micro-batch; None: not checked), or None. Each operand as its matmul sees it."""
    dims = {"fwd_input": (tokens, in_f), "fwd_weight": (out_f, in_f), "dgrad_grad_output": (tokens, out_f),
            "dgrad_weight": (in_f, out_f), "wgrad_grad_output": (out_f, tokens), "wgrad_input": (in_f, tokens)}
    for role in ROLES:
        o = r.op(role)
        if o is None:
            continue
        rows, k = dims[role]
        if k is not None and k % o.contraction_multiple():
            return (f"{role}={o.spec} needs its contraction dimension in multiples of {o.contraction_multiple()}, "
                    f"and {fqn}'s is {k}")
        if rows is not None and rows % o.row_multiple():
            return f"{role}={o.spec} needs its rows in multiples of {o.row_multiple()}, and {fqn}'s are {rows}"
    return None


def _q(x: torch.Tensor, op: Optional[lab.Operand], r: Recipe, signs=None, tp=None, role: str = "",
       transposed: bool = False) -> torch.Tensor:
    """``x`` (contraction last) as the matmul multiplies it: quantized and back, or as it is.
    ``tp``: the layer's :class:`_TP` when ``x`` is one rank's part of ``role``'s operand
    (``transposed``: laid out as the other matmul's operand, so split along the other dimension)."""
    if op is None:
        return x.float()
    split = tp.split(role, transposed) if tp is not None else None
    # lab.round_trip divides fp32 scales out as torchao's float8 dequantization does, so
    # precision=lab's fp8_tensorwise trains bit for bit as precision=fp8 matmul=emulated.
    with tp.own_stream(x.device) if tp is not None and op.stochastic else contextlib.nullcontext():
        return lab.fake_quantize(x, op, signs=signs, error=r.error, split=split)


def _signs(r: Recipe, gemm: str, device, tp=None) -> Optional[torch.Tensor]:
    """The sign vector of one matmul's transform, drawn once for both its operands
    (``hadamard-random`` draws anew at every call), or None without a transform.
    Under tensor parallelism every rank of the group multiplies with the first
    rank's draw: a transform is exact only with one vector for the whole matmul."""
    op = r.op(GEMMS[gemm][0])
    if op is None or not op.transform:
        return None
    signs = lab.transform_signs(op, device)
    return tp.same_signs(signs) if tp is not None and op.transform == "hadamard-random" else signs


def forked_rng(device: torch.device) -> ContextManager:
    """Draws made inside come from a copy of the default generators (the CPU's,
    and ``device``'s when it is a GPU), which are put back as they were on leaving:
    the run's own streams go on as if nothing had drawn."""
    return torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])


_TP_AMAX = True
"""Scales of a tensor-parallel part over the whole tensor (tests switch it off to show why)."""
_TP_SIGNS = True
"""One Hadamard sign vector per tensor-parallel group (tests switch it off to show why)."""
# The operands that are one rank's part of a split tensor, and the dimension of that part
# (0: rows, 1: contraction) in the layout the table of the module docstring gives each role
# (dgrad_weight as W^T). Colwise (W split by output rows): every operand made of the weight
# or the output gradient; rowwise (W split by input columns): of the weight or the input.
_SPLIT_ROLES = {
    "colwise": {"fwd_weight": 0, "dgrad_weight": 1, "dgrad_grad_output": 1, "wgrad_grad_output": 0},
    "rowwise": {"fwd_input": 1, "fwd_weight": 1, "dgrad_weight": 0, "wgrad_input": 0},
}


@dataclass(frozen=True)
class _TP:
    """A LabLinear's place in a tensor-parallel split: the ranks' group and which
    side of Megatron's split the layer is on (``colwise`` or ``rowwise``)."""

    group: object
    side: str

    def _max(self, t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t

    def split(self, role: str, transposed: bool) -> Optional[lab.Split]:
        """How ``role``'s operand is split here, or None when every rank holds it whole."""
        dim = _SPLIT_ROLES[self.side].get(role)
        if dim is None or not _TP_AMAX:
            return None
        return lab.Split(1 - dim if transposed else dim, self._max)

    @contextlib.contextmanager
    def own_stream(self, device: torch.device):
        """Stochastic rounding on this rank's part draws from a stream of its own:
        the parts of one tensor get independent noise, as one process's draws over
        the whole tensor are. The default generator moves on by one draw on every
        rank alike (the seed), so what else draws from it (dropout, random
        Hadamard signs) stays in step across the group, and a resumed run, whose
        checkpoint holds that generator, repeats the same streams."""
        seed = int(torch.randint(0, 2 ** 62, (), device=device))
        with forked_rng(device):
            torch.manual_seed(seed + dist.get_rank(self.group))
            yield

    def same_signs(self, signs: torch.Tensor) -> torch.Tensor:
        if _TP_SIGNS:
            dist.broadcast(signs, group_src=0, group=self.group)
        return signs


def _square(op: Optional[lab.Operand]) -> bool:
    """A block the transpose leaves as it is (tensor, or a square tile): quantizing
    ``W`` or ``W^T`` gives the same values, so the forward's layout is used."""
    return op is not None and op.block[0] == op.block[1] and not op.transform


def product(gemm: str, a: torch.Tensor, b: torch.Tensor, r: Recipe, tp: Optional[_TP] = None) -> torch.Tensor:
    """One matmul of a linear (a key of :data:`~mptrain.precision.recipe.GEMMS`) on
    ``r``'s quantized operands, in fp32, its operands 2-D as the layer holds them:
    ``forward`` is ``x W^T`` (``a`` = x, ``b`` = W), ``input gradient`` is ``dy W``
    (``a`` = dy, ``b`` = W), ``weight gradient`` is ``dy^T x`` (``a`` = dy, ``b`` = x).
    Each operand is laid out with its contraction dimension last before its cast
    (the module docstring's table); an operand ``r`` leaves unquantized is
    multiplied as it is. Random draws, where a spec makes them, come in the
    order training has always made them: the matmul's sign vector, then the
    operands left to right (the input gradient's weight first). The training
    matmuls and the numerics monitor's quantization noise both call this."""
    if gemm == "forward":
        s = _signs(r, gemm, a.device, tp)
        return _q(a, r.op("fwd_input"), r, s, tp, "fwd_input") @ _q(b, r.op("fwd_weight"), r, s, tp, "fwd_weight").t()
    if gemm == "input gradient":
        s, wop = _signs(r, gemm, a.device, tp), r.op("dgrad_weight")
        if _square(wop) or wop is None:  # the forward's layout: split along the other dimension
            wq = _q(b, wop, r, None, tp, "dgrad_weight", transposed=True)
        else:
            wq = _q(b.t().contiguous(), wop, r, s, tp, "dgrad_weight").t()
        return _q(a, r.op("dgrad_grad_output"), r, s, tp, "dgrad_grad_output") @ wq
    if gemm != "weight gradient":
        raise ValueError(f"product: {gemm!r} is not one of {', '.join(GEMMS)}")
    # Both operands with the tokens as their last (contraction) dimension.
    s = _signs(r, gemm, a.device, tp)
    return (_q(a.float().t().contiguous(), r.op("wgrad_grad_output"), r, s, tp, "wgrad_grad_output")
            @ _q(b.float().t().contiguous(), r.op("wgrad_input"), r, s, tp, "wgrad_input").t())


def unquantized(r: Recipe) -> Recipe:
    """``r`` with every operand left unquantized: :func:`product` of it is the exact
    fp32 product, laid out as ``r``'s is."""
    return replace(r, ops=(None,) * len(ROLES))


class _LabMatmul(torch.autograd.Function):
    """``x W^T + b`` on lab-quantized operands, for 2-D ``x`` (tokens x in features)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], r: Recipe,
                tp: Optional[_TP] = None):
        ctx.r, ctx.has_bias, ctx.tp = r, bias is not None, tp
        ctx.save_for_backward(x, w)
        with torch.autocast(x.device.type, enabled=False):  # the products are fp32's, not autocast's
            y = product("forward", x, w, r, tp)
            if bias is not None:
                y = y + bias.float()
        return y.to(x.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy: torch.Tensor):
        x, w = ctx.saved_tensors
        r, tp = ctx.r, ctx.tp
        with torch.autocast(gy.device.type, enabled=False):
            g = gy.float()
            # the input gradient's draws before the weight gradient's (a resumed run repeats them)
            dx = product("input gradient", g, w, r, tp)
            dw = product("weight gradient", g, x, r, tp)
            db = g.sum(0) if ctx.has_bias else None
        return dx.to(x.dtype), dw.to(w.dtype), db, None, None


class LabLinear(nn.Linear):
    """An ``nn.Linear`` whose matmuls run on lab-quantized operands (the module
    docstring); the same parameters and state_dict keys as the layer it replaces."""

    def __init__(self, in_features: int, out_features: int, recipe: Recipe, bias: bool = True,
                 device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recipe = recipe
        self.lab_recipe = recipe.name  # what the dtype audit reports for this layer's matmuls
        # The multiple a caller pads a variable token count to (a mixture's experts read it):
        # blocks or a transform along the tokens need whole blocks there.
        self.token_multiple = recipe.token_multiple()

    @classmethod
    def from_linear(cls, mod: nn.Linear, recipe: Recipe) -> "LabLinear":
        """A lab layer sharing ``mod``'s Parameter objects (no copy; any device, meta included)."""
        new = cls(mod.in_features, mod.out_features, recipe, bias=mod.bias is not None, device="meta")
        new.weight = mod.weight
        new.bias = mod.bias
        new.train(mod.training)
        return new

    def cast_operands(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The input and weight as the casts receive them: in the autocast dtype
        where autocast is on (as it would cast them for an ``nn.Linear``)."""
        w = self.weight
        dev = x.device.type
        if torch.is_autocast_enabled(dev):
            dt = torch.get_autocast_dtype(dev)
            x, w = x.to(dt), w.to(dt)
        return x, w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, w = self.cast_operands(x)
        if isinstance(w, DTensor):
            return self._split_forward(x, w)
        y = _LabMatmul.apply(x.reshape(-1, self.in_features), w, self.bias, self.recipe)
        return y.reshape(*x.shape[:-1], self.out_features)

    def _split_forward(self, x: torch.Tensor, w: DTensor) -> DTensor:
        """The forward of a layer torch's ``ColwiseParallel``/``RowwiseParallel`` split
        (the weight a DTensor sharded by output rows or input columns).

        The casts run on this rank's parts, as plain tensors, with the all-reduces a
        scale over the whole tensor needs made explicit (``_TP``), rather than as
        DTensor ops: the casts reshape into blocks, read float bits and round by
        hand, which DTensor's sharding rules do not cover, and an explicit MAX
        over the group is one visible, testable step. The result goes back as the
        DTensor the style expects: split by output column (colwise), or a partial
        sum the style all-reduces or reduce-scatters (rowwise)."""
        mesh = w.device_mesh
        side = "colwise" if w.placements[0] == Shard(0) else "rowwise"
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [Replicate() if side == "colwise" else Shard(-1)], run_check=False)
        # A replicated input's gradient is this rank's share of a sum over the group.
        xl = x.to_local(grad_placements=[Partial()]) if side == "colwise" else x.to_local()
        wl = w.to_local()
        bias = self.bias.to_local() if side == "colwise" and self.bias is not None else None
        tp = _TP(mesh.get_group(), side)
        y = _LabMatmul.apply(xl.reshape(-1, wl.shape[1]), wl, bias, self.recipe, tp)
        y = y.reshape(*xl.shape[:-1], wl.shape[0])
        if side == "colwise":
            return DTensor.from_local(y, mesh, [Shard(-1)], run_check=False)
        y = DTensor.from_local(y, mesh, [Partial()], run_check=False)
        return y if self.bias is None else y + self.bias.to(y.dtype)  # the bias once, not once per rank

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, lab={self.recipe.name}"


class LabLinears:
    """Converts ``nn.Linear`` layers to :class:`LabLinear`; the same interface as
    the float8 :class:`~mptrain.precision.policy.Fp8Linears` (``convert``,
    ``report``, ``definition``, and per-step calls with nothing to do here).
    ``recipe`` is ``precision.fp4``'s or ``precision.lab``'s (backend ``lab``),
    ``rules`` which linears it converts."""

    all_gather = False  # weights are gathered in the compute dtype, never in the lab's formats
    matmul = "emulated"
    matmul_why = "dequantized values multiplied in fp32 on every device"

    def __init__(self, recipe: Recipe, rules: LinearRules):
        self.definition, self.rules = recipe, rules
        self.recipe, self.key = recipe.name, recipe.key
        self.report: dict = {}

    def convert(self, model: nn.Module) -> nn.Module:
        """Swap every linear the rules and the blocks let through, in place;
        ``report`` says which and why not."""
        n_blocks = len(getattr(model, "blocks", ()))
        rules = self.rules.for_blocks(n_blocks)
        problem = check_blocks_left(rules, n_blocks, "precision=bf16")
        if problem:
            raise ConfigError(problem)
        converted, excluded = [], {}
        for fqn, mod in list(model.named_modules()):
            if type(mod) is not nn.Linear:  # exactly nn.Linear: a converted layer is a subclass
                continue
            why = excluded_because(rules, mod, fqn, n_blocks) or shape_problem(
                self.definition, fqn, mod.in_features, mod.out_features, None)
            if why:
                excluded[fqn] = why
                continue
            parent, _, name = fqn.rpartition(".")
            setattr(model.get_submodule(parent), name, LabLinear.from_linear(mod, self.definition))
            converted.append(fqn)
        fwd, bwd = self.definition.describe()
        self.report = {"recipe": self.recipe, "operands": self.definition.specs, "converted": converted,
                       "excluded": excluded, "forward": fwd, "backward": bwd,
                       "bf16_last_blocks": rules.last_blocks, "fsdp_float8_all_gather": False,
                       "matmul": self.matmul, "matmul_why": self.matmul_why,
                       # the 4-bit presets' switches, as run_info has always named them
                       **dict(self.definition.switches)}
        return model

    def update_histories(self, reduce_max) -> None:
        """Nothing: no amax history."""

    def refresh_scales(self, model: nn.Module) -> None:
        """Nothing: no scales kept between steps."""


def with_specs(recipe: Recipe, **specs: str) -> Recipe:
    """``recipe`` with some operands replaced (role=spec or none), checked again."""
    merged = {**recipe.specs, **specs}
    return replace(recipe, ops=build_recipe("custom", merged, error=recipe.error, key=recipe.key).ops)
