"""One life cycle for every optional part of a run.

A run's optional parts (the numerics monitor, the non-finite handling, the
dtype audit, the collective counter, the alerts, the ``debug.*`` fault
injector) each see the same few moments of a step and of the loop. Rather
than the step and the loop calling each by name behind an ``if`` of its
own, each is a :class:`Component`: every hook does nothing unless the part
overrides it, and a part that is off is simply not in the run's
:class:`Components`, which calls each hook on its members in order. The
step (``step.train_step``) and the loop (``trainer.py``) call the container
unconditionally.

The hooks, in the order a step meets them:

- ``begin_step(step)``: the step about to run (0-based);
- ``around_step(step)``: a context around the step's math (a dispatch mode that
  counts or records its operators, a stance, an error turned into another);
- ``backward_loss(loss)``: the loss each backward pass sees (composed over the
  members);
- ``after_backward(model, scale, step)``: gradients complete, as held (still
  scaled by ``scale``, the loss scale tensor or None);
- ``before_optimizer(model)`` / ``after_optimizer(model, skipped)``: around
  the optimizer's step (not called for a step the guard skipped on the host);
- ``after_step(step, result)``: the step's result, still on the device;

and of the loop:

- ``to_read()``: 0-d device tensors to read back with the logged loss, in the
  logging cadence's one host sync;
- ``check(done, reading)``: what was read back; may raise to stop the run (the
  non-finite checks);
- ``on_log(done, row, write)``: figures and alerts added to the training row of
  a logged step; ``write`` prints a console line;
- ``observe(done, row, write)``: what step ``done`` adds to its row after
  evaluation (a monitored step's figures); returns histograms;
- ``ends_run(done)``: a reason to end the run right after this step, without a
  checkpoint (the audit of ``train.audit_only``), or None;
- ``before_save(step)`` (may raise: nothing bad is saved), ``during_save(step)``
  and ``after_save(step)``: around a checkpoint (the last two are called by
  the checkpointer, which takes the container as a save hook);
- ``summarize(write)``: closing tables; returns figures for summary.json.

A resumable part names itself with ``state_key`` (its key in the
checkpoint's ``train_state.pt``) and has ``state_dict``/``load_state_dict``.
"""
from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Iterable, Iterator, Optional

import torch
import torch.nn as nn

Write = Callable[[str], None]
"""Prints one console line (the metric sinks' console)."""


class Component:
    """An optional part of a run: every hook does nothing by default.

    A subclass overrides the hooks it needs. ``state_key`` is None for a part
    with nothing to resume; otherwise its ``state_dict``/``load_state_dict``
    are saved and restored under that name."""

    state_key: Optional[str] = None

    def begin_step(self, step: int) -> None:
        """Step ``step`` (0-based) is about to run."""

    def around_step(self, step: int) -> ContextManager:
        """A context around the step's math; none by default."""
        return contextlib.nullcontext()

    def backward_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss the backward pass sees; the loss itself by default."""
        return loss

    def after_backward(self, model: nn.Module, scale: Optional[torch.Tensor], step: int) -> None:
        """Gradients are complete (still scaled by ``scale``, None without loss scaling)."""

    def before_optimizer(self, model: nn.Module) -> None:
        """The optimizer is about to step."""

    def after_optimizer(self, model: nn.Module, skipped: torch.Tensor) -> None:
        """The optimizer stepped (``skipped``: the 0-d flag, 1 when it did not apply)."""

    def after_step(self, step: int, result) -> None:
        """Step ``step`` returned ``result`` (a ``StepResult``, on the device)."""

    def to_read(self) -> dict[str, torch.Tensor]:
        """0-d device tensors to read back with the logged loss (mean over ranks)."""
        return {}

    def check(self, done: int, reading) -> None:
        """After a logged step's read-back (``report.Reading``); raise to stop the run."""

    def on_log(self, done: int, row: dict, write: Write) -> None:
        """Add figures or alerts to the training row of logged step ``done``."""

    def observe(self, done: int, row: dict, write: Write) -> dict:
        """Add what step ``done`` measured to its row; returns histograms by name."""
        return {}

    def ends_run(self, done: int) -> Optional[str]:
        """Why the run ends right after step ``done`` (no checkpoint), or None."""
        return None

    def before_save(self, step: int) -> None:
        """A checkpoint of step ``step`` is about to be written; raise to refuse it."""

    def during_save(self, step: int) -> None:
        """The checkpoint's shards are written; it is not yet visible."""

    def after_save(self, step: int) -> None:
        """The checkpoint is visible; older ones are not yet pruned."""

    def summarize(self, write: Write) -> dict:
        """At the end: closing lines written, figures for summary.json returned."""
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, sd: dict) -> None:
        pass


class Components(Component):
    """The run's parts in a fixed order; each hook is called on every member in
    that order (a part's figures and lines come out where it stands)."""

    def __init__(self, members: Iterable[Component] = ()):
        self.members = list(members)

    def __iter__(self) -> Iterator[Component]:
        return iter(self.members)

    def states(self) -> dict[str, Component]:
        """The resumable members by their ``train_state.pt`` key."""
        return {m.state_key: m for m in self.members if m.state_key is not None}

    def begin_step(self, step: int) -> None:
        for m in self.members:
            m.begin_step(step)

    @contextlib.contextmanager
    def around_step(self, step: int) -> Iterator[None]:
        # The first member's context is the outermost: it sees what the others raise, after they exit.
        with contextlib.ExitStack() as stack:
            for m in self.members:
                stack.enter_context(m.around_step(step))
            yield

    def backward_loss(self, loss: torch.Tensor) -> torch.Tensor:
        for m in self.members:
            loss = m.backward_loss(loss)
        return loss

    def after_backward(self, model: nn.Module, scale: Optional[torch.Tensor], step: int) -> None:
        for m in self.members:
            m.after_backward(model, scale, step)

    def before_optimizer(self, model: nn.Module) -> None:
        for m in self.members:
            m.before_optimizer(model)

    def after_optimizer(self, model: nn.Module, skipped: torch.Tensor) -> None:
        for m in self.members:
            m.after_optimizer(model, skipped)

    def after_step(self, step: int, result) -> None:
        for m in self.members:
            m.after_step(step, result)

    def to_read(self) -> dict[str, torch.Tensor]:
        return {k: v for m in self.members for k, v in m.to_read().items()}

    def check(self, done: int, reading) -> None:
        for m in self.members:
            m.check(done, reading)

    def on_log(self, done: int, row: dict, write: Write) -> None:
        for m in self.members:
            m.on_log(done, row, write)

    def observe(self, done: int, row: dict, write: Write) -> dict:
        hists: dict = {}
        for m in self.members:
            hists.update(m.observe(done, row, write))
        return hists

    def ends_run(self, done: int) -> Optional[str]:
        return next((why for why in (m.ends_run(done) for m in self.members) if why), None)

    def before_save(self, step: int) -> None:
        for m in self.members:
            m.before_save(step)

    def during_save(self, step: int) -> None:
        for m in self.members:
            m.during_save(step)

    def after_save(self, step: int) -> None:
        for m in self.members:
            m.after_save(step)

    def summarize(self, write: Write) -> dict:
        return {k: v for m in self.members for k, v in m.summarize(write).items()}


NO_PARTS = Components()
"""A step with no optional part: every hook does nothing (what a test or a bench that
calls ``train_step`` alone passes)."""
