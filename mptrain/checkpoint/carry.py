"""Carry a run's state from one precision phase's model and optimizer into the next's.

At a phase boundary (``precision.phases``) the run builds the next phase's model
and optimizer, as a resume would, and moves the state over in memory through the
same state-dict views a checkpoint uses (``get_state_dict``/``set_state_dict``: keys
are the model's own parameter names whatever the wrapper, DTensor shards stay where
they are), so a switch works under every wrapper a checkpoint does:

- weights: each tensor of the new model from the old one's, in the new one's dtype:
  widened exactly, or narrowed to nearest (torch's ``copy_``), or stochastically where
  the new phase's updates round stochastically (:func:`round_stochastic`, from a
  generator of its own: the run's random streams are not drawn from);
- buffers only the new model has (a delayed-scaling layer's amax history after a
  phase without one) keep the values they were built with: they start afresh;
- Adam's moments and step counts: the new optimizer's state takes the old one's
  values in its own dtypes (torch's loader casts moments to the parameter's dtype;
  mptrain's torchao AdamW puts them back into its configured storage).

Quantized moments and Kahan buffers are refused before a run starts
(``mptrain/precision/phases.py``); nothing here has to guess at them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from mptrain.core.shards import local_shard


@dataclass
class Carried:
    """What a switch did, for the console and the record."""

    narrowed: list[str] = field(default_factory=list)
    """Weights stored narrower from here on."""
    widened: list[str] = field(default_factory=list)
    """Weights stored wider from here on (exactly)."""
    fresh: list[str] = field(default_factory=list)
    """State only the new model has, which starts from its built values."""
    dropped: list[str] = field(default_factory=list)
    """State only the old model had (a delayed-scaling layer's history, when the new phase has none)."""


def round_stochastic(x: torch.Tensor, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """``x`` (fp32) rounded to bf16 up or down with the probabilities that make the
    result right on average: random bits added below bf16's last bit, then cut off."""
    if dtype != torch.bfloat16 or x.dtype != torch.float32:
        return x.to(dtype)
    bits = x.contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, generator=generator, dtype=torch.int32, device="cpu")
    rounded = (bits + noise.to(bits.device)) & -65536  # -65536: the high 16 bits, bf16's
    # non-finite values are left to plain rounding: their bits must not be perturbed
    out = torch.where(torch.isfinite(x), rounded.view(torch.float32), x)
    return out.to(dtype)


def _into(src: torch.Tensor, like: torch.Tensor, generator) -> torch.Tensor:
    """``src`` ready to load into ``like``'s place: the stochastic narrowing where asked
    (on this rank's part of a DTensor), else ``src`` itself (the load casts it)."""
    if generator is None or src.dtype == like.dtype or not like.is_floating_point():
        return src
    if isinstance(src, DTensor):  # round this rank's shard, keep its placement
        local = round_stochastic(local_shard(src), like.dtype, generator)
        return DTensor.from_local(local, src.device_mesh, src.placements, shape=src.shape, stride=src.stride())
    return round_stochastic(src, like.dtype, generator)


def carry(old_model: nn.Module, old_opt: torch.optim.Optimizer, new_model: nn.Module,
          new_opt: torch.optim.Optimizer, stochastic_seed: int | None = None) -> Carried:
    """Load the state of ``old_model``/``old_opt`` into ``new_model``/``new_opt`` (the
    module docstring). ``stochastic_seed``: narrow the weights stochastically, from a
    generator seeded with it (the same on every rank: replicas round alike); None: to nearest."""
    msd, osd = get_state_dict(old_model, old_opt)
    new_msd, new_osd = get_state_dict(new_model, new_opt)  # also creates the new optimizer's state tensors
    generator = None
    if stochastic_seed is not None:
        generator = torch.Generator().manual_seed(stochastic_seed)
    done = Carried(fresh=sorted(set(new_msd) - set(msd)), dropped=sorted(set(msd) - set(new_msd)))
    model_sd = {}
    for k, like in new_msd.items():  # sorted nowhere: the model's own order, the same on every rank
        if k not in msd:
            model_sd[k] = like
            continue
        src = msd[k]
        if like.is_floating_point() and src.dtype != like.dtype:
            wider = torch.finfo(like.dtype).bits > torch.finfo(src.dtype).bits
            (done.widened if wider else done.narrowed).append(k)
        model_sd[k] = _into(src, like, generator)
    for fqn, state in new_osd["state"].items():
        old = osd["state"].get(fqn, {})
        for name in list(state):
            if name in old:
                state[name] = old[name]
    set_state_dict(new_model, new_opt, model_state_dict=model_sd, optim_state_dict=new_osd)
    return done
