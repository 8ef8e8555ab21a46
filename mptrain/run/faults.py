"""The test aid behind ``debug.*``: faults planted or injected into a run.

:class:`FaultInjector` is a run component, registered only when a ``debug.*``
key is set (a run without one holds no injector; :data:`NO_FAULTS` stands in
where something must be handed on): NaN planted in a module's output, an
outlier channel planted in a linear's input, an inf written into a gradient
(:meth:`FaultInjector.after_backward`), the loss multiplied before backward
(:meth:`FaultInjector.backward_loss`, the step's), a kill in the middle of a save or right
after one (:meth:`FaultInjector.during_save`, :meth:`FaultInjector.after_save`,
called by the checkpointer through its save hooks). What the run does about
the non-finite numbers these provoke is in ``nonfinite.py``.
"""
from __future__ import annotations

import contextlib
import math
import os
import signal
from typing import ContextManager, Optional

import torch
import torch.nn as nn

from mptrain.core.errors import ConfigError
from mptrain.core.shards import local_shard
from mptrain.model.names import canonical_name
from mptrain.run.components import Component


def inject_inf_grad(model: nn.Module, value: float = math.inf) -> None:
    """Testing aid: write ``value`` (inf unless told; a huge finite value rehearses
    a gradient norm that overflows) into the first non-empty local gradient shard."""
    for p in model.parameters():
        if p.grad is None:
            continue
        g = local_shard(p.grad)
        if g.numel():
            g.view(-1)[0] = value
            return


class FaultInjector(Component):
    """The ``debug.*`` faults of one run, as a run component (built only when a
    ``debug.*`` key is set: :func:`mptrain.config.schema.debug_set`).

    The loop tells it the step about to run (:meth:`around_step`); a replay of
    a bad step sets the same step again (:meth:`at_step`), so a planted NaN reappears exactly.
    Planted faults (a NaN output, an outlier input channel) are module hooks
    installed here, so an unknown module name fails before training. ``model``
    may be None when nothing is planted (a test that injects into gradients).
    """

    def __init__(self, dcfg, model: Optional[nn.Module] = None, rank: int = 0):
        self.step = -1
        self.rank = rank
        self.inf_steps = set(dcfg.inject_inf_grad_steps)
        self.inf_rank = dcfg.inject_inf_grad_rank
        self.grad_value = float(dcfg.inject_grad_value)
        self.kill_at = dcfg.kill_during_save_at_step
        self.kill_after = dcfg.kill_after_save_at_step
        self.loss_multiplier = float(dcfg.loss_multiplier)
        if dcfg.nan_in_module and dcfg.nan_rank in (-1, rank):
            self._plant_nan(model, dcfg.nan_in_module, set(dcfg.nan_at_steps))
        if dcfg.outlier_module:
            self._plant_outlier(model, dcfg.outlier_module, int(dcfg.outlier_channel), float(dcfg.outlier_scale))

    def _plant_nan(self, model: nn.Module, name: str, at: set[int]) -> None:
        mods = {canonical_name(n): m for n, m in model.named_modules()}
        if name not in mods:
            raise ConfigError(f"debug.nan_in_module='{name}' is not a module of this model; "
                              f"e.g. {', '.join(list(mods)[1:6])}, ...")

        def hook(_m, _inp, out):
            return out * float("nan") if self.step in at else None

        mods[name].register_forward_hook(hook)

    @staticmethod
    def _plant_outlier(model: nn.Module, name: str, channel: int, scale: float) -> None:
        """Multiply input feature ``channel`` of linear ``name`` by ``scale`` on
        every forward pass. A pre-hook runs before the module's own forward, so a
        float8 linear casts (and the cast statistics measure) the outlier; it is
        put first, ahead of any pre-hook the precision policy installed."""
        mods = {canonical_name(n): m for n, m in model.named_modules()}
        linears = [n for n, m in mods.items() if isinstance(getattr(m, "in_features", None), int)]
        if name not in mods or name not in linears:
            what = "not a module of this model" if name not in mods else "not a linear (it has no in_features)"
            raise ConfigError(f"debug.outlier_module='{name}' is {what}; name a linear, "
                              f"e.g. {', '.join(linears[:5])}, ...")
        n_in = mods[name].in_features
        if channel >= n_in:
            raise ConfigError(f"debug.outlier_channel={channel} is not an input feature of '{name}', which has "
                              f"in_features={n_in}; set debug.outlier_channel between 0 and {n_in - 1}.")

        def hook(_m, args):
            x = args[0].clone()  # out of place: the caller's tensor (the residual stream, say) is left alone
            x[..., channel] *= scale
            return (x, *args[1:])

        mods[name].register_forward_pre_hook(hook, prepend=True)

    def backward_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss the backward pass sees (the step's ``StepState.backward_loss``): ``loss *
        debug.loss_multiplier``, or ``loss`` itself, untouched, when the multiplier is 1 (off)."""
        return loss if self.loss_multiplier == 1.0 else loss * self.loss_multiplier

    def at_step(self, step: int) -> None:
        """Step ``step`` runs (or is replayed): the planted faults act by it."""
        self.step = step

    def around_step(self, step: int) -> ContextManager:
        self.at_step(step)
        return contextlib.nullcontext()

    def inject_inf(self, step: int) -> bool:
        """Whether this rank writes an inf into a gradient at ``step``."""
        return step in self.inf_steps and self.inf_rank in (-1, self.rank)

    def after_backward(self, model: nn.Module, scale: Optional[torch.Tensor], step: int) -> None:
        """Called by the step once the gradients are complete: at a
        ``debug.inject_inf_grad_steps`` step, ``debug.inject_grad_value`` goes
        into one gradient (as held: a scaled gradient under loss scaling)."""
        if self.inject_inf(step):
            inject_inf_grad(model, self.grad_value)

    def before_save(self, step: int) -> None:
        """(The checkpointer's save hooks, this and the two below.) Nothing before a save."""

    def during_save(self, step: int) -> None:
        """Called with the shards written and the checkpoint not yet visible."""
        if self.kill_at == step:
            os.kill(os.getpid(), signal.SIGKILL)  # rehearses a node lost in the middle of a save

    def after_save(self, step: int) -> None:
        """Called once the checkpoint is visible, before older ones are pruned."""
        if self.kill_after == step:
            os.kill(os.getpid(), signal.SIGKILL)  # rehearses a node lost before the run wrote its records


class NoFaults:
    """What stands for the injector in a run without ``debug.*`` keys, where the step
    and the handler's replays ask it: the loss as it is, no step to note, no fault."""

    @staticmethod
    def backward_loss(loss: torch.Tensor) -> torch.Tensor:
        return loss

    def at_step(self, step: int) -> None:
        pass

    def after_backward(self, model: nn.Module, scale: Optional[torch.Tensor], step: int) -> None:
        pass


NO_FAULTS = NoFaults()
"""The injector of a run without ``debug.*`` keys: not a component, and nothing is injected."""
