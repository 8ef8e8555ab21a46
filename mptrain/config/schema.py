"""The typed config schema and its ConfigStore registration.

Every key a user can set lives in one of the dataclasses below, with a
docstring-style comment and a marker of what a resume may do with a changed
value: ``guarded(...)``, ``recorded(...)`` or ``harmless(..., why=...)`` (see
"on resume" below). Hydra merges the YAML files of ``mptrain/configs/`` into this
schema, so a misspelt key or a value of the wrong type fails before any work
starts. Choices that form a closed set are Enums: OmegaConf then names the
valid values in its error message.

What Hydra cannot check on its own lives beside this file, in
``checks.py``: the command-line key pre-check (a misspelt key with the
valid choices) and the cross-field rules (batch sizes that must divide,
heads that must divide the width, ...).
"""
from __future__ import annotations

import functools
import typing
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from enum import Enum
from typing import Any, Optional

from hydra.core.config_store import ConfigStore


class DType(Enum):
    """The floating-point formats a user can name in the config."""

    fp32 = "float32"
    bf16 = "bfloat16"
    fp16 = "float16"

    @property
    def torch(self):
        import torch

        return getattr(torch, self.value)


class ScaleMode(Enum):
    dynamic = "dynamic"
    static = "static"


class Fp8Recipe(Enum):
    """``precision.fp8.recipe``: named recipes (``mptrain/precision/recipe.py``), and ``delayed``."""

    tensorwise = "tensorwise"
    rowwise = "rowwise"
    rowwise_with_gw_hp = "rowwise_with_gw_hp"
    delayed = "delayed"
    mxfp8 = "mxfp8"
    nvfp4 = "nvfp4"


class Fp8Matmul(Enum):
    """Which kernel multiplies the float8 operands (``precision.fp8.matmul``)."""

    auto = "auto"
    scaled_mm = "scaled_mm"
    emulated = "emulated"


class Fp4Format(Enum):
    """The 4-bit format of ``precision.fp4`` (``mptrain/precision/labtrain.py``)."""

    nvfp4 = "nvfp4"
    mxfp4 = "mxfp4"


class AmaxCompute(Enum):
    """How delayed scaling reads its amax history."""

    max = "max"
    most_recent = "most_recent"


class Fp8GradDtype(Enum):
    e5m2 = "float8_e5m2"
    e4m3 = "float8_e4m3fn"


class UpdateRounding(Enum):
    """How an optimizer update is added to weights stored in bf16 (no fp32 masters)."""

    nearest = "nearest"
    stochastic = "stochastic"
    kahan = "kahan"


# What Adam's two moments are stored as. A functional Enum because two of the
# names start with a digit, as users know them from bitsandbytes ("8-bit Adam").
StateDtype = Enum("StateDtype", {"fp32": "fp32", "bf16": "bf16", "8bit": "8bit", "4bit": "4bit", "fp8": "fp8"})
StateDtype.__doc__ = "Storage of Adam's moments: ``optim.state_dtype`` (see docs/optimizer_state.md)."


class ModelFamily(Enum):
    """The decoder families (``mptrain/model/``)."""

    gpt = "gpt"
    llama = "llama"
    moe = "moe"


class Ffn(Enum):
    """The block's feed-forward network."""

    gelu = "gelu"
    swiglu = "swiglu"
    smooth_swiglu = "smooth_swiglu"


class MoEGate(Enum):
    """How a router turns its logits into gate scores (``model.moe.gate``)."""

    softmax = "softmax"
    sigmoid = "sigmoid"


class MoEBalance(Enum):
    """How the experts' load is balanced (``model.moe.balance``)."""

    aux_loss = "aux_loss"
    bias = "bias"
    none = "none"


class RouterDtype(Enum):
    """What a router computes its logits, gates and top-k in (``model.moe.router_dtype``)."""

    fp32 = "fp32"
    compute = "compute"


class EPDispatch(Enum):
    """The dtype a routed layer's tokens cross to their experts in (``parallel.ep_dispatch``)."""

    compute = "compute"
    fp32 = "fp32"
    bf16 = "bf16"
    fp8 = "fp8"


class ExpertGemm(Enum):
    """How the experts' matmuls run (``model.moe.expert_gemm``)."""

    auto = "auto"
    grouped = "grouped"
    looped = "looped"


class RopeDtype(Enum):
    """What the rotary angle tables are computed in."""

    fp32 = "fp32"
    bf16 = "bf16"


class ActCheckpoint(Enum):
    none = "none"
    block = "block"


class NonFinite(Enum):
    abort = "abort"
    skip = "skip"


class ParallelMode(Enum):
    none = "none"
    ddp = "ddp"
    fsdp = "fsdp"
    fsdp1 = "fsdp1"
    hsdp = "hsdp"
    fsdp_tp = "fsdp_tp"


class LRSchedule(Enum):
    cosine = "cosine"
    linear = "linear"
    constant = "constant"


class WandbMode(Enum):
    offline = "offline"
    online = "online"
    disabled = "disabled"


# ------------------------------------------------------------------ on resume
# What a changed value does to a resumed run. Every leaf field below is declared
# through one of three markers (kept in the dataclass field's metadata, which
# OmegaConf ignores); ``mptrain/run/resume.py`` reads them through :func:`on_resume`.
GUARDED = "guarded"  # changes the training math: refused unless resume.allow_changes names it, then recorded
RECORDED = "recorded"  # always allowed, and written to the run's config history
HARMLESS = "harmless"  # allowed and not recorded: it changes what is reported or kept, not what is trained


def guarded(default: Any = MISSING, *, factory: Any = MISSING) -> Any:
    """A field whose change alters what the model computes or learns: a resume
    refuses it unless ``resume.allow_changes`` names it, and records it then."""
    return _marked(GUARDED, "", default, factory)


def recorded(default: Any = MISSING, *, factory: Any = MISSING) -> Any:
    """A field a resume may always change (more steps, another wrapper or device),
    written to the config history because the later steps ran under it."""
    return _marked(RECORDED, "", default, factory)


def harmless(default: Any = MISSING, *, why: str, factory: Any = MISSING) -> Any:
    """A field whose change cannot alter the run's training figures; ``why`` says
    why, in a line (logging, paths, cadences, thresholds of warnings)."""
    return _marked(HARMLESS, why, default, factory)


def _marked(kind: str, why: str, default: Any, factory: Any) -> Any:
    """The dataclass field of ``default`` (or ``factory``) carrying the marker."""
    meta = {"on_resume": kind, "why": why}
    if factory is not MISSING:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


# Reasons that whole sections share.
_SINK = "a metric sink: where figures go, not what they are"
_OBSERVES = "the monitor reads the model and optimizer and changes nothing"


# --------------------------------------------------------------------------- model
@dataclass
class MoEConfig:
    """The mixture of experts (``model.family=moe``, ``mptrain/model/moe.py``):
    Llama's blocks whose feed-forward network, from ``first_dense_layers`` on, is a
    router choosing ``top_k`` of ``n_experts`` SwiGLU experts per token. Read by that
    family only: another family refuses any key here that differs from its default."""

    n_experts: int = guarded(8)
    """Routed experts per routed layer."""
    top_k: int = guarded(2)
    """Experts each token is sent to (1 <= top_k <= n_experts); their outputs are
    summed, weighted by the gates."""
    expert_hidden: Optional[int] = guarded(None)
    """Each expert's SwiGLU width. ``null``: the dense width (``model.ffn_hidden``,
    or Llama's rule); fine-grained mixtures use a fraction of it."""
    n_shared_experts: int = guarded(0)
    """Always-on experts of width ``expert_hidden`` added to every token's output
    (DeepSeek's shared experts; computed as one SwiGLU of ``n_shared_experts x
    expert_hidden``). 0: none."""
    first_dense_layers: int = guarded(0)
    """The first this many blocks keep a dense SwiGLU (DeepSeek's first dense
    layers, where routing is the least stable); at most ``model.n_layer``."""
    gate: MoEGate = guarded(MoEGate.softmax)
    """``softmax``: gate scores are a softmax over all experts (Mixtral, Qwen3-MoE,
    OLMoE). ``sigmoid``: each expert's score is its own sigmoid (DeepSeek-V3)."""
    norm_topk: bool = guarded(True)
    """Renormalise each token's chosen gates to sum to one (Qwen3-MoE's
    ``norm_topk_prob``, DeepSeek-V3's sigmoid gates); ``false`` weights the outputs
    by the raw scores."""
    balance: MoEBalance = guarded(MoEBalance.aux_loss)
    """How the load is balanced: ``aux_loss`` (the Switch/GShard auxiliary loss,
    ``aux_loss_coef`` times it added to every micro-batch's loss before backward;
    ``train/loss`` stays the cross-entropy, the term is logged as ``moe/aux_loss``),
    ``bias`` (DeepSeek-V3's auxiliary-loss-free balancing: a per-expert fp32 offset
    added to the scores for the choice only, moved by ``bias_rate`` after every
    applied optimizer step towards the experts that took fewer tokens, counted over
    the step's micro-batches and every data-parallel rank) or ``none``."""
    aux_loss_coef: float = guarded(0.01)
    """``balance=aux_loss``: the auxiliary loss's weight (0.01 in Switch; the term is
    this value at perfect balance)."""
    bias_rate: float = guarded(0.001)
    """``balance=bias``: how far each expert's offset moves per optimizer step (the
    update speed gamma of DeepSeek-V3, 0.001)."""
    capacity_factor: Optional[float] = guarded(None)
    """Each expert takes at most ``ceil(capacity_factor x tokens x top_k / n_experts)``
    of a forward's token choices (in token order); the rest are dropped (the token
    keeps its residual and its other choices), counted per step as
    ``moe/dropped_tokens`` and in the closing summary. ``null``: no capacity, no
    token is ever dropped."""
    router_dtype: RouterDtype = guarded(RouterDtype.fp32)
    """What the router's logits, gates and top-k are computed in: ``fp32`` whatever
    the precision (a half-precision router flips the choice between near-equal
    experts), or ``compute``, the autocast dtype: a study switch, warned about at
    start-up."""
    expert_gemm: ExpertGemm = recorded(ExpertGemm.auto)
    """How the experts' matmuls run: ``grouped`` (one ``torch._grouped_mm`` per
    matrix over all experts; refused where it cannot run), ``looped`` (each expert's
    linears on its own tokens) or ``auto`` (grouped where it runs and the experts are
    plain linears, looped elsewhere: under float8, MX or lab linears, each expert casts
    for itself). The same function; in fp32 the same bits. The banner says which ran and why."""


@dataclass
class ModelConfig:
    """Shape of the decoder: the GPT-2 family (``mptrain/model/gpt.py``), the
    Llama family (``mptrain/model/llama.py``) or the mixture of experts
    (``mptrain/model/moe.py``), chosen by ``family``."""

    name: str = guarded("gpt-mini")
    """Preset name, for run names and tags. Set by the ``model=`` group option."""
    family: ModelFamily = guarded(ModelFamily.gpt)
    """``gpt``: LayerNorm, learned positions, GELU MLP, biases, tied head.
    ``llama``: RMSNorm, rotary positions, SwiGLU, grouped-query attention, no
    biases. The ``llama-*`` presets set it. ``moe``: Llama's blocks with routed
    SwiGLU experts (``model.moe``); the ``moe-*`` presets set it."""
    n_layer: int = guarded(4)
    """Number of transformer blocks."""
    n_head: int = guarded(4)
    """Attention heads per block; must divide ``d_model``."""
    d_model: int = guarded(128)
    """Residual stream width."""
    block_size: int = guarded(128)
    """Context length in tokens: the length of every training window and the
    size of the learned position embedding."""
    vocab_size: Optional[int] = guarded(None)
    """Embedding rows. ``null`` takes the tokenizer's vocabulary, rounded up to a
    multiple of 64 (faster matmuls); a number smaller than the tokenizer's
    vocabulary is an error."""
    dropout: float = guarded(0.0)
    """Dropout on attention weights, residual branches and embeddings."""
    bias: bool = guarded(True)
    """Biases in linears and LayerNorms, as GPT-2 has them."""
    qk_norm: bool = guarded(False)
    """LayerNorm on each head's queries and keys before attention (QK-layernorm;
    RMSNorm in the Llama family): it bounds the attention logits, whose growth
    destabilises training at high learning rates. A model with it cannot be
    exported as GPT-2 or Llama."""
    n_kv_head: Optional[int] = guarded(None)
    """Llama and moe families: key/value heads (grouped-query attention; each serves
    ``n_head / n_kv_head`` query heads). ``null``: ``n_head`` (plain multi-head)."""
    ffn: Optional[Ffn] = guarded(None)
    """The feed-forward network: ``gelu`` (the GPT family's, its only one),
    ``swiglu`` (the Llama family's) or ``smooth_swiglu`` (Fishman et al. 2024:
    SwiGLU whose product is scaled per channel before the down-projection's
    float8 cast and the scale undone in its weight, so the function is
    unchanged and the outliers SwiGLU grows do not saturate float8).
    ``null``: the family's own."""
    ffn_hidden: Optional[int] = guarded(None)
    """Llama and moe families: the SwiGLU hidden width (in the moe family the dense
    layers', and each expert's unless ``model.moe.expert_hidden`` is set). ``null``:
    Llama's rule, 8/3 of ``d_model`` (times ``ffn_dim_multiplier``) rounded up to
    ``ffn_multiple_of``."""
    ffn_multiple_of: int = guarded(256)
    """Llama and moe families: the hidden width is rounded up to a multiple of this."""
    ffn_dim_multiplier: Optional[float] = guarded(None)
    """Llama and moe families: a factor on 8/3 ``d_model`` before rounding (1.3 in Llama 3 8B)."""
    rope_theta: Optional[float] = guarded(None)
    """Llama and moe families: the rotary base (10000 in Llama 2, 500000 in Llama 3).
    ``null``: 10000."""
    rope_dtype: Optional[RopeDtype] = guarded(None)
    """Llama and moe families: what the rotary angle tables are built in. ``null``/``fp32``:
    fp32, applied in fp32 then cast (the right choice); ``bf16``: a study knob
    that shows the damage, since bf16's 8-bit mantissa cannot hold a large
    position times a frequency (docs/llama.md has the error by position)."""
    norm_eps: Optional[float] = guarded(None)
    """Llama and moe families: RMSNorm's epsilon. ``null``: 1e-5."""
    tie_embeddings: Optional[bool] = guarded(None)
    """Share the token embedding with the output head. ``null``: the family's
    own (tied in GPT-2, untied in Llama). The GPT family is always tied."""
    init_from: Optional[str] = guarded(None)
    """A local ``transformers`` directory to start from (config.json and
    safetensors weights; pickles are refused): a LlamaForCausalLM for the Llama
    family, a GPT2LMHeadModel for the GPT family. Its weights replace the initial
    ones, each checked (names, shapes, finite values), and its config.json's
    architecture replaces the preset's (the banner says which values); a
    ``model`` key this run sets itself that the checkpoint contradicts is refused."""
    moe: MoEConfig = field(default_factory=lambda: MoEConfig())
    """The mixture of experts (``model.family=moe``); see :class:`MoEConfig`."""


# ----------------------------------------------------------------------- precision
@dataclass
class LossScaleConfig:
    """Loss scaling for fp16 (``torch.amp.GradScaler`` semantics)."""

    enabled: bool = guarded(False)
    """Multiply the loss before backward so small fp16 gradients do not flush
    to zero. On for ``precision=fp16``, off elsewhere."""
    mode: ScaleMode = guarded(ScaleMode.dynamic)
    """``dynamic``: halve on overflow, grow after ``growth_interval`` clean
    steps. ``static``: keep ``init_scale`` forever (steps with inf/nan
    gradients are still skipped)."""
    init_scale: float = guarded(65536.0)
    """Starting scale (2^16), or the fixed scale in static mode."""
    growth_factor: float = guarded(2.0)
    """Scale multiplier after ``growth_interval`` consecutive clean steps."""
    backoff_factor: float = guarded(0.5)
    """Scale multiplier on a step whose gradients hold inf/nan (that step is skipped)."""
    growth_interval: int = guarded(2000)
    """Clean steps between two growths."""
    min_loss_scale: float = harmless(1.0, why="where the run gives up; every step it takes is the same")
    """Abort when the dynamic scale falls below this: gradients overflow at
    every scale, so the run produces inf/nan whatever the scaling (the error
    names the cause, e.g. a non-finite forward loss, and the first module)."""
    warn_skip_rate: float = harmless(0.05, why="a warning threshold: what is reported, not what is trained")
    """Warn once when the share of skipped steps so far exceeds this (0 turns
    the warning off). A few skips while a dynamic scale settles are normal;
    a steady stream means the gradients overflow for another reason."""
    warn_after_steps: int = harmless(50, why="when the skip-rate warning starts looking")
    """Look at the skip rate only from this step on: the first steps of a
    dynamic scale, which start high on purpose, are expected to skip."""


@dataclass
class Fp8Config:
    """Float8 training of the linear layers (``precision=fp8`` and its recipe
    presets ``fp8-rowwise``, ``fp8-rowwise-gw-hp``, ``fp8-delayed``, ``mxfp8``).

    Converted linears compute their three matmuls in float8: activations and
    weights in E4M3 in the forward pass, output gradients in ``grad_dtype`` in
    the backward pass (E4M3 blocks for mxfp8), each scaled as ``recipe`` says.
    Everything else runs under bf16 autocast, with fp32 master weights."""

    enabled: bool = guarded(False)
    """Convert linears to float8. On for ``precision=fp8``."""
    recipe: Fp8Recipe = guarded(Fp8Recipe.tensorwise)
    """How scales are chosen: ``tensorwise`` (one scale per tensor, from its
    current amax; allows float8 all-gather under FSDP2), ``rowwise`` (one per
    row: more accurate), ``rowwise_with_gw_hp`` (rowwise, weight gradient kept
    in high precision), ``delayed`` (one per tensor, from an amax history of
    earlier steps: Transformer Engine's default; ``mptrain/precision/fp8delayed.py``),
    ``mxfp8`` (one power-of-two scale per 32 elements, torchao's MX training;
    ``mptrain/precision/fp8mx.py``), ``nvfp4`` (4-bit elements in blocks of 16; refused
    where torchao's training path cannot run)."""
    grad_dtype: Fp8GradDtype = guarded(Fp8GradDtype.e5m2)
    """Format of the output gradient in the backward matmuls: ``e5m2`` (range
    for gradients, the classic recipe) or ``e4m3`` (precision; torchao's
    default for the rowwise recipes, which pair it with power-of-2 scales)."""
    exclude: list[str] = guarded(factory=lambda: ["lm_head"])
    """Module names (fnmatch patterns on the model's own names, e.g.
    ``blocks.0.*``) kept in high precision. The output head is excluded by
    default: its logits feed the softmax directly."""
    dim_multiple: int = guarded(16)
    """Linears whose in or out features are not multiples of this stay in high
    precision (float8 matmul kernels need 16-aligned dimensions)."""
    bf16_first_blocks: int = guarded(0)
    """The first this many transformer blocks keep their linears out of float8
    (in the autocast dtype, bf16), by position rather than by name: Megatron's
    first/last-layers-in-bf16 rule for the blocks nearest the embedding, whose
    inputs are the least regular. 0: none."""
    bf16_last_blocks: int = guarded(0)
    """The last this many blocks likewise (nearest the output head). 0: none."""
    min_features: int = guarded(0)
    """Linears with fewer in or out features than this stay out of float8: on
    small matmuls the casts (an amax and a scaled copy of each operand) cost
    more than the float8 matmul saves. 0: no size rule."""
    amax_history_len: int = guarded(16)
    """``recipe=delayed``: how many past steps' amaxes each operand's history
    keeps (Transformer Engine's ``amax_history_len``)."""
    amax_compute: AmaxCompute = guarded(AmaxCompute.max)
    """``recipe=delayed``: the amax a scale is computed from: ``max`` over the
    history (safe after a drop, slow to follow it) or ``most_recent`` (the
    last step's: follows, but saturates when the amax grows)."""
    margin: int = guarded(0)
    """``recipe=delayed``: scale = format max / (amax * 2^margin); each unit of
    margin leaves twice the headroom for an amax that grows between steps,
    at the cost of one binade at the bottom."""
    fsdp_float8_all_gather: bool = guarded(True)
    """Under FSDP2 with the tensorwise recipe, all-gather weights in float8
    (half the bytes of bf16), with scales recomputed after every optimizer step."""
    matmul: Fp8Matmul = recorded(Fp8Matmul.auto)
    """Which kernel multiplies the float8 operands once they are cast:
    ``scaled_mm`` (``torch._scaled_mm``: float8 tensor cores on a GPU; on a CPU
    a generic kernel, about as fast as fp32 on an AMD EPYC and ~100x slower on
    an Intel Xeon), ``emulated`` (the same float8 values and scales, widened
    and multiplied in fp32: fast on every CPU; on a GPU without float8 it lets
    the casts be studied) or ``auto`` (``scaled_mm`` on a GPU; on a CPU the
    faster of the two as measured at start-up, which ``python -m
    mptrain.doctor`` also shows). The casts, their statistics and the
    gradients' formats are the same either way; results differ only by fp32
    accumulation order. mxfp8 maps it to torchao's kernel choice (``emulated``
    is its EMULATED kernel, ``scaled_mm`` needs a Blackwell GPU); nvfp4 has
    no emulated path."""


@dataclass
class Fp4Config:
    """4-bit linears (``precision=nvfp4`` and ``precision=mxfp4``;
    ``mptrain/precision/labtrain.py``, ``docs/fp4.md``).

    Each converted linear quantizes the operands of its three matmuls to E2M1
    values in scaled blocks along the matmul's contraction dimension, then
    multiplies the dequantized values in fp32 (an emulation: the same values a
    float4 tensor core multiplies, on any CPU or GPU). Everything else runs as
    the preset's ``compute_dtype`` says (bf16 autocast), with fp32 master
    weights. The keys below switch each part of NVIDIA's NVFP4 recipe on or
    off, so that a study can take them apart."""

    enabled: bool = guarded(False)
    """Convert linears to 4-bit. On for ``precision=nvfp4`` and ``precision=mxfp4``."""
    format: Fp4Format = guarded(Fp4Format.nvfp4)
    """``nvfp4``: blocks of 16 with E4M3 block scales and one fp32 scale per
    tensor (NVIDIA). ``mxfp4``: blocks of 32 with power-of-two (E8M0) scales
    (OCP Microscaling)."""
    hadamard: bool = guarded(True)
    """Apply a random Hadamard transform (16 x 16 blocks, one fixed sign
    vector) to both operands of the weight-gradient matmul along its
    contraction dimension (the tokens) before they are quantized: it spreads
    a block's outliers over the block. The product is unchanged in exact
    arithmetic, since the transform is orthogonal."""
    stochastic_rounding: bool = guarded(True)
    """Round the output gradient's elements to E2M1 stochastically (up or
    down, unbiased on average) in both backward matmuls; weights and
    activations round to nearest. Draws from torch's generator, whose state
    every checkpoint saves, so a resumed run repeats the draws."""
    weight_2d: bool = guarded(True)
    """nvfp4: one block scale per 16 x 16 tile of each weight, so that the
    forward and the input-gradient matmuls (which block the weight along
    different dimensions) multiply the very same quantized weight. ``false``:
    1 x 16 blocks along each matmul's contraction dimension. mxfp4 has 1 x 32
    blocks only."""
    bf16_last_blocks: Optional[int] = guarded(None)
    """The last this many transformer blocks keep their linears out of 4-bit
    (in the compute dtype). ``null``: the recipe's rule, 15% of the blocks
    rounded up (NVIDIA keeps about 15% of the linears, mostly the last ones,
    in higher precision). 0: none."""
    exclude: list[str] = guarded(factory=lambda: ["lm_head"])
    """Module names (fnmatch patterns on the model's own names) kept out of
    4-bit. The output head is excluded by default, as the recipe advises."""


@dataclass
class LabConfig:
    """The format lab (``precision=lab``; ``mptrain/precision/lab.py``,
    ``mptrain/precision/labtrain.py``, ``docs/formats.md``): every converted
    linear casts each operand of its three matmuls as an operand spec says,
    ``<element>/<block>/<scale>/<rounding>[/<transform>]`` (e.g.
    ``e2m1/1x16/e4m3/nearest``), and multiplies the dequantized values in fp32:
    any format, emulated on any machine. Each spec is checked at start-up."""

    enabled: bool = guarded(False)
    """Convert linears to the lab's recipe. On for ``precision=lab``."""
    recipe: str = guarded("nvfp4")
    """A named recipe (``python -m mptrain.formats --recipes`` lists them: tensorwise,
    rowwise, rowwise_with_gw_hp, mxfp8, block1x128, block128x128, nvfp4, nvfp4_1d,
    nvfp4_rht, mxfp4, hybrid_mxfp8_nvfp4, nvfp4_ue5m3, nvfp4_4over6, mxfp6_e2m3,
    mxfp6_e3m2: the names every recipe has everywhere), whose operands the six keys
    below override one by one; or ``custom``, where all six must be given."""
    fwd_input: Optional[str] = guarded(None)
    """The forward matmul's activation operand, blocked along the input features.
    ``null``: the named recipe's; ``none``: not quantized."""
    fwd_weight: Optional[str] = guarded(None)
    """The forward matmul's weight operand, blocked along the input features."""
    dgrad_grad_output: Optional[str] = guarded(None)
    """The input-gradient matmul's output-gradient operand, blocked along the output features."""
    dgrad_weight: Optional[str] = guarded(None)
    """The input-gradient matmul's weight operand, blocked along the output features."""
    wgrad_grad_output: Optional[str] = guarded(None)
    """The weight-gradient matmul's output-gradient operand, blocked along the tokens."""
    wgrad_input: Optional[str] = guarded(None)
    """The weight-gradient matmul's activation operand, blocked along the tokens."""
    fourover6_error: str = guarded("mse")
    """How a ``-4over6`` scale compares a block's two candidate casts: ``mse``
    (summed squared error), ``l1`` (summed absolute error) or ``max`` (largest
    absolute error)."""
    allow_forward_stochastic: bool = guarded(False)
    """Let a forward operand round stochastically (a random forward pass and loss;
    refused unless set)."""
    bf16_last_blocks: Optional[int] = guarded(None)
    """The last this many transformer blocks keep their linears out of the lab's
    formats. ``null``: 15% of the blocks rounded up (the NVFP4 recipe's rule); 0: none."""
    exclude: list[str] = guarded(factory=lambda: ["lm_head"])
    """Module names (fnmatch patterns on the model's own names) kept out of the
    lab's formats. The output head by default."""


@dataclass
class PhaseConfig:
    """One entry of ``precision.phases``: from which step on, and what changes
    (``mptrain/precision/phases.py``; docs/phases.md). A key left null keeps what
    the phase before had; the model's shape, the mesh and everything outside
    ``precision`` cannot change within a run (they have no key here)."""

    name: Optional[str] = guarded(None)
    """A label for the banner, the console and the records (null: ``phase <k>``)."""
    start: Optional[str] = guarded(None)
    """When it begins (before that step runs): a step (``1200``), a fraction of
    ``train.max_steps`` (``0.8``: step round(0.8 * max_steps)), or a point of the
    learning-rate schedule (``warmup_end``, ``decay_start``: the first step below the
    peak). With ``when``: the earliest step the signal is looked at (null: at once)."""
    when: Optional[str] = guarded(None)
    """Begin when a signal crosses a threshold instead, decided at the monitor's
    cadence: ``<signal> < <value>`` (or ``>``, ``<=``, ``>=``), the signal a metric
    name or a short name (``weight_gradient.noise_ratio < 1.732``, the sqrt(3) rule),
    or ``loss_spike`` (the loss-spike detector's alarm). Recorded with the step and
    the value; a resumed run keeps the decision."""
    precision: Optional[str] = guarded(None)
    """A precision preset (``bf16``, ``fp8``, ``nvfp4``...) this phase runs under,
    replacing the one before; the keys below change it further."""
    forward: Optional[str] = guarded(None)
    """Both operands of the forward matmul: a named recipe's (``mxfp8``), one
    operand spec for both (``e4m3/tensor/fp32/nearest``), or ``none`` (unquantized)."""
    input_gradient: Optional[str] = guarded(None)
    """Both operands of the input-gradient matmul, as ``forward``."""
    weight_gradient: Optional[str] = guarded(None)
    """Both operands of the weight-gradient matmul, as ``forward``."""
    fwd_input: Optional[str] = guarded(None)
    """One operand (an operand spec or ``none``), over ``forward``; the five keys below likewise."""
    fwd_weight: Optional[str] = guarded(None)
    dgrad_grad_output: Optional[str] = guarded(None)
    dgrad_weight: Optional[str] = guarded(None)
    wgrad_grad_output: Optional[str] = guarded(None)
    wgrad_input: Optional[str] = guarded(None)
    master_weights: Optional[bool] = guarded(None)
    """fp32 master weights from here on (``true``: a bf16-pure run's weights and
    moments widen to fp32 exactly), or bf16 storage (``false``: rounded as the
    phase's ``update_rounding`` rounds)."""
    update_rounding: Optional[UpdateRounding] = guarded(None)
    """How updates reach bf16-stored weights from here on (``nearest``, ``stochastic``;
    ``kahan`` cannot be switched into or out of: its moments are stored debiased)."""
    state_dtype: Optional[StateDtype] = guarded(None)
    """Adam's moments' storage from here on (``fp32``, ``bf16``; a quantized
    storage cannot change within a run)."""
    loss_scale: Optional[bool] = guarded(None)
    """Loss scaling on or off from here on (its state carries while it stays on)."""


@dataclass
class PrecisionConfig:
    """What each format is used for; docs/precision.md explains each choice."""

    name: str = guarded("fp32")
    """Preset name (``precision=`` group option), for run names and tags."""
    compute_dtype: DType = guarded(DType.fp32)
    """Dtype of matmuls under autocast. ``fp32`` turns autocast off."""
    master_weights: bool = guarded(True)
    """Store parameters (and so gradients and optimizer state) in fp32 while
    computing in ``compute_dtype``. ``false`` stores them in ``compute_dtype``
    (bf16 only: ``precision=bf16-pure``), so every optimizer update is rounded
    to bf16 — the study case that shows why master weights exist."""
    update_rounding: UpdateRounding = guarded(UpdateRounding.nearest)
    """How each optimizer update reaches weights stored in bf16
    (``master_weights=false``): ``nearest`` rounds the new value to the nearest
    bf16, so updates smaller than half a bf16 step are lost (``bf16-pure``);
    ``stochastic`` rounds up or down with probabilities that make the stored
    value right on average (torchao's AdamW, ``bf16-pure-sr``); ``kahan`` keeps
    what rounding dropped in a bf16 compensation buffer and adds it back on the
    next step (torch-optimi's AdamW, ``bf16-pure-kahan``; 2 more bytes per
    parameter). With fp32 master weights every update lands exactly, so only
    ``nearest`` is accepted there."""
    param_dtype: Optional[DType] = guarded(None)
    """Dtype parameters are cast to for compute by FSDP (the all-gathered
    copy). ``null`` means ``compute_dtype``."""
    reduce_dtype: DType = guarded(DType.fp32)
    """Dtype gradients are reduced in across ranks (DDP all-reduce, FSDP
    reduce-scatter)."""
    buffer_dtype: DType = guarded(DType.fp32)
    """Dtype of module buffers under FSDP/DDP."""
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    """Loss scaling; see :class:`LossScaleConfig`."""
    fp8: Fp8Config = field(default_factory=lambda: Fp8Config())
    """Float8 linears; see :class:`Fp8Config`."""
    fp4: Fp4Config = field(default_factory=lambda: Fp4Config())
    """4-bit linears; see :class:`Fp4Config`."""
    lab: LabConfig = field(default_factory=lambda: LabConfig())
    """The format lab's linears; see :class:`LabConfig`."""
    phases: list[PhaseConfig] = guarded(factory=list)
    """Precision that changes during the run: an ordered list of
    :class:`PhaseConfig`, each from a step (or a signal) on; empty: one precision
    throughout. A resume refuses a change to a phase that has begun, and allows
    (and records) a change to phases still ahead."""


# ------------------------------------------------------------------------ parallel
@dataclass
class ParallelConfig:
    """How the model is replicated or sharded over ranks (``mptrain/distributed/parallel.py``)."""

    name: ParallelMode = recorded(ParallelMode.none)
    """``none`` | ``ddp`` | ``fsdp`` (FSDP2 ``fully_shard``) | ``fsdp1`` |
    ``hsdp`` (FSDP2 on a replicate x shard mesh) | ``fsdp_tp`` (FSDP2 x tensor
    parallelism). ``fsdp``, ``hsdp`` and ``fsdp_tp`` are one wrapper on the
    mesh ``dp_replicate x dp_shard x tp``; they differ only in their presets'
    sizes, and any of them takes any sizes."""
    backend: str = recorded("auto")
    """Process-group backend: ``auto`` (nccl on CUDA, gloo on CPU), ``gloo`` or ``nccl``."""
    dp_replicate: int = recorded(1)
    """Mesh size of HSDP's replicate dimension: groups of ranks that each hold
    a whole (sharded) copy of the model, their gradients all-reduced across
    groups. Put it across nodes: its collective is one all-reduce per step.
    ``-1``: the world size over the other two sizes; ``0``: the number of
    nodes (world size / ranks per node). FSDP2 wrappers only."""
    dp_shard: int = recorded(-1)
    """Mesh size of the sharded data-parallel dimension (FSDP's all-gathers
    and reduce-scatters run along it). ``-1``: the rest of the world;
    ``0``: the ranks of one node (``LOCAL_WORLD_SIZE``). FSDP2 wrappers only."""
    tp: int = recorded(1)
    """Tensor-parallel size: each block's heads and MLP width, the embedding
    and the head split over this many ranks, which see the same batch. Must
    divide the heads, the key/value heads, the MLP width, the vocabulary and,
    with sequence parallelism, ``model.block_size``.
    Keep it inside a node (its collectives run in every block). ``-1``: the
    rest of the world; ``0``: the ranks of one node. FSDP2 wrappers only."""
    sequence_parallel: bool = recorded(True)
    """With ``tp > 1``: split the residual stream and the norms over the
    sequence between TP ranks (all-gather before each half of a block,
    reduce-scatter after) instead of holding it whole on every TP rank. Same
    results, less activation memory. Without TP there is nothing to split
    and it has no effect."""
    ep: int = recorded(1)
    """Expert parallelism (``model.family=moe`` on an FSDP2 mesh): each routed layer's
    experts split over this many of the ``dp_shard`` ranks (consecutive ranks; it must
    divide ``dp_shard`` and ``model.moe.n_experts``), each holding ``n_experts / ep``
    whole experts. Tokens still see different data on every rank: each routed layer
    sends every token choice to the rank of its expert and the outputs back, by
    all-to-all (``ep_dispatch`` names the dtype), and FSDP shards the experts over
    the ``dp_shard / ep`` ranks that hold the same ones. ``1``: every rank holds
    every expert. Not beside ``tp`` (refused)."""
    ep_dispatch: EPDispatch = guarded(EPDispatch.compute)
    """The dtype tokens cross to their experts in (a routed layer's input): ``compute``
    (the compute dtype: exactly what the experts' first matmuls would read), ``fp32``,
    ``bf16``, or ``fp8`` (float8 e4m3 with one fp32 scale per token and 128 features,
    as DeepSeek-V3 dispatches). The outputs come back in the experts' output dtype; the
    backward's gradients cross in the dtype of what they are gradients of (the layer's
    input: fp32 under autocast), so the default computes one process's values. A rounding this names
    (``fp8``, or ``bf16`` in an fp32 run) is applied with ``ep=1`` too, in place, so one
    process computes what the split does and the effect can be measured without ranks."""


# ---------------------------------------------------------------------------- data
@dataclass
class DataConfig:
    """Where tokens come from (``mptrain/data/``)."""

    kind: str = guarded("embedded")
    """Set by the ``data=`` group option. ``embedded``: the Python standard
    library's own source, present on every install, no network. ``text``: the
    local files in ``paths``. ``hf``: a Hugging Face ``datasets`` dataset (hub
    name, local directory, or local json/jsonl/parquet/text files) in ``path``.
    ``tokens``: token shards written by ``scripts/prepare_data.py`` in ``path``."""
    paths: list[str] = guarded(factory=list)
    """For ``data=text``: files, directories (all files below, sorted) or glob
    patterns, read as UTF-8."""
    path: Optional[str] = guarded(None)
    """For ``data=hf``: a dataset name on the hub (e.g. ``HuggingFaceFW/fineweb-edu``),
    a local dataset directory, or local data files (``*.jsonl``, ``*.json``,
    ``*.parquet``, ``*.txt``; comma-separated or a glob). For ``data=tokens``:
    the directory ``prepare_data.py`` wrote."""
    name: Optional[str] = guarded(None)
    """For ``data=hf``: the dataset configuration (e.g. ``sample-10BT``)."""
    split: str = guarded("train")
    """For ``data=hf``: the split to train on."""
    val_split: Optional[str] = guarded(None)
    """For ``data=hf``: a split to validate on. ``null``: hold out every
    ``round(1 / val_fraction)``-th document of ``split``."""
    text_field: str = guarded("text")
    """For ``data=hf``: the column holding the text."""
    streaming: bool = guarded(False)
    """For ``data=hf``: read the dataset as a stream (nothing downloaded or
    converted up front; tokenized in this process). Otherwise ``datasets``
    memory-maps it from its Arrow cache and tokenization runs in ``num_proc``
    processes."""
    num_proc: int = harmless(0, why="how many processes tokenize, not what they produce")
    """Tokenizer processes for ``data=hf`` (``datasets.map``); 0: one per CPU core."""
    max_documents: int = guarded(0)
    """Read at most this many documents of an ``hf`` dataset (0: all)."""
    shard_tokens: int = harmless(100_000_000, why="the size of the prepared shard files, not which tokens they hold")
    """Tokens per shard file written by the ``hf`` preparation."""
    tokenizer: str = guarded("bpe")
    """``bpe``: a byte-level BPE trained on the corpus with ``tokenizers`` and
    saved as a ``transformers`` fast tokenizer (trained once, cached; not for
    ``data=hf``). ``byte``: raw UTF-8 bytes (256 symbols + end of text).
    Anything else: a ``transformers`` tokenizer, by hub name (e.g. ``gpt2``;
    offline it must be in the Hugging Face cache) or local directory."""
    trust_remote_code: bool = harmless(
        False, why="a permission (never taken from a checkpoint), not a setting of the data")
    """Let a ``transformers`` tokenizer (or a Hugging Face dataset) run Python
    code that ships with it. Off: such a tokenizer or dataset is refused with
    an error naming this key. Turn it on only for sources you trust: the code
    runs with your permissions. Never taken from a checkpoint."""
    bpe_vocab_size: int = guarded(4096)
    """Vocabulary size of the trained BPE tokenizer."""
    max_chars: int = guarded(4_000_000)
    """Read at most this many characters of the corpus (whole files, in sorted
    order). Keeps the embedded default quick; 0 means no limit."""
    val_fraction: float = guarded(0.05)
    """Share of the text held out for validation (the end of each document for
    ``embedded``/``text``; whole documents for ``hf``)."""
    cache_dir: str = harmless("~/.cache/mptrain", why="where tokens are cached, not which tokens")
    """Where trained tokenizers, token caches and prepared ``hf`` shards are
    kept. The environment variable ``MPTRAIN_CACHE`` overrides it."""


# --------------------------------------------------------------------------- train
@dataclass
class TrainConfig:
    """The step schedule (``mptrain/run/trainer.py``)."""

    max_steps: int = recorded(500)
    """Optimizer steps to run."""
    global_batch_size: int = guarded(16)
    """Sequences per optimizer step, summed over all ranks and micro-batches."""
    micro_batch_size: Optional[int] = guarded(None)
    """Sequences per forward/backward on one rank. ``null``: the whole per-rank
    batch at once (no accumulation). Gradient accumulation steps are
    ``global_batch_size / (world_size * micro_batch_size)``."""
    grad_clip: float = guarded(1.0)
    """Clip the global gradient norm to this value (after unscaling). 0 turns clipping off."""
    eval_every: int = harmless(100, why="when validation runs; it reads the model and changes nothing")
    """Validation loss every this many steps (and at the last step). 0 turns it off."""
    eval_tokens: int = recorded(16384)
    """Target tokens the validation loss is measured on: ``eval_tokens //
    model.block_size`` whole windows (at least one), evenly spaced over the
    whole val split, or the whole split when it is smaller. The same windows at
    every evaluation and whatever the batch, micro-batch and world size, so runs
    that differ only in those are compared on the same text; the loss is the
    per-token mean over the set. ``summary.json`` records the set
    (``eval/tokens``, ``eval/windows``). The default is 128 windows of the
    default model's 128 tokens; raise it for a steadier figure (each evaluation
    costs a forward pass per window)."""
    eval_whole_split: bool = harmless(
        True, why="one more evaluation after the last step; it reads the model, draws no random numbers")
    """At the last step's evaluation (``eval_every`` > 0), also measure the loss
    on every window of the val split, not only the ``eval_tokens`` subset that
    ``val/loss`` reads: the figure to compare settings by
    (``scripts/compare.py``), on text that does not depend on ``eval_tokens``.
    summary.json holds it as ``final/whole_val_loss``, ``final/whole_val_ppl``,
    ``final/whole_val_bpb`` (where the bytes are known), ``eval/whole_tokens``
    and ``eval/whole_windows``; ``python -m mptrain.evaluate`` on the final
    checkpoint gives the same figure. Where the ``eval_tokens`` set already is
    the whole split it is that figure, not measured again. Paused time, like
    every evaluation, and it consumes none of the run's random numbers, so
    the run trains and saves as it would without it. Left out of the summary
    (not estimated) when the last step's evaluation did not run in this
    launch: a run stopped early (``stop_after``, a signal), or a launch that
    only closes a run whose last launch was lost after its last step."""
    z_loss: float = guarded(0.0)
    """Coefficient of the z-loss, ``z_loss * mean(log Z ^ 2)`` added to the
    training loss (log Z: the log-partition of the output logits), which keeps
    the output logits from drifting; 1e-4 is the usual value. Logged as
    ``train/z_loss``; ``train/loss`` and validation stay the cross-entropy. 0: off."""
    sample_tokens: int = harmless(32, why="the text shown after an evaluation, not the training")
    """After each evaluation, continue ``sample_prompt`` by this many tokens
    (greedy, so the text changes only when the model does) and show it on the
    console, in train.log, TensorBoard (text) and W&B. 0 turns it off."""
    sample_prompt: str = harmless("def ", why="the text shown after an evaluation, not the training")
    """The fixed prompt of those samples. The default suits the embedded corpus
    (Python source); pick one that suits your data."""
    log_every: int = harmless(10, why="when metrics are read back and written")
    """Metrics are written every this many steps (and at the first and last).
    Values are read back to the host only then."""
    device: str = recorded("auto")
    """``auto`` (CUDA when present, else CPU), ``cpu``, ``cuda``."""
    threads: int = recorded(0)
    """Intra-op threads torch computes with (``torch.set_num_threads``). 0: torch's
    choice (``OMP_NUM_THREADS`` when set, else about one per core). The count in
    use is in the banner, ``run_info.threads`` and ``summary.json``. It is part
    of the run's arithmetic on a CPU: how a matmul splits over threads decides
    where bf16/fp16 round (on an AMD EPYC with avx512_bf16, 2 threads differ from
    1 after 10 steps, and 1 thread equals a 2-rank DDP run bit for bit). So a
    resume compares the count in use, not this setting: another count is said
    and recorded in the config history, and refused where the run computes in
    bf16 or fp16 on a CPU (autocast's half precision, fp8's bf16 around its
    float8 matmuls) unless ``resume.allow_changes=[train.threads]``; fp32 runs
    and GPU runs (whose math is on the device) take it. On a busy machine (the
    load average above the usable cores, or CPU steal) the run measures its
    own forward pass at its count and at 1 thread and says so at start-up and
    in the progress line: 2 threads fighting other processes for 2 cores can
    take twice the time of 1."""
    seed: int = guarded(1337)
    """Seed for initialisation and for the order of training windows."""
    on_nonfinite: NonFinite = recorded(NonFinite.abort)
    """What to do with a step whose gradients hold inf/nan, in runs without a
    loss scaler: ``abort`` (stop with the step and the first module whose
    forward output or gradient was non-finite; nothing of the broken state is
    saved) or ``skip`` (do not apply that step; counted in
    ``train/nonfinite_skipped``). With fused AdamW the bad step is skipped on
    the device and, under ``abort``, so is every later one until the next
    logging step, where the run stops naming the bad step: no host sync per
    step. A non-fused optimizer needs one read-back per step to decide. With a
    loss scaler, skipping overflowing gradients is the scaler's job, but under
    ``abort`` a non-finite *forward* loss (which no scale can fix) still stops
    the run at the next logging step. The error says which of the three it was:
    a non-finite forward loss, non-finite gradients from a finite loss, or
    finite gradients whose global norm overflowed."""
    compile: Optional[bool] = recorded(None)
    """``torch.compile`` each transformer block (regional compilation: one
    compile serves every block, and it composes with FSDP). ``null``: on for
    CUDA, off on CPU (where the first step pays ~20 s of compilation); off for
    the mixture of experts, whose blocks are not compiled (``true`` is refused)."""
    activation_checkpointing: ActCheckpoint = harmless(
        ActCheckpoint.none, why="recomputes the same activations instead of keeping them: memory, not math")
    """``block``: recompute each block's activations in the backward pass
    instead of keeping them (less memory, ~1/3 more compute). ``none``: keep them."""
    tf32: bool = guarded(True)
    """Let fp32 matmuls and convolutions use TF32 tensor cores on CUDA (10-bit
    mantissa inputs, fp32 accumulation). No effect on CPU."""
    peak_tflops: Optional[float] = harmless(None, why="the peak perf/mfu is reported against")
    """Dense peak TFLOPS of one device for this run's matmul dtype, for
    ``perf/mfu``. ``null`` looks the device up in ``mptrain/observe/perf.py``'s table
    (CUDA devices; no MFU is logged where the peak is unknown, e.g. on CPU)."""
    stop_after: Optional[int] = harmless(None, why="where this launch stops; the schedule runs to max_steps either way")
    """End this invocation once this many optimizer steps are done (counted
    from step 0, so it is the same across resumes), writing a checkpoint to
    resume from. The learning-rate schedule still runs to
    ``max_steps``: this is a time slice of the run, not a shorter run. A
    launch that starts at or past it trains nothing and says so: raise it, or
    drop it, to continue."""
    audit: bool = harmless(False, why="records the first step's operators; that step computes the same")
    """Audit the first step: record every operator with its module and its
    input/output dtypes, print a per-module table, write ``audit.json`` into the
    run directory and flag dtype mistakes (``mptrain/observe/audit.py``). The audited
    step runs eagerly (``train.compile`` is ignored for it) and is slower."""
    memory_check: bool = harmless(True, why="a check before the model is built")
    """Before allocating the model, compare the memory estimator's figure per
    rank with the device's (and the host's) free memory and refuse a run that
    cannot fit, with both figures and the fixes. ``false`` skips the check."""
    audit_only: bool = harmless(False, why="where this launch stops, like stop_after")
    """Stop after the audited step, writing no checkpoint (what
    ``python -m mptrain.audit`` sets)."""


@dataclass
class OptimConfig:
    """AdamW with linear warmup and a decay schedule."""

    lr: float = guarded(2e-3)
    """Peak learning rate, reached at the end of warmup."""
    min_lr_ratio: float = guarded(0.1)
    """Final learning rate as a fraction of ``lr``."""
    warmup_fraction: float = guarded(0.1)
    """Linear warmup from 0 to ``lr`` over this share of ``train.max_steps``
    (rounded to whole steps), so a short run gets a real warmup too. The
    default run (500 steps) warms up over 50."""
    warmup_steps: Optional[int] = guarded(None)
    """Warmup length in steps instead; when set it overrides ``warmup_fraction``."""
    schedule: LRSchedule = guarded(LRSchedule.cosine)
    """Decay after warmup: ``cosine``, ``linear`` or ``constant``."""
    decay_fraction: float = guarded(1.0)
    """Share of the steps after warmup over which ``schedule`` decays to the
    floor, at the end of the run. 1.0: decay starts right after warmup; 0.2:
    hold the peak, then decay over the last 20% (warmup-stable-decay)."""
    decay_steps: Optional[int] = guarded(None)
    """Decay length in steps instead; when set it overrides ``decay_fraction``."""
    weight_decay: float = guarded(0.1)
    """Decoupled weight decay, applied to matrices only (not biases, norms)."""
    beta1: float = guarded(0.9)
    """Adam first-moment decay."""
    beta2: float = guarded(0.95)
    """Adam second-moment decay."""
    eps: float = guarded(1e-8)
    """Adam epsilon."""
    update_clip: float = guarded(0.0)
    """Clip each tensor's Adam update, as StableAdamW does: the tensor's
    learning rate is divided by ``max(1, RMS(g^2 / v) / update_clip)``, where
    ``v`` is its bias-corrected second moment including this step's gradient.
    0 turns it off; 1.0 is StableAdamW's setting. Every parameter gets its own
    optimizer group; with a non-fused AdamW (torch's for-loop one, the CPU
    default) the factors are read back to the host once per step, fused AdamW takes them on the device.
    A resume cannot turn it on or off (the optimizer state changes layout)."""
    fused: Optional[bool] = guarded(None)
    """Fused AdamW kernel (one launch for all parameters). ``null``: on for CUDA,
    off on CPU (where torch's AdamW runs its for-loop path: torch picks the
    multi-tensor ``foreach`` path only for CUDA tensors). torch's
    AdamW only: the torchao and torch-optimi optimizers have their own kernels."""
    state_dtype: Optional[StateDtype] = guarded(None)
    """Storage of Adam's two moments, independent of the weights. ``null``: the
    parameters' dtype (fp32 with master weights, bf16 in ``bf16-pure``), with
    torch's AdamW. ``fp32`` / ``bf16``: plain tensors of that dtype; ``8bit`` /
    ``4bit``: torchao's block-quantized moments (a code per element and an fp32
    scale per block of 256 / 128); ``fp8``: torchao's e4m3 moments with a scale
    per block of 256. Moments that differ from the parameters' dtype run on
    torchao's AdamW, which does its arithmetic in fp32 whatever the storage.
    torchao quantizes only tensors of at least 4096 elements whose size is a
    multiple of the block; smaller ones (biases, norms) keep the parameters'
    dtype. ``python -m mptrain.memory`` gives the bytes."""
    compile_step: Optional[bool] = guarded(None)
    """Compile the torchao optimizers' per-parameter update with torch.compile
    (one graph per tensor shape, compiled on the first step). ``null``: on CUDA
    only; on CPU the first step would spend seconds to minutes compiling for
    a speed-up tiny models do not need. ``true`` is refused where torch's or
    torch-optimi's AdamW runs (the banner says which optimizer runs)."""


# ----------------------------------------------------------------------------- log
@dataclass
class WandbConfig:
    """Weights & Biases sink. Runs offline unless ``mode=online``."""

    enabled: bool = harmless(False, why=_SINK)
    """Write a W&B run into ``<run>/wandb``."""
    mode: WandbMode = harmless(WandbMode.offline, why=_SINK)
    """``offline`` (sync later with ``wandb sync``), ``online`` or ``disabled``."""
    project: str = harmless("mptrain", why=_SINK)
    """W&B project."""
    entity: Optional[str] = harmless(None, why=_SINK)
    """W&B entity (user or team); ``null`` uses your default."""
    group: Optional[str] = harmless(None, why=_SINK)
    """Run group; ``null`` leaves runs ungrouped."""
    name: Optional[str] = harmless(None, why=_SINK)
    """Run name; ``null`` builds one from model, precision and parallel."""
    tags: list[str] = harmless(why=_SINK, factory=list)
    """Extra tags; precision, parallel and model are always added."""


@dataclass
class LogConfig:
    """Metric sinks (``mptrain/run/metrics.py``). Only rank 0 writes."""

    progress: bool = harmless(True, why="console output")
    """Progress on the console with loss, lr, tokens/s and loss scale: a bar on
    a terminal, plain lines when the output goes to a file or a pipe."""
    plain_every: Optional[int] = harmless(None, why="console output")
    """When the console is not a terminal, one plain progress line every this
    many steps (rounded up to a multiple of ``train.log_every``, when the loss
    is read). ``null``: about 20 lines per run."""
    jsonl: bool = harmless(True, why=_SINK)
    """``<run>/metrics.jsonl``: one JSON object per logged step."""
    tensorboard: bool = harmless(True, why=_SINK)
    """``<run>/tensorboard/`` event files."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """See :class:`WandbConfig`."""


@dataclass
class CheckpointConfig:
    """Distributed checkpoints in ``<run>/checkpoints/step-N/`` (``mptrain/checkpoint/checkpointer.py``)."""

    every: int = harmless(0, why="when checkpoints are written; a save reads the state and changes nothing")
    """Save every this many optimizer steps, and at the end of the run. 0: no
    periodic saves (see ``at_end``); a signal or ``train.stop_after`` still saves."""
    at_end: bool = harmless(True, why="whether the last step is saved; a save changes nothing")
    """Save once when the run reaches ``train.max_steps``, so a finished run can
    be sampled (``python -m mptrain.sample``), exported or extended. Cheap at
    small sizes; turn it off for throwaway runs of large models."""
    keep_last: int = harmless(2, why="how many checkpoints are kept on disk")
    """Keep this many most recent complete checkpoints; older ones are deleted. 0 keeps all."""
    keep_best: bool = harmless(False, why="which checkpoints are kept on disk; a save changes nothing")
    """Also keep the checkpoint with the lowest validation loss (``val/loss``)
    beside the ``keep_last`` newest, never pruned. An evaluation
    (``train.eval_every``) that beats every earlier one saves its step at
    once, whatever ``every`` says, so the best is the best evaluated, not
    the best of the periodic saves; summary.json names it (``best/step``,
    ``best/val_loss``). ``resume=auto`` still continues from the newest."""
    on_signal: bool = harmless(True, why="whether a signal saves before the process exits")
    """On SIGTERM/SIGINT (a preempted job, Ctrl-C), finish the current step,
    save a checkpoint and exit with code 0. A second SIGINT stops at once.
    Several ranks agree on the stop through an all-reduce (a host sync), so
    they look at the logging steps (``train.log_every``) only."""


@dataclass
class MonitorConfig:
    """The numerics monitor (``mptrain/observe/numerics.py``): what each format would do
    to this run's own gradients, updates and activations."""

    enabled: bool = harmless(True, why=_OBSERVES)
    """Collect ``numerics/*`` metrics on monitored steps."""
    every: int = harmless(50, why=_OBSERVES)
    """Monitor the first step and then every this many steps. Monitored steps
    cost a little more (statistics, a copy of the parameters, forward hooks);
    the others cost nothing."""
    histogram: bool = harmless(True, why=_OBSERVES)
    """Log a log2 histogram of |gradient| (TensorBoard histogram; bin counts in JSONL)."""
    activations: bool = harmless(True, why=_OBSERVES)
    """Record the absolute max of every block's output on monitored steps."""
    spike_factor: float = harmless(3.0, why=_OBSERVES)
    """A loss above this many times the median of the last ``spike_window``
    logged losses is reported as a spike event."""
    spike_window: int = harmless(20, why=_OBSERVES)
    """How many recent losses the spike median looks at."""
    stability: bool = harmless(True, why=_OBSERVES)
    """On monitored steps, also record what precedes a divergence
    (``mptrain/observe/stability.py``): each layer's largest attention logit and its
    attention entropy, the output logits' largest value and mean log-partition,
    each block's output RMS and max/RMS, and Adam's health per layer group
    (update RMS before the learning rate; share of elements whose squared
    gradient exceeds the second moment many times over), as ``stability/*``."""
    warn_attn_logit: float = harmless(100.0, why=_OBSERVES)
    """Early warning when a layer's largest attention logit passes this value
    (and again each time it doubles): logits this large make the softmax
    one-hot and precede the loss blow-ups of high learning rates."""
    warn_update_rms: float = harmless(2.0, why=_OBSERVES)
    """Early warning when a layer group's Adam update RMS (before the learning
    rate) passes this value: a healthy Adam stays at or below 1; above it the
    second moment lags a sudden gradient, which precedes loss spikes."""
    comm: bool = harmless(True, why=_OBSERVES)
    """On monitored steps, count the payload bytes of every collective the step
    issues (all-gather, reduce-scatter, all-reduce, broadcast), by dtype, as
    ``comm/<kind>/<dtype>_bytes`` (``mptrain/observe/comm.py``). Only runs with a
    process group (``parallel`` other than ``none``) have any."""
    fp8_casts: bool = harmless(True, why=_OBSERVES)
    """With float8 or 4-bit linears, on monitored steps: for every converted
    linear and each of its three low-precision operands (input, weight, output
    gradient), what the run's casts do to it: amax, scales, the shares flushed
    to zero and clamped at the format's max, and the signal-to-noise ratio of
    the round trip, as ``fp8.<layer>/<operand>/*`` (``mptrain/observe/fp8watch.py``)."""
    fp8_whatif: list[str] = harmless(why=_OBSERVES, factory=lambda: [
        "tensorwise", "rowwise", "mxfp8", "block1x128", "block128x128", "nvfp4", "nvfp4_rht", "mxfp4"])
    """With ``fp8_casts``: the same statistics, from the same tensors, for these
    other recipes (the run's own is left out), as
    ``fp8.<layer>/<operand>/<recipe>/*``: one run answers "would rowwise or MX
    blocks have flushed less here?", and "what would 4-bit do to this layer?".
    Any named recipe (``python -m mptrain.formats --recipes``; the names
    ``precision.fp8.recipe``, ``precision.fp4.format`` and ``precision.lab.recipe``
    take), each operand cast with its recipe's spec for the matmul it enters
    first (input: ``fwd_input``, weight: ``fwd_weight``, output gradient:
    ``dgrad_grad_output``) by the format lab's cast, rounding to nearest (the
    monitor draws no random numbers). A recipe whose casts are all float8
    (``tensorwise``, ``rowwise``, ``mxfp8``, ``block1x128``: one fp32 scale per
    128 elements of a row, ``block128x128``: per 128 x 128 tile) casts to the
    run's float8 format for each operand (E4M3 in a 4-bit run), so that its
    figures differ from the run's by the scales alone. ``nvfp4`` is NVIDIA's
    recipe (16 x 16 weight tiles; ``nvfp4_1d``: 1 x 16 weight blocks),
    ``nvfp4_rht`` the same in 1 x 16 blocks after a Hadamard transform of each
    block of 16 with a fixed sign vector (measured on the transformed tensor),
    ``mxfp4`` E2M1 in blocks of 32 with power-of-two scales. ``[]``: none."""


@dataclass
class ResumeConfig:
    """Continuing a run from a checkpoint (``mptrain/run/resume.py``)."""

    source: str = harmless("auto", why="where this launch continues from, not what it trains")
    """``auto``: continue from the newest intact checkpoint in this run directory,
    if there is one (a fresh run directory starts from scratch). ``none``: start
    from scratch (refused in a directory that holds checkpoints, which a new run
    would mix with). ``latest``: the run under ``outputs/`` of the folder the
    command runs in (where the default ``hydra.run.dir`` puts runs) whose newest
    complete checkpoint was saved last, named in one line; none there is an error
    naming the folder. Anything else: a checkpoint directory
    (``.../checkpoints/step-N``) or a run directory whose newest checkpoint is used.
    ``latest`` and a path continue into this launch's own run directory; one that
    finds the run finished trains nothing and leaves no directory behind."""
    allow_changes: list[str] = harmless(why="what this launch accepts, not what it trains", factory=list)
    """Config keys or sections (``precision``, ``optim.lr``, ``train.seed``) whose
    value may differ from the checkpoint's. A resume that changes the training
    math (a key declared ``guarded`` above: model, precision, data, optimizer,
    seed, batch sizes, clipping, z-loss, ...) is refused unless each changed key
    is named here; accepted changes are recorded as a history in config.yaml and
    summary.json, from the step they apply to, as are changes of the keys
    declared ``recorded`` (steps, wrapper, device, validation set, ...)."""


@dataclass
class DebugConfig:
    """Fault injection, for tests and for rehearsing what a bad step looks like."""

    inject_inf_grad_steps: list[int] = recorded(factory=list)
    """0-based steps at which an inf is written into one gradient element
    after backward (before unscaling), as an fp16 overflow would."""
    inject_inf_grad_rank: int = recorded(-1)
    """Rank that gets the inf; -1 means every rank."""
    inject_grad_value: float = recorded(float("inf"))
    """The value ``inject_inf_grad_steps`` writes. A huge finite one (e.g.
    ``1e20``) rehearses gradients that are all finite but whose global norm
    overflows fp32 (the squares of values above ~1.8e19 exceed its max)."""
    nan_in_module: Optional[str] = recorded(None)
    """Name of a module (as in ``model.named_modules()``, e.g. ``blocks.1.mlp.fc``)
    whose forward output is replaced by NaN at ``nan_at_steps``."""
    nan_at_steps: list[int] = recorded(factory=list)
    """0-based steps at which ``nan_in_module`` outputs NaN."""
    nan_rank: int = recorded(-1)
    """Rank whose ``nan_in_module`` outputs NaN; -1 means every rank. One rank
    alone rehearses a bad batch that only one data shard holds."""
    outlier_module: Optional[str] = recorded(None)
    """Name of a linear (as in ``model.named_modules()``, wrapper parts such as
    ``module.`` ignored, e.g. ``blocks.1.mlp.proj``) whose input gets an outlier
    channel: on every forward pass, training, evaluation and replays alike,
    feature ``outlier_channel`` of the input (its last dimension) is multiplied by
    ``outlier_scale`` before the module sees it (a forward pre-hook, so a float8
    linear's casts, and the cast statistics, see the outlier). The channel is part
    of the computation: its gradient going back is multiplied too. On every rank;
    null: off."""
    outlier_channel: int = recorded(0)
    """The input feature of ``outlier_module`` that is multiplied: ``0 <=
    outlier_channel < in_features`` of that linear (checked when the hook is
    installed)."""
    outlier_scale: float = recorded(1e4)
    """What ``outlier_channel`` is multiplied by: finite and nonzero (1e4 plants a
    channel four orders of magnitude above its neighbours, as LLM activation
    outliers are)."""
    loss_multiplier: float = recorded(1.0)
    """The loss the backward pass sees is multiplied by this (the cross-entropy
    plus any z-loss term, before the fp16 loss scaler scales it), so every
    gradient is this many times smaller (``1e-6``: a million times); 1.0 is off
    (the loss is passed on as it is). ``train/loss`` stays the loss itself, while
    ``train/grad_norm``, the numerics monitor's gradient figures and clipping
    (``train.grad_clip``) see the multiplied gradients. AdamW's update barely
    changes: ``m / (sqrt(v) + eps)`` cancels the factor, up to ``optim.eps``,
    which shrinks the steps once ``sqrt(v)`` comes near it (gradients of 1e-3 times
    1e-6 give 1e-9, below the default 1e-8), and up to clipping, which no longer
    acts. Under fp16, gradients this small can flush to zero despite the loss
    scale. Must be finite and > 0."""
    unguarded: list[str] = recorded(factory=list)
    """Guards of the device mesh switched off, to rehearse the failure each one
    prevents (a test aid: never in a real run). ``tp_reduce_dtype``: TP's
    gradient all-reduce (the norms' partial sums under sequence parallelism)
    left to FSDP2, which runs it in the gradient's dtype instead of
    ``precision.reduce_dtype`` (pytorch #190626); the dtype audit then flags it."""
    kill_during_save_at_step: Optional[int] = harmless(
        None, why="ends the process during a save; a launch it does not end trains the same")
    """SIGKILL this process in the middle of saving the checkpoint of this
    step (shards written, checkpoint not yet made visible): rehearses a node
    lost during a save."""
    kill_after_save_at_step: Optional[int] = harmless(
        None, why="ends the process after a save; a launch it does not end trains the same")
    """SIGKILL this process right after the checkpoint of this step is made
    visible (renamed into place), before older checkpoints are pruned and
    before anything else is written: at ``train.max_steps``, it rehearses a
    node lost between the final checkpoint and ``summary.json``."""


def debug_set(dcfg) -> bool:
    """Whether any ``debug.*`` key differs from its default: only then does a run
    build its fault injector (a test aid has no place in an ordinary run)."""
    plain = DebugConfig()
    return any(_listed(getattr(dcfg, f.name)) != _listed(getattr(plain, f.name)) for f in fields(DebugConfig))


def _listed(value: Any) -> Any:
    """A sequence as a plain list (a composed config holds a ListConfig where the
    dataclass default holds a list); anything else as it is."""
    return list(value) if isinstance(value, typing.Sequence) and not isinstance(value, str) else value


# --------------------------------------------------------------------------- root
@dataclass
class Config:
    """The whole run. ``mptrain/configs/config.yaml`` picks one option of each group."""

    model: ModelConfig = field(default_factory=ModelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    resume: ResumeConfig = field(default_factory=ResumeConfig)
    """Where to continue from; see :class:`ResumeConfig`. ``resume=<source>`` on the
    command line is short for ``resume.source=<source>``."""
    debug: DebugConfig = field(default_factory=DebugConfig)


@functools.cache
def on_resume() -> dict[str, tuple[str, str]]:
    """Every leaf key of the schema, dotted (``train.z_loss``), with its marker:
    (``GUARDED`` | ``RECORDED`` | ``HARMLESS``, the reason of a harmless one).
    A field declared without a marker is left out, and ``resume.py`` guards it."""
    out: dict[str, tuple[str, str]] = {}

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            if is_dataclass(hints[f.name]):
                walk(hints[f.name], f"{prefix}{f.name}.")
            elif "on_resume" in f.metadata:
                out[prefix + f.name] = (f.metadata["on_resume"], f.metadata["why"])

    walk(Config, "")
    return out


def register() -> None:
    """Put the schema in Hydra's ConfigStore as ``base_config``.

    ``mptrain/configs/config.yaml`` lists ``base_config`` first in its defaults, so
    every YAML merged after it is checked against these dataclasses.
    The run directory's resolvers (``${mptrain_now:...}``, ``${mptrain_new_dir:...}``)
    are the launch's business: the entry point registers them before Hydra composes
    (``mptrain.run.startup.Startup.register_resolvers``).
    """
    ConfigStore.instance().store(name="base_config", node=Config)


register()
