"""What a mixture-of-experts model's routing does, on the numerics monitor's steps.

A routed layer (:class:`~mptrain.model.moe.MoEFeedForward`, found by type, so
a model without one gets no monitor: :meth:`MoEMonitor.of` is None) keeps
what its last forward chose; on a monitored step :class:`MoEMonitor` arms
each layer's probe, folds every forward's figures into its stores from a
forward hook, and turns the reduced stores into ``moe/*`` metrics. Like the
stability monitor it lives inside :class:`~mptrain.observe.numerics.NumericsMonitor`,
which calls it from its own hooks and reduces its stores with its own, so the
one host sync of a monitored step stays the only one.

Per routed layer (``<group>`` is the block's layer group, ``block3``, as in
``numerics/`` and ``stability/``):

- ``moe/load_min/<group>``, ``moe/load_max/<group>``: the fewest and the most
  token choices one expert took over the step (each token makes ``top_k``;
  summed over micro-batches and over the data-parallel ranks, so every rank
  logs the same and one process logs what many do; choices over capacity
  included: the router's load, before any drop);
- ``moe/load_cv/<group>``: the coefficient of variation of those counts
  (population standard deviation over the mean): 0 at perfect balance,
  ``sqrt(n_experts - 1)`` when one expert takes everything;
- ``moe/router_entropy/<group>``: the mean over tokens of the entropy, in nats,
  of the token's gate distribution: the softmax over the experts, or for
  sigmoid gates the sigmoid scores normalised to sum to one per token (the
  distribution the balancing loss reads). At most ``ln(n_experts)``;
- ``moe/flip_share_bf16/<group>``: the share of tokens whose set of ``top_k``
  experts would change if the router's logits, gates and top-k were computed
  in bf16 (the weight and the input rounded to bf16, a bf16 product, bf16
  scores and bias: ``router_dtype="compute"`` under bf16 autocast) instead of
  fp32: both routings recomputed from the router's input, the fp32 one as the
  model computes it;
- ``moe/dropped_share/<group>``: with a capacity, the share of the step's
  token choices dropped over it;
- ``moe/bias_absmax/<group>``: with ``balance="bias"``, the largest
  |balancing bias| the step's forward used.

Run-wide: ``moe/load_cv`` and ``moe/flip_share_bf16``, the largest over the
layers.

Every figure is exact or summed in an order fixed by the tensors' sizes:
counts are integers, the entropies are summed along a token's row (one
thread) and then over tokens through :func:`~mptrain.core.sums.fixed_sum`,
so the same step logs the same figures on any number of threads.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from mptrain.core.observer import observing
from mptrain.core.shards import local_shard
from mptrain.core.sums import fixed_sum
from mptrain.model.moe import MoEFeedForward, Router, route
from mptrain.model.names import canonical_name, group_of, layer_name

EXTRA = ("entropy_sum", "tokens", "flips", "dropped", "choices")
"""What each layer's sum vector holds after its ``n_experts`` counts, in order."""

ALL_EXPERTS = "all"
"""The expert index in the name of a figure over every expert of a layer
(``block0.mlp.experts.all.gate``): see :func:`expert_groups`."""


# ----------------------------------------------------------------- finding the layers
def moe_layers(model: nn.Module) -> dict[str, MoEFeedForward]:
    """``{block group: its routed feed-forward layer}`` in block order, found by type
    (a wrapper keeps the type, or wraps the layer in a module of another type)."""
    found: dict[str, MoEFeedForward] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, MoEFeedForward):
            found.setdefault(group_of(name), mod)
    return found


def expert_groups(model: nn.Module) -> dict[str, str]:
    """``{an expert's linear: the name of its group}`` in metric names
    (:func:`~mptrain.model.names.layer_name`): ``block0.mlp.experts.3.gate`` ->
    ``block0.mlp.experts.all.gate``, one group per routed layer and matrix, so
    that figures over all of a layer's experts stand beside each expert's own.
    The router is no expert and no linear: it is in no group. Every expert of the layer
    is listed, under its index in the layer, also those another rank holds under expert
    parallelism (an :class:`~mptrain.model.moe.ExpertSlice`: ``total`` experts)."""
    out: dict[str, str] = {}
    for name, mod in model.named_modules():
        if not isinstance(mod, MoEFeedForward):
            continue
        layer = layer_name(canonical_name(name))
        expert = next(iter(mod.experts))  # every expert has the same linears
        matrices = [canonical_name(sub) for sub, lin in expert.named_modules() if isinstance(lin, nn.Linear)]
        for e in range(getattr(mod.experts, "total", len(mod.experts))):
            for matrix in matrices:
                out[f"{layer}.experts.{e}.{matrix}"] = f"{layer}.experts.{ALL_EXPERTS}.{matrix}"
    return out


# ----------------------------------------------------------------- statistics
def load_figures(counts: list[float]) -> dict[str, float]:
    """``{"min", "max", "cv"}`` of tokens per expert ``counts`` (exact integers);
    ``cv`` is the population standard deviation over the mean. ``{}`` when no
    token was routed."""
    total = sum(counts)
    if not counts or total <= 0:
        return {}
    mean = total / len(counts)
    var = sum((c - mean) ** 2 for c in counts) / len(counts)
    return {"min": min(counts), "max": max(counts), "cv": math.sqrt(var) / mean}


def gate_entropy_sum(scores: torch.Tensor, gate: str) -> torch.Tensor:
    """float64 sum over tokens of the entropy (nats) of each token's gate
    distribution, ``scores`` (tokens, n_experts) the gate scores: softmax
    probabilities as they are, sigmoid scores normalised per token. No host sync."""
    p = scores.detach().float()
    if gate == "sigmoid":
        p = p / p.sum(dim=-1, keepdim=True)
    # Along each token's row (one thread per row), then over tokens in a fixed order.
    # xlogy: 0 log 0 = 0, a gate the softmax rounded to zero adds nothing.
    return fixed_sum(-torch.xlogy(p, p).sum(dim=-1))


def chosen_sets(router: Router, x: torch.Tensor, dtype: torch.dtype,
                weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Each token's ``top_k`` experts, sorted (a set), with the router's logits,
    gates and top-k computed in ``dtype`` from its input ``x`` (tokens, d_model):
    the rule of :meth:`~mptrain.model.moe.Router.forward` (:func:`~mptrain.model.moe.route`),
    the bias in ``dtype`` as the router adds it to scores of that dtype. ``weight``: the
    router's weight as its forward read it (``Router.probe_weight``: after that forward
    FSDP may hold only a shard of it); the module's own by default."""
    # local_shard: under tensor parallelism a replicated DTensor, whose local tensor is the whole weight.
    w = local_shard((router.weight if weight is None else weight).detach())
    with torch.autocast(x.device.type, enabled=False):  # the dtype is chosen here, not by autocast
        logits = F.linear(x.to(dtype), w.to(dtype))
        bias = router.expert_bias.float() if router.use_bias else None
        experts = route(logits, bias, router.top_k, router.gate, router.norm_topk).experts
    return experts.sort(dim=-1).values


def bf16_flips(router: Router, x: torch.Tensor, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """How many tokens of ``x`` get another set of experts from a bf16 router
    than from an fp32 one (int64, 0-d, no host sync); ``weight`` as :func:`chosen_sets`."""
    x = x.detach()
    return (chosen_sets(router, x, torch.float32, weight)
            != chosen_sets(router, x, torch.bfloat16, weight)).any(dim=-1).sum()


# ----------------------------------------------------------------- monitor
class MoEMonitor:
    """The ``moe/*`` part of a monitored step (see the module docstring).

    ``start`` arms the routed layers' probes and hooks their forwards; each
    forward's hook folds that forward's counts and probe figures into
    ``sum_dp`` (per layer one float64 vector: the counts, then :data:`EXTRA`)
    and frees the probe's tensors; ``disarm`` after the backward pass;
    ``scalars`` turns the reduced stores into metrics. ``sum_dp`` is summed over
    the data-parallel ranks (each sees its own tokens; the tensor-parallel ranks
    of a group see the same ones), ``max_all`` (the balancing biases, equal on
    every rank) maxed over every rank."""

    @classmethod
    def of(cls, model: nn.Module) -> Optional["MoEMonitor"]:
        """The monitor of ``model``'s routed layers; None for a model without any."""
        layers = moe_layers(model)
        return cls(layers) if layers else None

    def __init__(self, layers: dict[str, MoEFeedForward]):
        self.layers = layers
        self.clear()

    def clear(self) -> None:
        """Drop the stores (after collect, or at the start of a monitored step)."""
        self.sum_dp: dict[str, torch.Tensor] = {}
        self.max_all: dict[str, torch.Tensor] = {}

    def start(self, device: torch.device) -> list:
        """Zeros for every figure in a fixed order (every rank packs the same layout
        for the collectives), the biases as this step's forward uses them, the
        probes armed and one forward hook per layer; returns the hook handles."""
        self.clear()
        hooks = []
        for group, mod in self.layers.items():
            self.sum_dp[f"moe/sums/{group}"] = torch.zeros(mod.n_experts + len(EXTRA), dtype=torch.float64,
                                                           device=device)
            if mod.router.use_bias:
                self.max_all[f"moe/bias/{group}"] = mod.router.expert_bias.detach().abs().amax().float().to(device)
            mod.probe = True
            # prepend: before any hook of a sharding wrapper on the layer itself, which would
            # reshard the router's weight that the bf16 what-if multiplies with
            hooks.append(mod.register_forward_hook(self._hook(group), prepend=True))
        return hooks

    def pause(self) -> None:
        """No probe this step (a dtype audit records the step's own ops): the loads
        are still counted, the entropy and the flip share are left out."""
        for mod in self.layers.values():
            mod.probe = False

    def disarm(self) -> None:
        """Probes off and their tensors dropped: the layers cost nothing extra until the next monitored step."""
        for mod in self.layers.values():
            mod.probe, mod.probe_input, mod.probe_scores = False, None, None
            mod.router.probe, mod.router.probe_weight = False, None

    def _hook(self, group: str):
        def hook(mod: MoEFeedForward, args, out) -> None:
            if torch._C._current_graph_task_id() != -1:
                return  # activation checkpointing's recompute inside the backward: counted in the forward
            with observing():  # the monitor's ops, not the step's: a dtype audit of this step skips them
                key = f"moe/sums/{group}"
                self.sum_dp[key] = self.sum_dp[key] + self._figures(mod)
        return hook

    @staticmethod
    def _figures(mod: MoEFeedForward) -> torch.Tensor:
        """One forward's float64 vector: its counts, then :data:`EXTRA` (no host sync)."""
        counts = mod.counts.to(torch.float64)
        x, scores = mod.probe_input, mod.probe_scores
        mod.probe_input, mod.probe_scores = None, None  # kept for this forward only
        zero = counts.new_zeros(())
        ent = gate_entropy_sum(scores, mod.router.gate) if scores is not None else zero
        weight, mod.router.probe_weight = mod.router.probe_weight, None
        flips = bf16_flips(mod.router, x, weight).to(torch.float64) if x is not None else zero
        # torch.full, not a tensor from the host: a host-to-device copy may wait for the device
        tokens = torch.full((), 0 if x is None else x.shape[0], dtype=torch.float64, device=counts.device)
        dropped = mod.dropped.to(device=counts.device, dtype=torch.float64).reshape(())
        return torch.cat([counts, torch.stack([ent, tokens, flips, dropped, counts.sum()])])

    # -- results
    def scalars(self, vals: dict[str, torch.Tensor]) -> dict[str, float]:
        """``moe/*`` metrics from the reduced stores (host tensors by key)."""
        out: dict[str, float] = {}
        for group, mod in self.layers.items():
            v = vals.get(f"moe/sums/{group}")
            if v is None:
                continue
            e = mod.n_experts
            counts = [float(c) for c in v[:e]]
            ent, tokens, flips, dropped, choices = (float(t) for t in v[e:])
            load = load_figures(counts)
            if load:  # counts as ints (exact in the float64 sums): metrics.jsonl writes 12, not 12.0
                out[f"moe/load_min/{group}"], out[f"moe/load_max/{group}"] = int(load["min"]), int(load["max"])
                out[f"moe/load_cv/{group}"] = load["cv"]
            if tokens > 0:  # the probe ran (not on an audited step)
                out[f"moe/router_entropy/{group}"] = ent / tokens
                out[f"moe/flip_share_bf16/{group}"] = flips / tokens
            if mod.capacity_factor is not None and choices > 0:
                out[f"moe/dropped_share/{group}"] = dropped / choices
            bias = vals.get(f"moe/bias/{group}")
            if bias is not None:
                out[f"moe/bias_absmax/{group}"] = float(bias)
        for name in ("load_cv", "flip_share_bf16"):
            per_layer = [v for k, v in out.items() if k.startswith(f"moe/{name}/")]
            if per_layer:
                out[f"moe/{name}"] = max(per_layer)
        return out


def console_figures(row: dict) -> dict[str, str]:
    """The short MoE figures of a logged row for the progress line (empty for a
    row without them: a step the monitor did not scan, a model without routed layers)."""
    out = {}
    if "moe/load_cv" in row:
        out["moe load cv"] = f"{row['moe/load_cv']:.3g}"
    if "moe/flip_share_bf16" in row:
        out["bf16 flips"] = f"{100 * row['moe/flip_share_bf16']:.3g}%"
    return out
