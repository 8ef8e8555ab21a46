"""The run's optional parts, each a component (``components.py``) built from its
own config section, and registered only when it is on.

The measuring and warning classes live in ``observe/`` and know nothing of the
loop; the small adapters here give each the component hooks it needs:

- :class:`NumericsPart` (``monitor.*``): the numerics monitor, with the
  stability monitor and the float8 cast watch it drives; compiled blocks run
  eagerly on its monitored steps; the closing float8 and outlier tables;
- :class:`CommPart` (``monitor.comm``, several ranks): the collectives of the
  monitored steps, by kind and dtype (and by mesh dimension under a mesh);
- :class:`AuditPart` (``train.audit``, ``train.audit_only``): the dtype audit
  of the first step of a launch, and the end of the run after it;
- :class:`SkipRatePart`, :class:`SpikePart`, :class:`StabilityPart`: the
  alerts, always on (their thresholds decide), each resumable under its name;
- :class:`~mptrain.run.mixture.MixturePart` (a model with routed layers): the
  mixture of experts' balancing term and capacity drops in the rows and the summary.

:func:`build_parts` puts them in order with the non-finite handler
(``nonfinite.py``, always on) and, only when a ``debug.*`` key is set, the fault
injector (``faults.py``).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterator, Optional

import torch
import torch.nn as nn
from mptrain.observe.comm import CommCounter, MeshGroups
from mptrain.distributed.parallel import DistContext
from mptrain.model.moe import routed_layers
from mptrain.observe import fp8watch
from mptrain.observe.alerts import SkipRateWarning, SpikeDetector
from mptrain.observe.audit import DtypeAudit
from mptrain.observe.numerics import NumericsMonitor
from mptrain.observe.stability import StabilityWarnings, outlier_table, outlier_table_when
from mptrain.plan.plan import Parts, Plan
from mptrain.precision.formats import dtype_name
from mptrain.precision.policy import PrecisionPolicy
from mptrain.run.build import RunModel
from mptrain.run.components import Component, Components, Write
from mptrain.run.faults import NO_FAULTS, FaultInjector
from mptrain.run.mixture import MixturePart
from mptrain.run.nonfinite import NonFiniteHandler
from mptrain.run.step import Guard


class NumericsPart(Component):
    """``monitor.*``: the numerics monitor on its monitored steps (its calls
    return at once on the others). ``audit_first``: the run audits its first
    step, whose attention probe (fp32 logits: monitoring) must stay out of the
    operators the audit records."""

    def __init__(self, monitor: NumericsMonitor, model: nn.Module, compile_blocks: bool, fp8_recipe: Optional[str],
                 audit_first: bool, max_steps: int = 0):
        self.monitor, self.model, self.compile_blocks, self.fp8_recipe = monitor, model, compile_blocks, fp8_recipe
        self.max_steps = max_steps  # the run's end: a launch that stopped before it gets no cadence advice
        self.audit_first = audit_first
        self.started = False
        self.stepping = False  # the optimizer is stepping this step (the guard did not skip it on the host)
        self.fp8_casts: Optional[dict] = None  # the last monitored step's float8 cast figures (fp8watch.report)
        self.outliers: Optional[tuple[int, dict]] = None  # (step, the last monitored step's figures)
        self.last = 0  # the last step this launch ran, which the closing table is measured against

    def around_step(self, step: int) -> ContextManager:
        self.monitor.start_step(step)
        if self.audit_first and not self.started:
            self.monitor.pause_probes()
        self.started = True
        # Compiled blocks run eagerly on a monitored step. The monitor hooks every
        # block with its own closure for that step only; traced, each hook would
        # recompile every block on and off the monitored steps, past dynamo's
        # recompile limit, after which the blocks fall back to eager for good.
        if self.compile_blocks and self.monitor.active(step):
            return torch.compiler.set_stance("force_eager")
        return contextlib.nullcontext()

    def after_backward(self, model: nn.Module, scale: Optional[torch.Tensor], step: int) -> None:
        self.monitor.after_backward(model, scale)

    def before_optimizer(self, model: nn.Module) -> None:
        self.monitor.before_optimizer(model)
        self.stepping = True

    def after_step(self, step: int, result) -> dict:
        if self.stepping:  # what the optimizer changed, or nothing when the loss scaler skipped it (result.skipped)
            self.monitor.after_optimizer(self.model, result.skipped)
            self.stepping = False
        self.last = step + 1
        return {}

    def observe(self, done: int, row: dict, write: Write) -> dict:
        if not self.monitor.active(done - 1):
            return {}
        scalars, hists = self.monitor.collect()  # collectives + one host sync, on monitored steps only
        row.update(scalars)
        if "fp8/worst/flush" in scalars:
            self.fp8_casts = fp8watch.report(scalars, self.fp8_recipe, done)
        if scalars:
            self.outliers = (done, scalars)  # the last monitored step's, for the closing table
        return hists

    rank_state_key = "numerics"

    def rank_state_dict(self) -> dict:
        """The weight codes the next monitored step counts flips against (this rank's part)."""
        watch = self.monitor.fp8
        return {"codes": watch.signals.codes_state()} if watch is not None else {}

    def load_rank_state_dict(self, sd: dict) -> None:
        watch = self.monitor.fp8
        if watch is not None and "codes" in sd:
            watch.signals.load_codes(sd["codes"])

    def take_over(self, old: Component) -> None:
        """Across a precision phase's boundary, the closing tables stay the run's: the last
        monitored step's cast and outlier figures, whichever phase measured them. (Not the
        weight codes: the new phase casts with another recipe, or builds new layers.)"""
        self.fp8_casts, self.outliers, self.last = old.fp8_casts, old.outliers, old.last

    def summarize(self, write: Write) -> dict:
        if self.fp8_casts is not None:
            write(fp8watch.table(self.fp8_casts))
        outliers = outlier_table(self.outliers[1], self.outliers[0]) if self.outliers is not None else ""
        if outliers:
            write(outliers)
            when = outlier_table_when(self.outliers[0], self.last, self.monitor.every, self.max_steps)
            if when:
                write(when)
        return {"fp8_casts": self.fp8_casts} if self.fp8_casts else {}


def numerics_monitor(parts: Parts, model: nn.Module, optimizer: torch.optim.Optimizer, choice,
                     policy: PrecisionPolicy, ctx: DistContext) -> NumericsMonitor:
    """The numerics monitor of the run (``monitor.*``), with the float8 cast
    watch (and its quantization signals) when the run casts to float8 or 4-bit
    and ``monitor.fp8_casts`` is on."""
    # owned_shard: the part of each parameter this rank sums, so that replicas (HSDP's
    # replicate groups, the TP ranks' copies of what TP does not split) count once.
    fp8_watch = (fp8watch.CastWatch.of_run(policy.lowp, model, list(parts.whatif), owned=ctx.owned_shard)
                 if policy.lowp and parts.casts else None)
    # Sums of what each rank sees are over every rank under TP: the TP ranks of a data-parallel
    # group share a batch but hold different heads (the attention probes) and, with sequence
    # parallelism, different positions. These sums feed means (a sum over its count), which
    # the ranks that hold copies change in neither; one shard_sum is then over the world.
    sum_seen = ctx.shard_sum if ctx.shape.tp > 1 else ctx.all_reduce_sum
    # A mixture-of-experts model's token counts are not means: they are summed over the
    # data-parallel ranks only (the TP ranks of a group route the same tokens), one
    # collective with the others' where that is the same reduction (no TP).
    monitor = NumericsMonitor(parts.monitor, model, reduce_sum=ctx.shard_sum, reduce_max=ctx.shard_max,
                              reduce_max_all=ctx.all_reduce_max, reduce_sum_all=sum_seen,
                              reduce_sum_dp=ctx.all_reduce_sum, fp8_watch=fp8_watch, owned=ctx.owned_shard)
    monitor.attach_optimizer(optimizer, choice)  # Adam's health on monitored steps (stability.py)
    return monitor


class CommPart(Component):
    """``monitor.comm``: the collectives of each monitored step (``when``), counted
    by kind and dtype (``comm/*`` metrics, and a console line for the first step of
    a launch that is counted); under a mesh (``groups``) also by mesh dimension
    (``comm/<dim>/*``)."""

    def __init__(self, when: Callable[[int], bool], groups: Optional[MeshGroups] = None):
        self.when, self.groups = when, groups  # groups: under a mesh, which dimension each collective ran on
        self.first: Optional[int] = None  # the first step this launch runs
        self.counter: Optional[CommCounter] = None  # this step's, when it is counted
        self.last: dict = {}  # the last counted step's figures, for the summary

    def around_step(self, step: int) -> ContextManager:
        self.first = step if self.first is None else self.first
        self.counter = CommCounter(self.groups) if self.when(step) else None
        return self.counter if self.counter is not None else contextlib.nullcontext()

    def step_figures(self) -> dict:
        """The figures of this step's collectives; empty when it was not counted."""
        return self.counter.metrics() if self.counter is not None else {}

    def observe(self, done: int, row: dict, write: Write) -> dict:
        if self.counter is not None:
            self.last = self.counter.metrics()
            row.update(self.last)
            if done - 1 == self.first:
                write(f"step {done:>6} | collectives of one step on this rank: {self.counter.text()}")
        return {}

    def summarize(self, write: Write) -> dict:
        return dict(self.last)


class AuditPart(Component):
    """``train.audit``: the dtype audit (``observe/audit.py``) of the first step of
    this launch: audit.json, its table and flags (with ``train.audit_only`` the run
    ends after that step: the trainer reads it from the plan). A precision phase's
    parts are built anew when it begins, so each phase's first step is audited too,
    into ``audit-phase<k>.json`` (``name``).
    ``comm_figures``: the audited step's collectives (empty when not counted)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, policy: PrecisionPolicy,
                 write_json: Callable[[str, dict], object],
                 comm_figures: Callable[[], dict] = dict, groups: Optional[MeshGroups] = None,
                 name: str = "audit.json"):
        self.model, self.optimizer, self.policy, self.groups, self.name = model, optimizer, policy, groups, name
        self.write_json, self.comm_figures = write_json, comm_figures
        self.first: Optional[int] = None  # the first step this launch runs: the audited one
        self.recorded: Optional[DtypeAudit] = None

    @contextlib.contextmanager
    def around_step(self, step: int) -> Iterator[None]:
        self.first = step if self.first is None else self.first
        if step != self.first:
            yield
            return
        # Compiled blocks run eagerly for it: a dispatch mode cannot look inside a graph.
        audit = DtypeAudit(self.model, self.optimizer, self.policy, self.groups)
        with torch.compiler.set_stance("force_eager"), audit:
            self.recorded = audit
            yield

    def observe(self, done: int, row: dict, write: Write) -> dict:
        audit, self.recorded = self.recorded, None
        if audit is not None:
            report = audit.report()
            report["comm"] = self.comm_figures()
            path = self.write_json(self.name, report)
            write(audit.table())
            write(f"step {done:>6} | dtype audit written to {path}")
            row["audit/flags"] = len(report["flags"])
        return {}


def _alert(row: dict, figures: dict, message: Optional[str], write: Write) -> None:
    """An alert's figures into the row, its message onto the console."""
    row.update(figures)
    if message:
        write(message)


class _AlertPart(Component):
    """An alert of ``observe/alerts.py`` or ``observe/stability.py`` as a component:
    its state (what it has already warned about) is the alert's own, saved and
    restored under the part's ``state_key``."""

    def __init__(self, alert):
        self.alert = alert

    def state_dict(self) -> dict:
        return self.alert.state_dict()

    def load_state_dict(self, sd: dict) -> None:
        self.alert.load_state_dict(sd)


class SkipRatePart(_AlertPart):
    """The fp16 skip-rate warning (``precision.loss_scale.warn_*``), on the logged
    rows that carry the loss scaler's figures; warns once per run."""

    state_key = "skip_warning"

    def __init__(self, ls_cfg):
        super().__init__(SkipRateWarning(ls_cfg))

    def on_log(self, done: int, reading, row: dict, write: Write) -> None:
        if "amp/skipped_steps" in row:  # a run with fp16 loss scaling
            _alert(row, *self.alert.check(done, row["amp/skipped_steps"]), write)


class SpikePart(_AlertPart):
    """The loss-spike detector (``monitor.spike_*``), on every logged loss."""

    state_key = "spikes"

    def __init__(self, mcfg):
        super().__init__(SpikeDetector(mcfg.spike_factor, mcfg.spike_window))

    def on_log(self, done: int, reading, row: dict, write: Write) -> None:
        _alert(row, *self.alert.check(done, row["train/loss"]), write)


class StabilityPart(_AlertPart):
    """The stability warnings (``monitor.warn_*``) on a monitored step's ``stability/*``
    figures; it stands after the numerics monitor, whose figures it reads."""

    state_key = "stability_warnings"

    def __init__(self, mcfg, compute: str):
        super().__init__(StabilityWarnings(mcfg, compute))

    def observe(self, done: int, row: dict, write: Write) -> dict:
        _alert(row, *self.alert.check(done, row), write)
        return {}


def mesh_groups(ctx: DistContext) -> Optional[MeshGroups]:
    """Under a device mesh, the dimension of each process group (for the
    collectives' accounting and the audit); None otherwise."""
    if ctx.mesh is None:
        return None
    return MeshGroups(ctx.mesh, ctx.world, ctx.dp_ranks, ctx.expert_mesh, ctx.ep_group)


@dataclass
class RunParts:
    """The run's components in order, the guard its step asks (the non-finite handler's),
    the ``debug.*`` injector (or :data:`~mptrain.run.faults.NO_FAULTS`: the step asks it
    for the loss its backward sees) and the parts the checkpointer tells of each save."""

    parts: Components
    guard: Guard
    faults: object
    save_hooks: tuple


def build_parts(plan: Plan, ctx: DistContext, built: RunModel, policy: PrecisionPolicy, batches,
                write_json: Callable[[str, dict], object]) -> RunParts:
    """Every part that is on (``plan.parts``), in the order its hooks must run: the injector
    first (its inf goes in before the monitor reads the gradients), the non-finite
    handler next (its context is the outermost: a bad step is replayed once the
    others have closed), the alerts of the logged row, then what a monitored step
    measures, in the order of its lines: monitor, collectives, audit, and the
    stability warnings on the monitor's figures. A mixture of experts' part stands
    with the alerts, on the logged row."""
    on, model = plan.parts, built.model
    injector = [FaultInjector(plan.debug, model, ctx.rank)] if on.faults else []  # a test aid: debug.* only
    faults = injector[0] if injector else NO_FAULTS
    handler = NonFiniteHandler(on.on_nonfinite, built.optimizer, built.scaler, model, policy, ctx, batches,
                               faults, on.loss_scale.min_loss_scale)
    members: list[Component] = [*injector, handler, SkipRatePart(on.loss_scale), SpikePart(on.monitor)]
    routed = routed_layers(model)
    if routed:  # a mixture of experts: its figures in the rows, its drops in the summary
        members.append(MixturePart(routed[0].capacity_factor,
                                   plan.batches.tokens_per_step * routed[0].top_k * len(routed)))
    comm: Optional[CommPart] = None
    groups = mesh_groups(ctx)
    if on.numerics:
        monitor = numerics_monitor(on, model, built.optimizer, built.opt_choice, policy, ctx)
        members.append(NumericsPart(monitor, model, built.compile_blocks,
                                    policy.lowp.recipe if policy.lowp else None, audit_first=on.audit,
                                    max_steps=plan.train.max_steps))
        if on.comm:
            comm = CommPart(monitor.active, groups)
            members.append(comm)
    if on.audit:
        members.append(AuditPart(model, built.optimizer, policy, write_json,
                                 comm.step_figures if comm is not None else dict, groups,
                                 f"audit-phase{plan.phase}.json" if plan.phase else "audit.json"))
    members.append(StabilityPart(on.monitor, dtype_name(policy.compute_dtype)))
    return RunParts(Components(members), handler.step_guard, faults, (handler, *injector))
