"""What the numerics monitor costs: the same run with the monitor off and at a cadence.

    python scripts/bench_monitor.py [overrides...]      (default: model=gpt-mini precision=fp32, 300 steps)

Prints training tokens/s (evaluation and checkpointing excluded; logging and
the monitor's own work included) for each setting and the monitor's overhead;
one setting turns off only ``monitor.stability`` (the attention probe, the
output-logit hook and Adam's figures), to show what those add.

    python scripts/bench_monitor.py --fp8-casts precision=fp8 [overrides...]

instead measures the float8 cast statistics (``fp8stats.CastWatch``) with
every step monitored, where their cost shows: monitor off, then monitored
with the statistics off, with the run's own casts only, and with the what-if
recipes too (the default).
Each setting runs twice (four times when the machine is busy at the start),
interleaved, and the fastest run counts, to damp noise from a shared machine;
the load average and CPU steal over the runs come last, with a warning when
other processes competed. One banner comes first and one progress line per
run (as in ``scripts/bench.py``); the harness's own banner and messages are
hidden, its warnings passed on once.
"""
from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, NamedTuple, Optional

if __name__ == "__main__" and any(a in ("-h", "--help") for a in sys.argv[1:]):
    print(__doc__)  # answered before torch's import, which alone can take 20 s on a busy machine
    sys.exit(0)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench.py's progress line and quiet runs

import torch  # noqa: E402
from bench import (  # noqa: E402
    STOP_EXIT,
    Progress,
    Stopped,
    configured,
    following,
    machine,
    quiet_harness,
    stop_signal,
    stoppable,
)
from mptrain.config.checks import compose_checked  # noqa: E402
from mptrain.core.machine import LoadMeter  # noqa: E402
from mptrain.run.trainer import run  # noqa: E402

from mptrain.config.checks import CONFIG_DIR as CONFIGS  # noqa: E402  (mptrain/configs/, shipped in the package)
DEFAULTS = ["model=gpt-mini", "precision=fp32", "train.max_steps=300", "train.eval_every=0",
            "log.progress=false", "log.tensorboard=false", "checkpoint.at_end=false"]  # not what is measured
SETTINGS = {"monitor off": ["monitor.enabled=false"], "monitor every 50 (default)": [],
            "every 50, stability off": ["monitor.stability=false"],  # what the stability/* figures add
            "monitor every 10": ["monitor.every=10"]}
FP8_SETTINGS = {"monitor off": ["monitor.enabled=false"],  # --fp8-casts: what the fp8.* figures add
                "every step, fp8 casts off": ["monitor.every=1", "monitor.fp8_casts=false"],
                "every step, own casts only": ["monitor.every=1", "monitor.fp8_whatif=[]"],
                "every step, casts + what-ifs": ["monitor.every=1"]}


def compose_cfg(overrides: list[str]):
    """The run's config: DEFAULTS, then ``overrides`` (checked as train.py checks its own)."""
    return compose_checked([*DEFAULTS, *overrides], CONFIGS)


def over_budget(since_first_s: float, since_first_steps: int, steps_left: int, budget_s: float) -> bool:
    """Whether a run, ``since_first_s`` seconds and ``since_first_steps`` steps past its
    first step with ``steps_left`` to go, is to be stopped: it has used ``budget_s``
    already, or its pace says it will. One left step is not worth stopping for (the
    stop lands after a step, and the run would be over by then)."""
    if steps_left < 2:
        return False
    if since_first_s >= budget_s:
        return True
    if since_first_steps < 1:
        return False  # no pace yet: the first step's time holds start-up work
    pace = since_first_s / since_first_steps
    return since_first_s + pace * steps_left > budget_s


class Capper:
    """Stands in for a run's progress line (the harness's logged steps arrive in
    :meth:`update` from ``bench.following``'s polling thread): passes them on, and,
    given a budget, stops the run when :func:`over_budget` says so, through the
    trainer's own stop (SIGTERM: it finishes the step, writes its summary and
    returns). Steps are seen as they are logged, every ``train.log_every`` steps."""

    def __init__(self, progress: Progress, total: int, budget_s: Optional[float]):
        self.progress, self.total, self.budget_s = progress, total, budget_s
        self.first: Optional[float] = None  # when the first step was seen: the trainer's handler is in place
        self.stopped = False

    def update(self, done: int) -> None:
        self.progress.update(done)
        if self.budget_s is None or done < 1 or self.stopped:
            return
        now = time.monotonic()
        if self.first is None:
            self.first = now
        if over_budget(now - self.first, done - 1, self.total - done, self.budget_s):
            self.stopped = True
            signal.raise_signal(signal.SIGTERM)


class Timed(NamedTuple):
    """A run's tokens/s; for a capped run, the steps and seconds it ran; for a run the
    user stopped (Ctrl-C, SIGTERM), the signal's name and the steps it ran (``partial``)."""
    tokens_per_s: float
    capped: str = ""
    partial: str = ""
    stopped_by: str = ""


def tokens_per_s(overrides: list[str], steps: int, head: str, budget_s: Optional[float] = None,
                 head_if_capped: str = "") -> tuple[Timed, list[str]]:
    """One quiet harness run with its progress line: (its timing, its warning lines);
    capped once it runs ``budget_s`` past its first step (or its pace says it will).
    ``head_if_capped``: the line's head once capped (the runs it drops taken off the count)."""
    progress = Progress(sys.stdout, head, steps)
    capper = Capper(progress, steps, budget_s)
    t = time.monotonic()
    # The trainer's handler is in place from its first step to its end; outside it (the
    # stop raised as the run ends) SIGTERM finds this no-op, not the default that ends the process.
    outer = signal.signal(signal.SIGTERM, lambda *_: None) if budget_s is not None else None
    try:
        with tempfile.TemporaryDirectory() as d, following(Path(d) / "metrics.jsonl", capper), \
                quiet_harness(False) as warnings:
            summary = run(compose_cfg(overrides), run_dir=d)
    except (Stopped, KeyboardInterrupt) as e:  # the user's stop before the run trained: nothing of it measured
        progress.finish(f"stopped by {signal.Signals(stop_signal(e)).name}: nothing of this run measured",
                        done=progress.done)
        raise
    except BaseException:
        progress.abandon()
        raise
    finally:
        if outer is not None:
            signal.signal(signal.SIGTERM, outer)
    tps, done = summary["perf/tokens_per_s"], int(summary["steps"])
    if summary.get("stopped_early") and not capper.stopped:  # the user's signal, taken by the trainer's stop
        note = f"partial: {done} of {steps} steps, stopped by {summary['stopped_early']}"
        progress.finish(f"{tps:,.0f} tokens/s, {note}", done=done)
        return Timed(tps, partial=note, stopped_by=summary["stopped_early"]), warnings
    if not capper.stopped:
        progress.finish(f"{tps:,.0f} tokens/s")
        return Timed(tps), warnings
    note = f"capped after {done} of {steps} steps, {time.monotonic() - t:.0f} s"
    progress.finish(f"{tps:,.0f} tokens/s, {note}", done=done, head=head_if_capped or None)
    return Timed(tps, note), warnings


def fastest(names: list[str], repeats: int, steps: int, width: int, overrides: Callable[[str], list[str]],
            budget_s: Optional[float] = None) -> tuple[dict[str, Timed], Optional[int]]:
    """Each setting of ``names`` run ``repeats`` times, interleaved, with its
    ``overrides(name)``: one progress line per run, each new harness warning shown
    once; returns the fastest run of each setting, and the signal that stopped the
    measurement (None when it ran to the end). With ``budget_s``, a run is capped
    past it (:class:`Capper`) and its setting's later runs are dropped. ``[k/N]``
    counts the runs that will run: N shrinks when a cap drops some.

    Ctrl-C (or SIGTERM) stops it at once: a run that was training ends after its
    step and counts as its setting's figure if that setting has no other (marked
    ``partial``); nothing more is run."""
    best: dict[str, Timed] = {}
    planned = [name for _ in range(repeats) for name in names]  # the runs still to go, in order
    seen: set[str] = set()
    k = 0
    with stoppable():
        while planned:
            name = planned.pop(0)
            k += 1
            later = planned.count(name)  # what a cap of this run drops
            label = f"{name:<{width}}"
            try:
                r, warnings = tokens_per_s(overrides(name), steps, f"  [{k}/{k + len(planned)}] {label}", budget_s,
                                           f"  [{k}/{k + len(planned) - later}] {label}")
            except (Stopped, KeyboardInterrupt) as e:
                return best, stop_signal(e)
            for w in [w for w in warnings if w not in seen]:
                seen.add(w)
                print(f"    harness {w}")
            if r.partial:
                best.setdefault(name, r)  # a whole run of the setting, if there is one, stands
                return best, signal.Signals[r.stopped_by].value
            if r.capped:
                planned = [n for n in planned if n != name]
            if name not in best or r.tokens_per_s > best[name].tokens_per_s:
                best[name] = r
    return best, None


def main() -> int:
    """Banner, each run with its progress line, then one line per setting; the exit code
    (0, or bench.py's :data:`STOP_EXIT` code for a stop by the user)."""
    user = sys.argv[1:]
    fp8 = "--fp8-casts" in user
    user = [a for a in user if a != "--fp8-casts"]
    cfg, device = configured(compose_cfg, user, "bench_monitor")
    if fp8 and not cfg.precision.fp8.enabled:
        sys.exit("bench_monitor: --fp8-casts measures the float8 cast statistics; add precision=fp8 "
                 "(or another float8 preset).")
    settings = FP8_SETTINGS if fp8 else SETTINGS
    meter = LoadMeter()
    repeats = meter.repeats(2)
    print(f"bench_monitor: {' '.join(DEFAULTS + user)} | {len(settings)} settings x {repeats}, interleaved\n"
          f"  machine  {machine(device)} | torch {torch.__version__}", flush=True)
    timed, stopped = fastest(list(settings), repeats, cfg.train.max_steps, 28, lambda name: [*settings[name], *user])
    base = timed["monitor off"].tokens_per_s if "monitor off" in timed else None
    print(f"\nbench_monitor: {' '.join(DEFAULTS + user)}")
    for name in [n for n in settings if n in timed]:
        t = timed[name]
        overhead = f"overhead {100 * (base / t.tokens_per_s - 1):+5.1f}%" if base else "overhead n/a"
        print(f"  {name:<28} {t.tokens_per_s:10,.0f} tokens/s   {overhead}" + (f"   {t.partial}" if t.partial else ""))
    if stopped is not None:
        missing = [n for n in settings if n not in timed]
        print(f"bench_monitor: stopped by {signal.Signals(stopped).name}"
              + (f"; not measured: {', '.join(missing)}" if missing else ""))
    print(meter.read().report(f"the fastest of {repeats} runs of each setting counts", head="  "))
    return 0 if stopped is None else STOP_EXIT.get(stopped, 128 + stopped)


if __name__ == "__main__":
    sys.exit(main())
