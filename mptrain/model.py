"""A GPT-2 style decoder as a plain ``nn.Module``.

No distributed or precision code lives here; the one precision rule the model
does own is that numerically sensitive ops run in fp32 on every device:
LayerNorm and the loss upcast their input explicitly, because CPU autocast
(unlike CUDA autocast) leaves them in half precision. Attention softmax runs
inside ``scaled_dot_product_attention``, whose fused kernels accumulate the
softmax in fp32.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


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


class CausalSelfAttention(nn.Module):
    def __init__(self, s: GPTShape):
        super().__init__()
        self.n_head = s.n_head
        self.qkv = nn.Linear(s.d_model, 3 * s.d_model, bias=s.bias)
        self.proj = nn.Linear(s.d_model, s.d_model, bias=s.bias)
        self.dropout = s.dropout
        self.resid_drop = nn.Dropout(s.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, T, C) -> (B, heads, T, head_dim)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, s: GPTShape):
        super().__init__()
        self.fc = nn.Linear(s.d_model, 4 * s.d_model, bias=s.bias)
        self.proj = nn.Linear(4 * s.d_model, s.d_model, bias=s.bias)
        self.drop = nn.Dropout(s.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x), approximate="tanh")))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, s: GPTShape):
        super().__init__()
        self.ln_1 = LayerNorm(s.d_model, s.bias)
        self.attn = CausalSelfAttention(s)
        self.ln_2 = LayerNorm(s.d_model, s.bias)
        self.mlp = MLP(s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token + position embeddings, ``n_layer`` blocks, final norm, tied head."""

    def __init__(self, s: GPTShape):
        super().__init__()
        self.shape = s
        self.wte = nn.Embedding(s.vocab_size, s.d_model)
        self.wpe = nn.Embedding(s.block_size, s.d_model)
        self.drop = nn.Dropout(s.dropout)
        self.blocks = nn.ModuleList(Block(s) for _ in range(s.n_layer))
        self.ln_f = LayerNorm(s.d_model, s.bias)
        self.lm_head = nn.Linear(s.d_model, s.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as GPT-2
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 init: N(0, 0.02), residual output projections scaled by
        1/sqrt(2 * n_layer) so the residual stream's variance does not grow
        with depth; zero biases; unit norm weights."""
        std = 0.02
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif ".ln_" in name or name.startswith("ln_"):
                nn.init.ones_(p)
            elif name.endswith("proj.weight"):
                nn.init.normal_(p, 0.0, std / math.sqrt(2 * self.shape.n_layer))
            else:
                nn.init.normal_(p, 0.0, std)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; the position embedding is left out by default (as
        in the usual 6N FLOPs estimate). The tied head is counted once."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.wpe.weight.numel() if non_embedding else n

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """Logits for ``idx`` (B, T); with ``targets``, also the mean
        cross-entropy, computed from fp32 logits."""
        B, T = idx.shape
        if T > self.shape.block_size:
            raise ValueError(f"sequence of {T} tokens is longer than block_size={self.shape.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        # fp32 loss: log-softmax over the vocabulary loses digits in half precision.
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss
