"""Whether, and from where, a run continues: decided before anything is built or written.

:func:`decide` picks the checkpoint (``resume.source``, through
:func:`mptrain.checkpoint.resolve.resolve_resume`: the newest intact one, a
damaged one passed over with one line saying so), compares the config it was saved with against this
launch's, and gives the run's plan its resume decision (``mptrain.plan.plan.Resume``),
one of three things:

- start fresh (no checkpoint; ``resume=none`` is refused in a directory that
  holds checkpoints, which a new run would interleave with);
- continue from a checkpoint, with the history of accepted config changes;
- nothing to do: the run already reached ``train.max_steps`` (or this launch's
  ``train.stop_after``). Its records stay as they are; raising the limit
  continues it. One exception: a run whose final checkpoint was saved by a
  launch that ended before writing summary.json is *closed*: the trainer loads
  that checkpoint and writes the missing records without training.

What a changed key does is declared beside the key, in the schema
(``mptrain/config/schema.py``: ``guarded``, ``recorded`` or ``harmless``,
listed by :func:`on_resume`). A change of a guarded key alters the training
math: it is refused with the list of differences unless the user names it in
``resume.allow_changes``; then it is recorded (``history``: from step N, key:
[before, after]) in config.yaml, summary.json and every later checkpoint, so
that no record says the whole run used a setting that only its later steps
did. A recorded key's change is always allowed and written to the history too;
a harmless one's is neither refused nor recorded.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional

from omegaconf import OmegaConf

from mptrain.checkpoint.checkpointer import flatten
from mptrain.checkpoint.integrity import complete_checkpoints, read_meta
from mptrain.checkpoint.optim_layout import quantized_layout_refusal
from mptrain.checkpoint.resolve import resolve_resume
from mptrain.config.checks import RENAMED_RECIPES
from mptrain.config.schema import GUARDED, RECORDED, OptimConfig, on_resume
from mptrain.core.errors import ConfigError, UserError
from mptrain.core.frozen import plain
from mptrain.plan.plan import FRESH, Plan, Resume
from mptrain.precision.formats import dtype_name
from mptrain.run.step import describe_schedule, lr_at

# Facts of a launch compared as if they were keys, with their marker: another
# world size reshards the checkpoint and reduces in another order.
LAUNCH = {"world_size": RECORDED}

# Changes no allow list can make: the checkpoint's optimizer state has another
# structure. Per key: what of its value decides the structure, the value a
# checkpoint saved before the key existed had, and why the structure differs.
STRUCTURAL = {
    "optim.update_clip": (bool, 0.0, "a value above 0 gives every parameter its own param group"),
    "precision.update_rounding": (
        str, "nearest", "each rounding runs another optimizer: torch's AdamW, torchao's with stochastic "
                        "rounding (its learning rate a tensor), torch-optimi's with Kahan compensation buffers"),
    "optim.state_dtype": (
        str, None, "the moments are stored as other tensors: plain ones of a dtype, or torchao's quantized "
                   "codes and block scales"),
}


class ResumeRefused(UserError):
    """The checkpoint cannot be continued under this config."""

    kind = "resume refused"


def decide(plan: Plan, run_dir: Path, ctx, say: Callable[[str], None]) -> Resume:
    """Rank 0 decides (one listing of the directory, one verification of the
    checkpoint) and every rank gets the same decision, or the same error."""
    decided: tuple = (None, None)
    if ctx.is_main:
        try:
            decided = (_decide(plan, Path(run_dir), say, ctx.device.type), None)
        except UserError as e:
            decided = (None, e)
    result, error = ctx.broadcast_object(decided)
    if error is not None:
        raise error
    return result


def _decide(plan: Plan, run_dir: Path, say, device_type: str = "cpu") -> Resume:
    source = plan.resume_from
    path = resolve_resume(source, run_dir, log=say)
    if path is None:
        return _fresh(plan, run_dir, source)
    meta = read_meta(path)
    saved = meta.get("config", {})
    at = meta.get("phase") or {}  # the precision phase it was saved in, and every phase begun (run/phases.py)
    phase, began = int(at.get("current", 0)), tuple(at.get("began", ()))
    begun = max([phase, *(int(b["phase"]) for b in began)])
    saved, now = _threads_in_use(saved, plain(plan.resolved), meta)
    changes, refused = compare({**saved, "world_size": meta.get("world_size")}, {**now, "world_size": plan.world},
                               list(plan.allow_changes), begun, guard=threads_guard(plan, device_type))
    if phase >= len(plan.phases):
        raise ResumeRefused(f"resume from {path}: it was saved in precision phase {phase}, and this launch's "
                            f"precision.phases has {len(plan.phases) - 1}; resume with the phases it was saved with.")
    _check_optimizer(plan.in_phase(phase), path, meta)
    if PHASES in changes:
        say(f"{PHASES}: phases that have not begun changed ({_phase_diff(*changes[PHASES], begun)}); they take "
            "effect when they begin, and the change is recorded in the run's config history.")
    step = int(meta["step"])
    if refused:
        raise ResumeRefused(
            f"resume from {path}: this launch's config differs from the checkpoint's where it changes the "
            f"training math ({'; '.join(refused)}). Resume with the settings it was saved with, or accept "
            f"the change with resume.allow_changes=[{','.join(_suggest(refused))}] (recorded as a history "
            f"from step {step}).")
    history = list(meta.get("history", []))
    if changes:
        history.append({"from_step": step, "changes": changes})
    decided = Resume(path=path, step=step, history=tuple(history), phase=phase, began=began)
    max_steps, stop_after = plan.train.max_steps, plan.train.stop_after
    saved_max = saved.get("train", {}).get("max_steps", max_steps)
    if step >= max_steps:
        if _records_missing(run_dir, path, step):
            return replace(decided, closing=(
                f"{path} is the run's final checkpoint (step {step}), but the launch that saved it "
                "ended before writing summary.json: loading it to write the run's records, without training."))
        lowered = (f" (lowered from {saved_max}; steps already trained are not undone)"
                   if saved_max > max_steps else "")
        return replace(decided, finished=(
            f"{path} is at step {step} and train.max_steps={max_steps}{lowered}: nothing to "
            "train; the run's records are left as they are. Raise train.max_steps above "
            f"{step} to continue it."))
    if stop_after is not None and step >= stop_after:
        # stop_after counts from step 0: this slice of the run is done already
        return replace(decided, finished=(
            f"{path} is at step {step} and train.stop_after={stop_after}: nothing to train in "
            "this launch; the run's records are left as they are. Raise train.stop_after above "
            f"{step}, or drop it, to continue."))
    if THREADS in changes:
        before, after = changes[THREADS]
        say(f"{THREADS}: this launch computes with {after} thread{'s' * (after != 1)}, the steps before {step} "
            f"with {before}; recorded in the run's config history.")
    if "train.max_steps" in changes:
        say(schedule_change(plan, saved.get("optim", {}), changes["train.max_steps"][0], step))
    return decided


def _records_missing(run_dir: Path, path: Path, step: int) -> bool:
    """Whether ``path``, this run directory's own checkpoint of step ``step``,
    lacks the summary.json its launch should have written after it (none, or one
    of an earlier step): that launch was killed between the two. A summary of a
    later step (the newest checkpoint damaged, an older one picked) is kept."""
    if path.resolve().parent != (run_dir / "checkpoints").resolve():
        return False  # a checkpoint of another run: this directory's records are not its
    return _read_summary(run_dir).get("steps", -1) < step


def _check_optimizer(plan: Plan, path: Path, meta: dict) -> None:
    """ResumeRefused when this launch's optimizer cannot load the checkpoint's state:
    another implementation (a change of precision can switch it even where
    neither structural key changed: ``optim.state_dtype=bf16`` is torch's AdamW
    under ``bf16-pure`` and torchao's under ``bf16``), or quantized moments saved
    per rank on another world size."""
    saved = meta.get("optimizer")  # recorded since the optimizer could be other than torch's
    impl = plan.optimizer.impl
    if saved and impl != saved["impl"]:
        names = {"torch": "torch's AdamW", "torchao": "torchao's AdamW", "optimi": "torch-optimi's AdamW"}
        raise ResumeRefused(
            f"resume from {path}: its optimizer state was written by {names[saved['impl']]} and this "
            f"launch's precision={plan.precision.name} with optim.state_dtype="
            f"{getattr(plan.optim.state_dtype, 'value', None) or 'null'} runs {names[impl]}, whose state has "
            "another layout (even with resume.allow_changes); resume with the precision and "
            "optim.state_dtype it was saved with, or start a new run.")
    refused = quantized_layout_refusal(path, meta, plan)
    if refused:
        raise ResumeRefused(refused)


def schedule_change(plan: Plan, saved_optim: dict, old_max: int, step: int) -> str:
    """What a new ``train.max_steps`` does to the learning-rate schedule from
    ``step`` on: warmup and decay lengths follow the run's length."""
    schema = OmegaConf.structured(OptimConfig)
    old = OmegaConf.merge(schema, {k: v for k, v in saved_optim.items() if k in schema})  # keys it knew
    new, new_max = plan.optim, plan.train.max_steps
    before, after = lr_at(step, old, old_max), lr_at(step, new, new_max)
    how = "stretches" if new_max > old_max else "shortens"
    return (f"train.max_steps {old_max} -> {new_max} {how} the learning-rate schedule: it was "
            f"{describe_schedule(old, old_max)}; it is now {describe_schedule(new, new_max)}. "
            f"The learning rate at step {step + 1} is {after:.2e} (the saved run would have used {before:.2e}).")


def _fresh(plan: Plan, run_dir: Path, source: str) -> Resume:
    """Start from step 0, unless that would mix with or replace a run already here."""
    found = complete_checkpoints(run_dir / "checkpoints")
    if source == "none" and found:
        raise ResumeRefused(
            f"resume=none, but {run_dir} holds checkpoints of a run (newest {found[-1].name}) that a new run "
            "would be mixed with. Pick a new hydra.run.dir, or delete its checkpoints/ to start over here.")
    summary = _read_summary(run_dir)
    max_steps = plan.train.max_steps
    if source == "auto" and summary and "stopped_early" not in summary:
        steps = summary.get("steps", 0)
        if steps >= max_steps:
            return Resume(finished=(
                f"{run_dir} holds a finished run ({steps} steps, summary.json): nothing to train; its records "
                "are left as they are."))
        raise ResumeRefused(
            f"{run_dir} holds a finished run of {steps} steps that saved no checkpoint "
            "(checkpoint.at_end=false, checkpoint.every=0), so it cannot continue to "
            f"train.max_steps={max_steps}. Pick a new hydra.run.dir, or pass resume=none to train "
            "again from scratch here (replacing its records).")
    return FRESH


def _read_summary(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return {}


def finished_summary(run_dir: Path) -> dict:
    """The summary a finished run left (returned again by a no-op rerun)."""
    return _read_summary(run_dir)


PHASES = "precision.phases"
"""Compared phase by phase: a phase that has begun is guarded like any key, one still ahead may change."""


def _phase_diff(old: list, new: list, begun: int) -> str:
    """The entries of ``precision.phases`` that differ, from entry ``begun - 1`` on (a phase's index is its entry's + 1)."""
    out = []
    for i in range(max(len(old), len(new))):
        a, b = (old[i] if i < len(old) else None), (new[i] if i < len(new) else None)
        if a != b:
            shown = [{k: v for k, v in (x or {}).items() if v is not None} or None for x in (a, b)]
            out.append(f"phases[{i}]: {shown[0]} -> {shown[1]}")
    return "; ".join(out)


THREADS = "train.threads"
"""Compared as the count of threads in use (meta.json's ``threads``), not the setting (0: torch's choice)."""


def _threads_in_use(saved: dict, now: dict, meta: dict) -> tuple[dict, dict]:
    """The two configs with ``train.threads`` the count each launch computed with: the
    checkpoint's from its meta.json, this launch's from torch (``use_threads`` has set it).
    A checkpoint from before the count was recorded leaves it out of the comparison."""
    import torch

    if meta.get("threads") is None:
        return saved, now
    return ({**saved, "train": {**saved.get("train", {}), "threads": int(meta["threads"])}},
            {**now, "train": {**now.get("train", {}), "threads": torch.get_num_threads()}})


def threads_guard(plan: Plan, device_type: str) -> dict[str, str]:
    """``{train.threads: why}`` where another thread count changes this run's bits, else empty.

    The rule: a CPU run that computes in bf16 or fp16 (autocast's half precision,
    and fp8's bf16 around its float8 matmuls). A CPU's half-precision matmul splits
    its sums over the threads, and where the partial sums round to bf16/fp16 depends
    on the split (measured: an AMD EPYC with avx512_bf16, 2 threads against 1). An
    fp32 run measured the same losses at 1 and 2 threads, and a GPU run's math is on
    the device: for those another count is recorded, not refused."""
    import torch

    half = plan.precision.compute_dtype in (torch.bfloat16, torch.float16)
    if device_type != "cpu" or not half:
        return {}
    return {THREADS: f"the count in use; a CPU's {dtype_name(plan.precision.compute_dtype)} matmuls round by how "
                     "they split over threads"}


def compare(saved: dict, now: dict, allow: list[str], begun: int = 0,
            guard: Optional[dict[str, str]] = None) -> tuple[dict, list[str]]:
    """(accepted changes ``{key: [before, after]}``, refused changes as text),
    each key judged by its marker in the schema (:func:`on_resume`): guarded ones
    refused unless ``allow`` names them or their section, guarded and recorded
    ones accepted into the history, harmless ones left out. Keys absent on one
    side (a checkpoint from an older version) are not compared, except the
    STRUCTURAL ones: a checkpoint saved before such a key existed ran with the
    value it has there (round to nearest, moments in the parameters' dtype).
    ``guard``: keys guarded in this launch whatever their marker, each with why
    (``train.threads`` where the run's bits depend on it, :func:`threads_guard`)."""
    guard = guard or {}
    old, new = flatten(saved), flatten(now)
    if old.get("precision.lab.recipe") in RENAMED_RECIPES:  # a checkpoint from before the one vocabulary:
        old["precision.lab.recipe"] = RENAMED_RECIPES[old["precision.lab.recipe"]]  # the same casts, renamed
    for key, (_, before_it_existed, _why) in STRUCTURAL.items():
        if key in new and key not in old:  # a checkpoint older than the key had its default
            old[key] = before_it_existed
    for entry in allow:
        if not any(k == entry or k.startswith(entry + ".") for k in new):
            raise ConfigError(f"resume.allow_changes: '{entry}' is not a config key or section "
                              "(e.g. precision, optim.lr, train.seed).")
    accepted, refused, kinds = {}, [], on_resume()
    before, after = list(old.pop(PHASES, None) or []), list(new.pop(PHASES, None) or [])
    if before != after:  # a phase that has begun (entry begun - 1 and before) is the run's history: guarded
        if before[:begun] != after[:begun] and not any(a in (PHASES, "precision") for a in allow):
            refused.append(f"{PHASES} (phases 1 to {begun} have begun): {_phase_diff(before, after, begun)}")
        else:
            accepted[PHASES] = [before, after]
    for key in sorted(old.keys() & new.keys()):
        if old[key] == new[key]:
            continue
        if key in STRUCTURAL:
            decides, _, why = STRUCTURAL[key]
            if decides(old[key]) != decides(new[key]):
                raise ResumeRefused(f"{key}: {old[key]!r} -> {new[key]!r} changes the layout of the saved "
                                    f"optimizer state ({why}), so this checkpoint cannot be loaded under it "
                                    "(even with resume.allow_changes); resume with the value it was saved "
                                    "with, or start a new run.")
        kind = LAUNCH.get(key) or (GUARDED if key in guard else kinds.get(key, (GUARDED, ""))[0])  # unmarked: guarded
        allowed = any(key == a or key.startswith(a + ".") for a in allow)
        if kind == GUARDED and not allowed:
            refused.append(f"{key}: {old[key]!r} -> {new[key]!r}" + (f" ({guard[key]})" if key in guard else ""))
        elif kind in (GUARDED, RECORDED):
            accepted[key] = [old[key], new[key]]
    return accepted, refused


def _suggest(refused: list[str]) -> list[str]:
    """The shortest allow list that covers the refused keys: whole sections for
    a preset (precision, model, data), the key itself otherwise."""
    out: list[str] = []
    for item in refused:
        key = item.split(":", 1)[0]
        section = key.split(".", 1)[0]
        name = section if section in ("precision", "model", "data") else key
        if name not in out:
            out.append(name)
    return out

