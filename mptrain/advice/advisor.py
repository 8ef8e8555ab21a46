"""One advise: check, announce, probe, answer, confirm (what ``python -m mptrain.advise`` runs).

:class:`Advisor` checks the request against the configuration (train.py's own
refusals, through the plan of the user's run on ``--world`` ranks; the target,
the memory budget), prints what it will do and a time estimate, trains the probe (``advice/probe.py``'s command line) in its run
directory (``advice/command.py``), reads the probe's figures into the pure
rules (``advice/rules.py``), writes the answer (``advice/answer.py``) and,
with ``--confirm``, trains the advice and the baseline. A SIGTERM or SIGINT
stops it (:class:`Interrupted`), with one line that says what it stopped
(:func:`interrupted_line`).
"""
from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

import torch
from omegaconf import OmegaConf

from mptrain.advice.answer import confirm_report, confirm_side, console_lines, lab_line, override_line, write
from mptrain.advice.command import Args, advise_dir
from mptrain.advice.probe import (
    GPU_TARGETS,
    MIN_STEPS,
    candidates,
    every_for,
    finished_summary,
    layout_facts,
    probe_overrides,
    read_facts,
    state_options,
    step_seconds,
    target_for,
    target_from_json,
    target_to_json,
    user_part,
    wait_for,
    without_mesh,
)
from mptrain.advice.rules import Advice, Thresholds, advise, smallest_option
from mptrain.config.checks import compose_checked
from mptrain.core import files
from mptrain.core.errors import ConfigError
from mptrain.core.text import duration
from mptrain.observe.perf import device_key
from mptrain.plan.build import build_plan
from mptrain.plan.plan import Launch
from mptrain.precision.support import verdicts
from mptrain.run.startup import Startup
from mptrain.run.trainer import run


def _device(want: str) -> torch.device:
    """The device a run of ``train.device=want`` takes (``auto``: CUDA where there is one)."""
    return torch.device("cuda" if want == "cuda" or (want == "auto" and torch.cuda.is_available()) else "cpu")


def _default_target(device: torch.device) -> str:
    if device.type == "cpu":
        return "cpu"
    key = device_key(torch.cuda.get_device_name(device))
    names = {v: k for k, v in GPU_TARGETS.items()}
    if key not in names:
        raise ConfigError(f"this GPU ({torch.cuda.get_device_name(device)}) is not in the peak table; pass "
                          f"--target with the closest of {', '.join(GPU_TARGETS)}.")
    return names[key]


class Interrupted(BaseException):
    """A SIGTERM or SIGINT stopped the advise: raised by :func:`stop_advising`
    outside a training loop, or when a probe or --confirm run's summary says a
    signal stopped it (``stopped_early``). A BaseException, as KeyboardInterrupt
    is: no ``except Exception`` on the way may take it for an error and go on."""

    def __init__(self, signal_name: str, detail: str = ""):
        super().__init__(signal_name)
        self.signal_name, self.detail = signal_name, detail


def stop_advising(signum, frame) -> None:
    """What SIGTERM and SIGINT do while the advise runs (``core/signals.py``'s
    ``SignalHandler(stop_advising)``): raise :class:`Interrupted`.

    Python's own defaults would end the process where it stands (SIGTERM) or
    with a traceback (SIGINT). While a probe or --confirm run trains, the
    loop's handler (``run/stop.py``) takes the signals instead: the run
    finishes its step, saves a checkpoint and records ``stopped_early`` in its
    summary, and gives this handler back."""
    raise Interrupted(signal.Signals(signum).name)


class Advisor:
    """One ``advise`` invocation: check, announce, probe, answer, confirm."""

    def __init__(self, args: Args, startup: Startup):
        self.args = args
        self.agreement = startup.agreement  # rank 0's run directory and advice, shared with the other ranks
        # the probe's and the confirm runs' hold on their directories: inside the one this advise created, a run
        # refused before training leaves nothing
        self.claims = startup.claims
        self.rank = int(os.environ.get("RANK", "0"))
        self.overrides = list(args.overrides)
        self.stage = "before the probe started"  # what a signal interrupts, for the line that says so
        self.run_dir: Optional[Path] = None
        if args.steps < MIN_STEPS:
            raise ConfigError(f"--steps {args.steps} is too few to measure: the monitors need several steps "
                              f"after the first; pass --steps {MIN_STEPS} or more.")
        # the plan of the user's run on --world ranks: what train.py would refuse, refused here before any work
        cfg = compose_checked(self.overrides)
        self.plan = build_plan(cfg, Launch.planned(args.world))
        # --confirm's paired seeds: the user's own train.seed and the next ones (the first seed is the run
        # they asked for)
        self.seeds = tuple(int(cfg.train.seed) + i for i in range(args.seeds if args.confirm else 0))
        self.device = _device(self.plan.device)
        self.target_name = args.target or _default_target(self.device)
        if self.target_name != "cpu" and self.target_name not in GPU_TARGETS:
            raise ConfigError(f"--target {self.target_name} is not a known target; choose one of "
                              f"{', '.join(['cpu', *GPU_TARGETS])}.")
        self.candidates = candidates(self.overrides)
        vocab = self.plan.vocab.expected  # the rows as far as the config tells: model.vocab_size, byte or BPE
        if vocab is not None:  # the probe learns a transformers tokenizer's size; the budget waits for it
            self._check_budget(state_options(self.candidates, args.world, vocab), vocab)

    def say(self, line: str = "") -> None:
        if self.rank == 0:
            print(line, flush=True)

    def _check_budget(self, options: dict, vocab: int) -> None:
        b = self.args.budget_gib
        if b is None:
            return
        smallest = smallest_option(options)
        if smallest is None or smallest.gib_per_rank > b:
            fig = (f"the smallest is {smallest.name} under {' '.join(smallest.overrides) or 'its precision'}: "
                   f"{smallest.gib_per_rank:.3g} GiB per rank" if smallest else "none of them can run")
            raise ConfigError(f"--budget-gib {b:g}: no precision and optimizer state fits {b:g} GiB per rank on "
                              f"{self.args.world} rank(s) (vocab {vocab}); {fig}. Raise the budget, add ranks "
                              "(--world with parallel=fsdp), or shrink the model or micro-batch.")

    def announce(self) -> None:
        """What the advise will do, then how long its probe takes here, from a step of
        the model measured now (:func:`~mptrain.advice.probe.step_seconds`)."""
        plan, a, m = self.plan, self.args, self.plan.model
        mesh = plan.parallel.mesh
        on = f"{a.world} rank(s)" + (f", mesh {mesh.text()} (the probe trains without it)"
                                     if plan.parallel.uses_mesh and mesh.world > 1 else "")
        self.say(f"advise: model={m.name} on {on}, target {self.target_name}; "
                 f"probe {a.steps} steps (monitored every {every_for(a.steps)}), float8 tensorwise linears with "
                 f"the rowwise and MX block casts" + (f" and the lab's {', '.join(a.lab)}" if a.lab else "")
                 + " as what-ifs" + (f"; then --confirm: {2 * len(self.seeds)} runs of {a.confirm} steps (the "
                                     f"recommendation and the baseline on {len(self.seeds)} paired seed(s), train.seed "
                                     f"{', '.join(map(str, self.seeds))})" if a.confirm else ""))
        # every rank times its own part of a step: the probe trains on the launch's ranks
        per_step = step_seconds(plan, plan.vocab.expected or 4096, self.device)
        confirm = (f"; --confirm's {2 * len(self.seeds)} runs ~{duration(per_step * a.confirm * 2 * len(self.seeds))} "
                   "more" if a.confirm else "")
        self.say(f"advise: a training step of this model took {per_step:.3g} s here now (fp32, timed before the "
                 f"probe, at this machine's present load); estimated time: the probe ~{duration(per_step * a.steps)}"
                 f"{confirm}; its float8 casts, monitored steps, data and start-up come on top")

    def _train(self, overrides: list[str], run_dir: Path) -> dict:
        """Train the config of ``overrides`` in ``run_dir`` (``resume.source=auto``: continuing
        what a signal stopped there) and return its summary; one an earlier launch of
        this command finished is read back instead. A run a signal stopped
        (its summary's ``stopped_early``) ends the advise: :class:`Interrupted`."""
        cfg = compose_checked(overrides)
        k = int(cfg.train.max_steps)
        summary = finished_summary(run_dir, k)
        if summary is not None:
            self.say(f"advise: {run_dir} finished in an earlier launch of this command: read back, not trained again")
            return summary
        run(cfg, run_dir=run_dir, claims=self.claims)
        if self.rank != 0:
            wait_for(run_dir / "summary.json", 600)
        summary = json.loads((run_dir / "summary.json").read_text())
        if summary.get("stopped_early"):
            raise Interrupted(str(summary["stopped_early"]), f" at step {summary['steps']} of {k}")
        return summary

    def probe(self, run_dir: Path) -> None:
        started = time.monotonic()
        self.stage = "during the probe"
        probe_dir = run_dir / "probe"
        if self.rank == 0 and self._measured_target(run_dir) is None:
            d = self.plan.model.d_model
            shape = (min(max(self.plan.batches.tokens_per_micro, 16), 2048), d, 4 * d)
            target = target_for(self.target_name, self.device, shape)
            files.write_json(run_dir / "target.json", target_to_json(target))
        summary = self._train(probe_overrides(self.overrides, self.args.steps, self.device.type, self.args.lab),
                              probe_dir)
        self.stage = "after the probe"
        self.probe_s = time.monotonic() - started
        self.target = target_from_json(json.loads((run_dir / "target.json").read_text()))
        vocab = int(OmegaConf.load(probe_dir / "config.yaml").run_info.vocab_size)
        self.options = state_options(self.candidates, self.args.world, vocab)  # with the tokenizer's real vocab
        self.facts = replace(read_facts(probe_dir, self.plan, self.options, self.args.lab),
                             layout=layout_facts(self.plan, self.candidates, vocab))
        self.say(f"advise: probe done in {duration(self.probe_s)} ({summary['steps']} steps, "
                 f"{self.facts.monitored_steps} monitored; {probe_dir})")

    def _measured_target(self, run_dir: Path) -> Optional[dict]:
        """The target an earlier launch of this command measured in ``run_dir`` (a rerun after
        a signal continues there), or None. Reused, not measured again: the advice rests on its
        matmul timings, and on a busy machine a second measurement can tip bf16 against fp32
        the other way, which would change the advice between the launches of one command (and
        with it the --confirm run the rerun must continue)."""
        try:
            saved = json.loads((run_dir / "target.json").read_text())
        except (OSError, ValueError):
            return None
        return saved if saved.get("name") == self.target_name else None

    def confirm(self, run_dir: Path, advice: Advice) -> tuple[list[str], dict]:
        """Train the advice and the baseline for ``--confirm`` steps on each of
        ``--seeds`` paired seeds; the report's lines and its figures as data.

        Seed k of both sides is one ``train.seed``: the two start from the same
        weights and see the same batches, so the paired test is on the per-seed
        gaps. Each run has its own directory, ``confirm-<side>-s<k>``; a rerun
        reads back the runs an earlier launch finished and continues the one a
        signal stopped (``_train``)."""
        k = self.args.confirm
        # the baseline runs here, whatever the target: bf16 where this machine has it natively
        baseline = "bf16" if verdicts(self.device, check_fp8=False)["bf16"].status == "native" else "fp32"
        advised = {o.split("=", 1)[0] for o in advice.overrides}
        # (a stop before step K would leave the comparison incomplete: train.stop_after and audit_only are dropped;
        # train.seed is each seed's own)
        keep = user_part(without_mesh(self.overrides), drop=(
            "precision", "hydra.run.dir", "train.max_steps", "train.eval_every", "resume.source", "checkpoint.at_end",
            "train.stop_after", "train.audit_only", "train.seed", *advised))
        # auto: a rerun of an interrupted advise continues from the checkpoint the signal saved
        common = [f"train.max_steps={k}", f"train.eval_every={k}", "checkpoint.at_end=false", "resume.source=auto"]
        own = {"recommended": list(advice.overrides), "baseline": [f"precision={baseline}"]}
        summaries: dict[str, list[dict]] = {name: [] for name in own}
        for name, ovs in own.items():
            self.say(f"advise: --confirm: the {name} configuration: {' '.join([*keep, *ovs, *common])}")
        # seed by seed, both sides of a seed together: a stop leaves every earlier seed's pair finished
        for i, seed in enumerate(self.seeds):
            for name, ovs in own.items():
                d = run_dir / f"confirm-{name}-s{i}"
                self.say(f"advise: --confirm: training the {name} configuration with train.seed={seed} (seed {i + 1} "
                         f"of {len(self.seeds)}) for {k} steps in {d}")
                self.stage = f"during --confirm's {name} run with train.seed={seed} (seed {i + 1} of {len(self.seeds)})"
                summaries[name].append(self._train([*keep, *ovs, *common, f"train.seed={seed}"], d))
        self.stage = "after the --confirm runs"
        same = sorted(own["recommended"]) == sorted(own["baseline"])
        return confirm_report(*(confirm_side(name, own[name], summaries[name]) for name in own), self.seeds, k, same,
                              Thresholds().speed_noise)

    def main(self) -> Advice:
        self.announce()
        run_dir = self.run_dir = advise_dir(self.args, self.agreement)
        self.probe(run_dir)
        advice = advise(self.facts, self.target, self.args.budget_gib)
        # Every rank read the same probe files into the same pure function; the confirm runs
        # below are collective, so a disagreement would train different things on different ranks.
        theirs = self.agreement.rank0_value("advice", override_line(advice))
        if theirs != override_line(advice):
            raise RuntimeError(f"rank {self.rank} advises `{override_line(advice)}`, rank 0 `{theirs}`: the ranks "
                               "read different probe files (is the run directory shared by every rank?)")
        for line in console_lines(advice):
            self.say(line)
        self.say("")
        self.say(f"advise: to train it: python train.py {override_line(advice)}")
        if advice.lab is not None and advice.lab.overrides:
            self.say(f"advise: to try the best lab candidate (emulated): python train.py {lab_line(self.overrides, advice)}")
        header = {"model": str(self.plan.model.name), "overrides": self.overrides, "world": self.args.world,
                  "budget_gib": self.args.budget_gib,
                  "probe": f"{self.facts.steps} steps, {self.facts.monitored_steps} monitored, "
                           f"{duration(self.probe_s)}, in probe/", "probe_s": self.probe_s}
        if self.args.confirm:
            header["confirm"], header["comparison"] = self.confirm(run_dir, advice)
            for line in header["confirm"]:
                self.say(line)
        self.stage = "while writing the advice"
        if self.rank == 0:
            paths = write(run_dir, advice, self.target, header)
            self.say(f"advise: wrote {', '.join(str(p) for p in paths)}")
        return advice


def interrupted_line(e: BaseException, advisor: Optional[Advisor]) -> str:
    """The one line an advise stopped by a signal ends with: which signal, what it
    stopped (the run and its step, from the run's own summary), what was not
    written, and how to continue."""
    sig, detail = (e.signal_name, e.detail) if isinstance(e, Interrupted) else ("SIGINT", "")
    where = f"{advisor.stage if advisor else 'before the probe started'}{detail}"
    d = advisor.run_dir if advisor else None
    if d is None:
        return f"mptrain.advise: stopped by {sig} {where}: nothing was written."
    if (d / "advice.json").exists():  # written last: the advice is complete
        return f"mptrain.advise: stopped by {sig} after writing the advice to {d}."
    incomplete = " the comparison is incomplete (no loss gap);" if where.startswith("during --confirm") else ""
    again = "" if any(o.startswith("hydra.run.dir=") for o in advisor.overrides) else f" with hydra.run.dir={d}"
    return (f"mptrain.advise: stopped by {sig} {where}:{incomplete} no advice was written to {d}; "
            f"rerun the same command{again} to continue there.")
