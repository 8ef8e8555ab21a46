"""One recipe type for every low-precision preset, one vocabulary of recipe
names, and the precision section as a frozen plan.

A :class:`Recipe` says, for each operand of a linear's three matmuls (the six
:data:`ROLES`), the operand spec it is cast with in the format lab's grammar
(:mod:`mptrain.precision.lab`), or none, and the backend that executes it:

- ``torchao float8``: torchao's ``Float8Linear`` (``tensorwise``, ``rowwise``,
  ``rowwise_with_gw_hp``), its kernel chosen by ``precision.fp8.matmul``;
- ``torchao mx``: torchao's block-scaled training (``mxfp8``; ``nvfp4`` where
  it can run), :mod:`mptrain.precision.fp8mx`;
- ``delayed``: mptrain's delayed-scaling float8 linear (``delayed``, with its
  history length, amax rule and margin), :mod:`mptrain.precision.fp8delayed`;
- ``lab``: the lab's emulated linears (``precision=nvfp4``/``mxfp4`` and
  ``precision=lab``), :mod:`mptrain.precision.labtrain`.

The specs of the torchao and delayed backends describe the casts those
backends make (tests/test_labtrain.py trains the lab's spec of each float8
recipe bit for bit as torchao's emulated linear); they are what the cast
statistics measure. ``precision.fp8``, ``precision.fp4`` and ``precision.lab``
all become a recipe through :func:`recipe_of`, and the whole ``precision``
section a :class:`PrecisionPlan` through :func:`precision_plan`.

One vocabulary: :data:`NAMED` holds every recipe name a user types, in
``precision.fp8.recipe`` (its values, ``delayed`` aside, which names a backend
over ``tensorwise``'s casts), ``precision.fp4.format``, ``precision.lab.recipe``
and ``monitor.fp8_whatif``; ``python -m mptrain.formats --recipes`` prints it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch
from omegaconf import OmegaConf

from mptrain.config.schema import Fp4Format, Fp8Recipe, LossScaleConfig, UpdateRounding
from mptrain.core.errors import ConfigError
from mptrain.core.frozen import frozen
from mptrain.precision import lab
from mptrain.precision.formats import dtype_name
from mptrain.precision.selection import LinearRules

ROLES = ("fwd_input", "fwd_weight", "dgrad_grad_output", "dgrad_weight", "wgrad_grad_output", "wgrad_input")
"""The six operands: the forward, input-gradient and weight-gradient matmuls' two each
(:mod:`mptrain.precision.labtrain` tabulates their layouts)."""
GEMMS = {"forward": ("fwd_input", "fwd_weight"), "input gradient": ("dgrad_grad_output", "dgrad_weight"),
         "weight gradient": ("wgrad_grad_output", "wgrad_input")}
NONE = "none"
"""An operand left unquantized."""
TOKEN_ROWS, TOKEN_CONTRACTION = ("fwd_input", "dgrad_grad_output"), ("wgrad_grad_output", "wgrad_input")
"""The operands whose tokens are a dimension blocks could run along: the rows of the forward's
and the input gradient's activation operands, and the weight gradient's contraction."""
STAT_ROLES = {"input": "fwd_input", "weight": "fwd_weight", "grad_output": "dgrad_grad_output"}
"""The operand whose spec the cast statistics measure each tensor with: each arrives
with its contraction dimension last for that matmul (input and weight for the forward,
the output gradient for the input gradient's)."""

TORCHAO_FLOAT8, TORCHAO_MX, DELAYED, LAB = "torchao float8", "torchao mx", "delayed", "lab"
BACKENDS = (TORCHAO_FLOAT8, TORCHAO_MX, DELAYED, LAB)
"""What executes a recipe's casts and matmuls (the module docstring)."""
FLOAT8_BACKEND = {"tensorwise": TORCHAO_FLOAT8, "rowwise": TORCHAO_FLOAT8, "rowwise_with_gw_hp": TORCHAO_FLOAT8,
                  "delayed": DELAYED, "mxfp8": TORCHAO_MX, "nvfp4": TORCHAO_MX}
"""``precision.fp8.recipe`` -> its backend."""

NVFP4 = {"fwd_input": "e2m1/1x16/e4m3/nearest", "fwd_weight": "e2m1/16x16/e4m3/nearest",
         "dgrad_grad_output": "e2m1/1x16/e4m3/stochastic", "dgrad_weight": "e2m1/16x16/e4m3/nearest",
         "wgrad_grad_output": "e2m1/1x16/e4m3/stochastic/hadamard", "wgrad_input": "e2m1/1x16/e4m3/nearest/hadamard"}
MXFP4 = dict.fromkeys(ROLES, "e2m1/1x32/ue8m0/nearest")
MXFP8 = dict.fromkeys(ROLES, "e4m3/1x32/ue8m0-rceil/nearest")
_TW = "e4m3/tensor/fp32/nearest"
TENSORWISE = {"fwd_input": _TW, "fwd_weight": _TW, "dgrad_grad_output": "e5m2/tensor/fp32/nearest",
              "dgrad_weight": _TW, "wgrad_grad_output": "e5m2/tensor/fp32/nearest", "wgrad_input": _TW}
ROWWISE = dict.fromkeys(ROLES, "e4m3/row/ue8m0-rceil/nearest")
_NV1D = "e2m1/1x16/e4m3/nearest"


def _mix(forward: dict, backward: dict) -> dict:
    return {r: (forward if r.startswith("fwd") else backward)[r] for r in ROLES}


NAMED = {
    "tensorwise": TENSORWISE,
    "rowwise": ROWWISE,
    "rowwise_with_gw_hp": {**ROWWISE, "wgrad_grad_output": NONE, "wgrad_input": NONE},
    "mxfp8": MXFP8,
    "block1x128": dict.fromkeys(ROLES, "e4m3/1x128/fp32/nearest"),
    "block128x128": dict.fromkeys(ROLES, "e4m3/128x128/fp32/nearest"),
    "nvfp4": NVFP4,
    "nvfp4_1d": {**NVFP4, "fwd_weight": _NV1D, "dgrad_weight": _NV1D},
    "nvfp4_rht": {r: s.replace("16x16", "1x16").removesuffix("/hadamard") + "/hadamard" for r, s in NVFP4.items()},
    "mxfp4": MXFP4,
    "hybrid_mxfp8_nvfp4": _mix(MXFP8, NVFP4),
    "nvfp4_ue5m3": {r: s.replace("/e4m3/", "/ue5m3/") for r, s in NVFP4.items()},
    "nvfp4_4over6": {r: s.replace("/e4m3/", "/e4m3-4over6/") for r, s in NVFP4.items()},
    "mxfp6_e2m3": dict.fromkeys(ROLES, "e2m3/1x32/ue8m0/nearest"),
    "mxfp6_e3m2": dict.fromkeys(ROLES, "e3m2/1x32/ue8m0/nearest"),
}
"""Every recipe name, operand by operand. The float8 presets' casts as torchao makes
them (``tensorwise`` with E5M2 gradients, which ``precision.fp8.grad_dtype`` sets
for the float8 presets; ``rowwise`` and ``rowwise_with_gw_hp`` with torchao's own
E4M3 gradients; ``mxfp8``); DeepSeek-V3's fp32-scaled blocks (``block1x128``,
``block128x128``, each on every operand); NVFP4 with its 16x16 weight tiles,
stochastic gradients and Hadamard weight-gradient operands, and its 1x16-weight
(``nvfp4_1d``) and all-Hadamard (``nvfp4_rht``) variants; MXFP4;
``hybrid_mxfp8_nvfp4`` (TransformerEngine's hybrid example: MXFP8 forward, NVFP4
backward); ``nvfp4_ue5m3`` (UE5M3 block scales); ``nvfp4_4over6`` (4 or 6 per
block, arXiv 2512.02010); ``mxfp6_*`` (OCP's MXFP6)."""
NAMED_WHY = {
    "tensorwise": "float8 with one fp32 scale per tensor, E4M3 forward and E5M2 gradients (torchao tensorwise)",
    "rowwise": "float8 E4M3 with one power-of-two scale per row (torchao rowwise)",
    "rowwise_with_gw_hp": "rowwise, the weight-gradient matmul unquantized (torchao rowwise_with_gw_hp)",
    "mxfp8": "E4M3 in blocks of 32 with power-of-two scales rounded up (torchao MXFP8)",
    "block1x128": "E4M3 with one fp32 scale per 128 elements of a row (DeepSeek-V3's activation blocks)",
    "block128x128": "E4M3 with one fp32 scale per 128 x 128 tile (DeepSeek-V3's weight blocks)",
    "nvfp4": "E2M1 in blocks of 16, E4M3 block scales under an fp32 tensor scale; NVIDIA's recipe",
    "nvfp4_1d": "NVFP4 with weights in 1 x 16 blocks, not 16 x 16 tiles (precision=nvfp4-1d)",
    "nvfp4_rht": "NVFP4 in 1 x 16 blocks, every matmul's operands after the fixed-sign Hadamard transform",
    "mxfp4": "E2M1 in blocks of 32 with OCP power-of-two scales",
    "hybrid_mxfp8_nvfp4": "MXFP8 forward, NVFP4 backward (TransformerEngine's hybrid example)",
    "nvfp4_ue5m3": "NVFP4 with UE5M3 block scales (TransformerEngine PR 3325)",
    "nvfp4_4over6": "NVFP4, each block scaled to 4 or 6, whichever errs less (Four Over Six)",
    "mxfp6_e2m3": "OCP MXFP6, E2M3 elements",
    "mxfp6_e3m2": "OCP MXFP6, E3M2 elements",
}
# One vocabulary: every name precision.fp8.recipe and precision.fp4.format take is a
# named recipe, except delayed, the delayed-scaling backend over tensorwise's casts.
assert {r.value for r in Fp8Recipe} - {"delayed"} <= set(NAMED) >= {f.value for f in Fp4Format}


@dataclass(frozen=True)
class DelayedScaling:
    """The delayed-scaling backend's options (``precision.fp8.amax_history_len``,
    ``amax_compute``, ``margin``; :mod:`mptrain.precision.fp8delayed`)."""

    history_len: int
    """How many past steps' amaxes each operand's history keeps."""
    amax_compute: str
    """``max`` over the history or ``most_recent``."""
    margin: int
    """scale = format max / (amax * 2^margin)."""


@dataclass(frozen=True)
class Recipe:
    """One low-precision recipe: six operand casts (None: unquantized) and the
    backend that executes them, with that backend's options."""

    name: str
    """A name of :data:`NAMED`, ``delayed``, or ``custom``."""
    ops: tuple[Optional[lab.Operand], ...]
    """One per :data:`ROLES`, in that order."""
    backend: str = LAB
    """One of :data:`BACKENDS`."""
    key: str = "precision.lab"
    """The config section it came from, named in every message about it."""
    error: str = "mse"
    """4over6's error measure (``precision.lab.fourover6_error``)."""
    matmul: str = "emulated"
    """``precision.fp8.matmul`` (``auto``, ``scaled_mm``, ``emulated``); the lab's is always ``emulated``."""
    delayed: Optional[DelayedScaling] = None
    """The delayed backend's options; None for the others."""
    all_gather: bool = False
    """``precision.fp8.fsdp_float8_all_gather``: gather float8 weights under FSDP2
    (the policy grants it to tensorwise under FSDP2 only)."""
    switches: tuple[tuple[str, Any], ...] = ()
    """What ``precision.fp4``'s keys set, as run_info has always named them (block_size,
    hadamard, stochastic_rounding, weight_2d)."""

    def op(self, role: str) -> Optional[lab.Operand]:
        """The cast of operand ``role``, or None."""
        return self.ops[ROLES.index(role)]

    def token_multiple(self) -> int:
        """What the tokens of one linear's call must be a multiple of for these casts:
        the rows of the forward's and the input gradient's activation operands, and the
        weight gradient's contraction (blocks or a Hadamard transform along the tokens).
        1 for one scale per tensor or per row. A mixture's experts pad each expert's
        tokens with zero rows up to it (``model/moe.py``)."""
        n = 1
        for role in TOKEN_ROWS:
            o = self.op(role)
            n = math.lcm(n, o.row_multiple() if o else 1)
        for role in TOKEN_CONTRACTION:
            o = self.op(role)
            n = math.lcm(n, o.contraction_multiple() if o else 1)
        return n

    @property
    def specs(self) -> dict[str, str]:
        """Every operand's spec (``none`` where unquantized)."""
        return {r: (o.spec if o else NONE) for r, o in zip(ROLES, self.ops)}

    @property
    def grad_element(self) -> str:
        """The output gradient's element format in the input-gradient matmul."""
        o = self.op("dgrad_grad_output")
        return o.element.name if o else NONE

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
        """The element format of each operand the cast statistics measure (``none`` where unquantized)."""
        return {k: (self.op(r).element.name if self.op(r) else NONE) for k, r in STAT_ROLES.items()}


def build_recipe(name: str, overrides: Optional[dict] = None, *, error: str = "mse",
                 allow_forward_stochastic: bool = False, key: str = "precision.lab", **backend: Any) -> Recipe:
    """The recipe ``name`` (a key of :data:`NAMED`, or ``custom``: every operand
    given) with ``overrides`` (role -> spec or ``none``) on top, every spec parsed
    and the recipe checked: one :class:`ConfigError` sentence for what is wrong.
    ``backend``: the other :class:`Recipe` fields (the lab's when not given)."""
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
    recipe = Recipe(name, tuple(ops), key=key, error=error, **backend)
    problem = _check(recipe, allow_forward_stochastic, key)
    if problem:
        raise ConfigError(problem)
    return recipe


def _check(r: Recipe, allow_forward_stochastic: bool, key: str) -> Optional[str]:
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


def _with_element(spec: str, element: str) -> str:
    """``spec`` with its element format replaced; ``none`` stays."""
    return spec if spec == NONE else f"{element}/{spec.split('/', 1)[1]}"


def fp8_recipe(f) -> Recipe:
    """``precision.fp8`` as a recipe: the named recipe's casts (``delayed``:
    tensorwise's), the output gradient in ``grad_dtype`` for the float8 backends
    (torchao's MX casts keep their own), and the backend with its options."""
    name = f.recipe.value
    backend = FLOAT8_BACKEND[name]
    specs = dict(NAMED["tensorwise" if name == "delayed" else name])
    if backend != TORCHAO_MX:
        grad = dtype_name(getattr(torch, f.grad_dtype.value))
        for r in ("dgrad_grad_output", "wgrad_grad_output"):
            specs[r] = _with_element(specs[r], grad)
    delayed = (DelayedScaling(int(f.amax_history_len), f.amax_compute.value, int(f.margin))
               if backend == DELAYED else None)
    # built as "custom" (every operand given), then named: the name is the preset's, the checks the same
    r = build_recipe("custom", specs, key="precision.fp8", backend=backend, matmul=f.matmul.value,
                     delayed=delayed, all_gather=bool(f.fsdp_float8_all_gather))
    return replace(r, name=name)


def fp4_recipe(f) -> Recipe:
    """``precision.fp4`` (``precision=nvfp4``/``mxfp4`` and their study switches) as a lab recipe."""
    fmt = f.format.value
    specs = dict(NAMED[fmt])
    if fmt == "nvfp4" and not f.weight_2d:
        specs.update(fwd_weight=_NV1D, dgrad_weight=_NV1D)
    for r in ("dgrad_grad_output", "wgrad_grad_output"):
        rnd = "stochastic" if f.stochastic_rounding else "nearest"
        specs[r] = specs[r].replace("/stochastic", f"/{rnd}").replace("/nearest", f"/{rnd}")
    for r in ("wgrad_grad_output", "wgrad_input"):
        specs[r] = specs[r].replace("/hadamard", "") + ("/hadamard" if f.hadamard else "")
    switches = (("block_size", 16 if fmt == "nvfp4" else 32), ("hadamard", bool(f.hadamard)),
                ("stochastic_rounding", bool(f.stochastic_rounding)), ("weight_2d", bool(f.weight_2d)))
    return build_recipe(fmt, specs, key="precision.fp4", switches=switches)


def lab_recipe(c) -> Recipe:
    """``precision.lab`` as a recipe: the named one with the six keys on top."""
    overrides = {r: getattr(c, r) for r in ROLES}
    return build_recipe(str(c.recipe), overrides, error=str(c.fourover6_error),
                        allow_forward_stochastic=bool(c.allow_forward_stochastic))


def recipe_of(p) -> Optional[Recipe]:
    """The run's low-precision recipe from the ``precision`` section ``p`` (the
    float8, 4-bit or lab linears it turns on: the config checks allow one), or
    None without low-precision linears. Invalid specs raise :class:`ConfigError`."""
    if p.fp8.enabled:
        return fp8_recipe(p.fp8)
    if p.fp4.enabled:
        return fp4_recipe(p.fp4)
    if p.lab.enabled:
        return lab_recipe(p.lab)
    return None


def rules_of(p) -> Optional[LinearRules]:
    """Which linears the recipe of ``p`` converts (:class:`LinearRules`; the 4-bit
    and lab sections' ``bf16_last_blocks`` null stays None until the model's
    blocks are counted), or None without low-precision linears."""
    if p.fp8.enabled:
        f = p.fp8
        return LinearRules("precision.fp8", "float8", tuple(f.exclude), f.bf16_first_blocks, f.bf16_last_blocks,
                           f.min_features, f.dim_multiple)
    for section, what in (("fp4", "4-bit"), ("lab", f"the lab's {p.lab.recipe}")):
        c = getattr(p, section)
        if c.enabled:
            last = None if c.bf16_last_blocks is None else int(c.bf16_last_blocks)
            return LinearRules(f"precision.{section}", what, tuple(c.exclude), 0, last, 0, 1)
    return None


# ------------------------------------------------------------------ the precision plan
@dataclass(frozen=True)
class PrecisionPlan:
    """The ``precision`` section as the facts a run uses, derived once
    (:func:`precision_plan`): the dtypes, the loss scaling, the low-precision
    recipe and which linears it converts."""

    name: str
    """The preset (``precision=`` option), for run names and tags."""
    compute_dtype: torch.dtype
    """What autocast computes matmuls in (fp32: autocast off)."""
    param_dtype: torch.dtype
    """Storage of parameters, gradients and optimizer state: fp32 with master weights, else the compute dtype."""
    wrapper_param_dtype: torch.dtype
    """What a sharding wrapper gathers the linears in (``precision.param_dtype``, null: the compute dtype)."""
    reduce_dtype: torch.dtype
    """What gradients are reduced in across ranks."""
    buffer_dtype: torch.dtype
    """Module buffers' dtype under FSDP/DDP."""
    master_weights: bool
    """fp32 master weights (false: ``bf16-pure`` and its update-rounding variants)."""
    update_rounding: UpdateRounding
    """How updates reach bf16-stored weights (``nearest``, ``stochastic``, ``kahan``)."""
    loss_scale: LossScaleConfig
    """Loss scaling: a frozen copy of the ``precision.loss_scale`` section (:func:`~mptrain.core.frozen.frozen`)."""
    recipe: Optional[Recipe]
    """The low-precision linears' recipe; None without them."""
    rules: Optional[LinearRules]
    """Which linears the recipe converts; None without a recipe."""

    @property
    def float8(self) -> bool:
        """The linears are float8 ones (``precision.fp8``: torchao's, delayed scaling's, MX),
        not the lab's emulated ones."""
        return self.recipe is not None and self.recipe.backend != LAB

    @property
    def float8_gather(self) -> bool:
        """Tensorwise float8 linears asked to all-gather their weights in float8 under FSDP2
        (``precision.fp8.fsdp_float8_all_gather``; the policy grants it where the wrapper can)."""
        r = self.recipe
        return r is not None and r.backend == TORCHAO_FLOAT8 and r.name == "tensorwise" and r.all_gather


def precision_plan(p) -> PrecisionPlan:
    """The :class:`PrecisionPlan` of the ``precision`` section ``p`` (anything
    with its attributes: a composed config, or a frozen copy of it). Invalid
    specs and recipes raise the one-sentence :class:`ConfigError` of :func:`recipe_of`."""
    compute = p.compute_dtype.torch
    ls = OmegaConf.to_object(p.loss_scale) if OmegaConf.is_config(p.loss_scale) else p.loss_scale
    return PrecisionPlan(
        name=str(p.name), compute_dtype=compute,
        param_dtype=torch.float32 if p.master_weights else compute,
        wrapper_param_dtype=(p.param_dtype or p.compute_dtype).torch,
        reduce_dtype=p.reduce_dtype.torch, buffer_dtype=p.buffer_dtype.torch,
        master_weights=bool(p.master_weights), update_rounding=p.update_rounding,
        loss_scale=frozen(ls),
        recipe=recipe_of(p), rules=rules_of(p))

