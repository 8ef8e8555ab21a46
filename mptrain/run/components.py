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

- ``around_step(step)``: a context around step ``step`` (0-based): what a part
  does as the step begins (a monitored step's hooks, a counter, the audit's
  dispatch mode) and around its math (a stance, an error turned into another);
- ``after_backward(model, scale, step)``: gradients complete, as held (still
  scaled by ``scale``, the loss scale tensor or None);
- ``before_optimizer(model)``: gradients unscaled and clipped, the optimizer
  about to step (not called for a step the guard skipped on the host);
- ``after_step(step, result)``: the step's result, still on the device; returns
  0-d device tensors to read back with the logged loss, in the logging
  cadence's one host sync;

and of the loop:

- ``on_log(done, reading, row, write)``: a logged step's read-back
  (``reading``; a part may raise to stop the run: the non-finite checks), then
  figures and alerts added to its training ``row``; ``write`` prints a console line;
- ``observe(done, row, write)``: what step ``done`` adds to its row after
  evaluation (a monitored step's figures); returns histograms;
- ``summarize(write)``: closing tables; returns figures for summary.json.

What a part does at a checkpoint (``before_save``, ``during_save``,
``after_save``) is the checkpointer's own protocol (``checkpoint/checkpointer.py``
``SaveHook``), given the parts that have something to do then; what the ``debug.*``
injector does to the loss before backward is the step's (``StepState.backward_loss``);
that a run ends after its audited step (``train.audit_only``) the plan says.

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
    rank_state_key: Optional[str] = None
    """Set for a part with state of its own on every rank (its ``rank_state_dict``): saved in
    each rank's file of a checkpoint and restored on the same world size."""

    def around_step(self, step: int) -> ContextManager:
        """A context around step ``step`` (0-based); none by default."""
        return contextlib.nullcontext()

    def after_backward(self, model: nn.Module, scale: Optional[torch.Tensor], step: int) -> None:
        """Gradients are complete (still scaled by ``scale``, None without loss scaling)."""

    def before_optimizer(self, model: nn.Module) -> None:
        """Gradients are unscaled and clipped; the optimizer is about to step."""

    def after_step(self, step: int, result) -> dict[str, torch.Tensor]:
        """Step ``step`` returned ``result`` (a ``StepResult``, on the device); returns 0-d
        device tensors to read back with the next logged loss (mean over ranks), by name."""
        return {}

    def on_log(self, done: int, reading, row: dict, write: Write) -> None:
        """Logged step ``done``: what was read back (``report.Reading``; raise to stop the
        run), then figures or alerts added to its training ``row``."""

    def observe(self, done: int, row: dict, write: Write) -> dict:
        """Add what step ``done`` measured to its row; returns histograms by name."""
        return {}

    def summarize(self, write: Write) -> dict:
        """At the end: closing lines written, figures for summary.json returned."""
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, sd: dict) -> None:
        pass

    def rank_state_dict(self) -> dict:
        return {}

    def load_rank_state_dict(self, sd: dict) -> None:
        pass

    def take_over(self, old: "Component") -> None:
        """Continue where ``old``, this part's predecessor, left off: a precision phase
        builds the run's parts anew for its model. By default its resumable state."""
        if self.state_key is not None:
            self.load_state_dict(old.state_dict())


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

    def rank_states(self) -> dict[str, Component]:
        """The members with per-rank state, by their key in each rank's checkpoint file."""
        return {m.rank_state_key: m for m in self.members if m.rank_state_key is not None}

    @contextlib.contextmanager
    def around_step(self, step: int) -> Iterator[None]:
        # The first member's context is the outermost: it sees what the others raise, after they exit.
        with contextlib.ExitStack() as stack:
            for m in self.members:
                stack.enter_context(m.around_step(step))
            yield

    def after_backward(self, model: nn.Module, scale: Optional[torch.Tensor], step: int) -> None:
        for m in self.members:
            m.after_backward(model, scale, step)

    def before_optimizer(self, model: nn.Module) -> None:
        for m in self.members:
            m.before_optimizer(model)

    def after_step(self, step: int, result) -> dict[str, torch.Tensor]:
        return {k: v for m in self.members for k, v in m.after_step(step, result).items()}

    def on_log(self, done: int, reading, row: dict, write: Write) -> None:
        for m in self.members:
            m.on_log(done, reading, row, write)

    def observe(self, done: int, row: dict, write: Write) -> dict:
        hists: dict = {}
        for m in self.members:
            hists.update(m.observe(done, row, write))
        return hists

    def summarize(self, write: Write) -> dict:
        return {k: v for m in self.members for k, v in m.summarize(write).items()}

    def take_over(self, old: "Component") -> None:
        """Each member continues from the member of its kind in ``old`` (one that is new here starts fresh)."""
        before = {type(m): m for m in getattr(old, "members", [])}
        for m in self.members:
            if type(m) in before:
                m.take_over(before[type(m)])


NO_PARTS = Components()
"""A step with no optional part: every hook does nothing (what a test or a bench that
calls ``train_step`` alone passes)."""
