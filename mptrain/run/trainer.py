"""``run(cfg)``: one training run, as a :class:`Trainer`.

Read it top to bottom like a table of contents:

- ``Trainer.__init__`` builds: data, model, precision, wrapper, optimizer,
  the reporter, the run's optional parts, the loop's resumable state, resume,
  outputs;
- ``Trainer.train`` is the loop: for each step, ``train_step`` (the math, in
  ``step.py``), then ``log`` (one read-back, the non-finite check, the row),
  ``evaluate``, ``observe`` (what the parts measured), ``checkpoint``; at the
  end ``summarize``.

The optional parts of a run (the numerics monitor, the non-finite handling,
the dtype audit, the collective counter, the alerts, the ``debug.*`` faults)
are components (``components.py``, built in ``parts.py``): the loop calls them
all at the same few points and never one by name. Everything the run reports
(run_info, the banner, metric rows, summary.json and the closing lines) is
formatted in ``report.py``, which the loop only tells when.
"""
from __future__ import annotations


from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn

from omegaconf import DictConfig

from mptrain.core.machine import use_threads
from mptrain.data.batches import Prefetcher, ValSet
from mptrain.distributed.parallel import DistContext, export_submitit_env, setup
from mptrain.plan.build import build_plan
from mptrain.plan.plan import Plan
from mptrain.run.build import build_data, build_model, build_policy
from mptrain.checkpoint.checkpointer import Checkpointer, Progress
from mptrain.run.console import LOG_NAME, RunLog
from mptrain.run.parts import build_parts
from mptrain.run.phases import Began, PhaseSchedule, phase_warnings, switch
from mptrain.run.report import LoopStep, Reporter, read_back, start_clock
from mptrain.run.resume import decide, finished_summary
from mptrain.run.rundir import Claim, check_present, held, run_dir_of
from mptrain.run.step import evaluate, set_lr_at, step_state, train_step
from mptrain.run.stop import StopSignal

__all__ = ["run", "Trainer"]


def run(cfg: DictConfig, run_dir: Optional[str | Path] = None, claims: Optional[dict] = None) -> dict:
    """Train as configured; returns the summary (also written to summary.json).

    The run holds its directory's lock throughout (``rundir.py``); a user error
    raised before training starts leaves the directory as it found it."""
    run_dir = run_dir_of(run_dir)
    export_submitit_env()  # a submitit task learns its rank here; only rank 0 locks the directory
    with held(run_dir, claims) as claim:  # claims: the launch's (run/startup.Claims); None: the run's own
        plan = build_plan(cfg)  # every check, once, before any process group or data work
        ctx = setup(plan)
        log = RunLog(run_dir / LOG_NAME, enabled=ctx.is_main)  # the console, kept in <run>/train.log
        try:
            # train.threads from here to the run's end (the resume compares the count in use), then torch's again
            with log.capturing(), use_threads(plan.train.threads):
                plan = plan.decided(decide(plan, run_dir, ctx, log.say))  # rank 0 decides, every rank agrees
                if plan.resume.finished:
                    log.say(plan.resume.finished)
                    return finished_summary(run_dir)
                if plan.resume.closing:
                    log.say(plan.resume.closing)
                return Trainer(plan, ctx, run_dir, claim, log).train()
        except BaseException as e:
            log.failure(e)
            raise
        finally:
            log.close()
            ctx.shutdown()


class Trainer:
    """One run of ``plan``: built in ``__init__``, trained by :meth:`train`."""

    # ------------------------------------------------------------------ build
    def __init__(self, plan: Plan, ctx: DistContext, run_dir: Path, claim: Optional[Claim] = None,
                 log: Optional[RunLog] = None):
        t_start, mem_start = start_clock(ctx.device)  # wall time and peak memory count from here
        plan = plan.in_phase(plan.resume.phase)  # a resumed run is built in the phase its checkpoint was saved in
        self.plan, self.ctx, self.run_dir, self.claim = plan, ctx, run_dir, claim
        self.schedule = PhaseSchedule(plan.phases, plan.phase, plan.resume.began)
        self.runlog = log or RunLog(None, enabled=ctx.is_main)
        policy, hw_warnings = build_policy(plan, ctx)  # refuses the impossible before any work
        for k in range(plan.phase + 1, len(plan.phases)):  # a later phase too, rather than hours into the run
            hw_warnings += [f"precision phase {k}: {w}" for w in build_policy(plan.in_phase(k), ctx)[1]]
        hw_warnings += phase_warnings(plan) + plan.family.warnings(plan.model)  # a family's study switch that is on
        self.data = build_data(plan, ctx, self.runlog.say)  # tokens, windows, this rank's batches
        self.built = build_model(plan, ctx, policy, self.data.vocab, self.data.tokens.vocab_size)
        # run_info and the dtype table: what the banner prints and config.yaml records
        self.report = Reporter(plan, ctx, run_dir, t_start, self.runlog, policy, self.data, self.built, mem_start)
        self._build_parts(policy)
        self._build_state()
        self._resume()
        self._open_outputs(([policy.warning] if policy.warning else []) + hw_warnings)
        self.feed: Optional[Prefetcher] = None  # the batches, while the loop runs
        self.phase_first: Optional[int] = None  # the first step of the phase entered last in this launch

    @property
    def tc(self):
        return self.plan.train

    @property
    def model(self) -> nn.Module:
        return self.state.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.state.optimizer

    @property
    def resumed_from(self) -> Optional[Path]:
        """The checkpoint this launch resumed from; None on a fresh start."""
        return self.plan.resume.path

    def _build_parts(self, policy) -> None:
        """The run's optional parts (``parts.py``: each from its config section,
        only those that are on) and the state each step works on."""
        built = build_parts(self.plan, self.ctx, self.built, policy, self.data.batches, self.report.record.write_json)
        self.parts, self.save_hooks = built.parts, built.save_hooks
        self.state = step_state(self.plan, self.built.model, self.built.optimizer, self.built.scaler, policy, self.ctx,
                                built.guard, built.faults)

    def _build_state(self) -> None:
        """The loop's state. Everything in ``self.states`` survives a resume: the
        checkpointer saves and restores each through state_dict/load_state_dict,
        under the names train_state.pt has always used."""
        self.progress = Progress()
        self.states = {"scaler": self.built.scaler, "progress": self.progress, **self.parts.states()}
        tok = self.data.tokens.tokenizer
        self.ckpt = Checkpointer(self.plan, self.run_dir, self.ctx,
                                 meta_extra={"tokenizer": {"name": tok.name, "path": tok.path},
                                             "history": list(self.plan.resume.history)},
                                 hooks=self.save_hooks)  # before (bad steps), during and after (debug.* kills)
        if self.schedule.on:  # where the run is among its precision phases (meta.json has it too, for resume)
            self.states[PhaseSchedule.state_key] = self.schedule
            self.ckpt.meta_extra["phase"] = self.schedule.record()
        if self.plan.checkpoint.keep_best:  # its best so far, resumed with the rest; train_state.pt's keys stay
            self.states["best"] = self.ckpt.best  # those of older checkpoints when it is off
        self.last_saved: Optional[int] = None
        self.stopped_by: Optional[str] = None

    def _resume(self) -> None:
        """Load the checkpoint the plan picked (``resume.py``: chosen, verified and
        compared with this config by rank 0 before anything was built)."""
        r = self.plan.resume
        if r.path is not None:
            self.ckpt.load(r.path, self.model, self.optimizer, self.states, self.state.policy,
                           self.parts.rank_states())
        self.report.resumed(r.path, list(r.history))
        self.start = self.progress.step
        if r.closing:
            self.last_saved = self.start  # the final checkpoint is the one just loaded: not saved again

    def _open_outputs(self, warnings: list[str]) -> None:
        """From here on the run writes its records. Every (re)start first drops what
        the model's current state did not go through: metric rows after the step it
        starts from (all of them on a fresh start) and the summary of an earlier launch."""
        if self.claim is not None:
            self.claim.started = True  # an error from now on keeps what this launch wrote
        self.runlog.keep()
        if self.ctx.is_main:
            (self.run_dir / "summary.json").unlink(missing_ok=True)
        self.metrics = self.report.open(self.start, warnings, self.progress.tokens)

    # ------------------------------------------------------------------- loop
    def train(self) -> dict:
        """Run the remaining steps, then :meth:`summarize`."""
        stop = StopSignal(self.plan.checkpoint.on_signal, announce=self.ctx.is_main)
        self.model.train()
        self.metrics.console.start(initial=self.start)
        try:
            with Prefetcher(self.data.batches, self.start, self.tc.max_steps, self.ctx.device) as feed:
                self.feed = feed
                for step, micro in feed:
                    if self.run_step(step, micro, stop):
                        break
        except BaseException:
            stop.restore()  # never leave our handler installed
            self.metrics.close()  # flush what was logged up to the failure (JSONL, TensorBoard, W&B)
            raise
        # The handler stays through the final checkpoint, evaluation and summary: a SIGTERM there
        # (a scheduler's second one, a preemption) asks for what the run is already doing, and
        # the default action would end it silently, exit 143, without its summary.
        try:
            summary = self.summarize()
        finally:
            stop.restore()
        if stop.flag and not self.stopped_by:
            self.runlog.say(f"{stop.name} came while the run wrote its final records; they were finished first")
        return summary

    def run_step(self, step: int, micro: list, stop: StopSignal) -> bool:
        """One step and everything scheduled after it; True when the run stops here."""
        while (began := self.schedule.due(step)) is not None:  # a precision phase begins before this step
            self.enter_phase(began)
        out = self.train_step(step, micro)
        done = step + 1
        log_now = done == 1 or done % self.tc.log_every == 0 or done == self.tc.max_steps
        row = self.log(done, out) if log_now else {}
        row.update(self.evaluate(done))
        hists = self.observe(done, row)
        decided = self.schedule.decide(done, row, self.ctx)  # a signal a phase waits on (every rank, the same rows)
        if decided is not None:
            self.ckpt.meta_extra["phase"] = self.schedule.record()
            self.metrics.write(f"step {done:>6} | {decided.decision()}")
        if row:
            self.metrics.log(done, row, hists)
        if self.plan.parts.audit_only and done == self.start + 1:
            self.stopped_by = "train.audit_only"  # the audit was the point: no checkpoint of it
            return True
        self.stopped_by = self.stop_reason(done, log_now, stop)
        every = self.plan.checkpoint.every
        best = self.ckpt.new_best(done, row.get("val/loss"))  # checkpoint.keep_best: saved at once
        if self.stopped_by or best or (every and (done % every == 0 or done == self.tc.max_steps)):
            self.checkpoint(done, best)
        if self.stopped_by:
            self.metrics.write(f"step {done:>6} | stopping ({self.stopped_by}); resume with resume=auto "
                               f"hydra.run.dir={self.run_dir}")
        return self.stopped_by is not None

    def enter_phase(self, began: Began) -> None:
        """Switch to the precision phase ``began`` names before its step: the phase's model,
        optimizer, loss scaler and parts built, the state carried over (``phases.switch``),
        outside the training time."""
        with self.report.clock.paused():
            plan, policy, built, carried = switch(self.plan, self.ctx, self.built, self.data, began)
            self.plan, self.built = plan, built
            old_parts = self.parts
            self._build_parts(policy)  # the parts watch the new model; what they learned so far carries
            self.parts.take_over(old_parts)
            self.states.update(scaler=built.scaler, **self.parts.states())
            self.schedule.entered(began)
            self.ckpt.plan = plan  # meta.json names the optimizer this phase steps with
            self.ckpt.meta_extra["phase"] = self.schedule.record()
            self.phase_first = began.step
            self.report.phase_began(began, plan, policy, built, carried)

    def train_step(self, step: int, micro: list) -> LoopStep:
        """Set the learning rate, run the step's math (``step.train_step``) inside
        what the parts wrap it in, count it."""
        lr = set_lr_at(self.optimizer, step, self.plan.optim, self.tc.max_steps)
        with self.parts.around_step(step):
            result = train_step(self.state, micro, self.parts, step)
        reads = self.parts.after_step(step, result)
        self.progress.step = step + 1
        self.progress.tokens += self.data.tokens_per_step
        self.report.clock.step()
        self.metrics.console.advance()
        if step == self.start or step == self.phase_first:
            self.report.after_first_step(self.model, self.optimizer, self.plan.phase)
        return LoopStep(result, lr, reads)

    def log(self, done: int, out: LoopStep) -> dict:
        """The training metrics of step ``done``: one read-back (the logging cadence's host
        sync), the row, then the parts on it: the non-finite check (a non-finite loss or step,
        a collapsed loss scale stop the run) and the alerts (skip rate, loss spike)."""
        seen = read_back(self.ctx, out.result, out.reads, self.state.scaler)
        row = self.report.row(done, out, seen, self.progress.tokens, self.feed)
        self.parts.on_log(done, seen, row, self.metrics.write)
        return row

    def evaluate(self, done: int) -> dict:
        """Validation loss at the eval cadence and at the last step (there also on the
        whole split, :meth:`evaluate_whole`); not counted as training time."""
        tc = self.tc
        if not (tc.eval_every and (done % tc.eval_every == 0 or done == tc.max_steps)):
            return {}
        with self.report.clock.paused():
            row = self.report.evaluated(done, self.val_loss(self.report.val_set))
            if done == tc.max_steps and tc.eval_whole_split:
                self.evaluate_whole(done)
            self.report.sample(done, self.model, self.state.policy)
        return row

    def val_loss(self, val: ValSet) -> float:
        """The model's mean loss on ``val``, each rank its share (the same call under every wrapper)."""
        mbs, ctx = self.data.micro_batch, self.ctx
        return evaluate(self.model, self.state.policy, ctx, val.batches(mbs, ctx.dp_rank, ctx.dp_world))

    def evaluate_whole(self, done: int) -> None:
        """The last step's loss on every window of the val split (``train.eval_whole_split``),
        or the figure just measured where ``train.eval_tokens`` already covers the split.
        The run's generators are put back after it (``fork_rng``): a lab recipe that rounds
        stochastically or draws Hadamard signs in the forward would draw from them, and the
        checkpoint saved next, with its generator states, must be the one a run without
        this evaluation saves."""
        whole = self.report.whole_set
        loss = None
        if not self.report.val_set.is_whole:
            device = self.ctx.device
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                loss = self.val_loss(whole)
        self.report.evaluated_whole(done, loss)

    def observe(self, done: int, row: dict) -> dict:
        """What the parts measured on step ``done`` (numerics monitor, collective
        bytes, the dtype audit, stability warnings), into ``row``; returns histograms."""
        return self.parts.observe(done, row, self.metrics.write)

    def stop_reason(self, done: int, log_now: bool, stop: StopSignal) -> Optional[str]:
        """Why the run stops after step ``done``, or None to go on."""
        # A signal may reach ranks at different steps: they agree through a tiny
        # all-reduce, a host sync, so several ranks look only when they log.
        if (self.ctx.world == 1 or log_now) and self.ctx.any_rank(stop.flag):
            return stop.name or "a signal on another rank"
        stop_after = self.tc.stop_after
        if stop_after is not None and stop_after <= done < self.tc.max_steps:
            return f"train.stop_after={stop_after}"
        return None

    def checkpoint(self, done: int, best: bool = False) -> None:
        """Save step ``done`` (``best``: its validation loss is the lowest so far); never
        after a bad step, and not counted as training time."""
        check_present(self.run_dir)  # a save into a removed run directory would make it again, for itself alone
        with self.report.clock.paused():
            self.ckpt.save(done, self.model, self.optimizer, self.states, self.parts.rank_states())
        self.last_saved = done
        self.metrics.write(f"step {done:>6} | checkpoint saved: {self.ckpt.root / f'step-{done}'}"
                           + (" (the best validation loss so far, kept: checkpoint.keep_best)" if best else ""))

    # -------------------------------------------------------------- summarize
    def summarize(self) -> dict:
        """Final checkpoint if due, summary.json, the closing lines. A launch that
        closes a run (``plan.closing``) first does what the lost launch did not:
        prune, and take the final figures from metrics.jsonl."""
        self.metrics.console.close()
        step = self.progress.step
        ck = self.plan.checkpoint
        if (ck.every or ck.at_end) and self.last_saved != step and step == self.tc.max_steps:
            self.checkpoint(step)
        if self.plan.resume.closing:  # the lost launch's unfinished business: its pruning, its final figures
            self.ckpt.prune()
            self.report.logged_up_to(step)
        figures = self.parts.summarize(self.metrics.write)  # the parts' closing tables and figures
        figures.update(self._best_summary())
        summary = self.report.finish(self.model, self.optimizer, self.progress, self.stopped_by, figures)
        self.ctx.barrier()  # leave together: the next multirun job starts on every rank at once
        return summary

    def _best_summary(self) -> dict:
        """With ``checkpoint.keep_best``: which step is the best checkpoint, said in a
        line and as summary.json's ``best/step``, ``best/val_loss``, ``best/checkpoint``."""
        best = self.ckpt.best.summary()
        if not best:
            return {}
        path = self.ckpt.root / f"step-{best['best/step']}"
        self.metrics.write(f"best checkpoint: step {best['best/step']} (val loss {best['best/val_loss']:.4f}): "
                           f"{path}")
        return {**best, "best/checkpoint": str(path)}
