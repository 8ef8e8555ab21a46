"""Which precision phase the run is in, and when it enters the next (``precision.phases``).

:class:`PhaseSchedule` is resumable loop state: the phase the model and optimizer
were built for, and a record of every phase begun (the step, and for a phase that
waited on a signal, what it read). The trainer asks :meth:`PhaseSchedule.due` before
each step and switches (``Trainer.enter_phase``: the next phase's model and
optimizer built, the state carried over by ``mptrain/checkpoint/carry.py``);
:meth:`PhaseSchedule.decide` looks at each logged row for a signal a phase waits
on. A decision is taken by rank 0 and broadcast, so every rank switches at the same
step; it is kept in the checkpoint, so a resumed run never decides it again.

A phase enters before the step it begins at: a checkpoint of step N (saved after
step N-1) holds the phase that ran step N-1, and a resumed run switches before step
N exactly as the straight run did. A signal read after step N-1 makes its phase
begin at step N.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

import torch

from mptrain.checkpoint.carry import Carried, carry
from mptrain.plan.plan import Plan
from mptrain.precision.phases import Phase
from mptrain.precision.policy import PrecisionPolicy
from mptrain.run.build import RunData, RunModel, build_model, build_policy


@dataclass(frozen=True)
class Began:
    """One phase begun: before which step, and what started it."""

    phase: int
    step: int
    label: str
    trigger: Optional[str] = None
    """The ``when`` it waited on; None for a phase that began at its start step."""
    value: Optional[float] = None
    """The signal's value that crossed the threshold."""
    read_at: Optional[int] = None
    """The step whose row held that value."""

    def words(self) -> str:
        """``phase 1 'bf16 tail' begins before step 41``."""
        return f"phase {self.phase} '{self.label}' begins before step {self.step + 1}"

    def decision(self) -> str:
        """What a signal decided: its value, the rule, and the phase it begins."""
        return (f"{self.trigger.split()[0]} = {self.value:.4g} at step {self.read_at} ({self.trigger}): "
                f"{self.words()}")


class PhaseSchedule:
    """The run's position among its phases (the module docstring); resumable under ``phases``."""

    state_key = "phases"

    def __init__(self, phases: tuple[Phase, ...], current: int = 0, began: tuple = ()):
        self.phases = phases
        self.current = current
        """The phase the model and optimizer are built for."""
        self.began: list[Began] = [b if isinstance(b, Began) else Began(**b) for b in began]  # meta.json's: dicts
        """Every phase begun, in order; a decided one may be ahead of ``current`` until its step."""

    @property
    def on(self) -> bool:
        """The run has phases to enter."""
        return len(self.phases) > 1

    def _next(self) -> Optional[Phase]:
        k = self.current + 1
        return self.phases[k] if k < len(self.phases) else None

    def due(self, step: int) -> Optional[Began]:
        """The phase to enter before 0-based ``step``, or None: the next one, at its start
        step, or at the step its signal decided."""
        nxt = self._next()
        if nxt is None:
            return None
        decided = [b for b in self.began if b.phase == nxt.index]
        if decided:
            return decided[0] if decided[0].step <= step else None
        if nxt.trigger is None and step >= nxt.start:
            b = Began(nxt.index, step, nxt.label)
            self.began.append(b)
            return b
        return None

    def entered(self, b: Began) -> None:
        """The model and optimizer are built for ``b``'s phase now."""
        self.current = b.phase

    def waiting(self, done: int) -> Optional[Phase]:
        """The phase whose signal is looked at after step ``done``, or None."""
        nxt = self._next()
        if nxt is None or nxt.trigger is None or done < nxt.start:
            return None
        return None if any(b.phase == nxt.index for b in self.began) else nxt

    def decide(self, done: int, row: dict, ctx) -> Optional[Began]:
        """After step ``done``'s row: whether the waiting phase's signal crossed, decided by
        rank 0 and broadcast (every rank calls this on the same steps: those with a row)."""
        nxt = self.waiting(done)
        if nxt is None or not row:
            return None
        value = nxt.trigger.value(row) if ctx.is_main else None
        if ctx.world > 1:
            value = ctx.broadcast_object(value)
        if value is None:
            return None
        b = Began(nxt.index, done, nxt.label, nxt.trigger.said, value, done)
        self.began.append(b)
        return b

    def record(self) -> dict:
        """Where the run is, for meta.json: the resume decision reads it before anything is built."""
        return {"current": self.current, "began": [asdict(b) for b in self.began]}

    def state_dict(self) -> dict:
        return self.record()

    def load_state_dict(self, sd: dict) -> None:
        self.current = int(sd.get("current", 0))
        self.began = [Began(**b) for b in sd.get("began", [])]  # train_state.pt's: the checkpoint's record


def switch(plan: Plan, ctx, built: RunModel, data: RunData, began: Began
           ) -> tuple[Plan, PrecisionPolicy, RunModel, Carried]:
    """Build phase ``began.phase``'s policy, model, optimizer and loss scaler, and carry
    ``built``'s state into them. The build draws nothing from the run's random streams
    (``fork_rng``): its initial weights come from a generator of their own and are
    overwritten, and the dropout stream it seeds must stay where the run has it.
    Weights narrowed into stochastically rounded storage are rounded from a generator
    seeded with the run's seed and the step, the same on every rank."""
    plan = plan.in_phase(began.phase)
    # The last step's gradients are no part of the state carried over: freed before the
    # new model exists, the switch holds two phases' weights and optimizer state, no more
    # (what observe/memory_phases.py's switch_bytes counts).
    built.model.zero_grad(set_to_none=True)
    policy, _ = build_policy(plan, ctx)  # the machine could run it: every phase was checked at start-up
    stochastic = plan.optimizer.rounding == "stochastic"
    # The carry's state views make the new optimizer's state with one step of zero gradients
    # at a zero learning rate, which a stochastically rounding AdamW draws for: inside too.
    with torch.random.fork_rng(devices=[ctx.device] if ctx.device.type == "cuda" else []):
        new = build_model(plan, ctx, policy, data.vocab, data.tokens.vocab_size)
        carried = carry(built.model, built.optimizer, new.model, new.optimizer,
                        stochastic_seed=plan.train.seed * 1_000_003 + began.step if stochastic else None)
    policy.refresh_fp8_scales(new.model)  # float8 all-gather scales must match the carried weights
    new.scaler.carry_from(built.scaler)
    return plan, policy, new, carried


def phase_warnings(plan: Plan) -> list[str]:
    """What a launch of ``plan`` should know about its phases before it trains. A launch
    resumed on another world size cannot take back the weight codes each rank kept
    (``parts-rank<R>.pt``: they are its shard's), so its first monitored step measures no
    ``weight_flips``: a phase still waiting on that signal can begin one monitored step
    later than in a run that was never interrupted (a decision already taken is kept)."""
    waiting = [ph for ph in plan.phases[plan.phase + 1:]
               if ph.trigger is not None and ph.trigger.metric == "numerics/quant/weight_flips"]
    decided = {int(b["phase"]) for b in plan.resume.began}  # meta.json's records
    resharded = any(h["from_step"] == plan.resume.step and "world_size" in h["changes"]
                    for h in plan.resume.history)
    if plan.resume.path is None or not resharded or not waiting or waiting[0].index in decided:
        return []
    return [f"{waiting[0].key} waits on weight_flips, which this launch, resumed on another world size, first "
            "measures on its second monitored step (the codes each rank kept are its old shard's): the phase "
            f"may begin up to monitor.every={plan.parts.monitor.every} steps later than in an uninterrupted run."]
