"""A GPT-2 style decoder as a plain ``nn.Module``.

No distributed or precision code lives here; the one precision rule the model
does own is that numerically sensitive ops run in fp32 on every device:
LayerNorm and the loss upcast their input explicitly, because CPU autocast
(unlike CUDA autocast) leaves them in half precision. Attention softmax runs
inside ``scaled_dot_product_attention``, whose fused kernels accumulate the
softmax in fp32.

Two pieces serve the stability monitor (``mptrain/observe/stability.py``): the
optional QK-layernorm (``GPTShape.qk_norm``: LayerNorm on each head's queries
and keys, which bounds the attention logits), and the attention probe, which
recomputes the logits the fused kernel hides, on the steps where a monitor
switches it on (``CausalSelfAttention.probe``, from
:class:`mptrain.model.common.AttentionProbe`).

The block, the initial draws, the loss and the forward past the embeddings
are both families' and live in ``mptrain/model/common.py``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from mptrain.model.common import AttentionProbe, Block, LossFn, blocks_and_head, draw_init, gelu_tanh, heads


@dataclass
class GPTShape:
    """The numbers that define a model; built from ``ModelConfig`` + vocab size."""

    vocab_size: int
    n_layer: int
    n_head: int
    d_model: int
    block_size: int
    dropout: float = 0.0
    bias: bool = True
    qk_norm: bool = False  # last, so positional constructions from before it keep their meaning


class LayerNorm(nn.Module):
    """LayerNorm computed in fp32 whatever the input dtype, output in the input dtype.

    Under CUDA autocast ``layer_norm`` is already on the fp32 list; under CPU
    autocast it is not, so a bf16/fp16 activation would be normalised in half
    precision. Upcasting here makes the model behave the same on both.
    """

    def __init__(self, dim: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Autocast off: otherwise it would cast our fp32 operands back down.
        with torch.autocast(x.device.type, enabled=False):
            w = self.weight.float()
            b = self.bias.float() if self.bias is not None else None
            y = F.layer_norm(x.float(), (x.shape[-1],), w, b, 1e-5)
        return y.to(x.dtype)


class CausalSelfAttention(AttentionProbe, nn.Module):
    """Multi-head causal self-attention through ``scaled_dot_product_attention``.

    With ``qk_norm``, each head's queries and keys pass through a LayerNorm
    over ``head_dim`` first, so a logit can only grow through the norms'
    weights, not through the whole q/k projection. ``probe`` (off unless a
    monitor sets it) makes each forward also fold the largest logit and the
    mean entropy into ``probe_stats`` (see :meth:`_probe`)."""

    def __init__(self, s: GPTShape):
        super().__init__()
        self.n_head = s.n_head
        self.qkv = nn.Linear(s.d_model, 3 * s.d_model, bias=s.bias)
        self.proj = nn.Linear(s.d_model, s.d_model, bias=s.bias)
        self.dropout = s.dropout
        self.resid_drop = nn.Dropout(s.dropout)
        self.head_dim = head_dim = s.d_model // s.n_head
        self.q_norm = LayerNorm(head_dim, s.bias) if s.qk_norm else None
        self.k_norm = LayerNorm(head_dim, s.bias) if s.qk_norm else None
        self.probe: bool = False
        self.probe_stats: Optional[dict[str, torch.Tensor]] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        qkv = self.qkv(x)
        # (B, T, 3 * heads * head_dim) -> three (B, heads, T, head_dim). The
        # widths are read from the output, not from the shape: under tensor
        # parallelism a rank's qkv output holds only its share of the heads, as
        # [q; k; v] of those heads (distributed/tensor_parallel.py).
        q, k, v = qkv.split(qkv.shape[-1] // 3, dim=2)
        q, k, v = (heads(t, self.head_dim) for t in (q, k, v))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.probe:
            self._probe(q, k)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).contiguous().view(B, T, q.shape[1] * self.head_dim)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    gelu_tanh = True  # the tanh GELU whose CPU kernel the banner names (common.gelu_kernel_text)

    def __init__(self, s: GPTShape):
        super().__init__()
        self.fc = nn.Linear(s.d_model, 4 * s.d_model, bias=s.bias)
        self.proj = nn.Linear(4 * s.d_model, s.d_model, bias=s.bias)
        self.drop = nn.Dropout(s.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(gelu_tanh(self.fc(x))))


def gpt_block(s: GPTShape) -> Block:
    """A GPT-2 block: LayerNorms, multi-head attention and the GELU MLP in the
    shared pre-norm :class:`~mptrain.model.common.Block`."""
    return Block(LayerNorm(s.d_model, s.bias), CausalSelfAttention(s), LayerNorm(s.d_model, s.bias), MLP(s))



class GPT(nn.Module):
    """Token + position embeddings, ``n_layer`` blocks, final norm, tied head.

    ``loss_fn`` computes the loss from the logits (:class:`LossFn`);
    ``parallel.wrap`` compiles it when it compiles the blocks."""

    def __init__(self, s: GPTShape):
        super().__init__()
        self.shape = s
        self.wte = nn.Embedding(s.vocab_size, s.d_model)
        self.wpe = nn.Embedding(s.block_size, s.d_model)
        self.drop = nn.Dropout(s.dropout)
        self.blocks = nn.ModuleList(gpt_block(s) for _ in range(s.n_layer))
        self.ln_f = LayerNorm(s.d_model, s.bias)
        self.lm_head = nn.Linear(s.d_model, s.vocab_size, bias=False)
        self.tie_weights()
        self.loss_fn = LossFn()
        if not self.wte.weight.is_meta:  # on the meta device there is nothing to fill yet
            self.reset_parameters()

    def tie_weights(self) -> None:
        """The head shares the token embedding's matrix, as in GPT-2."""
        self.lm_head.weight = self.wte.weight

    @torch.no_grad()
    def reset_parameters(self, generator: Optional[torch.Generator] = None) -> None:
        """GPT-2 init: N(0, 0.02), residual output projections scaled by
        1/sqrt(2 * n_layer) so the residual stream's variance does not grow
        with depth; zero biases; unit norm weights (QK-layernorm's too).

        Every tensor is drawn whole, in fp32 on the CPU, from ``generator``
        (the global generator when None), one parameter after another in
        ``named_parameters`` order, and then written into the parameter
        whatever its device, dtype or sharding: a parameter that is an FSDP2
        shard (a DTensor) keeps only its part of the tensor every rank drew.
        So one seeded generator gives the same initial weights on one rank or
        many, on CPU or GPU, built on the meta device or not. Drawing on the
        CPU costs time on large models (about 1 s per 200M parameters), never
        more memory than the largest single tensor. A generator on a GPU draws
        there, much faster, but other numbers than the CPU's (scripts/gpu_check.py's
        speed runs, where the values do not matter, use one)."""
        draw_init(self, generator, LayerNorm, ("proj.weight",), self.shape.n_layer)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; the position embedding is left out by default (as
        in the usual 6N FLOPs estimate). The tied head is counted once."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.wpe.weight.numel() if non_embedding else n

    def active_params(self, non_embedding: bool = True) -> int:
        """The parameters one token's forward uses: every one (:meth:`num_params`), a dense
        model's; the mixture of experts answers the same question with fewer."""
        return self.num_params(non_embedding)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """Logits for ``idx`` (B, T); with ``targets``, also the mean
        cross-entropy, computed from fp32 logits."""
        B, T = idx.shape
        if T > self.shape.block_size:
            raise ValueError(f"sequence of {T} tokens is longer than block_size={self.shape.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        return blocks_and_head(self, x, targets)
