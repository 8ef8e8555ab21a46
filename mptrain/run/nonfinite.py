"""Non-finite numbers: what the run does about them.

- :class:`NonFiniteGuard` decides, per step, whether a step whose gradients
  hold inf/nan is applied (runs without a loss scaler; the scaler does its own);
  :data:`NO_GUARD` is the step's guard where the loss scaler decides.
- :class:`NonFiniteHandler` (a run component) turns a bad step into one clear
  error: it looks at the guard (and, under fp16 loss scaling, at the loss) when
  the loop can afford a host sync, replays the bad step (:func:`replay_step`,
  all ranks in step) and names what went wrong, one of three distinct
  diagnoses: the forward loss itself was non-finite; the gradients held inf/nan
  although the loss was finite; or every gradient was finite but their global
  norm overflowed fp32. It also stops a run whose loss scale has collapsed.

The ``debug.*`` faults that provoke all this live in ``faults.py``; the handler
replays them through the component it is given, without knowing what they are.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from mptrain.core.shards import local_shard
from mptrain.model.names import canonical_name
from mptrain.run.components import Component


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


class Unguarded:
    """The step's guard where the loss scaler guards (fp16): it never holds a
    step back (the scaler skips overflowing steps itself) and hands no flag."""

    def gate(self, grad_norm: torch.Tensor, step: int) -> tuple[Optional[torch.Tensor], bool]:
        """``(found_inf, skip_now)`` as :meth:`NonFiniteGuard.gate` says it: apply, no flag."""
        return None, False


NO_GUARD = Unguarded()
"""The guard of a step whose loss scaler decides on inf/nan."""


def _gather(ctx, obj) -> list:
    """Every rank's ``obj`` (picklable), in rank order (a collective when world > 1)."""
    if not (ctx.has_group and ctx.world > 1):
        return [obj]
    out: list = [None] * ctx.world
    dist.all_gather_object(out, obj)
    return out


def _first_named(ctx, name: str) -> str:
    """The first rank's non-empty ``name``, tagged with that rank when there are several."""
    seen = _gather(ctx, name)
    for rank, where in enumerate(seen):
        if where:
            return where + (f" on rank {rank}" if len(seen) > 1 else "")
    return ""


@dataclass
class Replay:
    """What replaying one step found; every rank holds the same answer."""

    where: str = ""
    """The first module whose output (forward order) or output gradient
    (backward order) held inf/nan, or "" when none did."""
    loss_finite: bool = True
    """The forward loss of every micro-batch replayed, on every rank."""
    grads_finite: bool = True
    """Every gradient after the whole backward (only looked at when it completed)."""
    bad_grad: str = ""
    """A parameter whose gradient is non-finite (quoted, then its rank when there
    are several), when no module output was."""
    norm: float = 0.0
    """The global gradient norm, as the step computes it (fp32)."""
    largest: float = 0.0
    """The largest |gradient| and the parameter that holds it."""
    largest_in: str = ""


def replay_step(model: nn.Module, policy, ctx, micro_batches: list, scale: float = 1.0,
                after_backward=None, backward_loss=None) -> Replay:
    """Replay a step's forward and backward with hooks: which module first held
    inf/nan, whether the loss was finite and, when the backward completes
    (``after_backward`` runs then, e.g. to repeat an injected fault), what the
    unscaled gradients and their norm look like. ``backward_loss`` turns each
    micro-batch's loss into the one its backward sees, as the step does
    (the ``debug.*`` injector's ``backward_loss``); None: the loss itself. The weights are
    those the bad step started from: it was not applied.

    Every rank calls it, and the ranks agree after each forward and each
    backward (a small collective) on whether to go on: a rank that stopped
    alone would leave the others waiting in the next collective of the
    backward pass until the process group's timeout. Names come from the
    first rank that saw the value, when there are several.
    """
    found: list[str] = []
    handles = _watch_modules(model, found)
    out = Replay()
    try:
        model.zero_grad(set_to_none=True)
        if _replay_passes(model, policy, ctx, micro_batches, scale, found, out, backward_loss or _same):
            if after_backward is not None:
                after_backward()
            _gradient_facts(model, ctx, scale, out)
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
    out.where = _first_named(ctx, found[0] if found else "")
    return out


def _bad(t) -> bool:
    return torch.is_tensor(t) and t.is_floating_point() and not bool(torch.isfinite(t).all())


def _watch_modules(model: nn.Module, found: list) -> list:
    """Hooks that append where a module's output, or the gradient of its output, is non-finite."""
    def fwd_hook(name):
        def hook(_m, _inp, out):
            t = out[0] if isinstance(out, (tuple, list)) else out
            if _bad(t):
                found.append(f"forward output of '{name}'")
            elif torch.is_tensor(t) and t.requires_grad:
                t.register_hook(lambda g: found.append(f"gradient of '{name}' output") if _bad(g) else None)
        return hook

    return [m.register_forward_hook(fwd_hook(canonical_name(n) or "model (the loss)"))
            for n, m in model.named_modules()]


def _same(loss: torch.Tensor) -> torch.Tensor:
    return loss


def _replay_passes(model, policy, ctx, micro_batches: list, scale: float, found: list, out: Replay,
                   backward_loss) -> bool:
    """Forward and backward of each micro-batch, as the step runs them; False when
    the ranks stopped together at a non-finite value."""
    n = len(micro_batches)
    for x, y in micro_batches:
        with ctx.grad_sync(model, enabled=True), policy.autocast():
            _, loss = model(x.to(ctx.device), y.to(ctx.device))
        out.loss_finite = not ctx.any_rank(not bool(torch.isfinite(loss)))
        if ctx.any_rank(bool(found)) or not out.loss_finite:
            return False
        (backward_loss(loss) * (scale / n)).backward()  # the step divides by n so micro-batches sum to the mean
        if ctx.any_rank(bool(found)):
            return False
    return True


def _gradient_facts(model: nn.Module, ctx, scale: float, out: Replay) -> None:
    """Unscale the replayed gradients, then record whether they are all finite,
    the largest |gradient| and the global norm (collectives: every rank calls it)."""
    bad, top, top_in = "", 0.0, ""
    for n, p in model.named_parameters():
        if p.grad is None or not local_shard(p.grad).numel():
            continue
        g = local_shard(p.grad)
        if scale != 1.0:
            g.div_(scale)
        if not bad and _bad(g):
            bad = f"'{canonical_name(n)}'"  # quoted here: a rank tag may follow
        m = float(g.abs().max())
        if m > top:  # False for nan
            top, top_in = m, canonical_name(n)
    out.grads_finite = not ctx.any_rank(bool(bad))
    out.bad_grad = _first_named(ctx, bad)
    out.norm = float(ctx.clip_grad_norm(model, 0.0))  # max_norm 0: measure, do not clip
    out.largest, out.largest_in = max(_gather(ctx, (top, top_in)))


LOSS_FLAG = "nonfinite/loss_flag"
"""The name under which the handler's loss flag is read back with the logged loss."""


class NonFiniteHandler(Component):
    """From a bad step to one error that names the step, what went wrong and where.

    ``guard`` is None when a loss scaler handles inf/nan (fp16): the scaler
    skips steps whose gradients overflow, and what is left to catch is a
    forward pass whose loss is non-finite (no scale fixes that; under
    ``abort`` the first such step is tracked on the device, without a host
    sync, and seen at the logging cadence) and a scale that collapsed.

    As a run component it looks when the loop reads the loss back
    (:meth:`on_log`), turns a bad step the guard raised on into its error
    (:meth:`around_step`), and resumes the guard's count of skipped steps
    (``nonfinite_guard``); as the checkpointer's save hook it looks before every
    checkpoint (:meth:`before_save`). ``faults`` is the run's ``debug.*`` injector
    (``faults.NO_FAULTS`` without one): a replay repeats its faults, so a planted
    NaN reappears exactly.
    """

    def __init__(self, mode: str, optimizer, scaler, model, policy, ctx, batches, faults,
                 min_loss_scale: float):
        self.mode = mode
        self.guard = None if scaler.enabled else NonFiniteGuard(mode, optimizer, ctx.device)
        self.state_key = None if self.guard is None else "nonfinite_guard"
        self.model, self.policy, self.ctx, self.batches, self.faults = model, policy, ctx, batches, faults
        self.min_loss_scale = min_loss_scale
        self.fp16 = policy.compute_dtype == torch.float16
        # First 0-based step whose loss was non-finite (fp16 under abort only; the guard covers the rest).
        self.bad_loss_step = (torch.full((), -1, dtype=torch.int64, device=ctx.device)
                              if scaler.enabled and mode == "abort" else None)
        self.looked_at = -1  # the last step at which the loop read the loss back

    def watch_loss(self, loss: torch.Tensor, step: int) -> None:
        """Note a non-finite loss at 0-based ``step``, on the device (no host sync)."""
        if self.bad_loss_step is not None:
            bad = ~torch.isfinite(loss)
            self.bad_loss_step = torch.where(bad & (self.bad_loss_step < 0), step, self.bad_loss_step)

    def loss_flag(self) -> Optional[torch.Tensor]:
        """1.0 once a non-finite loss was noted (a device tensor to read back with the
        loss, in the same host sync), or None when nothing is tracked."""
        return None if self.bad_loss_step is None else (self.bad_loss_step >= 0).float()

    def _replay(self, step: int, scale: float = 1.0) -> Replay:
        """Replay 0-based ``step`` exactly: the same batch (a function of the step)
        and the same faults, planted or injected."""
        self.faults.at_step(step)
        return replay_step(self.model, self.policy, self.ctx, self.batches.batch(step), scale=scale,
                           after_backward=lambda: self.faults.after_backward(self.model, None, step),
                           backward_loss=self.faults.backward_loss)

    def _later(self, bad_step: int, detected: Optional[int]) -> str:
        if detected is None or detected == bad_step + 1:
            return ""
        if self.guard is None:  # the scaler skipped the bad step; the steps after it ran
            return f" (seen at step {detected}, the next point the loop looked)"
        return (f" (seen at step {detected}, the next point the loop looks: the steps in between were "
                "not applied either)")

    def error(self, bad_step: int, detected: Optional[int] = None, forward: bool = False) -> NonFiniteError:
        """The error for 0-based ``bad_step``, after replaying it to tell which of
        the three cases it is; ``forward``: the loop saw its loss non-finite."""
        r = self._replay(bad_step)
        head, tail = f"step {bad_step + 1}: ", (f" Nothing of this step was applied or saved"
                                                f"{self._later(bad_step, detected)}. ")
        skip = "; train.on_nonfinite=skip skips such steps instead."
        if forward or not r.loss_finite:
            return NonFiniteError(head + _forward_text(r, self.guard is None) + "." + tail
                                  + _forward_fixes(self.fp16) + skip)
        if r.where or not r.grads_finite:
            return NonFiniteError(
                f"{head}the gradients hold inf/nan although the loss was finite (an overflow in the backward "
                f"pass); first non-finite value: {_grad_where(r)}.{tail}Usual fixes: a lower optim.lr or "
                f"checking the data{skip}")
        if not math.isfinite(r.norm):
            return NonFiniteError(head + _norm_text(r) + "." + tail + "Gradients this large mean the run "
                                  f"diverged: a lower optim.lr or checking the data are the usual fixes{skip}")
        return NonFiniteError(
            f"{head}the gradient norm was inf/nan, but replaying the step from the same weights and batch "
            f"found every value finite (a non-deterministic fault?).{tail}Usual fixes: a lower optim.lr or "
            f"checking the data{skip}")

    def check_guard(self, done: int) -> None:
        """Fused optimizer under ``abort``: bad steps were skipped on the device
        without a host sync; look now (a host sync) and raise if there was one."""
        g = self.guard
        if g is not None and g.on_device and g.mode == "abort":
            bad = g.first_bad_step()
            if bad is not None:
                raise self.error(bad, done)

    def check_loss(self, done: int, loss: float, flagged: bool) -> None:
        """At a logging step, with the loss read back (the mean over ranks) and the
        tracked flag read with it: under ``abort`` a non-finite loss stops the run."""
        self.looked_at = done
        if self.mode == "abort" and (flagged or not math.isfinite(loss)):
            raise self.error(self._first_bad_loss(done), done, forward=True)

    def _first_bad_loss(self, done: int) -> int:
        """The first 0-based step whose loss was non-finite on any rank (collective),
        or the step just done when that was not tracked."""
        if self.bad_loss_step is None:
            return done - 1
        seen = [int(v) for v in self.ctx.all_gather(self.bad_loss_step) if int(v) >= 0]
        return min(seen) if seen else done - 1

    def check_deferred(self, done: int) -> None:
        """Before a checkpoint (and at the end): raise for a bad step the loop has
        not looked at yet, so nothing after it is saved. A host sync; the loss
        flag is read only when this step's logging did not already read it."""
        self.check_guard(done)
        if self.bad_loss_step is not None and self.looked_at != done:
            if self.ctx.any_rank(bool(self.bad_loss_step >= 0)):
                raise self.error(self._first_bad_loss(done), done, forward=True)

    def check_loss_scale(self, done: int, scale: float) -> None:
        """A loss scale below ``min_loss_scale`` means every scale overflows: stop,
        saying whether the forward loss or the gradients are non-finite."""
        if scale >= self.min_loss_scale:
            return
        r = self._replay(done - 1, scale)
        head = (f"step {done}: the loss scale fell to {scale:g}, below precision.loss_scale.min_loss_scale="
                f"{self.min_loss_scale:g}: ")
        if not r.loss_finite:
            raise NonFiniteError(head + _forward_text(r, True) + ". Nothing of the broken state was saved. "
                                 + _forward_fixes(self.fp16) + ".")
        raise NonFiniteError(
            f"{head}the gradients overflow at every scale although the loss is finite; first non-finite "
            f"value: {_grad_where(r)}. Nothing of the broken state was saved. Consider bf16, a lower "
            "optim.lr, or checking the data.")

    @property
    def skipped(self) -> Optional[torch.Tensor]:
        """Steps the guard skipped under ``skip`` (device tensor), else None."""
        return self.guard.skipped if self.guard is not None and self.guard.mode == "skip" else None

    # ------------------------------------------------------------ as a component
    @property
    def step_guard(self):
        """What the step asks whether to apply: the guard, or :data:`NO_GUARD` under loss scaling."""
        return NO_GUARD if self.guard is None else self.guard

    @contextlib.contextmanager
    def around_step(self, step: int) -> Iterator[None]:
        """A bad step the guard raised on (a non-fused optimizer under ``abort``)
        becomes its error, after the step's other contexts have closed."""
        try:
            yield
        except NonFiniteStep:
            raise self.error(step) from None

    def after_step(self, step: int, result) -> dict[str, torch.Tensor]:
        self.watch_loss(result.loss, step)  # on the device: read back with the loss when logging
        flag = self.loss_flag()  # fp16 under abort: was any loss since the last look non-finite?
        return {} if flag is None else {LOSS_FLAG: flag}

    def on_log(self, done: int, reading, row: dict, write) -> None:
        """At a logging step: the guard's deferred flag, then the loss read back (before
        the scale: the cause), then a loss scale that collapsed; then the skip count."""
        self.check_guard(done)
        self.check_loss(done, reading.loss, reading.flags.get(LOSS_FLAG, 0.0) > 0)
        if reading.loss_scale is not None:
            self.check_loss_scale(done, reading.loss_scale)
        if self.skipped is not None:
            row["train/nonfinite_skipped"] = int(self.skipped)

    def before_save(self, step: int) -> None:
        """(The checkpointer's save hook.) A bad step not looked at yet stops the run here:
        nothing after it is saved."""
        self.check_deferred(step)

    def during_save(self, step: int) -> None:
        """(A save hook.) Nothing to do while the shards are sealed."""

    def after_save(self, step: int) -> None:
        """(A save hook.) Nothing to do once the checkpoint is visible."""

    def summarize(self, write) -> dict:
        return {} if self.skipped is None else {"train/nonfinite_skipped": int(self.skipped)}

    def state_dict(self) -> dict:
        return self.guard.state_dict()  # only saved with a guard (state_key)

    def load_state_dict(self, sd: dict) -> None:
        self.guard.load_state_dict(sd)


def _forward_text(r: Replay, scaled: bool) -> str:
    """The forward-loss diagnosis, without the step."""
    where = r.where or "none when the step was replayed (the weights have changed since)"
    return ("the forward pass produced a non-finite loss (inf/nan)"
            + (", which no loss scale can fix: loss scaling only acts on the backward pass" if scaled else "")
            + f"; first non-finite value: {where}")


def _forward_fixes(fp16: bool) -> str:
    if fp16:
        return "Usual fixes: a lower optim.lr, checking the data, or precision=bf16 (fp16 overflows past 65504)"
    return "Usual fixes: a lower optim.lr or checking the data"


def _grad_where(r: Replay) -> str:
    if r.where:
        return r.where
    if r.bad_grad:
        return (f"the gradient of {r.bad_grad} (every module output and output gradient was finite: it "
                "arose after the backward pass)")
    return "none when the step was replayed"


def _norm_text(r: Replay) -> str:
    """The norm-overflow diagnosis, without the step."""
    big = torch.finfo(torch.float32).max
    return (f"every gradient is finite, but their global norm overflowed (its sum of squares must fit fp32, and values "
            f"above {math.sqrt(big):.2g} square past fp32's max {big:.2g}); the largest |gradient| is "
            f"{r.largest:.3g}, in '{r.largest_in}'")
