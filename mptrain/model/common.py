"""The parts both model families are made of, written once.

Each family (``gpt.py``, ``llama.py``) keeps what is its own (its norm, its
attention, its MLP, its embeddings) and takes the rest from here: the
pre-norm block that strings a norm, an attention and an MLP together, the
drawing of the initial weights, the fp32 loss, the forward from the embedded
tokens to the logits, and the attention probe the stability monitor switches
on. One block class means one thing for the wrappers to find (FSDP units,
activation checkpointing, compiling) whatever the family.

As in the families, no distributed or precision code lives here; the one
distributed type named (:func:`write_whole`'s DTensor) is only recognised, so
that an initial weight can land in a parameter that is already a shard.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from mptrain.core.sums import fixed_sum
from mptrain.model.names import canonical_name

# ------------------------------------------------------------------ the block


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x)).

    Built from the modules a family hands in (its norms, attention and MLP),
    so that both families' blocks are this one class and hold the same four
    attribute names: the parameter names (``blocks.N.ln_1.weight``,
    ``blocks.N.attn....``) and their order, which the initial draws and every
    checkpoint follow, are the ones each family always had."""

    def __init__(self, ln_1: nn.Module, attn: nn.Module, ln_2: nn.Module, mlp: nn.Module):
        super().__init__()
        # Registered in this order: named_parameters (and so the initial draws) walk it.
        self.ln_1 = ln_1
        self.attn = attn
        self.ln_2 = ln_2
        self.mlp = mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def blocks_and_head(model: nn.Module, x: torch.Tensor, targets: Optional[torch.Tensor]):
    """The rest of either family's forward from the embedded tokens ``x``: the
    blocks, the final norm and the head; the logits, and with ``targets`` also
    ``model.loss_fn``'s loss."""
    for block in model.blocks:
        x = block(x)
    logits = model.lm_head(model.ln_f(x))
    if targets is None:
        return logits
    return logits, model.loss_fn(logits, targets)


def cross_entropy_fp32(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` (B, T, V) against ``targets`` (B, T),
    computed in fp32: log-softmax over the vocabulary loses digits in half
    precision. Eager, it writes the fp32 logits and their log-probabilities out
    whole (two B x T x V fp32 tensors: 13 GB for gpt-small's batch of 32 x 1024
    with GPT-2's vocabulary); compiled (``loss_fn`` under ``train.compile``),
    the upcast, log-softmax and pick fuse into passes over the 16-bit logits."""
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


# ------------------------------------------------------------------ initial weights


def write_whole(p: torch.Tensor, full: torch.Tensor) -> None:
    """Copy ``full`` (the whole tensor, on the CPU) into ``p``: all of it, or,
    when ``p`` is a DTensor shard, the part this rank holds (cut locally, no
    communication: every rank has drawn, or read, the same ``full``)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(p, DTensor):
        part = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
        p.to_local().copy_(part.to_local())
    else:
        p.copy_(full)


def draw_init(model: nn.Module, generator: Optional[torch.Generator], norm: type, residual: tuple[str, ...],
              n_layer: int) -> None:
    """GPT-2's init, as both families draw it: zero biases, unit weights for every
    ``norm`` module (QK-norm's included), N(0, 0.02) for the rest, with the residual
    output projections (names ending in one of ``residual``) scaled by
    1/sqrt(2 * n_layer). Each tensor is drawn whole in fp32, in ``named_parameters``
    order, on the CPU (or ``generator``'s device), then written whole into its
    parameter (:func:`write_whole`). Ones and zeros draw no random numbers, so
    adding QK-norm or biases leaves the other weights' values as they were."""
    std = 0.02
    norms = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, norm)}
    for name, p in model.named_parameters():
        full = torch.empty(p.shape, dtype=torch.float32, device=generator.device if generator is not None else "cpu")
        if name.endswith("bias"):
            full.zero_()
        elif name in norms:
            full.fill_(1.0)
        elif name.endswith(residual):
            full.normal_(0.0, std / math.sqrt(2 * n_layer), generator=generator)
        else:
            full.normal_(0.0, std, generator=generator)
        write_whole(p, full)


# ------------------------------------------------------------------ the attention probe

# Largest number of attention logits the probe holds at once (fp32, 64 MiB per intermediate):
# it walks the (batch x head) rows in slices of this size so that a monitored
# step of a long-context model does not need a (B, H, T, T) tensor.
PROBE_ELEMENTS = 2**24


def attention_logit_stats(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(largest logit, mean entropy in nats) of causal attention with queries
    ``q`` and keys ``k`` (B, H, T, head_dim): logits ``q.k / sqrt(head_dim)``
    over the allowed (key <= query) positions only, entropy of each query's
    softmax averaged over batch, heads and query positions. fp32 0-d tensors,
    left on the device (no host sync); the entropies are summed in float64, in
    an order that does not depend on the number of threads
    (:func:`~mptrain.core.sums.fixed_sum`): the same figure, bit for bit, on any."""
    B, H, T, hd = q.shape
    q, k = q.float().reshape(B * H, T, hd), k.float().reshape(B * H, T, hd)
    allowed = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    rows = max(1, PROBE_ELEMENTS // (T * T))
    top = torch.full((), float("-inf"), device=q.device)
    ent = torch.zeros((), dtype=torch.float64, device=q.device)
    for i in range(0, B * H, rows):
        s = (q[i:i + rows] @ k[i:i + rows].transpose(-2, -1)) / math.sqrt(hd)
        s = s.masked_fill(~allowed, float("-inf"))
        top = torch.maximum(top, s.amax())
        logp = torch.log_softmax(s, dim=-1)
        # masked positions have p = 0 and log p = -inf: their 0 * -inf is dropped, not summed as NaN
        ent = ent - fixed_sum(torch.where(allowed, logp.exp() * logp, 0.0))
    return top, (ent / (B * H * T)).float()


class AttentionProbe:
    """The stability monitor's view into an attention module (both families'):
    with ``probe`` set (by a monitor, on monitored steps), each forward folds
    the largest attention logit and the mean entropy of its rows into
    ``probe_stats`` (:meth:`_probe`), logits the fused kernel never shows."""

    probe: bool = False
    probe_stats: Optional[dict[str, torch.Tensor]] = None

    # Eager even inside a compiled block: the dict it mutates lives outside the
    # graph, and the probe runs on monitored steps only.
    @torch.compiler.disable
    def _probe(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """Fold this call's attention statistics into ``probe_stats``: the max of
        the largest logits, the sum of the mean entropies, and the number of
        calls (so ``entropy_sum / calls`` is the mean). Computed in fp32 from
        detached q and k; the forward's own result is untouched."""
        with torch.no_grad(), torch.autocast(q.device.type, enabled=False):
            top, ent = attention_logit_stats(q.detach(), k.detach())
        st = self.probe_stats
        if st is None:
            self.probe_stats = {"logit_max": top, "entropy_sum": ent, "calls": torch.ones((), device=top.device)}
        else:
            st["logit_max"] = torch.maximum(st["logit_max"], top)
            st["entropy_sum"] = st["entropy_sum"] + ent
            st["calls"] = st["calls"] + 1


@torch.no_grad()
def write_weights(model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Initial weights given instead of drawn (``model.init_from``): each parameter
    gets ``weights``' tensor of its name (wrapper parts of the name ignored, so a
    wrapped or sharded model reads the same keys), written as :func:`draw_init`
    writes: whole in fp32, a shard taking only its part. Every name must be there."""
    for name, p in model.named_parameters():
        write_whole(p, weights[canonical_name(name)].to(torch.float32))


class LossFn:
    """Both families' loss, :func:`cross_entropy_fp32`, held by a declared object
    (the model's ``loss_fn``, set in ``__init__``) so that compiling it is a method
    of that object, called where the blocks are compiled (``parallel.wrap``:
    ``model.loss_fn.compile()`` beside ``blk.compile()``), instead of a compiled
    function swapped onto the module from outside.

    Not an nn.Module on purpose: it has no weights, and as a submodule it would
    join ``named_modules``, where the dtype audit, the monitors and the fault
    localisation hook every module: the audit's table would gain a row, and
    hooks that come and go on a compiled module make it recompile."""

    def __init__(self) -> None:
        self.compiled = False
        self._fn = cross_entropy_fp32

    def compile(self) -> None:
        """Compile the loss (its fp32 upcast, log-softmax and pick fuse into passes
        over the 16-bit logits); a second call changes nothing."""
        if not self.compiled:
            self._fn = torch.compile(cross_entropy_fp32)
            self.compiled = True

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self._fn(logits, targets)
