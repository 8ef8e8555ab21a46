"""Settings over seeds: a sweep over ``train.seed`` grouped by everything but the seed,
each setting's figures as a spread over its seeds, each setting against its reference
as a paired difference (seed k with seed k) with its interval and verdict
(:mod:`mptrain.core.stats`), and the speed at matched quality: the tokens and training
time until the validation loss first reaches a target.

A *setting* is the runs that agree on every config key but ``train.seed`` (and the
keys the schema marks harmless: they change what is reported, not what is trained).
The statistics live in :mod:`mptrain.core.stats`; this module only gathers the
numbers and writes them out.
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from typing import Optional

import yaml

from mptrain.compare.runs import PAIRED_ACROSS, Run, _flat, _harmless, _value, labels_of
from mptrain.core import stats

SEED_KEY = "train.seed"
WHOLE, EVAL_SET = "final/whole_val_loss", "final/val_loss"
# The final figures shown as a spread over seeds next to the loss: (column, summary key, format).
FINAL_FIGURES = (("final train loss", "final/train_loss", ".4f"), ("tokens/s", "perf/tokens_per_s", ",.0f"),
                 ("wall time (s)", "wall_time_s", ".1f"), ("peak memory (GiB)", "mem/peak_gib", ".2f"))


class SpecError(ValueError):
    """A ``--reference`` that names no setting, or more than one (its message is the CLI's error line)."""


@dataclass
class Setting:
    """The runs of one setting, one per seed in seed order; ``extra``: runs of a seed the
    setting already had (a rerun), left out of every figure and named."""

    label: str
    runs: list[Run]
    extra: list[Run] = field(default_factory=list)

    @property
    def seeds(self) -> list:
        """The setting's seeds, in the order of :attr:`runs`."""
        return [seed_of(r) for r in self.runs]

    def by_seed(self) -> dict:
        """Seed -> run."""
        return {seed_of(r): r for r in self.runs}


def seed_of(run: Run):
    """The run's ``train.seed`` (its default where an older config lacks it)."""
    return _value(run, SEED_KEY)


def _seed_order(seed) -> tuple:
    return (0, seed, "") if isinstance(seed, (int, float)) else (1, 0, str(seed))


def group_settings(runs: list[Run]) -> list[Setting]:
    """The runs grouped into settings (module doc), in the order their first runs come,
    each labelled by the keys that differ between settings (never the seed)."""
    harmless = _harmless()
    keys = sorted({k for r in runs for k in _flat(r)} - {SEED_KEY} - harmless)
    groups: dict[str, list[Run]] = {}
    for r in runs:
        groups.setdefault(json.dumps([_value(r, k) for k in keys], sort_keys=True, default=str), []).append(r)
    firsts = [members[0] for members in groups.values()]
    labels = labels_of(firsts, skip=(SEED_KEY,)) if len(firsts) > 1 else [
        str(_flat(firsts[0]).get("precision.name", "all runs"))]
    out = []
    for label, members in zip(labels, groups.values(), strict=True):
        kept: dict = {}
        extra = []
        for r in members:
            (extra.append(r) if seed_of(r) in kept else kept.setdefault(seed_of(r), r))
        out.append(Setting(label, sorted(kept.values(), key=lambda r: _seed_order(seed_of(r))), extra))
    return out


# ------------------------------------------------------------ which setting each is compared with
def _matches(s: Setting, spec: str) -> bool:
    """Whether ``spec`` (a label, or ``key=value[,key=value]``) names setting ``s``."""
    if spec == s.label:
        return True
    pairs = [p.split("=", 1) for p in spec.split(",")]
    if not all(len(p) == 2 for p in pairs):
        return False
    run = s.runs[0]
    for key, want in pairs:
        have = _value(run, key.strip())
        try:
            parsed = yaml.safe_load(want)
        except yaml.YAMLError:
            parsed = want
        if not (str(have) == want.strip() or have == parsed):
            return False
    return True


def reference_of(settings: list[Setting], spec: Optional[str]) -> tuple[dict[int, Optional[Setting]], str]:
    """Each setting's reference (by ``id``) and a sentence saying how it was chosen.

    ``spec`` (``--reference``): the one setting it names, for every setting. Without it,
    as the per-run table: within the settings that agree on everything but the precision
    (and the optimizer state's storage), the fp32 one, else the bf16 one. A sweep where
    that pairs nothing (an fp32 learning-rate sweep) is read against its first setting."""
    if spec:
        hits = [s for s in settings if _matches(s, spec)]
        if len(hits) != 1:
            names = "; ".join(s.label for s in settings)
            raise SpecError(f"--reference {spec} names {'no' if not hits else len(hits)} settings "
                            f"(the settings: {names})")
        return {id(s): hits[0] for s in settings}, f"the reference is {hits[0].label} (--reference)"
    harmless = _harmless()
    keys = sorted({k for s in settings for k in _flat(s.runs[0])} - harmless)
    keys = [k for k in keys if not k.startswith(PAIRED_ACROSS)]
    groups: dict[str, list[Setting]] = {}
    for s in settings:
        groups.setdefault(json.dumps([_value(s.runs[0], k) for k in keys], default=str), []).append(s)
    refs: dict[int, Optional[Setting]] = {}
    for members in groups.values():
        ref = next((m for name in ("fp32", "bf16") for m in members
                    if (m.runs[0].config.get("precision") or {}).get("name") == name), None)
        refs.update({id(m): ref for m in members})
    if len(settings) > 1 and all(refs[id(s)] in (None, s) for s in settings):
        return ({id(s): settings[0] for s in settings},
                f"the reference is the first setting, {settings[0].label}: no fp32 (or bf16) setting differs "
                "from another only in precision (choose another with --reference)")
    return refs, "each setting's reference is the fp32 (else bf16) setting that differs from it only in precision"


# ------------------------------------------------------------ final figures
def final_val(run: Run, whole: bool) -> Optional[float]:
    """The run's final validation loss: over the whole val split (``whole``) or on the
    eval set (summary.json, else the last ``val/loss``); None when it has none."""
    v = run.summary.get(WHOLE) if whole else run.summary.get(EVAL_SET, run.last("val/loss"))
    return float(v) if isinstance(v, (int, float)) else None


def val_set(runs: list[Run]) -> tuple[bool, str]:
    """Which set the final losses of ``runs`` are compared on: the whole val split where
    every run has it, else the eval set; with the words saying so."""
    if runs and all(isinstance(r.summary.get(WHOLE), (int, float)) for r in runs):
        tokens = {r.summary.get("eval/whole_tokens") for r in runs}
        return True, "whole val split" + (f" ({tokens.pop():,} tokens)" if len(tokens) == 1 and None not in tokens
                                          and isinstance(next(iter(tokens)), int) else "")
    tokens = {r.summary.get("eval/tokens") for r in runs}
    n = tokens.pop() if len(tokens) == 1 else None
    return False, "eval set" + (f" ({n:,} tokens)" if isinstance(n, int) else "")


def figure_spread(runs: list[Run], key: str) -> Optional[stats.Spread]:
    """The spread over ``runs`` of a summary figure (None unless every run has it)."""
    values = [r.summary.get(key) for r in runs]
    if not values or not all(isinstance(v, (int, float)) and math.isfinite(v) for v in values):
        return None
    return stats.spread(values)


@dataclass
class Versus:
    """A setting against its reference over the seeds both ran."""

    seeds: list
    left_out: list[str]
    """Seeds only one side has, in words."""
    set_name: str
    paired: Optional[stats.Paired]
    """None when the two share no seed with a final loss."""


def versus(s: Setting, ref: Setting, effect: Optional[float]) -> Versus:
    """The paired comparison of ``s`` with ``ref``'s final validation losses, seed k with seed k."""
    mine, theirs = s.by_seed(), ref.by_seed()
    both = [k for k in mine if k in theirs]
    left = ([f"seed {k} (only {s.label})" for k in mine if k not in theirs]
            + [f"seed {k} (only {ref.label})" for k in theirs if k not in mine])
    whole, name = val_set([mine[k] for k in both] + [theirs[k] for k in both])
    pairs = [(final_val(mine[k], whole), final_val(theirs[k], whole)) for k in both]
    kept = [k for k, (a, b) in zip(both, pairs, strict=True)
            if a is not None and b is not None and math.isfinite(a) and math.isfinite(b)]
    left += [f"seed {k} (no finite final val loss)" for k in both if k not in kept]
    a = [final_val(mine[k], whole) for k in kept]
    b = [final_val(theirs[k], whole) for k in kept]
    return Versus(kept, left, name, stats.paired(a, b, size=effect) if kept else None)


# ------------------------------------------------------------ speed at matched quality
@dataclass(frozen=True)
class Reach:
    """Where one run's validation loss first reaches the target."""

    reached: bool
    step: Optional[float] = None
    tokens: Optional[float] = None
    time_s: Optional[float] = None
    at_first_eval: bool = False
    """Already at or below the target at its first evaluation (nothing to interpolate from)."""
    short_by: Optional[float] = None
    """Never reached: its final val/loss minus the target."""


def training_time(run: Run) -> list[tuple[int, float, float]]:
    """``(step, tokens, seconds of training so far)`` per log row: the sum over rows of
    ``perf/step_time_s`` times the steps since the previous row. Evaluation and
    checkpoints are not in a step's time; a resumed run's rows that repeat steps
    replace the ones logged before the interruption."""
    out: list[tuple[int, float, float]] = []
    for r in run.rows:
        step, dt = r.get("step"), r.get("perf/step_time_s")
        if not isinstance(step, (int, float)) or "train/loss" not in r:
            continue  # a validation row between logging steps: no step time of its own
        dt = dt if isinstance(dt, (int, float)) else math.nan  # an older run without step times: tokens only
        while out and out[-1][0] >= step:  # a resume repeats steps: the later rows are the run's
            out.pop()
        prev_step, _, prev_t = out[-1] if out else (0, 0.0, 0.0)
        out.append((step, float(r.get("train/tokens", math.nan)), prev_t + dt * (step - prev_step)))
    return out


def _at(clock: list[tuple[int, float, float]], step: float) -> tuple[float, float]:
    """Tokens and training time at ``step``, linear between the log rows around it."""
    before = [c for c in clock if c[0] <= step]
    after = [c for c in clock if c[0] >= step]
    if not before or not after:
        c = (before or after or [(step, math.nan, math.nan)])[-1 if before else 0]
        return c[1], c[2]
    (s0, k0, t0), (s1, k1, t1) = before[-1], after[0]
    f = 0.0 if s1 == s0 else (step - s0) / (s1 - s0)
    return k0 + f * (k1 - k0), t0 + f * (t1 - t0)


def _crossing(steps: list, losses: list, target: float) -> Optional[tuple[float, bool]]:
    """The step where ``losses`` first reach ``target`` (linear between the last point above
    and the first at or below it) and whether that is already the first point; None if never."""
    for i, (step, loss) in enumerate(zip(steps, losses, strict=True)):
        if loss <= target:
            if i == 0:
                return step, True
            s0, l0 = steps[i - 1], losses[i - 1]
            return s0 + (l0 - target) / (l0 - loss) * (step - s0), False
    return None


def _short_by(losses: list, target: float) -> float:
    return next((v for v in reversed(losses) if math.isfinite(v)), math.inf) - target


def reach(run: Run, target: float) -> Reach:
    """Where ``run``'s ``val/loss`` curve first reaches ``target`` (:func:`_crossing`)."""
    steps, losses = run.series("val/loss", "step")
    hit = _crossing(steps, losses, target)
    if hit is None:
        return Reach(False, short_by=_short_by(losses, target))
    tokens, t = _at(training_time(run), hit[0])
    return Reach(True, hit[0], tokens, t, at_first_eval=hit[1])


def mean_curve(s: Setting) -> tuple[list, list[float], list[float], list[float]]:
    """The setting's mean ``val/loss`` curve over its seeds at the steps every seed
    evaluated: ``(steps, mean loss, mean tokens, mean training time)`` at each."""
    curves = [dict(zip(*r.series("val/loss", "step"), strict=True)) for r in s.runs]
    steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
    clocks = [training_time(r) for r in s.runs]
    at = [[_at(c, step) for c in clocks] for step in steps]
    return (steps, [statistics.fmean([c[k] for c in curves]) for k in steps],
            [statistics.fmean([a[0] for a in row]) for row in at],
            [statistics.fmean([a[1] for a in row]) for row in at])


def mean_reach(s: Setting, target: float) -> Reach:
    """Where the setting's mean curve (:func:`mean_curve`) first reaches ``target``: the
    speed-up's figure, defined also where some seeds never reach it (the reference's own
    mean final loss, the default target, is reached by its mean curve at its last point)."""
    steps, losses, tokens, times = mean_curve(s)
    hit = _crossing(steps, losses, target)
    if hit is None:
        return Reach(False, short_by=_short_by(losses, target))
    clock = list(zip(steps, tokens, times, strict=True))
    k, t = _at(clock, hit[0])
    return Reach(True, hit[0], k, t, at_first_eval=hit[1])


def default_target(ref: Setting) -> Optional[float]:
    """The reference setting's mean final ``val/loss`` (the curve's set, at the last step
    every seed evaluated); None without one."""
    _, losses, _, _ = mean_curve(ref)
    return losses[-1] if losses and math.isfinite(losses[-1]) else None


# ------------------------------------------------------------ the report
@dataclass
class Report:
    """Everything the seed tables and the seed figure show."""

    settings: list[Setting]
    refs: dict[int, Optional[Setting]]
    how: str
    """How the references were chosen, in words."""
    targets: dict[int, Optional[float]]
    """Each setting's target val/loss (by ``id``)."""
    target_how: str
    reaches: dict[int, list[Reach]]
    """Per setting, one :class:`Reach` per seed (its runs' order)."""
    means: dict[int, Optional[Reach]]
    """Per setting, where its mean curve reaches the target (:func:`mean_reach`)."""
    versus: dict[int, Optional[Versus]]

    @property
    def one_seed(self) -> bool:
        """Whether no setting has two seeds: nothing tells a difference from seed noise."""
        return all(len(s.runs) < 2 for s in self.settings)


def report(runs: list[Run], reference: Optional[str] = None, target_loss: Optional[float] = None,
           effect: Optional[float] = None) -> Report:
    """Group ``runs`` into settings and compare each with its reference (``--reference``),
    at the target ``target_loss`` (default: the reference's mean final val/loss), with
    seed estimates for a difference of ``effect`` nats (default: the one observed).
    Raises :class:`SpecError` for a ``reference`` that names no single setting."""
    settings = group_settings(runs)
    refs, how = reference_of(settings, reference)
    targets, reaches, means, vs = {}, {}, {}, {}
    for s in settings:
        ref = refs[id(s)]
        t = target_loss if target_loss is not None else (default_target(ref) if ref is not None else None)
        targets[id(s)] = t
        reaches[id(s)] = [reach(r, t) for r in s.runs] if t is not None else []
        means[id(s)] = mean_reach(s, t) if t is not None else None
        vs[id(s)] = versus(s, ref, effect) if ref is not None and ref is not s else None
    target_how = ("--target-loss" if target_loss is not None else
                  "the reference's mean final val/loss over its seeds (the eval set every point of the curve is on)")
    return Report(settings, refs, how, targets, target_how, reaches, means, vs)


def short_text(x: float) -> str:
    """A shortfall in nats, signed: four decimals, or two significant digits below 0.001
    (an fp16 run 0.00002 short of an fp32 target is not "+0.0000")."""
    return f"{x:+.4f}" if not math.isfinite(x) or abs(x) >= 1e-3 else f"{x:+.1e}"


def _spread_ci(values: list[float], spec: str) -> str:
    """``mean ± sd (sd, n seeds), 95% CI lo to hi`` (the interval from 2 seeds on) of the
    finite ``values``; n/a when there are none (a run without ``perf/step_time_s``)."""
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return "n/a"
    sp = stats.spread(values)
    return sp.text(spec) + (f", 95% CI {sp.ci[0]:{spec}} to {sp.ci[1]:{spec}}" if sp.ci else "")


def _ratio(num: Optional[float], den: Optional[float]) -> str:
    return "n/a" if not num or not den or not math.isfinite(num / den) else f"{num / den:.2f}x"


def matched_md(rep: Report) -> str:
    """The speed-at-matched-quality table, with the lines saying what the target and the
    times are; the first thing comparison.md and the printout show."""
    if not any(rep.reaches.values()):
        return ("### Speed at matched quality\n\nNo validation loss curve (`val/loss`) in these runs, or no "
                "reference to take the target from: set `train.eval_every` or `--target-loss`.")
    head = ["setting", "target val/loss", "seeds at target", "tokens to target", "training time to target (s)",
            "speed-up at matched quality", "raw tokens/s ratio"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    first_eval = []
    for s in rep.settings:
        ref, t, got = rep.refs[id(s)], rep.targets[id(s)], rep.reaches[id(s)]
        if t is None:
            lines.append(f"| {s.label} | n/a | n/a | n/a | n/a | n/a | n/a |")
            continue
        hit = [g for g in got if g.reached]
        first_eval += [s.label] if any(g.at_first_eval for g in hit) else []
        missed = [g for g in got if not g.reached]
        at = f"{len(hit)} of {len(got)}"
        if missed:
            at += (f"; never reached by {len(missed)}: final val/loss short by "
                   f"{', '.join(short_text(g.short_by) for g in missed)}")
        tokens = _spread_ci([g.tokens for g in hit], ",.0f") if hit else "n/a"
        times = _spread_ci([g.time_s for g in hit], ".3g") if hit else "n/a"
        mine, theirs = rep.means[id(s)], rep.means.get(id(ref)) if ref is not None else None
        if mine is not None and not mine.reached:
            speedup = f"never (mean curve short by {short_text(mine.short_by)})"
            v = rep.versus.get(id(s))
            if v is not None and v.paired is not None and v.paired.n > 1 and not v.paired.resolved:
                # a shortfall the paired final losses cannot tell from noise is not a measured loss
                speedup += "; its final loss is not resolved from the reference's, so this may be noise"
        elif mine is None or theirs is None or not theirs.reached:
            speedup = "n/a"
        else:
            speedup = _ratio(theirs.time_s, mine.time_s)
        tps = figure_spread(s.runs, "perf/tokens_per_s")
        ref_tps = figure_spread(ref.runs, "perf/tokens_per_s") if ref is not None else None
        name = s.label + (" (reference)" if ref is s else "")
        lines.append("| " + " | ".join([name, f"{t:.4f}", at, tokens, times, speedup,
                                        _ratio(tps.mean if tps else None, ref_tps.mean if ref_tps else None)]) + " |")
    notes = [f"Target: {rep.target_how}. Training time is the sum of `perf/step_time_s` over the steps "
             "(evaluation and checkpoints left out; a resume's repeated steps counted once); each seed's crossing "
             "is interpolated linearly between the last evaluation above the target and the first at or below it. "
             "Speed-up at matched quality: the reference's training time to target / the setting's, both on the mean "
             "curve over seeds (mean loss and mean time at each evaluation; the default target is where the "
             "reference's mean curve ends, so single seeds may fall short of it); raw tokens/s ratio: "
             "the setting's mean tokens/s / the reference's."]
    if first_eval:
        notes.append(f"Already at the target at the first evaluation (no crossing to interpolate): "
                     f"{', '.join(first_eval)}; evaluate more often to place it.")
    return "### Speed at matched quality\n\n" + "\n".join(lines) + "\n\n" + "\n\n".join(notes)


def seeds_md(rep: Report) -> str:
    """The final-loss table over seeds: each setting's spread, its paired difference from
    its reference with the interval, p-value and verdict, and its other final figures."""
    extra = [(c, k, f) for c, k, f in FINAL_FIGURES if any(figure_spread(s.runs, k) for s in rep.settings)]
    head = ["setting", "seeds", "final val loss", "on", "- reference (paired)", "verdict", *(c for c, _, _ in extra)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    notes = [f"Paired by seed: seed k of a setting against seed k of its reference; {rep.how}. "
             "comparison.png's second panel draws these differences over the steps: settings whose loss curves "
             "coincide in the loss panel are apart there."]
    for s in rep.settings:
        ref, v = rep.refs[id(s)], rep.versus[id(s)]
        whole, name = val_set(s.runs)
        finals = [x for r in s.runs if (x := final_val(r, whole)) is not None]
        diverged = len([x for x in finals if not math.isfinite(x)])
        finals = [x for x in finals if math.isfinite(x)]
        if v is None or v.paired is None:
            diff, words = ("(reference)" if ref is s else "n/a"), ("" if ref is s else "no reference")
        else:
            c = v.paired
            diff = f"{c.mean:+.4f}" + (f" (95% CI {c.ci[0]:+.4f} to {c.ci[1]:+.4f})" if c.ci else "")
            words = stats.verdict(c)
            if v.set_name != name:
                words += f" [on the {v.set_name}]"
            if v.left_out:
                notes.append(f"{s.label} against {ref.label}: left out {', '.join(v.left_out)}.")
        if s.extra:
            notes.append(f"{s.label}: left out {', '.join(r.path.name for r in s.extra)} "
                         "(a seed the setting already has).")
        final = (stats.spread(finals).text() if finals else "n/a") + (f"; {diverged} diverged" if diverged else "")
        cells = [s.label, ",".join(map(str, s.seeds)), final, name, diff, words]
        cells += [(sp.text(f) if (sp := figure_spread(s.runs, k)) else "n/a") for _, k, f in extra]
        lines.append("| " + " | ".join(cells) + " |")
    if rep.one_seed:
        notes.append("One seed per setting: the noise between seeds cannot be judged, so no difference here "
                     "is resolved; rerun with train.seed=0,1,2.")
    return ("### Final validation loss over seeds\n\n" + "\n".join(lines) + "\n\n" + "\n\n".join(notes))
