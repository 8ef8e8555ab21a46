"""A Llama-style decoder (RMSNorm, rotary positions, grouped-query attention,
SwiGLU) as a plain ``nn.Module``, with the interface and conventions of
:class:`mptrain.model.gpt.GPT`.

Its parameter names, layouts and numerics follow transformers'
``LlamaForCausalLM``, so a Hugging Face checkpoint loads by renaming alone
(``model.layers.N.self_attn.q_proj`` -> ``blocks.N.attn.q`` and so on): the
rotary embedding uses the same "rotate_half" (non-interleaved) pairing, the
same frequencies and the same fp32 arithmetic, and RMSNorm the same order of
operations, so the logits equal transformers' on the same fp32 weights.

As in ``gpt.py``, no distributed or precision code lives here; the model owns
only the rule that numerically sensitive ops run in fp32 on every device:
RMSNorm, the rotary embedding and the loss upcast their input explicitly,
because CPU autocast (unlike CUDA autocast) would leave them in half precision.

Two study knobs are off by default: ``LlamaShape.rope_dtype="bf16"`` builds
the rotary tables in bfloat16, to show the damage that does at long context
(:func:`rope_error_by_position` measures it), and ``LlamaShape.smooth_swiglu``
divides the SwiGLU product by its per-channel maximum before the down
projection (Fishman et al. 2024, "Smooth-SwiGLU"), leaving the function
unchanged but the down projection's low-precision operands free of outliers.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from mptrain.model.common import AttentionProbe, Block, LossFn, blocks_and_head, draw_init, heads


@dataclass
class LlamaShape:
    """The numbers that define a Llama model; built from ``ModelConfig`` + vocab size."""

    vocab_size: int
    n_layer: int
    n_head: int
    d_model: int
    block_size: int
    n_kv_head: int  # key/value heads; n_head must be a multiple (grouped-query attention)
    ffn_hidden: int  # SwiGLU hidden width (see swiglu_hidden)
    rope_theta: float = 10000.0
    rope_dtype: str = "fp32"  # "fp32" (transformers' arithmetic) or "bf16" (the study knob)
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    qk_norm: bool = False
    dropout: float = 0.0
    smooth_swiglu: bool = False

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


def swiglu_hidden(d_model: int, multiple_of: int = 256, ffn_dim_multiplier: float | None = None) -> int:
    """Llama's SwiGLU width: two thirds of the usual 4 * d_model (SwiGLU has
    three matrices, not two, so this keeps the MLP's parameters about the
    same), optionally scaled by ``ffn_dim_multiplier``, rounded up to a
    multiple of ``multiple_of`` (Llama 3 8B: 4096, 1024, 1.3 -> 14336)."""
    h = int(2 * 4 * d_model / 3)
    if ffn_dim_multiplier:
        h = int(ffn_dim_multiplier * h)
    return multiple_of * math.ceil(h / multiple_of)


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32 whatever the input dtype, output in the input dtype.

    The order of operations is transformers' ``LlamaRMSNorm`` (mean of the
    squares, ``rsqrt(variance + eps)``, multiply, then the weight), so in fp32
    the result is the same to the bit. In half precision it differs on purpose
    in one place: transformers rounds the normalised activation to the input
    dtype *before* multiplying by the weight (two roundings); here the weight
    is applied in fp32 too and the result rounded once.
    """

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Autocast off: otherwise it could cast our fp32 operands back down.
        with torch.autocast(x.device.type, enabled=False):
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
            y = self.weight.float() * h
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


# ------------------------------------------------------------------ rotary embedding
def rope_tables(head_dim: int, positions: int, theta: float, dtype: str = "fp32",
                device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of the rotary angles of positions ``0 .. positions - 1``, each
    (positions, head_dim), fp32.

    ``dtype="fp32"`` is transformers' default rope arithmetic exactly:
    ``inv_freq = 1 / theta ** (arange(0, head_dim, 2) / head_dim)`` in fp32,
    angles = position x inv_freq in fp32, each frequency used twice (the
    "rotate_half" layout: dimension ``i`` pairs with ``i + head_dim / 2``).

    ``dtype="bf16"`` is the study knob: positions, ``inv_freq`` and their
    product in bfloat16, and cos/sin of those angles in bfloat16 too (what a
    table computed in bf16 gets: a matmul form of the product under bf16
    autocast, or frequencies kept in a buffer the model's bf16 cast reaches),
    returned as fp32 tensors holding the bf16 values. Its 8-bit significand
    rounds ``inv_freq`` by up to 1/512 of itself, so an angle of p radians is
    already off by up to ~p/512 at short range; it holds integers exactly only
    up to 256, and an angle of ~1e5 radians only to within ~1e3, so at long
    context the fast-turning pairs rotate by close to random angles
    (:func:`rope_error_by_position` measures it).
    """
    if dtype not in ("fp32", "bf16"):
        raise ValueError(f"rope dtype {dtype!r}: expected 'fp32' or 'bf16'")
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    pos = torch.arange(positions, dtype=torch.float32, device=device)
    if dtype == "bf16":
        inv_freq, pos = inv_freq.to(torch.bfloat16), pos.to(torch.bfloat16)
    # An outer product by broadcasting, not a matmul: autocast leaves elementwise
    # ops alone, so a table built under autocast is still the dtype asked for.
    angles = pos[:, None] * inv_freq[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().float(), emb.sin().float()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dimension (transformers' pairing)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (B, H, T, head_dim) by the angles of ``cos``/``sin`` (T,
    head_dim): ``x * cos + rotate_half(x) * sin``, computed in fp32 (in bf16
    the rotation of a large activation would lose digits), returned in ``x``'s dtype."""
    with torch.autocast(x.device.type, enabled=False):
        h = x.float()
        y = h * cos + rotate_half(h) * sin
    return y.to(x.dtype)


class RotaryCache:
    """The rotary tables of one model, built lazily and kept outside the module tree.

    Not a registered buffer: checkpoints, ``state_dict``, FSDP and
    ``model.to(dtype)`` never see the tables (a bf16 cast of the model would
    otherwise turn them into the bf16 variant). Built on the first forward on
    a device, for the sequence length asked, and rebuilt when a longer one is
    asked or the device changes; a shorter length is a slice (each position's
    values are computed independently, so the slice equals a table built for
    that length). On the meta device nothing is computed or kept: empty
    tables of the right shape come back.

    One object is shared by all of a model's attention layers, which read it
    themselves instead of taking the tables as a block argument: a wrapper
    that casts floating-point forward inputs (FSDP's mixed precision) would
    otherwise round the tables to the compute dtype.
    """

    def __init__(self, head_dim: int, theta: float, dtype: str = "fp32"):
        self.head_dim, self.theta, self.dtype = head_dim, theta, dtype
        self.cos: Optional[torch.Tensor] = None
        self.sin: Optional[torch.Tensor] = None

    def tables(self, T: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each (T, head_dim) fp32 on ``device``."""
        device = torch.device(device)
        if device.type == "meta":
            empty = torch.empty(T, self.head_dim, device=device)
            return empty, empty
        if self.cos is None or self.cos.device != device or self.cos.shape[0] < T:
            self.cos, self.sin = rope_tables(self.head_dim, T, self.theta, self.dtype, device)
        return self.cos[:T], self.sin[:T]


def rope_error_by_position(positions: Iterable[int], theta: float, head_dim: int, bucket: int = 1024,
                           samples: int = 8, seed: int = 0) -> dict[str, list]:
    """How far the rotary embedding is from exact, position by position.

    For each position of ``positions`` (any increasing integers, e.g.
    ``range(8192)`` or ``[131071]``), ``samples`` random vectors are rotated
    with the bf16 tables, with the fp32 tables and exactly (angles and
    rotation in float64), and the error of each is ``|rotated - exact| / |x|``.
    The positions are cut into consecutive buckets of ``bucket`` of them; the
    answer holds, per bucket, its first and last position and the mean error
    of each table: ``{"first": [...], "last": [...], "bf16": [...], "fp32": [...]}``.
    (Both include the fp32 rounding of ``x`` itself, ~3e-8: the error at position 0.)
    """
    pos = torch.as_tensor(list(positions), dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 1, len(pos), head_dim, generator=g, dtype=torch.float64)
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = pos.double()[:, None] * inv_freq[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    exact = x * emb.cos() + rotate_half(x) * emb.sin()
    err = {}
    for dt in ("bf16", "fp32"):
        cos, sin = rope_tables(head_dim, int(pos.max()) + 1, theta, dt)
        y = apply_rope(x.float(), cos[pos], sin[pos]).double()
        err[dt] = ((y - exact).norm(dim=-1) / x.norm(dim=-1)).mean(dim=(0, 1))  # (positions,)
    out: dict[str, list] = {"first": [], "last": [], "bf16": [], "fp32": []}
    for i in range(0, len(pos), bucket):
        out["first"].append(int(pos[i]))
        out["last"].append(int(pos[min(i + bucket, len(pos)) - 1]))
        for dt in ("bf16", "fp32"):
            out[dt].append(err[dt][i:i + bucket].mean().item())
    return out


# ------------------------------------------------------------------ attention
def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, n_kv_head, T, hd) -> (B, n_kv_head * n_rep, T, hd), each kv head
    repeated ``n_rep`` times consecutively (transformers' ``repeat_kv``: query
    head ``h`` reads kv head ``h // n_rep``)."""
    if n_rep == 1:
        return x
    B, H, T, hd = x.shape
    return x[:, :, None].expand(B, H, n_rep, T, hd).reshape(B, H * n_rep, T, hd)


class Attention(AttentionProbe, nn.Module):
    """Grouped-query causal self-attention with rotary positions, through
    ``scaled_dot_product_attention``.

    ``n_head`` query heads share ``n_kv_head`` key/value heads, each kv head
    serving ``n_head // n_kv_head`` consecutive query heads. With ``qk_norm``,
    each head's queries and keys pass through an RMSNorm over ``head_dim``
    before the rotation. ``probe`` / ``probe_stats`` are those of
    :class:`mptrain.model.common.AttentionProbe` (both families'): on the steps a monitor
    sets ``probe``, each forward folds the largest logit and the mean entropy
    of the (rotated, repeated) queries and keys into ``probe_stats``."""

    def __init__(self, s: LlamaShape, rope: Optional[RotaryCache] = None):
        super().__init__()
        if s.d_model % s.n_head or s.n_head % s.n_kv_head:
            raise ValueError(f"d_model={s.d_model} must be a multiple of n_head={s.n_head}, "
                             f"and n_head a multiple of n_kv_head={s.n_kv_head}")
        self.n_head, self.n_kv_head, self.head_dim = s.n_head, s.n_kv_head, s.head_dim
        self.q = nn.Linear(s.d_model, s.n_head * s.head_dim, bias=False)
        self.k = nn.Linear(s.d_model, s.n_kv_head * s.head_dim, bias=False)
        self.v = nn.Linear(s.d_model, s.n_kv_head * s.head_dim, bias=False)
        self.o = nn.Linear(s.n_head * s.head_dim, s.d_model, bias=False)
        self.dropout = s.dropout
        self.resid_drop = nn.Dropout(s.dropout)
        self.q_norm = RMSNorm(s.head_dim, s.norm_eps) if s.qk_norm else None
        self.k_norm = RMSNorm(s.head_dim, s.norm_eps) if s.qk_norm else None
        self.rope = rope if rope is not None else RotaryCache(s.head_dim, s.rope_theta, s.rope_dtype)
        self.probe: bool = False
        self.probe_stats: Optional[dict[str, torch.Tensor]] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # (B, T, heads * hd) -> (B, heads, T, hd). The head counts are read from
        # the projections' outputs, not from the shape: under tensor parallelism
        # a rank's q/k/v hold only its share of the heads (parallel.tp).
        q, k, v = (heads(proj(x), self.head_dim) for proj in (self.q, self.k, self.v))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = self.rope.tables(T, x.device)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # Repeated explicitly, as transformers does, rather than through SDPA's
        # enable_gqa, which not every fused kernel takes.
        n_rep = q.shape[1] // k.shape[1]
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        if self.probe:
            self._probe(q, k)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).contiguous().view(B, T, q.shape[1] * self.head_dim)
        return self.resid_drop(self.o(y))


# ------------------------------------------------------------------ MLP
class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``.

    With ``smooth_swiglu`` (Fishman et al. 2024, arXiv 2409.12517): the
    product ``h = silu(gate(x)) * up(x)`` grows outlier channels in long
    low-precision runs (the product of two aligned linears is quadratic in
    their weights), and one outlier channel sets a per-tensor float8 scale
    that flushes every other channel. So ``h`` is divided per channel by
    ``s``, its amax over batch and tokens (detached, recomputed every
    forward), and the matching input columns of ``down``'s weight are
    multiplied by ``s`` for that matmul: the function (and its gradients) is
    unchanged in exact arithmetic, but the down projection's operands, the
    ones a low-precision matmul quantizes, see the smoothed values.

    ``down`` stays an ``nn.Linear`` attribute with its own weight, so the
    precision layer's by-type conversion still finds it, and the smoothed
    matmul runs through ``down``'s own forward, whatever it was converted to
    (a float8 or 4-bit linear casts the smoothed operands, and its cast
    statistics see them): ``torch.func.functional_call`` hands that forward
    the scaled weight in place of its own, and autograd carries the gradient
    back to the real one. ``s`` is a power of two, so dividing and
    multiplying by it is exact in every dtype: the smoothing changes only
    what a quantized matmul rounds.
    """

    def __init__(self, s: LlamaShape):
        super().__init__()
        self.gate = nn.Linear(s.d_model, s.ffn_hidden, bias=False)
        self.up = nn.Linear(s.d_model, s.ffn_hidden, bias=False)
        self.down = nn.Linear(s.ffn_hidden, s.d_model, bias=False)
        self.drop = nn.Dropout(s.dropout)
        self.smooth = s.smooth_swiglu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.gate(x)) * self.up(x)
        if not self.smooth:
            return self.drop(self.down(h))
        return self.drop(smoothed(self.down, h))


def smoothed(down: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """``down(h)`` computed as ``down``'s forward of ``h / s`` with weight
    ``W * s``: ``s`` is each input channel's amax over batch and tokens
    (detached, recomputed every call) rounded up to a power of two, clamped so
    that an all-zero channel divides 0 by a normal number, not 0 by 0."""
    amax = h.detach().abs().amax(dim=tuple(range(h.dim() - 1))).float().clamp_min(torch.finfo(h.dtype).tiny)
    s = torch.exp2(torch.ceil(torch.log2(amax)))
    return torch.func.functional_call(down, {"weight": down.weight * s}, (h / s.to(h.dtype),))


def llama_block(s: LlamaShape, rope: Optional[RotaryCache] = None) -> Block:
    """A Llama block: RMSNorms, grouped-query attention with rotary positions
    (reading the model's shared ``rope`` tables) and SwiGLU in the shared
    pre-norm :class:`~mptrain.model.common.Block`."""
    return Block(RMSNorm(s.d_model, s.norm_eps), Attention(s, rope), RMSNorm(s.d_model, s.norm_eps), SwiGLU(s))


class Llama(nn.Module):
    """Token embedding, ``n_layer`` blocks, final RMSNorm, output head (untied
    unless ``tie_embeddings``). No position embedding: positions enter as
    rotations of each head's queries and keys.

    ``loss_fn`` computes the loss from the logits (:class:`mptrain.model.common.LossFn`);
    ``parallel.wrap`` compiles it when it compiles the blocks."""

    def __init__(self, s: LlamaShape):
        super().__init__()
        self.shape = s
        self.wte = nn.Embedding(s.vocab_size, s.d_model)
        self.drop = nn.Dropout(s.dropout)
        rope = RotaryCache(s.head_dim, s.rope_theta, s.rope_dtype)  # one for all layers
        self.blocks = nn.ModuleList(llama_block(s, rope) for _ in range(s.n_layer))
        self.ln_f = RMSNorm(s.d_model, s.norm_eps)
        self.lm_head = nn.Linear(s.d_model, s.vocab_size, bias=False)
        self.tie_weights()
        self.loss_fn = LossFn()
        if not self.wte.weight.is_meta:  # on the meta device there is nothing to fill yet
            self.reset_parameters()

    def tie_weights(self) -> None:
        """The head shares the token embedding's matrix when ``tie_embeddings``
        (the small Llama 3.2 models do); otherwise it has its own, and this does nothing."""
        if self.shape.tie_embeddings:
            self.lm_head.weight = self.wte.weight

    @torch.no_grad()
    def reset_parameters(self, generator: Optional[torch.Generator] = None) -> None:
        """N(0, 0.02) for the embedding, the head and every linear; the residual
        output projections (``attn.o``, ``mlp.down``) scaled by 1/sqrt(2 * n_layer)
        so the residual stream's variance does not grow with depth; unit norm
        weights (QK-norm's too).

        The drawing discipline is :meth:`mptrain.model.gpt.GPT.reset_parameters`':
        every tensor drawn whole, in fp32 on the CPU (or on ``generator``'s
        device), from ``generator`` (the global one when None), one parameter
        after another in ``named_parameters`` order, then written into the
        parameter whatever its device, dtype or sharding. So one seeded
        generator gives the same weights on one rank or many, built on the
        meta device or not. Pretrained weights (``model.init_from``) are written
        instead of these by ``parallel.materialize`` (:func:`mptrain.model.common.write_weights`)."""
        draw_init(self, generator, RMSNorm, ("attn.o.weight", "mlp.down.weight"), self.shape.n_layer)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count, the tied head counted once. ``non_embedding``
        (the N of the 6N FLOPs estimate: parameters that take part in
        matmuls) leaves out an untied token embedding, a table lookup; a tied
        one is the head's matrix and stays, as in GPT's count."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding and not self.shape.tie_embeddings:
            n -= self.wte.weight.numel()
        return n

    def active_params(self, non_embedding: bool = True) -> int:
        """The parameters one token's forward uses: every one (:meth:`num_params`), a dense
        model's; the mixture of experts answers the same question with fewer."""
        return self.num_params(non_embedding)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """Logits for ``idx`` (B, T); with ``targets``, also the mean
        cross-entropy, computed from fp32 logits."""
        T = idx.shape[1]
        if T > self.shape.block_size:
            raise ValueError(f"sequence of {T} tokens is longer than block_size={self.shape.block_size}")
        x = self.drop(self.wte(idx))
        return blocks_and_head(self, x, targets)
