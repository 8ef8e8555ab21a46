"""The mixture of experts in the run (``model.family=moe``): what a step adds to the
model's own forward, and what the run reports of it.

- :class:`Mixture` (the step's ``StepState.mixture``): per micro-batch, the balancing
  term of ``model.moe.balance=aux_loss`` (every routed layer's, summed) added to the
  loss its backward sees, divided by the micro-batches as the loss is, while
  ``train/loss`` stays the cross-entropy; every routed layer's token counts and
  capacity drops summed over the micro-batches. When the step closes: the counts
  and drops summed over the data-parallel ranks (one all-reduce, only where
  ``balance=bias`` or a capacity needs them), then, with ``balance=bias``, each
  layer's router bias moved by its counts (DeepSeek-V3's update, ``Router.nudge``)
  unless the step was skipped. Every rank moves its bias from the same sums, so the
  biases stay identical across ranks and equal to one process's on the same batch.
  :data:`NO_MIXTURE` (the other families) adds nothing and costs nothing.
- :class:`MixturePart` (a component, ``components.py``): the step's figures into
  the logged row (``moe/aux_loss``, ``moe/dropped_tokens``) and the run's drops into
  the closing line and summary.json, resumable (the drops so far).

The bias is the model's own state (an fp32 buffer of each router): checkpoints
save it with the weights, so a resumed run continues with it.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn as nn

from mptrain.model.moe import MoEFeedForward, routed_layers
from mptrain.run.components import Component, Write


def mixture_info(model: nn.Module, device: torch.device, compute: torch.dtype, n_params: int,
                 n_active: int) -> Optional[dict]:
    """What run_info records of a mixture (None for a dense model): the routed layers, the
    routed experts' weights and their share of ``n_params`` (the model's, counted as the
    run counts them), ``n_active`` (one token's), and how the expert GEMMs run on
    ``device`` computing in ``compute`` (``MoEFeedForward.gemm_choice``: the path and why).
    The sizes are read off the linears' features, whatever wrapper or conversion holds them."""
    layers = routed_layers(model)
    if not layers:
        return None
    # Every expert of each layer, though under expert parallelism this rank holds only its share:
    # one expert's size times the layer's count.
    experts = sum(lay.n_experts * sum(lin.in_features * lin.out_features for lin in (ex.gate, ex.up, ex.down))
                  for lay in layers for ex in [next(iter(lay.experts))])
    path, why = layers[0].gemm_choice(device, compute)
    return {"routed_layers": len(layers), "expert_params": experts, "expert_share": experts / max(n_params, 1),
            "params": n_params, "params_active": n_active, "expert_gemm": path, "expert_gemm_why": why}


class Mixture:
    """The mixture's part of a step (module docstring): the routed ``layers`` and
    ``reduce_sum``, the sum over the data-parallel ranks (``DistContext.all_reduce_sum``)."""

    def __init__(self, layers: list[MoEFeedForward], reduce_sum: Callable[[torch.Tensor], torch.Tensor]):
        first = layers[0]
        self.layers, self.reduce_sum = layers, reduce_sum
        self.n_experts, self.balance = first.n_experts, first.balance
        self.capacity = first.capacity_factor is not None
        # The counts cross the ranks only where a figure needs every rank's: the bias's update, the drops.
        self.across_ranks = self.balance == "bias" or self.capacity

    @classmethod
    def of(cls, model: nn.Module, reduce_sum: Callable[[torch.Tensor], torch.Tensor]) -> "Mixture | NoMixture":
        """The mixture of ``model``'s routed layers, or :data:`NO_MIXTURE` for a dense model."""
        layers = routed_layers(model)
        return cls(layers, reduce_sum) if layers else NO_MIXTURE

    def begin(self, device: torch.device) -> "_Tally":
        """This step's tally over its micro-batches."""
        return _Tally(self, device)


class _Tally:
    """One step of the mixture: the terms added, the counts and drops summed."""

    def __init__(self, mix: Mixture, device: torch.device):
        self.mix, self.n = mix, 0
        # int64: exact counts; gloo and NCCL both sum them (a bool or a float would not be exact)
        self.counts = torch.zeros((len(mix.layers), mix.n_experts), dtype=torch.int64, device=device)
        self.dropped = torch.zeros((), dtype=torch.int64, device=device)
        self.aux_sum = torch.zeros((), dtype=torch.float32, device=device) if mix.balance == "aux_loss" else None

    def add(self, loss: torch.Tensor) -> torch.Tensor:
        """After a micro-batch's forward: its counts and drops summed, and ``loss`` plus
        the balancing term (fp32, with gradient) when ``balance=aux_loss``."""
        layers = self.mix.layers
        self.n += 1
        self.counts += torch.stack([m.counts for m in layers])
        self.dropped += torch.stack([m.dropped for m in layers]).sum()
        if self.aux_sum is None:
            return loss
        aux = torch.stack([m.aux_loss() for m in layers]).sum()
        self.aux_sum += aux.detach()
        return loss + aux

    def close(self, skipped: torch.Tensor) -> dict[str, Optional[torch.Tensor]]:
        """After the step (applied, or ``skipped``: a 0-d device flag, 1 for a step not
        applied): the counts and drops over the ranks, the bias moved, and the step's
        figures for :class:`~mptrain.run.step.StepResult` (``aux_loss``, ``dropped``)."""
        mix = self.mix
        counts, dropped = self.counts, self.dropped
        if mix.across_ranks:  # one collective: the counts and the drops together
            both = mix.reduce_sum(torch.cat([counts.reshape(-1), dropped.reshape(1)]))
            counts, dropped = both[:-1].view_as(counts), both[-1]
        if mix.balance == "bias":
            # A skipped step's counts become zeros, a balanced load: each offset moves by
            # sign(0) * rate = 0, exactly, decided on the device (no host sync).
            counts = counts * (skipped == 0).to(counts.dtype)
            for layer, c in zip(mix.layers, counts, strict=True):
                layer.router.nudge(c, layer.bias_rate)
        return {"aux_loss": None if self.aux_sum is None else self.aux_sum / max(self.n, 1),
                "dropped": dropped if mix.capacity else None}


class NoMixture:
    """A dense model's step: nothing added, nothing counted."""

    def begin(self, device: torch.device) -> "NoTally":
        return NoTally()


class NoTally:
    """A dense model's step tally: the loss as it is, no figure."""

    def add(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def close(self, skipped: torch.Tensor) -> dict[str, Optional[torch.Tensor]]:
        return {"aux_loss": None, "dropped": None}


NO_MIXTURE = NoMixture()
"""The step of a model without routed layers."""


class MixturePart(Component):
    """The mixture's figures in the run's records: each logged step's ``moe/aux_loss``
    (``balance=aux_loss``: the balancing term summed over the routed layers, mean over
    the micro-batches and ranks) and ``moe/dropped_tokens`` (with a capacity: the token
    choices dropped in that step, over every routed layer, micro-batch and rank); the
    run's drops in the closing line and summary.json (``moe/dropped_tokens``,
    ``moe/dropped_share``). ``choices_per_step``: the token choices a step routes,
    over every rank (tokens x top_k x routed layers)."""

    state_key = "moe"

    def __init__(self, capacity_factor: Optional[float], choices_per_step: int):
        self.capacity_factor, self.choices_per_step = capacity_factor, choices_per_step
        self.dropped: Optional[torch.Tensor] = None  # on the device: summed without a host sync
        self.before = 0  # drops of the steps before this launch (a resumed run's)
        self.steps = 0  # steps counted, this launch's and those before

    def after_step(self, step: int, result) -> dict[str, torch.Tensor]:
        reads = {}
        if result.aux_loss is not None:
            reads["moe/aux_loss"] = result.aux_loss
        if result.dropped is not None:
            reads["moe/dropped_tokens"] = result.dropped  # every rank holds the sum over ranks
            self.dropped = result.dropped if self.dropped is None else self.dropped + result.dropped
            self.steps += 1
        return reads

    def on_log(self, done: int, reading, row: dict, write: Write) -> None:
        if "moe/aux_loss" in reading.flags:
            row["moe/aux_loss"] = reading.flags["moe/aux_loss"]
        if "moe/dropped_tokens" in reading.flags:  # the mean over ranks of one sum: that sum
            row["moe/dropped_tokens"] = int(round(reading.flags["moe/dropped_tokens"]))

    def total(self) -> int:
        """Token choices dropped over the run so far (a host sync: at a checkpoint and at the end)."""
        return self.before + (int(self.dropped) if self.dropped is not None else 0)

    def summarize(self, write: Write) -> dict:
        if self.capacity_factor is None:
            return {}
        dropped, choices = self.total(), self.steps * self.choices_per_step
        share = dropped / choices if choices else 0.0
        write(f"moe: {dropped:,} of {choices:,} token choices dropped over capacity in this run ({share:.2%}; "
              f"model.moe.capacity_factor={self.capacity_factor:g}; each dropped choice leaves its token "
              "the residual and its other experts)")
        return {"moe/dropped_tokens": dropped, "moe/dropped_share": share}

    def state_dict(self) -> dict:
        return {"dropped": self.total(), "steps": self.steps}

    def load_state_dict(self, sd: dict) -> None:
        self.before, self.steps, self.dropped = int(sd.get("dropped", 0)), int(sd.get("steps", 0)), None
