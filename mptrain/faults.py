"""Non-finite numbers: what the run does about them, and how tests provoke them.

- :class:`NonFiniteGuard` decides, per step, whether a step whose gradients
  hold inf/nan is applied (runs without a loss scaler; the scaler does its own).
- :class:`NonFiniteHandler` turns a bad step into one clear error: it looks at
  the guard when the loop can afford a host sync, replays the bad step to name
  the first non-finite module (:func:`locate_nonfinite`, all ranks in step) and
  stops a run whose loss scale has collapsed.
- :class:`FaultInjector` is the test aid behind ``debug.*``: NaN planted in a
  module's output, an inf written into a gradient, a kill in the middle of a save.
"""
from __future__ import annotations

import os
import signal
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from .config import ConfigError
from .numerics import canonical_name
from .shards import local_shard


class NonFiniteStep(Exception):
    """Raised inside a step whose gradients hold inf/nan when the run aborts on it."""


class NonFiniteError(RuntimeError):
    """The run stopped on non-finite numbers; the message names the step and the module."""


class NonFiniteGuard:
    """Watches each step's gradient norm for inf/nan in runs without a loss scaler.

    When the optimizer can skip a step on the device (fused AdamW reads a
    ``found_inf`` flag, as it does for ``GradScaler``), nothing is read back per
    step: a bad step is skipped on the device, and under ``abort`` every step
    after it is skipped too, so the weights stay those the bad step started
    from until the loop looks (at the logging cadence, before a checkpoint and
    at the end) and raises. Other optimizers cannot skip without knowing, so
    the check then reads one flag back per step.
    """

    def __init__(self, mode: str, optimizer: torch.optim.Optimizer, device: torch.device):
        self.mode = mode
        self.on_device = bool(getattr(optimizer, "_step_supports_amp_scaling", False))
        self.bad_step = torch.full((), -1, dtype=torch.int64, device=device)  # first bad 0-based step
        self.skipped = torch.zeros((), dtype=torch.int64, device=device)

    def gate(self, grad_norm: torch.Tensor, step: int) -> tuple[Optional[torch.Tensor], bool]:
        """``(found_inf, skip_now)``. On the device path, ``found_inf`` is the 0-d
        flag to hand the fused kernel (1: do not apply) and ``skip_now`` is False.
        Otherwise the flag is read back (one host sync): ``found_inf`` is None and
        ``skip_now`` says whether to skip; under ``abort`` a bad step raises
        :class:`NonFiniteStep` instead."""
        bad = ~torch.isfinite(grad_norm.float())
        if self.mode == "abort":
            self.bad_step = torch.where(bad & (self.bad_step < 0), step, self.bad_step)
            stop = self.bad_step >= 0  # sticky: nothing after the first bad step is applied
        else:
            stop = bad
        self.skipped += stop.to(self.skipped.dtype)
        if self.on_device:
            return stop, False
        skip_now = bool(stop)  # host sync (non-fused optimizer only)
        if skip_now and self.mode == "abort":
            raise NonFiniteStep()
        return None, skip_now

    def first_bad_step(self) -> Optional[int]:
        """The first bad 0-based step under ``abort`` (a host sync), or None."""
        at = int(self.bad_step)
        return at if at >= 0 else None

    # Resumable: under ``skip`` the count of skipped steps goes on across a resume.
    # (Under ``abort`` no checkpoint is ever written after a bad step.)
    def state_dict(self) -> dict:
        return {"skipped": int(self.skipped)}

    def load_state_dict(self, sd: dict) -> None:
        self.skipped.fill_(int(sd.get("skipped", 0)))


def inject_inf_grad(model: nn.Module) -> None:
    """Testing aid: put an inf into the first non-empty local gradient shard."""
    for p in model.parameters():
        if p.grad is None:
            continue
        g = local_shard(p.grad)
        if g.numel():
            g.view(-1)[0] = float("inf")
            return


def _gather_strings(ctx, s: str) -> list[str]:
    """Every rank's ``s``, in rank order (a collective when world > 1)."""
    if not (ctx.has_group and ctx.world > 1):
        return [s]
    out: list = [None] * ctx.world
    dist.all_gather_object(out, s)
    return out


def locate_nonfinite(model: nn.Module, policy, ctx, micro_batches: list, scale: float = 1.0) -> str:
    """Replay a step's forward and backward with hooks and name the first module
    whose output (in forward order) or output gradient (in backward order) holds
    inf/nan. The weights are those the bad step started from: it was not applied.

    Every rank calls it, and the ranks agree after each forward and each
    backward (a small collective) on whether to go on: a rank that stopped
    alone would leave the others waiting in the next collective of the
    backward pass until the process group's timeout. The answer names the
    first rank that saw the value, when there are several.
    """
    found: list[str] = []

    def bad(t) -> bool:
        return torch.is_tensor(t) and t.is_floating_point() and not bool(torch.isfinite(t).all())

    def fwd_hook(name):
        def hook(_m, _inp, out):
            t = out[0] if isinstance(out, (tuple, list)) else out
            if bad(t):
                found.append(f"forward output of '{name}'")
            elif torch.is_tensor(t) and t.requires_grad:
                t.register_hook(lambda g: found.append(f"gradient of '{name}' output") if bad(g) else None)
        return hook

    handles = [m.register_forward_hook(fwd_hook(canonical_name(n) or "model (the loss)"))
               for n, m in model.named_modules()]
    try:
        model.zero_grad(set_to_none=True)
        for x, y in micro_batches:
            with ctx.grad_sync(model, enabled=True), policy.autocast():
                _, loss = model(x.to(ctx.device), y.to(ctx.device))
            if ctx.any_rank(bool(found)):
                break
            (loss * scale).backward()
            if ctx.any_rank(bool(found)):
                break
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
    seen = _gather_strings(ctx, found[0] if found else "")
    for rank, where in enumerate(seen):
        if where:
            return where + (f" on rank {rank}" if len(seen) > 1 else "")
    return "no module (inf/nan appeared in the gradient reduction or clipping)"


class FaultInjector:
    """The ``debug.*`` faults of one run, off unless configured.

    The loop tells it the step about to run (:meth:`begin_step`); a replay of
    a bad step sets the same step again, so a planted NaN reappears exactly.
    """

    def __init__(self, dcfg=None, model: Optional[nn.Module] = None, rank: int = 0):
        self.step = -1
        self.rank = rank
        self.inf_steps = set(dcfg.inject_inf_grad_steps) if dcfg is not None else set()
        self.inf_rank = dcfg.inject_inf_grad_rank if dcfg is not None else -1
        self.kill_at = dcfg.kill_during_save_at_step if dcfg is not None else None
        if dcfg is not None and dcfg.nan_in_module and dcfg.nan_rank in (-1, rank):
            self._plant_nan(model, dcfg.nan_in_module, set(dcfg.nan_at_steps))

    def _plant_nan(self, model: nn.Module, name: str, at: set[int]) -> None:
        mods = {canonical_name(n): m for n, m in model.named_modules()}
        if name not in mods:
            raise ConfigError(f"debug.nan_in_module='{name}' is not a module of this model; "
                              f"e.g. {', '.join(list(mods)[1:6])}, ...")

        def hook(_m, _inp, out):
            return out * float("nan") if self.step in at else None

        mods[name].register_forward_hook(hook)

    def begin_step(self, step: int) -> None:
        self.step = step

    def inject_inf(self, step: int) -> bool:
        """Whether this rank writes an inf into a gradient at ``step``."""
        return step in self.inf_steps and self.inf_rank in (-1, self.rank)

    def during_save(self, step: int) -> None:
        """Called with the shards written and the checkpoint not yet visible."""
        if self.kill_at == step:
            os.kill(os.getpid(), signal.SIGKILL)  # rehearses a node lost in the middle of a save


class NonFiniteHandler:
    """From a bad step to one error that names the step and the first non-finite module.

    ``guard`` is None when a loss scaler handles inf/nan (fp16): the scaler
    skips bad steps, and the only fault left is a scale that collapsed.
    """

    def __init__(self, mode: str, optimizer, scaler, model, policy, ctx, batches, faults: FaultInjector,
                 min_loss_scale: float):
        self.guard = None if scaler.enabled else NonFiniteGuard(mode, optimizer, ctx.device)
        self.model, self.policy, self.ctx, self.batches, self.faults = model, policy, ctx, batches, faults
        self.min_loss_scale = min_loss_scale

    def _replay(self, step: int, scale: float = 1.0) -> str:
        """Where 0-based ``step`` first went non-finite: replayed exactly, from the
        same batch (a function of the step) and the same planted faults."""
        self.faults.begin_step(step)
        return locate_nonfinite(self.model, self.policy, self.ctx, self.batches.batch(step), scale=scale)

    def error(self, bad_step: int, detected: Optional[int] = None) -> NonFiniteError:
        """The error for 0-based ``bad_step``, after replaying it to find the module."""
        where = self._replay(bad_step)
        later = (f" (seen at step {detected}, the next point the loop looks: the steps in between were "
                 "not applied either)" if detected is not None and detected != bad_step + 1 else "")
        return NonFiniteError(
            f"step {bad_step + 1}: the gradients hold inf/nan; first non-finite value: {where}. "
            f"Nothing of this step was applied or saved{later}. (train.on_nonfinite=skip skips such steps "
            "instead; lowering optim.lr or checking the data are the usual fixes.)")

    def check_deferred(self, done: int) -> None:
        """Fused optimizer under ``abort``: bad steps were skipped on the device
        without a host sync; look now (a host sync) and raise if there was one."""
        g = self.guard
        if g is not None and g.on_device and g.mode == "abort":
            bad = g.first_bad_step()
            if bad is not None:
                raise self.error(bad, done)

    def check_loss_scale(self, done: int, scale: float) -> None:
        """A loss scale below ``min_loss_scale`` means every scale overflows: stop."""
        if scale >= self.min_loss_scale:
            return
        where = self._replay(done - 1, scale)
        raise NonFiniteError(
            f"step {done}: the loss scale fell to {scale:g}, below "
            f"precision.loss_scale.min_loss_scale={self.min_loss_scale:g}: the gradients "
            f"overflow at every scale. First non-finite value: {where}. Nothing of the broken state "
            "was saved. Consider bf16, a lower optim.lr, or checking the data.")

    @property
    def skipped(self) -> Optional[torch.Tensor]:
        """Steps the guard skipped under ``skip`` (device tensor), else None."""
        return self.guard.skipped if self.guard is not None and self.guard.mode == "skip" else None
