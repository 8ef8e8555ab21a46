"""Precision that changes during a run: ``precision.phases`` resolved, checked and described.

The run's own ``precision`` section is phase 0. Each entry of ``precision.phases``
(:class:`~mptrain.config.schema.PhaseConfig`) is one more phase, entered in order:
from its start step on, or once its signal crossed a threshold. A phase is the
whole precision of the steps it covers, derived from the phase before it:

- ``precision``: another preset's section replaces the one before (its recipe too);
- ``forward``/``input_gradient``/``weight_gradient`` and the six operand keys change
  the recipe per matmul and operand. A recipe changed that way runs on the lab's
  emulated linears (``mptrain/precision/labtrain.py``), which execute any operand
  spec; an operand left ``none`` is multiplied as autocast hands it, in fp32;
- ``master_weights``, ``update_rounding``, ``state_dtype``, ``loss_scale``: the
  storage of weights and moments and the loss scaler.

:func:`entry` reads one entry and :func:`phase` makes it a :class:`Phase` (with its own
:class:`~mptrain.precision.recipe.PrecisionPlan` and optimizer :class:`Choice`, which the
plan's builder derives between the two), refusing in one sentence what a phase cannot
change safely; the run switches
between them by rebuilding its model and optimizer and carrying their state over
(``mptrain/checkpoint/carry.py``, ``mptrain/run/phases.py``).
"""
from __future__ import annotations

import copy
import math
import operator
import re
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch
from omegaconf import OmegaConf

from mptrain.config.presets import preset
from mptrain.config.schema import PrecisionConfig
from mptrain.core.errors import ConfigError
from mptrain.precision.formats import dtype_name
from mptrain.precision.optimizers import QUANTIZED, Choice
from mptrain.precision.recipe import GEMMS, LAB, NAMED, NONE, ROLES, PrecisionPlan, Recipe, build_recipe
from mptrain.precision.selection import LinearRules

GEMM_KEYS = {"forward": "forward", "input_gradient": "input gradient", "weight_gradient": "weight gradient"}
"""A phase's per-matmul keys -> the matmul (:data:`~mptrain.precision.recipe.GEMMS`)."""

SIGNALS = {
    "forward.noise_ratio": "numerics/quant/forward/noise_ratio",
    "input_gradient.noise_ratio": "numerics/quant/input_gradient/noise_ratio",
    "weight_gradient.noise_ratio": "numerics/quant/weight_gradient/noise_ratio",
    "weight_flips": "numerics/quant/weight_flips",
    "norm_bias": "numerics/quant/norm_bias",
    "saturation": "fp8/worst/saturate",
    "underflow": "fp8/worst/flush",
    "loss_spike": "events/loss_spike",
}
"""The short names a phase's ``when`` may use, and the metric each reads (any other
metric name is taken as it is)."""
CAST_SIGNALS = ("numerics/quant/", "fp8/")
"""Metric prefixes measured on the low-precision linears' casts (``monitor.fp8_casts``)."""
MONITOR_SIGNALS = ("numerics/", "stability/", "fp8/", "fp8.")
"""Metric prefixes only the numerics monitor writes (``monitor.enabled``)."""
_OPS = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge}
_WHEN = re.compile(r"^\s*([A-Za-z0-9_./-]+)\s*(<=|>=|<|>)\s*([-+0-9.eE]+|inf)\s*$")


@dataclass(frozen=True)
class Trigger:
    """A phase's ``when``: a metric, a comparison and a threshold."""

    said: str
    """As the config gave it."""
    metric: str
    op: str
    threshold: float

    def value(self, row: dict) -> Optional[float]:
        """The metric's value in a logged row when it crosses the threshold there, else None."""
        v = row.get(self.metric)
        if v is None or not isinstance(v, (int, float)) or math.isnan(v):
            return None
        return float(v) if _OPS[self.op](float(v), self.threshold) else None


@dataclass(frozen=True)
class Phase:
    """One phase of the run's precision (0: the run's own section)."""

    index: int
    label: str
    """``name``, or ``phases[<i>]`` (the list entry), or the preset's name for phase 0."""
    key: str
    """The config key it came from, named in every message about it."""
    start: int
    """The step it begins before (with a trigger: the earliest step its signal is looked at)."""
    start_said: str
    """How the start was given, in words: ``decay_start (step 120)``."""
    trigger: Optional[Trigger]
    precision: PrecisionPlan
    optimizer: Choice
    changes: tuple[str, ...]
    """What differs from the phase before, in words (empty: nothing)."""
    carry: tuple[str, ...]
    """What happens to the weights, moments, scales and loss scaler at its boundary, in words."""

    def describe(self) -> dict:
        """The phase in run_info: its start, trigger, precision and optimizer."""
        r = self.precision.recipe
        return {"index": self.index, "label": self.label, "start": self.start, "start_said": self.start_said,
                "when": self.trigger.said if self.trigger else None, "precision": self.precision.name,
                "compute": dtype_name(self.precision.compute_dtype), "params": dtype_name(self.precision.param_dtype),
                "optimizer": self.optimizer.describe(), "loss_scale": bool(self.precision.loss_scale.enabled),
                "recipe": None if r is None else {"name": r.name, "backend": r.backend, **r.specs},
                "changes": list(self.changes), "carry": list(self.carry)}


def parse_when(text: str, key: str) -> Trigger:
    """``when`` as a :class:`Trigger`, or one ConfigError with the grammar."""
    t = text.strip()
    if t in ("loss_spike", SIGNALS["loss_spike"]):
        return Trigger(t, SIGNALS["loss_spike"], ">", 0.0)
    m = _WHEN.match(t)
    if not m:
        raise ConfigError(f"{key}.when={text!r} is not '<signal> <op> <value>' (e.g. 'weight_gradient.noise_ratio < "
                          f"1.732') or 'loss_spike'; the short signal names: {', '.join(SIGNALS)}, or any metric name.")
    name, op, value = m.groups()
    try:
        threshold = float(value)
    except ValueError:
        raise ConfigError(f"{key}.when={text!r}: {value!r} is not a number.") from None
    metric = SIGNALS.get(name, name)
    if "/" not in metric:
        raise ConfigError(f"{key}.when={text!r}: {name!r} is neither a short signal name ({', '.join(SIGNALS)}) "
                          "nor a metric name (one with a '/', as in metrics.jsonl).")
    return Trigger(t, metric, op, threshold)


def _start(said: Optional[str], has_trigger: bool, points: dict[str, int], max_steps: int,
           key: str, optim: Any) -> tuple[int, str]:
    """The start step and how it was given, in words."""
    if said is None or str(said).strip() == "":
        if has_trigger:
            return 0, "as soon as its signal says"
        raise ConfigError(f"{key}.start is not given: a step (1200), a fraction of the run (0.8) or a point "
                          f"of the schedule ({', '.join(points)}), or a signal in {key}.when.")
    s = str(said).strip()
    if s in points:
        step = points[s]
        if s == "decay_start" and step >= max_steps:
            raise ConfigError(f"{key}.start=decay_start names no step: the learning rate does not decay within "
                              f"train.max_steps={max_steps} (optim.schedule="
                              f"{getattr(optim.schedule, 'value', optim.schedule)}, optim.decay_fraction="
                              f"{optim.decay_fraction:g}); give a step or a fraction of the run.")
        return step, f"{s} (step {step})"
    if re.fullmatch(r"\d+", s):
        return int(s), f"step {int(s)}"
    try:
        f = float(s)
    except ValueError:
        f = math.nan
    if 0.0 < f < 1.0:
        step = round(f * max_steps)
        return step, f"{s} of the run (step {step} of {max_steps})"
    raise ConfigError(f"{key}.start={said!r} is not a step (1200), a fraction of the run between 0 and 1 "
                      f"(0.8) or a point of the schedule ({', '.join(points)}).")


def _gemm_specs(value: str, gemm: str, key: str) -> dict[str, str]:
    """The two operand specs a per-matmul key gives: ``none``, a named recipe's, or one spec for both."""
    a, b = GEMMS[gemm]
    v = str(value).strip()
    if v.lower() == NONE:
        return {a: NONE, b: NONE}
    if v in NAMED:
        return {a: NAMED[v][a], b: NAMED[v][b]}
    if "/" not in v:
        raise ConfigError(f"{key}={value!r} is not a named recipe ({', '.join(NAMED)}), an operand spec "
                          "(e4m3/tensor/fp32/nearest) or none.")
    return {a: v, b: v}


def _recipe(ph: Any, base: Optional[Recipe], base_rules: Optional[LinearRules], key: str
            ) -> tuple[Optional[Recipe], Optional[LinearRules]]:
    """The phase's recipe and rules: ``base``'s, with the per-matmul and per-operand keys on top."""
    overrides: dict[str, str] = {}
    for k, gemm in GEMM_KEYS.items():
        if getattr(ph, k) is not None:
            overrides.update(_gemm_specs(getattr(ph, k), gemm, f"{key}.{k}"))
    overrides.update({r: str(getattr(ph, r)) for r in ROLES if getattr(ph, r) is not None})
    if not overrides:
        return base, base_rules
    specs = {**(base.specs if base else dict.fromkeys(ROLES, NONE)), **overrides}
    if base is not None and specs == base.specs:
        return base, base_rules  # the same casts: the same backend too
    if all(str(v).lower() == NONE for v in specs.values()):
        return None, None  # nothing left quantized: plain linears under autocast
    r = build_recipe("custom", specs, key=key, error=base.error if base else "mse")
    rules = base_rules or LinearRules(key, "the phase's recipe", ("lm_head",), 0, None, 0, 1)
    return r, rules


def _section(ph: Any, prev: Any, key: str) -> Any:
    """The phase's ``precision`` section: its preset's, or the one before, with its storage keys on top."""
    if ph.precision is not None:
        section = preset(PrecisionConfig, "precision", str(ph.precision), f"{key}.precision")
        if section.phases:
            raise ConfigError(f"{key}.precision={ph.precision} has phases of its own; a phase runs one precision: "
                              "name a preset without precision.phases.")
    else:
        section = copy.deepcopy(prev)
    if ph.master_weights is not None:
        section.master_weights = bool(ph.master_weights)
        if section.master_weights and ph.update_rounding is None:
            section.update_rounding = "nearest"  # every update lands exactly in fp32 masters
    if ph.update_rounding is not None:
        section.update_rounding = ph.update_rounding
    if ph.loss_scale is not None:
        section.loss_scale.enabled = bool(ph.loss_scale)
    return section


def _refusal(prev: Phase, new_choice: Choice, new: PrecisionPlan, key: str, parallel: str) -> Optional[str]:
    """What a switch from ``prev`` to the new phase could not carry over safely, or None."""
    a, b = prev.optimizer, new_choice
    if parallel == "fsdp1":
        return (f"{key}: precision.phases cannot run under parallel=fsdp1, whose flattened shards the switch "
                "would have to rebuild; use parallel=fsdp (FSDP2), ddp or none.")
    if (a.rounding == "kahan") != (b.rounding == "kahan"):
        return (f"{key} switches update_rounding {a.rounding} -> {b.rounding}: torch-optimi's Kahan AdamW stores its "
                "moments already bias-corrected and a compensation buffer the other optimizers do not have, so its "
                "state cannot be carried across; keep kahan throughout, or use stochastic rounding.")
    if (a.state in QUANTIZED or b.state in QUANTIZED) and (a.state != b.state or a.param_dtype != b.param_dtype):
        return (f"{key} changes the optimizer from moments in {a.state} over {a.param_dtype} weights to {b.state} "
                f"over {b.param_dtype}: torchao's quantized moments cannot be carried into another storage; keep "
                "optim.state_dtype and the weights' storage the same across phases, or use plain fp32/bf16 moments.")
    return None


def _changes(prev: Phase, new: PrecisionPlan, choice: Choice) -> tuple[str, ...]:
    """What differs from ``prev``, in words."""
    a, out = prev.precision, []
    if new.name != a.name:
        out.append(f"precision {a.name} -> {new.name}")
    if new.compute_dtype != a.compute_dtype:
        out.append(f"compute {dtype_name(a.compute_dtype)} -> {dtype_name(new.compute_dtype)}")
    if choice != prev.optimizer:
        out.append(f"optimizer: {choice.describe()}")
    if bool(new.loss_scale.enabled) != bool(a.loss_scale.enabled):
        out.append(f"loss scaling {'on' if new.loss_scale.enabled else 'off'}")
    ra, rb = a.recipe.specs if a.recipe else None, new.recipe.specs if new.recipe else None
    if ra != rb:
        if rb is None:
            out.append("no low-precision linears (plain linears under autocast)")
        else:
            for gemm, (x, y) in GEMMS.items():
                before = (ra or {}).get(x, NONE), (ra or {}).get(y, NONE)
                if (rb[x], rb[y]) != before:
                    out.append(f"{gemm}: {rb[x]} x {rb[y]}" if rb[x] != NONE or rb[y] != NONE
                               else f"{gemm}: unquantized")
            if new.recipe.backend == LAB and (a.recipe is None or a.recipe.backend != LAB):
                out.append("the recipe runs on the lab's emulated linears")
    return tuple(out)


def _carry(prev: Phase, new: PrecisionPlan, choice: Choice) -> tuple[str, ...]:
    """What the boundary does to the state, in words (``mptrain/checkpoint/carry.py`` does it)."""
    a, b, out = prev.optimizer, choice, []
    rounding = "stochastically, as its updates round" if b.rounding == "stochastic" else "to nearest"
    for what, x, y in (("weights", a.param_dtype, b.param_dtype), ("Adam's moments", a.state, b.state)):
        if x == y:
            out.append(f"{what} carried as they are ({x})")
        elif y == "fp32":
            out.append(f"{what} widened {x} -> fp32 (exactly)")
        else:
            out.append(f"{what} narrowed {x} -> {y}, rounded {rounding if what == 'weights' else 'to nearest'}")
    ra, rb = prev.precision.recipe, new.recipe
    if rb is not None and rb.delayed is not None:
        same = ra is not None and ra.delayed == rb.delayed
        out.append("amax histories and delayed scales " + ("carried" if same else "start afresh"))
    if prev.precision.loss_scale.enabled and new.loss_scale.enabled:
        out.append("loss scale and its growth count carried")
    elif new.loss_scale.enabled:
        out.append(f"loss scaling starts at {new.loss_scale.init_scale:g}")
    return tuple(out)


def phase_zero(plan: PrecisionPlan, choice: Choice) -> Phase:
    """The run's own precision as phase 0."""
    return Phase(0, plan.name, "precision", 0, "from the start", None, plan, choice, (), ())


@dataclass(frozen=True)
class Entry:
    """One ``precision.phases`` entry read, before its precision is derived: the
    plan's builder derives the precision plan and optimizer of ``section`` and
    ``optim`` (each derived fact in one place) and hands them to :func:`phase`."""

    index: int
    key: str
    config: Any
    """The entry as configured (a :class:`~mptrain.config.schema.PhaseConfig`)."""
    start: int
    start_said: str
    trigger: Optional[Trigger]
    section: Any
    """Its whole ``precision`` section (a preset's, or the phase before's), storage keys applied."""
    optim: Any
    """The ``optim`` section with its ``state_dtype`` applied."""


def entry(ph: Any, i: int, prev: Phase, prev_section: Any, optim: Any, max_steps: int,
          points: dict[str, int]) -> Entry:
    """Entry ``i`` of ``precision.phases`` (``ph``) after phase ``prev`` (whose section is
    ``prev_section``; phase 0's: the run's ``precision`` section), or the first ConfigError."""
    key = f"precision.phases[{i}]"
    trigger = parse_when(str(ph.when), key) if ph.when is not None else None
    start, said = _start(ph.start, trigger is not None, points, max_steps, key, optim)
    if not trigger and prev.index and start <= prev.start and not prev.trigger:
        raise ConfigError(f"{key}.start ({said}) is not after {prev.key}'s ({prev.start_said}): "
                          "phases run in the order listed, each from a later step.")
    if prev.index == 0:
        prev_section = OmegaConf.merge(OmegaConf.structured(PrecisionConfig), prev_section)
        prev_section.phases = []  # phase 0's section without the list: a phase runs one precision
    o = copy.deepcopy(optim)
    if ph.state_dtype is not None:
        o.state_dtype = ph.state_dtype
    return Entry(i + 1, key, ph, start, said, trigger, _section(ph, prev_section, key), o)


def phase(e: Entry, prev: Phase, plan: PrecisionPlan, choice: Choice, parallel: str) -> Phase:
    """The phase of entry ``e`` given its section's precision plan and optimizer (the
    preset's recipe, or ``prev``'s, with the per-matmul keys on top), or the
    ConfigError of what the switch from ``prev`` could not carry over."""
    ph = e.config
    named = ph.precision is not None
    recipe, rules = _recipe(ph, plan.recipe if named else prev.precision.recipe,
                            plan.rules if named else prev.precision.rules, e.key)
    plan = replace(plan, recipe=recipe, rules=rules)
    problem = _refusal(prev, choice, plan, e.key, parallel)
    if problem:
        raise ConfigError(problem)
    label = str(ph.name) if ph.name else f"phases[{e.index - 1}]"
    return Phase(e.index, label, e.key, e.start, e.start_said, e.trigger, plan, choice, _changes(prev, plan, choice),
                 _carry(prev, plan, choice))
