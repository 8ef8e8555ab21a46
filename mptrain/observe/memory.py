"""How much memory a configuration needs per rank: ``python -m mptrain.memory <overrides> [--world N]``.

Exact for the tensors whose size is known in advance: the weights, their
gradients and the optimizer state (Adam's two moments, each with the scales
and quantization map of torchao's block-quantized formats; the Kahan
compensation buffer), counted tensor by tensor on a meta-device copy of the
model, on this rank's shard of each (``tests/test_memory.py`` checks every row
against a real step). An estimate for activations (:func:`activation_bytes`:
what autograd keeps for the backward pass of mptrain's GPT, counted tensor by
tensor on real steps) and for FSDP's gathered copies. ``summary.json`` puts
the estimate beside the measured peak; :func:`summary_figures` gives its
bytes per parameter. What it leaves out (the framework's own memory, measured
in the process; allocator slack; transient buffers; the data) is
:func:`left_out`, and the run's closing line beside its peak :func:`measured_line`.

Under a device mesh (``parallel=fsdp|hsdp|fsdp_tp``, ``dp_replicate x
dp_shard x tp``, the plan's mesh)
each parameter is first split as tensor parallelism splits it (the family
spec's table that ``distributed/tensor_parallel.py`` applies: fan-out linears
by row, fan-in ones by column, embedding and head by vocabulary row; norms
whole), then its dim-0
rows over ``dp_shard``; the ``dp_replicate`` groups hold the same shard, so
they divide nothing. Activations inside the split halves (q/k/v, attention,
the MLP's hidden width) are divided by ``tp``, the residual stream and the
norms by ``tp`` too under sequence parallelism; the linears' gathered inputs
and the head's gathered logits are whole on every TP rank.

The same figure guards a run before it allocates anything
(``mptrain/observe/memory_phases.py``'s ``fit_check``, ``train.memory_check``,
over every precision phase): a configuration whose estimate exceeds the
device's free memory, or the host's available memory, is refused with both
figures (:func:`fit_problem`) instead of climbing into the out-of-memory killer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from mptrain.config.mesh import MESH_MODES, MeshShape
from mptrain.model.families import build as build_family
from mptrain.model.families import ffn_hidden, model_spec
from mptrain.model.moe import MoEFeedForward
from mptrain.plan.plan import Plan
from mptrain.precision.formats import dtype_name
from mptrain.precision.optimizers import (
    BLOCK,
    MIN_QUANTIZED,
    QUANTIZED,
    moment_bytes,
)

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}

STATE_ROWS = ("weights", "gradients", "exp_avg", "exp_avg_sq", "kahan_comp")
"""The rows that scale with the parameter count, in table order; each has a bytes-per-parameter figure."""


@dataclass
class Estimate:
    """Bytes per rank, row by row. ``n_params`` is the number of parameter
    elements this rank holds (its shards under FSDP), the denominator of
    :meth:`bytes_per_param`; ``labels`` say what each row is made of."""

    weights: int
    grads: int
    exp_avg: int
    exp_avg_sq: int
    kahan_comp: int
    gathered: int
    activations: int
    n_params: int
    labels: dict[str, str] = field(default_factory=dict)

    @property
    def params(self) -> int:
        """The weights (with fp32 master weights these ARE the master copy)."""
        return self.weights

    @property
    def optimizer(self) -> int:
        """Everything the optimizer keeps per parameter: both moments and the compensation buffer."""
        return self.exp_avg + self.exp_avg_sq + self.kahan_comp

    @property
    def state(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        return self.state + self.gathered + self.activations

    def parts(self) -> dict[str, int]:
        """Bytes of each row by a stable key (``weights``, ``master_copy``,
        ``gradients``, ``exp_avg``, ``exp_avg_sq``, ``kahan_comp``, ``gathered``,
        ``activations``, ``total``)."""
        return {"weights": self.weights, "master_copy": 0, "gradients": self.grads, "exp_avg": self.exp_avg,
                "exp_avg_sq": self.exp_avg_sq, "kahan_comp": self.kahan_comp, "gathered": self.gathered,
                "activations": self.activations, "total": self.total}

    def rows(self) -> list[tuple[str, int]]:
        """(label, bytes) per row, in table order, ending with the total."""
        return [(self.labels.get(k, k), v) for k, v in self.parts().items()]

    def bytes_per_param(self) -> dict[str, float]:
        """Bytes per parameter of each row that scales with the parameters
        (:data:`STATE_ROWS`) and of their sum (``state``), over the parameters
        this rank holds. fp32 training with AdamW is 4 + 4 + 4 + 4 = 16."""
        n = max(self.n_params, 1)
        parts = self.parts()
        out = {k: parts[k] / n for k in STATE_ROWS}
        out["state"] = self.state / n
        return out


def meta_model(m, vocab: int):
    """The model the ``model`` section ``m`` builds with ``vocab`` rows, on the
    meta device (no memory, no initialisation), with the fields the trainer passes."""
    import torch

    with torch.device("meta"):
        return build_family(m, vocab)


def shapes(m, vocab: int) -> tuple[list[tuple[int, ...]], int]:
    """(shape of every parameter, elements of the largest transformer block) of the
    model section ``m`` with ``vocab`` rows (:func:`meta_model`); the tied
    head appears once, as in ``model.parameters()``. (A dense model's blocks are
    all alike; a mixture's routed blocks outweigh its dense ones.)"""
    return _shapes(meta_model(m, vocab))


def _shapes(model) -> tuple[list[tuple[int, ...]], int]:
    """:func:`shapes` of a model already built (the estimate builds it once for all its rows)."""
    block = max((sum(p.numel() for p in blk.parameters()) for blk in model.blocks), default=0)
    return [tuple(p.shape) for p in model.parameters()], block


def local_numels(shape_list: list[tuple[int, ...]], mode: str, world: int) -> list[int]:
    """Elements of each parameter on rank 0, the rank with the most: the whole
    tensor under ``none``/``ddp``; under ``fsdp`` (FSDP2) its dim-0 chunk the way
    ``torch.chunk`` cuts it (``ceil(dim0 / world)`` rows); under ``fsdp1`` one
    flat shard of ``ceil(total / world)`` elements (FSDP1 flattens tensors
    together, so per-tensor sizes have no meaning there)."""
    numels = [math.prod(s) for s in shape_list]
    if world <= 1 or mode in ("none", "ddp"):
        return numels
    if mode == "fsdp1":
        return [math.ceil(sum(numels) / world)]
    # a 0-d parameter is not sharded; an empty one holds nothing anywhere
    return [n if not s else (math.ceil(s[0] / world) * (n // s[0]) if s[0] else 0)
            for s, n in zip(shape_list, numels, strict=True)]


def tp_dims(model) -> dict[str, Optional[int]]:
    """Per parameter name of ``model`` (either family, unwrapped), the dimension
    tensor parallelism splits it along, or None where every TP rank holds it
    whole (norms, GPT's position embedding, a fan-in linear's bias). Read off
    the family spec's table that ``distributed/tensor_parallel.py`` applies, so
    the two agree: a fan-out (colwise) linear splits its output rows (weight and
    bias dim 0), a fan-in (rowwise) one its input columns (weight dim 1); the
    token embedding and the head split the vocabulary (dim 0)."""
    split = model_spec(model).split
    dims: dict[str, Optional[int]] = {f"{split.embedding}.weight": 0, f"{split.head}.weight": 0}
    for i in range(len(model.blocks)):
        for s in split.linears:
            at = f"blocks.{i}.{s.path}"
            dims.update({f"{at}.weight": 0, f"{at}.bias": 0} if s.colwise else {f"{at}.weight": 1})
    # every name, a tied head's too (named_parameters() lists a shared tensor once)
    return {name: dims.get(name) for name, _ in model.named_parameters(remove_duplicate=False)}


def tp_shape(shape: tuple[int, ...], dim: Optional[int], tp: int) -> tuple[int, ...]:
    """``shape`` as one TP rank holds it: ``dim`` cut in ``tp`` (the checks
    require it to divide; rounded up otherwise, as the first rank holds most)."""
    if dim is None or tp <= 1:
        return shape
    return tuple(math.ceil(n / tp) if i == dim else n for i, n in enumerate(shape))


def shard_numel(shape: tuple[int, ...], ways: int) -> int:
    """Elements of rank 0's FSDP2 chunk of a tensor of ``shape`` cut into ``ways`` by rows."""
    n = math.prod(shape)
    if not shape or ways <= 1:
        return n
    return math.ceil(shape[0] / ways) * (n // shape[0]) if shape[0] else 0


def mesh_numels(model, mesh: MeshShape) -> list[int]:
    """Elements of each parameter of ``model`` on rank 0 of ``mesh``: its TP
    part (:func:`tp_dims`), then that part's dim-0 chunk over ``dp_shard``.
    ``dp_replicate`` divides nothing: each replica group holds the same shards."""
    dims = tp_dims(model)
    return [shard_numel(tp_shape(tuple(p.shape), dims[name], mesh.tp), mesh.dp_shard)
            for name, p in model.named_parameters()]


def block_tp_numel(model, tp: int) -> int:
    """Elements of the largest transformer block on one TP rank (what FSDP gathers per block)."""
    dims = tp_dims(model)
    return max((sum(math.prod(tp_shape(tuple(p.shape), dims[f"blocks.{i}.{n}"], tp))
                    for n, p in blk.named_parameters()) for i, blk in enumerate(model.blocks)), default=0)


ATTENTION_KERNEL = "flash/mem-efficient SDPA, no T x T"
"""What the activation estimate assumes attention keeps (the activations row's label says it)."""


def activation_bytes(m, micro_batch: int, vocab: int, compute: str, weight_copies: int = 0,
                     checkpointed: bool = False, tp: int = 1, sp: bool = False) -> int:
    """Bytes autograd keeps between the forward and the backward pass of one
    micro-batch of ``micro_batch`` sequences of model ``m`` (a ``ModelConfig``),
    computing in ``compute`` (``fp32``/``bf16``/``fp16``), plus ``weight_copies``
    (bytes of autocast's 16-bit copies of the weights, kept for the backward).

    Per layer and token, as counted on real steps (``tests/test_memory.py``):
    the fp32 residual stream into each LayerNorm (2 x 4d bytes) and their mean
    and rstd (16); in the compute dtype the qkv input, q/k/v, the attention
    output (= the projection's input), the MLP's input, GELU input and
    projection input (14d elements); and the attention kernel's log-sum-exp,
    fp32 per head (4h). ``scaled_dot_product_attention``'s fused kernels
    (flash and memory-efficient on CUDA, flash on the CPU) recompute the
    attention probabilities in the backward pass, so no B x H x T x T matrix is
    kept: the count is linear in T. (Korthikanti et al. 2022 count that matrix,
    5 x heads x T bytes per token and layer; it dominates at context 2048.) With dropout:
    1-byte masks after attention and the MLP; on the CPU attention with dropout
    takes the math kernel, which does keep T x T, not counted here.
    QK-layernorm adds the fp32 q and k its norms keep and the normed q and k.
    Once per micro-batch: the final norm and head input, and the logits with
    their fp32 log-probabilities for the loss.

    ``checkpointed`` (``train.activation_checkpointing=block``): each block
    keeps only its fp32 input (4d bytes per token, as counted on real steps)
    and one block's activations exist at a time, while the backward pass
    recomputes it.

    ``tp`` ranks of tensor parallelism (``sp``: with sequence parallelism):
    :func:`per_rank` divides each part as that layout holds it."""
    b, t, d, h = micro_batch, m.block_size, m.d_model, m.n_head
    c = BYTES[compute]
    # (whole on every TP rank: the gathered inputs of qkv and the MLP;
    #  split: q/k/v, attention output, the MLP's hidden width, log-sum-exp per head;
    #  the residual stream: the norms' inputs and statistics, dropout's masks)
    whole, split, stream = 2 * c * d, 12 * c * d + 4 * h, 8 * d + 16
    if m.dropout:
        stream += 2 * d
    if m.qk_norm:
        split += 8 * d + 2 * c * d + 16 * h
    head = 4 * d + 8 + c * d + vocab * (c + 4) + (d if m.dropout else 0)
    return _layers(m.n_layer, b * t, (whole, split, stream), head, weight_copies, 4 * d if checkpointed else 0, tp, sp)


def per_rank(tokens: int, parts: tuple[int, int, int], tp: int, sp: bool) -> int:
    """Bytes of ``tokens`` tokens' activations of ``parts`` (bytes per token:
    whole on every TP rank, split by the heads or the MLP width, on the
    residual stream) on one of ``tp`` ranks; the residual stream is split only
    under sequence parallelism (``sp``)."""
    whole, split, stream = parts
    return tokens * whole + tokens * split // tp + tokens * stream // (tp if sp else 1)


def _layers(n_layer: int, tokens: int, parts: tuple[int, int, int], head: int, weight_copies: int,
            kept: int, tp: int, sp: bool) -> int:
    """Every block's ``parts`` (:func:`per_rank`) plus the head's bytes per
    token (whole on every TP rank: the logits are gathered) and the weight
    copies. ``kept`` > 0: checkpointed blocks, each keeping only its input
    (``kept`` bytes per token, on the residual stream), and one block's
    activations alive at a time while the backward pass recomputes it."""
    block = per_rank(tokens, parts, tp, sp)
    if kept and n_layer:
        return n_layer * per_rank(tokens, (0, 0, kept), tp, sp) + block + tokens * head + weight_copies
    return n_layer * block + tokens * head + weight_copies


def llama_activation_bytes(m, micro_batch: int, vocab: int, compute: str, weight_copies: int = 0,
                           checkpointed: bool = False, tp: int = 1, sp: bool = False) -> int:
    """:func:`activation_bytes` for the Llama family, as counted on real steps
    (``tests/test_memory.py``). Per layer and token: each RMSNorm's fp32 input,
    normalized value and rstd (2 x (8d + 4)); the attention input, one fp32
    tensor or, under autocast, one compute-dtype copy per projection (q, k and
    v are three linears: 3cd); the fused kernel's q, keys and values repeated
    to every query head, and output (4cd), and its fp32 log-sum-exp (4h); the
    MLP input (4d, or 2cd for gate and up); SwiGLU's gate output, its SiLU,
    the up output and their product, the down projection's input (4c x hidden).
    The rotary tables are one pair per context length, shared by the layers
    (not counted). QK-norm adds its fp32 norms on q and k. Once per
    micro-batch: the final norm, the head's input and the logits with their
    fp32 log-probabilities, and the token ids. ``tp``/``sp``: as in
    :func:`activation_bytes`."""
    b, d = micro_batch, m.d_model
    return _layers(m.n_layer, b * m.block_size, _llama_block(m, compute), _llama_head(m, vocab, compute),
                   weight_copies, 4 * d if checkpointed else 0, tp, sp)


def _llama_block(m, compute: str, mlp: bool = True) -> tuple[int, int, int]:
    """Bytes per token of one Llama block (:func:`llama_activation_bytes`), as (whole on
    every TP rank, split, on the residual stream); ``mlp=False``: its attention and
    norms only (a mixture's routed block adds its own MLP's)."""
    d, h, c, half = m.d_model, m.n_head, BYTES[compute], compute != "fp32"
    kv = m.n_kv_head or h
    # whole on every TP rank: the projections' gathered inputs; split: attention and the MLP's
    # hidden width; the residual stream: the norms' inputs, outputs and statistics
    whole = (3 * c * d if half else 4 * d) + ((2 * c * d if half else 4 * d) if mlp else 0)
    split, stream = 4 * c * d + 4 * h + (4 * c * ffn_hidden(m) if mlp else 0), 2 * (8 * d + 4)
    if m.dropout:
        stream += 2 * d
    if m.qk_norm:
        hd = d // h
        split += 8 * d + 4 * h + 8 * kv * hd + 4 * kv
    return whole, split, stream


def _llama_head(m, vocab: int, compute: str) -> int:
    """Bytes per token the Llama (and moe) family keeps once per micro-batch: the final
    norm, the head's input, the logits with their fp32 log-probabilities, the token ids."""
    c, d, half = BYTES[compute], m.d_model, compute != "fp32"
    return 8 * d + 4 + (c * d if half else 4 * d) + vocab * (c + 4) + 8


def moe_activation_bytes(m, micro_batch: int, vocab: int, compute: str, weight_copies: int = 0,
                         checkpointed: bool = False, tp: int = 1, sp: bool = False) -> int:
    """:func:`activation_bytes` for the mixture of experts, as counted on real steps
    (``tests/test_moe.py``): the first ``model.moe.first_dense_layers`` blocks are Llama
    blocks (:func:`llama_activation_bytes`); each routed block keeps Llama's attention
    and norms and (:func:`_routed_mlp`) its routed MLP's. The experts' weight copies
    (autocast's, or the grouped GEMM's stacked ones) are ``weight_copies``'
    (:func:`expert_stacks`). ``tp``/``sp``: as in :func:`activation_bytes` (1, False: no TP here)."""
    tokens, d = micro_batch * m.block_size, m.d_model
    attn = _llama_block(m, compute, mlp=False)
    routed = per_rank(tokens, (attn[0] + _routed_mlp(m, compute), attn[1], attn[2]), tp, sp)
    dense_layers = int(m.moe.first_dense_layers)
    dense = per_rank(tokens, _llama_block(m, compute), tp, sp) if dense_layers else 0
    head = tokens * _llama_head(m, vocab, compute) + weight_copies
    if checkpointed:  # every block's fp32 input, and one block's activations at a time
        return int(m.n_layer) * per_rank(tokens, (0, 0, 4 * d), tp, sp) + max(routed, dense) + head
    return dense_layers * dense + (int(m.n_layer) - dense_layers) * routed + head


def _routed_mlp(m, compute: str) -> int:
    """Bytes per token a routed MLP keeps, with k = top_k, E experts of width h and c the
    compute dtype's bytes: the router's fp32 input (4d) and scores (4E); the chosen experts
    and each choice's row and slot (int64: 8k, 16k); the renormalised gates (4k + 4); the
    chosen rows as the expert matmuls take them (fp32, or a compute-dtype copy for each of
    gate and up: 2ckd); SwiGLU's four tensors of width h per choice (4ckh); each choice's
    output in fp32, weighted by its gate (8kd, 4k); shared experts as one SwiGLU of their
    summed width. Every choice counts: a capacity drops some, so this is the bound."""
    e, d, c, half = m.moe, m.d_model, BYTES[compute], compute != "fp32"
    k, width = int(e.top_k), int(e.expert_hidden or ffn_hidden(m))
    out = (4 * d + 4 * int(e.n_experts) + 8 * k + 16 * k + (4 * k + 4 if e.norm_topk else 0)
           + (2 * c * k * d if half else 4 * k * d) + 4 * c * k * width + 8 * k * d + 4 * k)
    shared = int(e.n_shared_experts) * width
    if shared:  # its input cast for gate and up under autocast, and SwiGLU's four tensors
        out += (2 * c * d if half else 0) + 4 * c * shared
    return out


def linear_weights(model) -> tuple[list[int], int]:
    """(weight elements of each block's linears, the head's): what autocast
    copies, read off the (meta) model, whatever its family (a mixture's blocks
    differ: a dense one, a routed one with every expert's linears)."""
    import torch.nn as nn

    blocks = [sum(mod.weight.numel() for mod in blk.modules() if isinstance(mod, nn.Linear))
              for blk in model.blocks]
    return blocks, model.lm_head.weight.numel()


def expert_stacks(model, compute: str, looped: bool) -> list[int]:
    """Per block, the bytes of routed expert weights the grouped GEMMs stack (compute dtype) per
    forward and keep for the backward; 0 for dense blocks and when the GEMMs run ``looped`` (set,
    or converted experts). Where ``auto`` falls back to looped at run time, this is the bound."""
    if looped:
        return [0] * len(model.blocks)
    return [BYTES[compute] * sum(lin.weight.numel() for lay in blk.modules() if isinstance(lay, MoEFeedForward)
                                 for ex in lay.experts for lin in (ex.gate, ex.up, ex.down))
            for blk in model.blocks]


ACTIVATIONS = {"gpt": activation_bytes, "llama": llama_activation_bytes, "moe": moe_activation_bytes}
"""Each family's activation count by ``model.family``. A table of the estimator's
own, not a field of the family's spec: what autograd keeps is counted on real
steps here (``tests/test_memory.py``), and the model layer knows nothing of it."""


def _count(n: int) -> str:
    """A parameter count in words: ``15.79B``, ``0.34M``."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def mixture_lines(plan: Plan, vocab: int) -> list[str]:
    """What ``python -m mptrain.memory`` says of a mixture of experts under its table (none
    for a dense model): all parameters against those one token uses, the routed experts'
    share of the weights (every rank holds, or shards, every expert: the rows count them
    all), and what the routers keep in fp32."""
    model = meta_model(plan.model, vocab)
    layers = [lay for lay in model.modules() if isinstance(lay, MoEFeedForward)]
    if not layers:
        return []
    total, active = model.num_params(non_embedding=False), model.active_params(non_embedding=False)
    experts = sum(lin.weight.numel() for lay in layers for ex in lay.experts for lin in (ex.gate, ex.up, ex.down))
    routers = sum(lay.router.weight.numel() for lay in layers)
    in_fp32 = layers[0].router.in_fp32
    return [f"mixture of experts: {_count(total)} parameters, {_count(active)} of them active per token "
            f"({active / total:.0%}: the weights, gradients and moments above hold all {_count(total)}); the routed "
            f"experts of {len(layers)} layers are {_count(experts)} ({experts / total:.0%} of the weights)",
            f"  routers: {_count(routers)} weights, logits, gates and top-k computed in "
            + ("fp32 from the stored weight" if in_fp32 else "the compute dtype (model.moe.router_dtype=compute)")
            + f", gathered in the storage dtype under FSDP; the balancing bias (balance=bias): {len(layers)} x "
            f"{layers[0].n_experts} fp32 values, kept fp32 under every precision"]


def _experts_looped(m, p) -> bool:
    """Whether a mixture's expert GEMMs run looped under precision plan ``p``: asked for,
    or its recipe converts the experts' linears (they then cast for themselves); a dense
    model's answer does not matter."""
    e = getattr(m, "moe", None)
    return e is None or getattr(e.expert_gemm, "value", e.expert_gemm) == "looped" or p.recipe is not None


def mesh_overrides(tp: Optional[int], replicate: Optional[int]) -> list[str]:
    """The ``parallel.*`` overrides the commands' ``--tp`` and ``--replicate``
    stand for (either may be None: not given); ``dp_shard`` then takes the rest."""
    out = [f"parallel.tp={tp}"] if tp else []
    out += [f"parallel.dp_replicate={replicate}"] if replicate else []
    return out + (["parallel.dp_shard=-1"] if out else [])


def estimate(plan: Plan, vocab: int, micro_batch: Optional[int] = None) -> Estimate:
    """Bytes per rank of the run ``plan`` (``mptrain/plan/``: its launch's world and mesh,
    its optimizer, precision and batches) with ``vocab`` rows; ``micro_batch`` sequences
    per forward instead of the plan's (what-ifs)."""
    m, p, choice, mesh, world = plan.model, plan.precision, plan.optimizer, plan.parallel.mesh, plan.world
    mode = plan.parallel.name
    compute = dtype_name(p.compute_dtype)
    store = choice.param_dtype  # the dtype the weights (and so their grads) are stored in
    pb = BYTES[store]
    model = meta_model(m, vocab)
    shape_list, block_numel = _shapes(model)
    on_mesh = mode in MESH_MODES
    local = mesh_numels(model, mesh) if on_mesh else local_numels(shape_list, mode, world)
    n = sum(local)

    weights = grads = n * pb
    exp_avg = sum(moment_bytes(k, choice.state, pb) for k in local)
    exp_avg_sq = exp_avg  # the same layout: a signed and an unsigned map of equal size
    kahan = n * pb if choice.kahan else 0

    gathered = 0
    if (mode == "fsdp1" or on_mesh) and world > 1:
        # one block gathered for compute, one prefetched, in the gather dtype (a TP rank's part of each)
        gathered = 2 * (block_tp_numel(model, mesh.tp) if on_mesh else block_numel) \
            * BYTES[dtype_name(p.wrapper_param_dtype)]
    b = micro_batch or plan.batches.micro_batch
    checkpointed = plan.train.activation_checkpointing.value == "block"
    copies, copied = 0, ""
    per_block, head = linear_weights(model)
    if not (mode == "fsdp1" or on_mesh) and BYTES[compute] < pb and not p.float8:
        # Autocast casts each linear's weight once per forward and the backward keeps
        # the copy (FSDP gathers weights already in the compute dtype: nothing to cast);
        # a checkpointed block keeps none of its own, only the one being recomputed.
        copies = BYTES[compute] * ((max(per_block, default=0) if checkpointed else sum(per_block)) + head)
        copied = ", + autocast weight copies"
    else:
        # A mixture's grouped expert GEMMs stack their weights in the compute dtype even
        # where autocast copies nothing (fp32, pure bf16, FSDP's gathered weights).
        stacks = expert_stacks(model, compute, looped=_experts_looped(m, p))
        copies = max(stacks, default=0) if checkpointed else sum(stacks)
        copied = ", + the grouped expert GEMMs' stacked weights" if copies else ""
    sp = on_mesh and plan.parallel.sequence_parallel
    activations = ACTIVATIONS[plan.family.name](m, b, vocab, compute, copies, checkpointed, mesh.tp, sp)

    act = (", block checkpointing" if checkpointed else "") + (
        f", 1/{mesh.tp} of the split parts" + (" and the residual stream" if sp else "")
        if on_mesh and mesh.tp > 1 else "") + copied
    labels = _labels(store, compute, choice, local, mode, act)
    return Estimate(weights, grads, exp_avg, exp_avg_sq, kahan, gathered, activations, n, labels)


def _labels(store: str, compute: str, choice, local: list[int], mode: str, act: str) -> dict[str, str]:
    """What each row of an estimate is made of, so that a reader sees where the
    bytes go (``act``: the activations row's notes)."""
    if store == "fp32" and compute == "fp32":
        w, master = "weights (fp32)", "separate master copy (none: fp32 training)"
    elif store == "fp32":
        w = f"weights (fp32 master weights, {compute} compute)"
        master = "separate master copy (none: the fp32 weights are it)"
    else:
        w, master = f"weights ({store}, no fp32 master)", f"separate master copy (none: {store} weights only)"
    if choice.state in QUANTIZED and mode != "fsdp1":
        big = sum(k >= MIN_QUANTIZED and k % BLOCK[choice.state] == 0 for k in local)
        extras = "scales" + (" + qmap" if choice.state != "fp8" else "")
        moment = f"{choice.state} + {extras}; {len(local) - big} of {len(local)} tensors left {store}"
    else:
        moment = choice.state
    return {"weights": w, "master_copy": master, "gradients": f"gradients ({store})",
            "exp_avg": f"Adam exp_avg ({moment})", "exp_avg_sq": f"Adam exp_avg_sq ({moment})",
            "kahan_comp": f"Kahan compensation ({store})" if choice.kahan else "Kahan compensation (none)",
            "gathered": "FSDP gathered copies (estimate)",
            "activations": f"activations (estimate; {ATTENTION_KERNEL}{act})", "total": "total"}


def summary_figures(e: Estimate) -> dict:
    """What ``summary.json`` can carry from an estimate: the state's bytes per
    parameter (``mem/bytes_per_param``), the same per part, the state's
    GiB, and the parameters per rank they are counted over."""
    bpp = e.bytes_per_param()
    return {"mem/bytes_per_param": round(bpp["state"], 4),
            "mem/bytes_per_param_parts": {k: round(bpp[k], 4) for k in STATE_ROWS},
            "mem/state_gib": e.state / 2**30,
            "mem/params_per_rank": e.n_params}


# -------------------------------------------------------------- does it fit?
REFUSE_BELOW = 0.9
"""A run is refused when less than this fraction of its estimate is free. The
estimate's activation rows can sit a few per cent above what compiled kernels
keep (gpt-6.7b bf16 with checkpointed blocks, micro-batch 2 x 2048 on an H200:
103.8 GiB estimated, 100.6 GiB peak), so a run within that margin is let
through: a refusal means it cannot fit, not that it might not."""


def gib_text(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def _cgroup_headroom() -> Optional[int]:
    """Bytes a cgroup memory limit still leaves this process: the tightest over
    its cgroup and their parents (v2, or v1's memory controller); None with no
    limit. In a container ``/proc/meminfo`` describes the whole machine, while
    the OOM killer enforces the limit. Reclaimable page cache (inactive file
    pages) counts as free: the kernel drops it before it kills."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    best: Optional[int] = None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            root, names = Path("/sys/fs/cgroup"), ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            root = Path("/sys/fs/cgroup/memory")
            names = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        here = root / path.lstrip("/")
        while True:  # a limit may sit on any ancestor, up to the mount's root
            room = _headroom(here, *names)
            if room is not None:
                best = room if best is None else min(best, room)
            if here == root or root not in here.parents:
                break
            here = here.parent
    return best


def _headroom(d: Path, limit_name: str, usage_name: str, inactive_key: str) -> Optional[int]:
    """``limit - usage + inactive file pages`` of cgroup folder ``d``; None without a limit there."""
    try:
        limit = (d / limit_name).read_text().strip()
        usage = int((d / usage_name).read_text())
    except (OSError, ValueError):
        return None
    if not limit.isdigit() or int(limit) >= 2**60:  # "max" (v2) or v1's page-rounded "unlimited"
        return None
    inactive = 0
    try:
        for row in (d / "memory.stat").read_text().splitlines():
            key, _, value = row.partition(" ")
            if key == inactive_key:
                inactive = int(value)
    except (OSError, ValueError):
        pass
    return max(0, int(limit) - usage + inactive)


def host_available() -> Optional[int]:
    """Bytes this host can still give a process: ``MemAvailable`` of
    ``/proc/meminfo`` (free memory plus what the kernel can reclaim), lowered to
    a cgroup limit's headroom; None where neither can be read (not Linux)."""
    available: Optional[int] = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024  # the file says kB and means KiB
    except (OSError, ValueError, IndexError):
        pass
    room = _cgroup_headroom()
    if room is not None:
        available = room if available is None else min(available, room)
    return available


def device_free(device) -> Optional[int]:
    """Free bytes on a CUDA ``device`` (``torch.cuda.mem_get_info``); None for any other device."""
    if device.type != "cuda":
        return None
    import torch

    return int(torch.cuda.mem_get_info(device)[0])


def fit_problem(needed: int, available: Optional[int], what: str, where: str, fixes: Sequence[str],
                detail: str = "") -> Optional[str]:
    """The refusal when ``needed`` bytes per rank cannot fit in ``available``
    (less than :data:`REFUSE_BELOW` of it is free), or None: it fits, or the
    free memory is unknown. ``what`` names the run, ``where`` the memory
    (``"cuda:0 has"``, ``"this host has"``), ``detail`` follows the free
    figure; ``fixes`` are the ways out, to which the check's own override is added."""
    if available is None or available >= REFUSE_BELOW * needed:
        return None
    return (f"{what} needs about {gib_text(needed)} per rank but {where} {gib_text(available)} free{detail}. "
            f"Fixes: {', '.join(fixes)}; train.memory_check=false skips this check.")


def fit_fixes(plan: Plan) -> list[str]:
    """What would bring the estimate of ``plan`` down, leaving out what it already does."""
    mode, mesh, micro_batch = plan.parallel.name, plan.parallel.mesh, plan.batches.micro_batch
    fixes = ["more ranks (torchrun --nproc_per_node, --nnodes)" if mode in ("fsdp1", *MESH_MODES)
             else "more ranks with parallel=fsdp"]
    if mesh.dp_replicate > 1:
        fixes.append(f"more sharding (a larger parallel.dp_shard, a smaller parallel.dp_replicate={mesh.dp_replicate})")
    if plan.train.activation_checkpointing.value != "block":
        fixes.append("train.activation_checkpointing=block")
    if micro_batch > 1:
        fixes.append(f"a smaller micro-batch (train.micro_batch_size={micro_batch // 2})")
    return fixes + ["a smaller model"]


# ------------------------------------------------- what the estimate leaves out
def process_kib(field: str) -> Optional[int]:
    """A figure of this process from ``/proc/self/status`` in KiB (``VmRSS``:
    resident now, ``VmHWM``: its peak since the last reset); None where it
    cannot be read (not Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])  # the file says kB and means KiB
    except (OSError, ValueError, IndexError):
        pass
    return None


def left_out(e: Estimate, micro_batch: int, block_size: int, vocab: int) -> list[str]:
    """What the estimate does not count, as the lines ``python -m mptrain.memory``
    prints under its table. The framework's own share is this process's resident
    memory now: a process that has imported torch and mptrain and built nothing
    but a meta-device model, about what a run holds before its first tensor."""
    rss = process_kib("VmRSS")
    here = (f"{rss / 2**20:.2f} GiB resident in this process (no model built)"
            if rss is not None else "not measurable here (no /proc/self/status)")
    logits_grad = micro_batch * block_size * vocab * 4
    return [
        f"not counted in the total ({e.total / 2**30:.3f} GiB):",
        f"  - the framework: the Python interpreter, torch's libraries and mptrain, {here}",
        "    (a CPU run's peak includes it; a GPU run adds its CUDA context)",
        "  - allocator slack: memory freed but kept for reuse (glibc's malloc on a CPU; on a GPU,",
        "    CUDA's caching allocator: a run's mem/peak_reserved_gib over its mem/peak_gib)",
        f"  - the backward pass's transient buffers: the logits' gradient alone is "
        f"{micro_batch} x {block_size} x {vocab} x 4 bytes = {logits_grad / 2**30:.3f} GiB",
        "  - the data: the token store, the batches in flight, the validation windows",
        "a run prints its measured peak beside this estimate when it ends (summary.json: mem/peak_rss_gib",
        "on a CPU, mem/peak_gib and mem/peak_reserved_gib on a GPU)",
    ]


def measured_line(estimate_bytes: int, figures: dict, at: str = "") -> str:
    """The end-of-run line that puts a run's measured peak (``figures``, the
    summary's ``mem/*`` keys) beside the estimate (``at``: where a run of several
    precision phases peaks, in words); empty when nothing was measured."""
    est = (f"estimate {estimate_bytes / 2**30:.3f} GiB{' at ' + at if at else ''}: weights, gradients, optimizer "
           "state, activations (python -m mptrain.memory says what it leaves out)")
    if "mem/peak_gib" in figures:  # CUDA: what tensors held, and what the caching allocator held for them
        reserved = figures.get("mem/peak_reserved_gib")
        held = f", {reserved:.3f} GiB reserved by CUDA's caching allocator" if reserved is not None else ""
        return f"memory: peak {figures['mem/peak_gib']:.3f} GiB allocated{held} | {est}"
    if "mem/peak_rss_gib" not in figures:
        return ""
    start = figures.get("mem/start_rss_gib")
    before = (f" ({start:.3f} GiB of it before the run built anything: Python, torch, mptrain)"
              if start is not None else "")
    return f"memory: peak resident {figures['mem/peak_rss_gib']:.3f} GiB{before} | {est}"


def format_table(e: Estimate) -> list[str]:
    """The table ``python -m mptrain.memory`` prints: GiB and bytes per parameter per row."""
    bpp = e.bytes_per_param()
    width = max(len(label) for label, _ in e.rows())
    lines = [f"  {'':<{width}} {'GiB':>10} {'bytes/param':>12}"]
    for key, v in e.parts().items():
        per = f"{bpp[key]:12.3f}" if key in bpp else (f"{0.0:12.3f}" if key == "master_copy" else "")
        if key == "gathered":  # the per-parameter rows end here: their sum first
            lines.append(f"  {'= weights, gradients, optimizer':<{width}} {e.state / 2**30:10.3f} {bpp['state']:12.3f}")
        lines.append(f"  {e.labels.get(key, key):<{width}} {v / 2**30:10.3f} {per}".rstrip())
    lines.append(f"  bytes/param: over the {e.n_params:,} parameters this rank holds")
    return lines

