"""The memory of a run whose precision changes (``precision.phases``), and the check
that it fits before a run allocates anything (``train.memory_check``).

Each phase has its own precision and optimizer, so its own weights, gradients,
moments and activations: :func:`phase_estimates` prices each phase the run has
ahead with ``mptrain/observe/memory.py``'s :func:`~mptrain.observe.memory.estimate`
(a run without phases has one) and each switch between two. The largest decides
whether the run fits: a bf16-pure-sr run with an fp32 tail needs the tail's fp32
weights and moments at the end, not the 8 bytes per parameter it starts with.

At a switch the run holds two phases at once: the next phase's model and
optimizer are built while the old ones still hold the state carried over into
them (``mptrain/run/phases.py``, ``mptrain/checkpoint/carry.py``). No step is in
flight then, so no activations; the switch frees the old gradients first.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from mptrain.config.mesh import MESH_MODES
from mptrain.observe.memory import (
    Estimate,
    device_free,
    estimate,
    fit_fixes,
    fit_problem,
    gib_text,
    host_available,
    shapes,
)
from mptrain.plan.plan import Plan


@dataclass
class Phased:
    """The estimate of each precision phase a run has ahead, and of each switch between two."""

    names: tuple[str, ...]
    """Per phase, in words: ``phase 1 'tail' (bf16, from 0.9 of the run (step 45 of 50))``."""
    estimates: tuple[Estimate, ...]
    switches: tuple[int, ...] = ()
    """Bytes per rank while entering each phase after the first (:func:`switch_bytes`)."""

    @property
    def largest(self) -> int:
        """The position of the phase with the largest total (the first of equals)."""
        return max(range(len(self.estimates)), key=lambda i: (self.estimates[i].total, -i))

    @property
    def estimate(self) -> Estimate:
        """The largest phase's estimate."""
        return self.estimates[self.largest]

    @property
    def peak(self) -> int:
        """The most the run holds per rank: its largest phase, or a switch where that is more."""
        return max((self.estimate.total, *self.switches))

    def decides(self, short: bool = False) -> str:
        """What the peak is, in words (empty for a run of one phase); ``short``: phases by index and label only."""
        if len(self.estimates) == 1:
            return ""
        name = (lambda i: self.names[i].split(" (")[0]) if short else (lambda i: self.names[i])
        if self.peak > self.estimate.total:
            k = max(range(len(self.switches)), key=lambda i: (self.switches[i], -i))
            return f"the switch into {name(k + 1)}, which holds two phases' weights and optimizer state"
        return f"its largest phase, {name(self.largest)}"

    def lines(self) -> list[str]:
        """Each phase's total and each switch's, for ``python -m mptrain.memory`` (none for one phase)."""
        if len(self.estimates) == 1:
            return []
        rows = []
        for i, (name, e) in enumerate(zip(self.names, self.estimates, strict=True)):
            if i:
                rows.append((f"switch into {name.split(' (')[0]}: both phases' weights and optimizer state",
                             self.switches[i - 1], ""))
            rows.append((name, e.total, "  <- the largest" if i == self.largest else ""))
        width = max(len(label) for label, _, _ in rows)
        return (["precision phases, per rank (the table above is the largest phase's):"]
                + [f"  {label:<{width}} {n / 2**30:10.3f} GiB{mark}" for label, n, mark in rows]
                + ["  (a switch holds no gradients, freed first, and no activations: no step is in flight)",
                   f"the run needs about {self.peak / 2**30:.3f} GiB per rank: {self.decides(short=True)}"])

    def describe(self) -> dict:
        """The phases' figures in GiB, for run_info."""
        return {"phases_gib": {n: round(e.total / 2**30, 4) for n, e in zip(self.names, self.estimates, strict=True)},
                "switches_gib": [round(s / 2**30, 4) for s in self.switches],
                "largest": self.names[self.largest], "peak_gib": round(self.peak / 2**30, 4),
                "peak_is": self.decides()}


def switch_bytes(old: Estimate, new: Estimate) -> int:
    """Bytes per rank while a run enters the phase of ``new`` from that of ``old``: both
    models' weights and both optimizers' state. Between steps nothing else is alive
    (the module docstring); the carry moves one tensor at a time, not counted."""
    return old.params + old.optimizer + new.params + new.optimizer


def phase_name(plan: Plan, k: int) -> str:
    """Phase ``k`` of ``plan`` in words: its index, label, precision and start."""
    if not plan.phases:
        return f"phase 0 '{plan.precision.name}' ({plan.precision.name}, from the start)"
    ph = plan.phases[k]
    start = f"when {ph.trigger.said}" if ph.trigger else ("from the start" if k == 0 else f"from {ph.start_said}")
    return f"phase {k} '{ph.label}' ({ph.precision.name}, {start})"


def phase_estimates(plan: Plan, vocab: int, micro_batch: Optional[int] = None) -> Phased:
    """:func:`~mptrain.observe.memory.estimate` of each phase of ``plan`` from the one it
    is in on (a resumed run never goes back to an earlier one), and of each switch."""
    ks = range(plan.phase, len(plan.phases)) if plan.phases else range(1)
    es = tuple(estimate(plan.in_phase(k) if plan.phases else plan, vocab, micro_batch) for k in ks)
    return Phased(tuple(phase_name(plan, k) for k in ks), es, tuple(switch_bytes(a, b) for a, b in zip(es, es[1:])))


def fit_check(plan: Plan, vocab: int, device) -> Optional[str]:
    """Why one rank of the run ``plan`` cannot start on ``device``, or None.

    The estimate per rank against the memory that will hold it: a CUDA
    device's free memory; for any other device the host's available memory,
    shared by the ranks of this node (the launch's ``per_node``). A CUDA run keeps no
    copy of the model on the host, but initialisation draws each weight whole
    in fp32 on the CPU (``GPT.reset_parameters``), which is also the most a
    checkpoint write stages there at once: the largest weight must fit in the
    host's share of each local rank.

    With precision phases the figure is the run's peak over them
    (:meth:`Phased.peak`), and the refusal names the phase (or the switch) it is."""
    mesh, world, mode, m = plan.parallel.mesh, plan.world, plan.parallel.name, plan.model
    phased = phase_estimates(plan, vocab)
    need, decides = phased.peak, phased.decides()
    on = f"mesh {mesh.text()}" if mode in MESH_MODES and world > 1 else f"{world} rank{'s' if world > 1 else ''}"
    what = (f"model={m.name} (parallel={mode}, {on}, micro-batch {plan.batches.micro_batch} x {m.block_size}"
            f"{'; at ' + decides if decides else ''}; estimate: python -m mptrain.memory)")
    host = host_available()
    local_world = max(1, plan.launch.per_node)
    share = None if host is None else host // local_world  # the ranks of one node share its memory
    among = f" per rank ({gib_text(host)} shared by {local_world} ranks)" if host is not None and local_world > 1 else ""
    if device.type != "cuda":
        return fit_problem(need, share, what, "this host has", fit_fixes(plan), among)
    problem = fit_problem(need, device_free(device), what, f"{device} has", fit_fixes(plan))
    if problem:
        return problem
    largest = 4 * max((math.prod(s) for s in shapes(m, vocab)[0]), default=0)
    return fit_problem(largest, share, f"initialising model={m.name} (its largest weight, whole, in fp32 "
                       "on the CPU)", "this host has", ["fewer ranks per node", "a host with more memory"], among)
