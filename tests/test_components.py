"""The run's optional parts as components: only those that are on are built (the
``debug.*`` injector only with a ``debug.*`` key), the protocol has at most eight
hooks, ``train_step`` takes at most four parameters and branches on no feature, the
Reporter gains no attribute after it is built, and the checkpointer calls its save hooks."""
from __future__ import annotations

import inspect

import pytest

from mptrain.distributed.parallel import setup
from mptrain.run.components import Component, Components
from mptrain.run.faults import FaultInjector
from mptrain.run.nonfinite import NonFiniteHandler
from mptrain.run.parts import AuditPart, CommPart, NumericsPart, SkipRatePart, SpikePart, StabilityPart
from mptrain.run.step import train_step
from mptrain.run.trainer import Trainer

from .conftest import make_plan

ALWAYS = [NonFiniteHandler, SkipRatePart, SpikePart, StabilityPart]
"""The parts every run holds: the non-finite handling and the alerts (resumable)."""


@pytest.fixture
def built(tmp_path):
    """``built(*overrides)``: a Trainer built (not trained) for a tiny config."""
    ctxs = []

    def make(*overrides: str) -> Trainer:
        plan = make_plan(*overrides)
        ctx = setup(plan)
        ctxs.append(ctx)
        return Trainer(plan, ctx, tmp_path / f"run{len(ctxs)}")

    yield make
    for ctx in ctxs:
        ctx.shutdown()


def _kinds(t: Trainer) -> list[type]:
    return [type(p) for p in t.parts]


def test_only_the_parts_that_are_on_are_built(built):
    plain = built("monitor.enabled=false")
    assert _kinds(plain) == ALWAYS  # no injector, monitor, counter or audit
    assert not any(isinstance(p, FaultInjector) for p in plain.parts)
    # The checkpoint keys of train_state.pt stay those old checkpoints have.
    assert list(plain.states) == ["scaler", "progress", "nonfinite_guard", "skip_warning", "spikes",
                                  "stability_warnings"]

    monitored = built("train.audit=true")  # monitor.enabled is the default; one process: no counter
    assert _kinds(monitored) == [NonFiniteHandler, SkipRatePart, SpikePart, NumericsPart, AuditPart, StabilityPart]
    assert CommPart not in _kinds(monitored)


def test_a_debug_key_builds_the_injector_first_and_the_handler_replays_it(built):
    t = built("monitor.enabled=false", "debug.loss_multiplier=0.5")
    assert _kinds(t) == [FaultInjector, *ALWAYS]
    injector, handler = t.parts.members[:2]
    assert handler.faults is injector  # a replay repeats the run's faults
    assert t.state.backward_loss == injector.backward_loss  # the loss each backward sees is the injector's
    assert t.ckpt.hooks == (handler, injector)  # the handler looks before a save; kills during and after it
    plain = built("monitor.enabled=false")
    assert not any(isinstance(p, FaultInjector) for p in plain.parts)
    assert plain.ckpt.hooks == (plain.parts.members[0],)  # the handler alone


def test_the_component_protocol_has_at_most_eight_hooks():
    """Hooks one part alone used were merged into broader ones (issue 51): what remains
    is called by the step and the loop for every part."""
    state = ("state_dict", "load_state_dict", "rank_state_dict", "load_rank_state_dict")  # saved, not called
    hooks = [n for n, v in vars(Component).items() if callable(v) and not n.startswith("_") and n not in state]
    assert len(hooks) <= 8, hooks
    assert set(hooks) == {n for n, v in vars(Components).items() if callable(v) and not n.startswith("_")
                          and n not in ("states", "rank_states")}, "the container calls every hook on its members"


def test_train_step_takes_at_most_four_parameters_and_branches_on_no_feature():
    assert len(inspect.signature(train_step).parameters) <= 4
    source = inspect.getsource(train_step)
    assert "is not None" not in source and "is None" not in source


class _Recorder(Component):
    """Records the hooks the loop and the checkpointer call, in order."""

    def __init__(self):
        self.calls: list[tuple] = []

    def around_step(self, step):
        self.calls.append(("around_step", step))
        return super().around_step(step)

    def on_log(self, done, reading, row, write):
        self.calls.append(("on_log", done, reading.loss == reading.loss))  # the read-back's loss, a float

    def before_save(self, step):
        self.calls.append(("before_save", step))

    def during_save(self, step):
        self.calls.append(("during_save", step))

    def after_save(self, step):
        self.calls.append(("after_save", step))


def test_reporter_gains_no_attribute_while_running_and_hooks_are_called_in_order(built):
    t = built("train.max_steps=2", "checkpoint.at_end=true", "monitor.enabled=false")
    rec = _Recorder()
    t.parts = Components([*t.parts, rec])  # what the loop calls
    t.ckpt.hooks = (*t.ckpt.hooks, rec)  # and the checkpointer
    report_attrs, trainer_attrs = set(vars(t.report)), set(vars(t))
    summary = t.train()
    assert summary["steps"] == 2
    assert set(vars(t.report)) == report_attrs  # every attribute set in __init__
    assert set(vars(t)) == trainer_attrs
    assert rec.calls == [("around_step", 0), ("on_log", 1, True), ("around_step", 1), ("on_log", 2, True),
                         ("before_save", 2), ("during_save", 2), ("after_save", 2)]
