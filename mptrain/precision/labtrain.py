"""Training linears whose three matmuls run on lab-quantized operands, per GEMM role
(``precision=lab``, ``precision=nvfp4``, ``precision=mxfp4``; docs/formats.md, docs/fp4.md).

A :class:`LabRecipe` gives each operand of each matmul an operand spec
(:mod:`mptrain.precision.lab`), or none (the operand stays as autocast hands it
over). For ``y = x W^T`` with ``x`` (tokens, in), ``W`` (out, in), ``dy`` (tokens, out):

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
and ``mxfp4`` with ``precision.fp4``'s switches applied (:func:`fp4_recipe`):
one implementation of 4-bit training.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from mptrain.core.errors import ConfigError
from mptrain.precision import lab
from mptrain.precision.selection import LinearRules, check_blocks_left, excluded_because

KEEP_SHARE = 0.15  # NVIDIA keeps about 15% of the linears, mostly the last ones, in higher precision
ROLES = ("fwd_input", "fwd_weight", "dgrad_grad_output", "dgrad_weight", "wgrad_grad_output", "wgrad_input")
"""The six operands, in the order of the table in the module docstring."""
GEMMS = {"forward": ("fwd_input", "fwd_weight"), "input gradient": ("dgrad_grad_output", "dgrad_weight"),
         "weight gradient": ("wgrad_grad_output", "wgrad_input")}
NONE = "none"
"""An operand left unquantized."""
STAT_ROLES = {"input": "fwd_input", "weight": "fwd_weight", "grad_output": "dgrad_grad_output"}
"""The operand whose spec the cast statistics measure each tensor with: each arrives
with its contraction dimension last for that matmul (input and weight for the forward,
the output gradient for the input gradient's)."""

NVFP4 = {"fwd_input": "e2m1/1x16/e4m3/nearest", "fwd_weight": "e2m1/16x16/e4m3/nearest",
         "dgrad_grad_output": "e2m1/1x16/e4m3/stochastic", "dgrad_weight": "e2m1/16x16/e4m3/nearest",
         "wgrad_grad_output": "e2m1/1x16/e4m3/stochastic/hadamard", "wgrad_input": "e2m1/1x16/e4m3/nearest/hadamard"}
MXFP4 = dict.fromkeys(ROLES, "e2m1/1x32/ue8m0/nearest")
MXFP8 = dict.fromkeys(ROLES, "e4m3/1x32/ue8m0-rceil/nearest")
_TW = "e4m3/tensor/fp32/nearest"
FP8_TENSORWISE = {"fwd_input": _TW, "fwd_weight": _TW, "dgrad_grad_output": "e5m2/tensor/fp32/nearest",
                  "dgrad_weight": _TW, "wgrad_grad_output": "e5m2/tensor/fp32/nearest", "wgrad_input": _TW}
FP8_ROWWISE = dict.fromkeys(ROLES, "e4m3/row/ue8m0-rceil/nearest")


def _mix(forward: dict, backward: dict) -> dict:
    return {r: (forward if r.startswith("fwd") else backward)[r] for r in ROLES}


NAMED = {
    "fp8_tensorwise": FP8_TENSORWISE,
    "fp8_rowwise": FP8_ROWWISE,
    "fp8_rowwise_with_gw_hp": {**FP8_ROWWISE, "wgrad_grad_output": NONE, "wgrad_input": NONE},
    "mxfp8": MXFP8,
    "nvfp4": NVFP4,
    "mxfp4": MXFP4,
    "hybrid_mxfp8_nvfp4": _mix(MXFP8, NVFP4),
    "nvfp4_ue5m3": {r: s.replace("/e4m3/", "/ue5m3/") for r, s in NVFP4.items()},
    "nvfp4_4over6": {r: s.replace("/e4m3/", "/e4m3-4over6/") for r, s in NVFP4.items()},
    "mxfp6_e2m3": dict.fromkeys(ROLES, "e2m3/1x32/ue8m0/nearest"),
    "mxfp6_e3m2": dict.fromkeys(ROLES, "e3m2/1x32/ue8m0/nearest"),
}
"""The named recipes, operand by operand. The first six are today's presets'
casts (float8 tensorwise and rowwise as torchao casts them, E5M2 gradients for
tensorwise; MXFP8; NVFP4 with its 16x16 weight tiles, stochastic gradients and
Hadamard weight-gradient operands; MXFP4); ``hybrid_mxfp8_nvfp4`` is
TransformerEngine's example of a hybrid (MXFP8 forward, NVFP4 backward);
``nvfp4_ue5m3`` swaps NVFP4's E4M3 block scales for UE5M3; ``nvfp4_4over6``
picks 4 or 6 per block (arXiv 2512.02010); ``mxfp6_*`` are OCP's MXFP6."""
NAMED_WHY = {
    "fp8_tensorwise": "float8 with one fp32 scale per tensor, E4M3 forward and E5M2 gradients (torchao tensorwise)",
    "fp8_rowwise": "float8 E4M3 with one power-of-two scale per row (torchao rowwise)",
    "fp8_rowwise_with_gw_hp": "rowwise, the weight-gradient matmul unquantized (torchao rowwise_with_gw_hp)",
    "mxfp8": "E4M3 in blocks of 32 with power-of-two scales rounded up (torchao MXFP8)",
    "nvfp4": "E2M1 in blocks of 16, E4M3 block scales under an fp32 tensor scale; NVIDIA's recipe",
    "mxfp4": "E2M1 in blocks of 32 with OCP power-of-two scales",
    "hybrid_mxfp8_nvfp4": "MXFP8 forward, NVFP4 backward (TransformerEngine's hybrid example)",
    "nvfp4_ue5m3": "NVFP4 with UE5M3 block scales (TransformerEngine PR 3325)",
    "nvfp4_4over6": "NVFP4, each block scaled to 4 or 6, whichever errs less (Four Over Six)",
    "mxfp6_e2m3": "OCP MXFP6, E2M3 elements",
    "mxfp6_e3m2": "OCP MXFP6, E3M2 elements",
}


@dataclass(frozen=True)
class LabRecipe:
    """One linear's six operands (None: unquantized) and 4over6's error measure."""

    name: str
    ops: tuple[Optional[lab.Operand], ...]
    error: str = "mse"

    def op(self, role: str) -> Optional[lab.Operand]:
        return self.ops[ROLES.index(role)]

    @property
    def specs(self) -> dict[str, str]:
        return {r: (o.spec if o else NONE) for r, o in zip(ROLES, self.ops)}

    def describe(self) -> tuple[str, str]:
        """(forward, backward) in words, for the banner and run_info."""
        s = self.specs
        fwd = f"x {s['fwd_input']}, W {s['fwd_weight']}"
        bwd = (f"dx: dy {s['dgrad_grad_output']}, W {s['dgrad_weight']}; "
               f"dW: dy {s['wgrad_grad_output']}, x {s['wgrad_input']}")
        return fwd, bwd

    def elements(self, forward: bool) -> str:
        """The element formats of the forward (or backward) operands, upper case:
        ``E2M1``, ``E4M3/E5M2``; ``unquantized`` where none is."""
        roles = [r for r in ROLES if r.startswith("fwd") == forward]
        names = sorted({self.op(r).element.name.upper() for r in roles if self.op(r)})
        return "/".join(names) or "unquantized"

    def formats(self) -> dict[str, str]:
        """The element format of each operand the cast statistics measure."""
        return {k: (self.op(r).element.name if self.op(r) else NONE) for k, r in STAT_ROLES.items()}


def build_recipe(name: str, overrides: Optional[dict] = None, *, error: str = "mse",
                 allow_forward_stochastic: bool = False, key: str = "precision.lab") -> LabRecipe:
    """The recipe ``name`` (a key of :data:`NAMED`, or ``custom``: every operand
    given) with ``overrides`` (role -> spec or ``none``) on top, every spec parsed
    and the recipe checked: one :class:`ConfigError` sentence for what is wrong."""
    if name != "custom" and name not in NAMED:
        raise ConfigError(f"{key}.recipe={name!r} is not a named recipe: one of {', '.join(NAMED)}, or custom "
                          "(every operand given).")
    specs = dict(NAMED.get(name, {}))
    specs.update({r: v for r, v in (overrides or {}).items() if v is not None})
    missing = [r for r in ROLES if r not in specs]
    if missing:
        raise ConfigError(f"{key}.recipe=custom needs every operand; {', '.join(f'{key}.{r}' for r in missing)} "
                          "not given (a spec such as e2m1/1x16/e4m3/nearest, or none).")
    if error not in lab.FOUR_OVER_SIX_ERRORS:
        raise ConfigError(f"{key}.fourover6_error={error!r}: one of {', '.join(lab.FOUR_OVER_SIX_ERRORS)}.")
    ops = []
    for r in ROLES:
        text = str(specs[r]).strip()
        try:
            ops.append(None if text.lower() == NONE else lab.parse(text))
        except lab.SpecError as e:
            raise ConfigError(f"{key}.{r}: {e}") from None
    recipe = LabRecipe(name, tuple(ops), error)
    problem = _check(recipe, allow_forward_stochastic, key)
    if problem:
        raise ConfigError(problem)
    return recipe


def _check(r: LabRecipe, allow_forward_stochastic: bool, key: str) -> Optional[str]:
    """The recipe-wide rules: stochastic forward operands, and transforms on both operands."""
    for role in GEMMS["forward"]:
        o = r.op(role)
        if o and o.stochastic and not allow_forward_stochastic:
            return (f"{key}.{role}={o.spec} rounds a forward operand stochastically, which makes the forward "
                    f"pass (and the loss) random; round it to nearest, or set {key}.allow_forward_stochastic=true.")
    for gemm, (a, b) in GEMMS.items():
        ta, tb = [(r.op(x).transform if r.op(x) else "") for x in (a, b)]
        if ta != tb:
            return (f"the {gemm} matmul has transform '{ta or 'none'}' on {key}.{a} and '{tb or 'none'}' on "
                    f"{key}.{b}: a Hadamard transform leaves the product unchanged only when both operands "
                    "take the same one; give both the same.")
    return None


def fp4_recipe(fcfg) -> LabRecipe:
    """``precision.fp4`` (``precision=nvfp4``/``mxfp4`` and their study switches) as a lab recipe."""
    fmt = fcfg.format.value
    specs = dict(NAMED[fmt])
    if fmt == "nvfp4" and not fcfg.weight_2d:
        specs.update(fwd_weight="e2m1/1x16/e4m3/nearest", dgrad_weight="e2m1/1x16/e4m3/nearest")
    for r in ("dgrad_grad_output", "wgrad_grad_output"):
        rnd = "stochastic" if fcfg.stochastic_rounding else "nearest"
        specs[r] = specs[r].replace("/stochastic", f"/{rnd}").replace("/nearest", f"/{rnd}")
    for r in ("wgrad_grad_output", "wgrad_input"):
        specs[r] = specs[r].replace("/hadamard", "") + ("/hadamard" if fcfg.hadamard else "")
    return build_recipe(fmt, specs, key="precision.fp4")


def lab_recipe(lcfg) -> LabRecipe:
    """``precision.lab`` as a recipe: the named one with the six keys on top."""
    overrides = {r: getattr(lcfg, r) for r in ROLES}
    return build_recipe(str(lcfg.recipe), overrides, error=str(lcfg.fourover6_error),
                        allow_forward_stochastic=bool(lcfg.allow_forward_stochastic))


def shape_problem(r: LabRecipe, fqn: str, in_f: int, out_f: int, tokens: Optional[int]) -> Optional[str]:
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


def _q(x: torch.Tensor, op: Optional[lab.Operand], r: LabRecipe, signs=None, tp=None, role: str = "",
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


def _signs(r: LabRecipe, gemm: str, device, tp=None) -> Optional[torch.Tensor]:
    """The sign vector of one matmul's transform, drawn once for both its operands
    (``hadamard-random`` draws anew at every call), or None without a transform.
    Under tensor parallelism every rank of the group multiplies with the first
    rank's draw: a transform is exact only with one vector for the whole matmul."""
    op = r.op(GEMMS[gemm][0])
    if op is None or not op.transform:
        return None
    signs = lab.transform_signs(op, device)
    return tp.same_signs(signs) if tp is not None and op.transform == "hadamard-random" else signs


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
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
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


class _LabMatmul(torch.autograd.Function):
    """``x W^T + b`` on lab-quantized operands, for 2-D ``x`` (tokens x in features)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], r: LabRecipe,
                tp: Optional[_TP] = None):
        ctx.r, ctx.has_bias, ctx.tp = r, bias is not None, tp
        ctx.save_for_backward(x, w)
        with torch.autocast(x.device.type, enabled=False):  # the products are fp32's, not autocast's
            s = _signs(r, "forward", x.device, tp)
            y = _q(x, r.op("fwd_input"), r, s, tp, "fwd_input") @ _q(w, r.op("fwd_weight"), r, s, tp, "fwd_weight").t()
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
            s, wop = _signs(r, "input gradient", g.device, tp), r.op("dgrad_weight")
            if _square(wop) or wop is None:  # the forward's layout: split along the other dimension
                wq = _q(w, wop, r, None, tp, "dgrad_weight", transposed=True)
            else:
                wq = _q(w.t().contiguous(), wop, r, s, tp, "dgrad_weight").t()
            dx = _q(g, r.op("dgrad_grad_output"), r, s, tp, "dgrad_grad_output") @ wq
            # Weight gradient: both operands with the tokens as their last (contraction) dimension.
            s, a_op, b_op = (_signs(r, "weight gradient", g.device, tp), r.op("wgrad_grad_output"),
                             r.op("wgrad_input"))
            dw = (_q(g.t().contiguous(), a_op, r, s, tp, "wgrad_grad_output")
                  @ _q(x.float().t().contiguous(), b_op, r, s, tp, "wgrad_input").t())
            db = g.sum(0) if ctx.has_bias else None
        return dx.to(x.dtype), dw.to(w.dtype), db, None, None


class LabLinear(nn.Linear):
    """An ``nn.Linear`` whose matmuls run on lab-quantized operands (the module
    docstring); the same parameters and state_dict keys as the layer it replaces."""

    def __init__(self, in_features: int, out_features: int, recipe: LabRecipe, bias: bool = True,
                 device=None, dtype=None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recipe = recipe
        self.lab_recipe = recipe.name  # what the dtype audit reports for this layer's matmuls

    @classmethod
    def from_linear(cls, mod: nn.Linear, recipe: LabRecipe) -> "LabLinear":
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


def kept_last_blocks(cfg, n_blocks: int) -> int:
    """``bf16_last_blocks``, its null resolved to the recipe's 15% (rounded up)."""
    if cfg.bf16_last_blocks is None:
        return math.ceil(KEEP_SHARE * n_blocks)
    return int(cfg.bf16_last_blocks)


class LabLinears:
    """Converts ``nn.Linear`` layers to :class:`LabLinear`; the same interface as
    the float8 :class:`~mptrain.precision.policy.Fp8Linears` (``convert``,
    ``report``, ``cast_rules``, and per-step calls with nothing to do here).
    ``cfg`` is ``precision.fp4`` or ``precision.lab`` (both carry ``exclude`` and
    ``bf16_last_blocks``); ``recipe`` the lab recipe either one makes."""

    all_gather = False  # weights are gathered in the compute dtype, never in the lab's formats
    matmul = "emulated"
    matmul_why = "dequantized values multiplied in fp32 on every device"

    def __init__(self, cfg, recipe: LabRecipe, key: str):
        self.cfg, self.kind, self.key = cfg, recipe, key
        self.recipe = recipe.name
        self.report: dict = {}

    def _rules(self, n_blocks: int) -> LinearRules:
        last = kept_last_blocks(self.cfg, n_blocks)
        why = (f"null: the recipe's {KEEP_SHARE:.0%} of {n_blocks} blocks, rounded up"
               if self.cfg.bf16_last_blocks is None else "")
        what = "4-bit" if self.key == "precision.fp4" else f"the lab's {self.recipe}"
        return LinearRules(self.key, what, tuple(self.cfg.exclude), 0, last, 0, 1, "", why)

    def convert(self, model: nn.Module) -> nn.Module:
        """Swap every linear the rules and the blocks let through, in place;
        ``report`` says which and why not."""
        n_blocks = len(getattr(model, "blocks", ()))
        rules = self._rules(n_blocks)
        problem = check_blocks_left(rules, n_blocks, "precision=bf16")
        if problem:
            raise ConfigError(problem)
        converted, excluded = [], {}
        for fqn, mod in list(model.named_modules()):
            if type(mod) is not nn.Linear:  # exactly nn.Linear: a converted layer is a subclass
                continue
            why = excluded_because(rules, mod, fqn, n_blocks) or shape_problem(
                self.kind, fqn, mod.in_features, mod.out_features, None)
            if why:
                excluded[fqn] = why
                continue
            parent, _, name = fqn.rpartition(".")
            setattr(model.get_submodule(parent), name, LabLinear.from_linear(mod, self.kind))
            converted.append(fqn)
        fwd, bwd = self.kind.describe()
        self.report = {"recipe": self.recipe, "operands": self.kind.specs, "converted": converted,
                       "excluded": excluded, "forward": fwd, "backward": bwd,
                       "bf16_last_blocks": rules.last_blocks, "fsdp_float8_all_gather": False,
                       "matmul": self.matmul, "matmul_why": self.matmul_why}
        if self.key == "precision.fp4":  # the 4-bit presets' switches, as run_info has always named them
            c = self.cfg
            self.report.update(block_size=16 if self.recipe == "nvfp4" else 32, hadamard=bool(c.hadamard),
                               stochastic_rounding=bool(c.stochastic_rounding), weight_2d=bool(c.weight_2d))
        return model

    def cast_rules(self, whatif: list[str]) -> tuple[str, dict[str, str], list[str]]:
        """The cast statistics' view of this run (``observe/fp8watch.py``): each
        measured operand's element format under the run's own recipe, and the
        what-ifs beside it."""
        return self.recipe, self.kind.formats(), [w for w in whatif if w != self.recipe]

    def update_histories(self, reduce_max) -> None:
        """Nothing: no amax history."""

    def refresh_scales(self, model: nn.Module) -> None:
        """Nothing: no scales kept between steps."""


def with_specs(recipe: LabRecipe, **specs: str) -> LabRecipe:
    """``recipe`` with some operands replaced (role=spec or none), checked again."""
    merged = {**recipe.specs, **specs}
    return replace(build_recipe("custom", merged, error=recipe.error), name=recipe.name)
