"""``run(cfg)``: one training run, as a :class:`Trainer`.

Read it top to bottom like a table of contents:

- ``Trainer.__init__`` builds: data, model, precision, wrapper, optimizer,
  the loop's resumable state, resume, outputs;
- ``Trainer.train`` is the loop: for each step, ``train_step`` (the math, in
  ``step.py``), then ``log``, ``evaluate``, ``observe`` (monitor, collectives,
  audit), ``checkpoint``; at the end ``summarize``.

The concerns the loop calls into have their own homes: inf/nan handling and
fault injection in ``faults.py``; everything the run reports (run_info, the
banner, metric rows, alerts, the numerics monitor's figures, summary.json and
the closing lines) in ``report.py``, which the loop only tells when.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from omegaconf import DictConfig

from mptrain.core.errors import ConfigError
from mptrain.data.batches import Prefetcher, ValSet
from mptrain.distributed.parallel import DistContext, export_submitit_env, setup
from mptrain.precision.rules import validate
from mptrain.run.build import build_data, build_model, build_policy
from mptrain.checkpoint.checkpointer import Checkpointer, Progress
from mptrain.run.console import LOG_NAME, RunLog
from mptrain.run.faults import (
    FaultInjector,
    NonFiniteError,
    NonFiniteHandler,
    NonFiniteStep,
)
from mptrain.run.report import LoopStep, Reporter, numerics_monitor, start_clock
from mptrain.run.resume import ResumePlan, finished_summary
from mptrain.run.resume import plan as resume_plan
from mptrain.run.rundir import Claim, held
from mptrain.run.step import evaluate, set_lr_at, train_step
from mptrain.run.stop import StopSignal

__all__ = ["run", "Trainer", "NonFiniteError"]


def run(cfg: DictConfig, run_dir: Optional[str | Path] = None) -> dict:
    """Train as configured; returns the summary (also written to summary.json).

    The run holds its directory's lock throughout (``rundir.py``); a user error
    raised before training starts leaves the directory as it found it."""
    run_dir = Path(run_dir) if run_dir else _hydra_run_dir()
    export_submitit_env()  # a submitit task learns its rank here; only rank 0 locks the directory
    with held(run_dir) as claim:
        validate(cfg)
        ctx = setup(cfg.parallel, cfg.train.device)
        log = RunLog(run_dir / LOG_NAME, enabled=ctx.is_main)  # the console, kept in <run>/train.log
        try:
            with log.capturing():
                plan = resume_plan(cfg, run_dir, ctx, log.say)
                if plan.finished:
                    log.say(plan.finished)
                    return finished_summary(run_dir)
                if plan.closing:
                    log.say(plan.closing)
                return Trainer(cfg, ctx, run_dir, plan, claim, log).train()
        except BaseException as e:
            log.failure(e)
            raise
        finally:
            log.close()
            ctx.shutdown()


def _hydra_run_dir() -> Path:
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        raise ConfigError("run(cfg) outside @hydra.main needs an explicit run_dir.")
    return Path(HydraConfig.get().runtime.output_dir)


class Trainer:
    """One run: built in ``__init__``, trained by :meth:`train`."""

    # ------------------------------------------------------------------ build
    def __init__(self, cfg: DictConfig, ctx: DistContext, run_dir: Path, plan: Optional[ResumePlan] = None,
                 claim: Optional[Claim] = None, log: Optional[RunLog] = None):
        self.t_start = start_clock(ctx.device)  # wall time and peak memory count from here
        validate(cfg, ctx.world)
        self.cfg, self.ctx, self.run_dir, self.tc = cfg, ctx, run_dir, cfg.train
        self.plan, self.claim = plan or ResumePlan(), claim
        self.runlog = log or RunLog(None, enabled=ctx.is_main)
        self.say = self.runlog.say
        self.policy, self.hw_warnings = build_policy(cfg, ctx)  # refuses the impossible before any work
        self._build_data()
        self._build_model()
        self._build_state()
        self._describe()
        self._resume()
        self._open_outputs()

    def _build_data(self) -> None:
        """Tokens, windows and this rank's batches (``build.py``)."""
        d = build_data(self.cfg, self.ctx, self.say)
        self.tokens, self.vocab, self.mbs, self.accum = d.tokens, d.vocab, d.micro_batch, d.accum
        self.val_windows, self.batches, self.tokens_per_step = d.val_windows, d.batches, d.tokens_per_step

    def _build_model(self) -> None:
        """The wrapped model, its optimizer and loss scaler (``build.py``), then
        what watches over them: fault handling and the numerics monitor."""
        cfg, ctx = self.cfg, self.ctx
        m = build_model(cfg, ctx, self.policy, self.vocab, self.tokens.vocab_size)
        self.model, self.n_params, self.compile_blocks = m.model, m.n_params, m.compile_blocks
        self.opt_choice, self.optimizer, self.scaler = m.opt_choice, m.optimizer, m.scaler
        self.faults = FaultInjector(cfg.debug, self.model, ctx.rank)
        self.nonfinite = NonFiniteHandler(self.tc.on_nonfinite.value, self.optimizer, self.scaler, self.model,
                                          self.policy, ctx, self.batches, self.faults,
                                          cfg.precision.loss_scale.min_loss_scale)
        self.monitor = numerics_monitor(cfg, self.model, self.optimizer, self.policy, ctx)

    def _build_state(self) -> None:
        """The loop's state. Everything in ``self.states`` survives a resume: the
        checkpointer saves and restores each through state_dict/load_state_dict."""
        cfg = self.cfg
        self.progress = Progress()
        self.report = Reporter(cfg, self.ctx, self.run_dir, self.t_start, self.policy, self.scaler, self.nonfinite,
                               self.tokens_per_step)
        self.states = {"scaler": self.scaler, "progress": self.progress, **self.report.states()}
        if self.nonfinite.guard is not None:
            self.states["nonfinite_guard"] = self.nonfinite.guard
        self.ckpt = Checkpointer(cfg.checkpoint, self.run_dir, self.ctx, cfg, hooks=[self.faults],
                                 meta_extra={"tokenizer": {"name": self.tokens.tokenizer.name,
                                                           "path": self.tokens.tokenizer.path},
                                             "history": self.plan.history})
        self.clock = self.report.clock  # training time: eval and checkpoints pause it
        self.last_saved: Optional[int] = None
        self.stopped_by: Optional[str] = None

    def _describe(self) -> None:
        """run_info and the dtype table (``report.py``): what the banner prints and config.yaml records."""
        self.report.describe(self.model, self.optimizer, self.policy, self.opt_choice, self.tokens, self.n_params,
                             self.vocab, (self.mbs, self.accum), self.compile_blocks)

    def _resume(self) -> None:
        """Load the checkpoint the plan picked (``resume.py``: chosen, verified and
        compared with this config by rank 0 before anything was built)."""
        self.resumed_from = self.plan.path
        if self.resumed_from is not None:
            self.ckpt.load(self.resumed_from, self.model, self.optimizer, self.states, self.policy)
        self.report.resumed(self.resumed_from, self.plan.history)
        self.start = self.progress.step
        if self.plan.closing:
            self.last_saved = self.start  # the final checkpoint is the one just loaded: not saved again

    def _open_outputs(self) -> None:
        """From here on the run writes its records. Every (re)start first drops what
        the model's current state did not go through: metric rows after the step it
        starts from (all of them on a fresh start) and the summary of an earlier launch."""
        if self.claim is not None:
            self.claim.started = True  # an error from now on keeps what this launch wrote
        self.runlog.keep()
        if self.ctx.is_main:
            (self.run_dir / "summary.json").unlink(missing_ok=True)
        warnings = ([self.policy.warning] if self.policy.warning else []) + self.hw_warnings
        self.metrics = self.report.open(self.start, self.runlog, warnings, self.progress.tokens)

    # ------------------------------------------------------------------- loop
    def train(self) -> dict:
        """Run the remaining steps, then :meth:`summarize`."""
        stop = StopSignal(self.cfg.checkpoint.on_signal)
        self.model.train()
        self.metrics.console.start(initial=self.start)
        try:
            with Prefetcher(self.batches, self.start, self.tc.max_steps, self.ctx.device) as feed:
                self.feed = feed
                for step, micro in feed:
                    if self.run_step(step, micro, stop):
                        break
        except BaseException:
            self.metrics.close()  # flush what was logged up to the failure (JSONL, TensorBoard, W&B)
            raise
        finally:
            stop.restore()  # also when a step raises: never leave our handler installed
        return self.summarize()

    def run_step(self, step: int, micro: list, stop: StopSignal) -> bool:
        """One step and everything scheduled after it; True when the run stops here."""
        out = self.train_step(step, micro)
        done = step + 1
        log_now = done == 1 or done % self.tc.log_every == 0 or done == self.tc.max_steps
        row = self.log(done, out) if log_now else {}
        row.update(self.evaluate(done))
        hists = self.observe(step, out, row)
        self.report.warn_stability(done, row)  # stability/* of a monitored step
        if row:
            self.metrics.log(done, row, hists)
        if self.tc.audit_only:
            self.stopped_by = "train.audit_only"
            return True  # the audit was the point: no checkpoint of a one-step run
        self.stopped_by = self.stop_reason(done, log_now, stop)
        every = self.cfg.checkpoint.every
        if self.stopped_by or (every and (done % every == 0 or done == self.tc.max_steps)):
            self.checkpoint(done)
        if self.stopped_by:
            self.metrics.write(f"step {done:>6} | stopping ({self.stopped_by}); resume with resume=auto "
                               f"hydra.run.dir={self.run_dir}")
        return self.stopped_by is not None

    def train_step(self, step: int, micro: list) -> LoopStep:
        """Set the learning rate, run the step's math (``step.train_step``), count it."""
        lr = set_lr_at(self.optimizer, step, self.cfg.optim, self.tc.max_steps)
        self.faults.begin_step(step)
        self.monitor.start_step(step)
        auditing = self.tc.audit and step == self.start
        if auditing:  # the audit records the step's own ops: no attention probe (monitoring) inside them
            self.monitor.pause_probes()
        try:
            with self.report.instruments(self.monitor.active(step), auditing, self.compile_blocks, self.model,
                                         self.optimizer, self.policy) as (comm, audit):
                result = train_step(self.model, self.optimizer, self.scaler, self.policy, self.ctx, micro,
                                    self.tc.grad_clip, self.monitor, self.nonfinite.guard, step,
                                    z_loss=self.tc.z_loss, faults=self.faults)
        except NonFiniteStep:
            raise self.nonfinite.error(step) from None
        self.nonfinite.watch_loss(result.loss, step)  # on the device: read back with the loss when logging
        self.progress.step = step + 1
        self.progress.tokens += self.tokens_per_step
        self.clock.step()
        self.metrics.console.advance()
        if step == self.start:
            self.report.after_first_step(self.model, self.optimizer)
        return LoopStep(result, lr, comm, audit)

    def log(self, done: int, out: LoopStep) -> dict:
        """The training metrics of step ``done`` (``report.py``): the host syncs of the logging cadence."""
        return self.report.row(done, out, self.progress.tokens, self.feed)

    def evaluate(self, done: int) -> dict:
        """Validation loss at the eval cadence and at the last step; not counted as training time."""
        tc = self.tc
        if not (tc.eval_every and (done % tc.eval_every == 0 or done == tc.max_steps)):
            return {}
        with self.clock.paused():
            # The same windows at every evaluation and on any batch or world size (cheap to lay out again).
            val = ValSet(self.val_windows, tc.eval_tokens)
            loss = evaluate(self.model, self.policy, self.ctx, val.batches(self.mbs, self.ctx.rank, self.ctx.world))
            row = self.report.evaluated(done, loss, val)
            self.report.sample(done, self.model, self.policy)
        return row

    def observe(self, step: int, out: LoopStep, row: dict) -> dict:
        """Numerics monitor, collective bytes and the dtype audit of this step, into
        ``row`` (``report.py``); returns the monitor's histograms."""
        return self.report.observe(step, self.start, out, row, self.monitor)

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

    def checkpoint(self, done: int) -> None:
        """Save step ``done``; never after a bad step, and not counted as training time."""
        self.nonfinite.check_deferred(done)
        with self.clock.paused():
            self.ckpt.save(done, self.model, self.optimizer, self.states)
        self.last_saved = done
        self.metrics.write(f"step {done:>6} | checkpoint saved: {self.ckpt.root / f'step-{done}'}")

    # -------------------------------------------------------------- summarize
    def summarize(self) -> dict:
        """Final checkpoint if due, summary.json, the closing lines. A launch that
        closes a run (``plan.closing``) first does what the lost launch did not:
        prune, and take the final figures from metrics.jsonl."""
        self.metrics.console.close()
        step = self.progress.step
        ck = self.cfg.checkpoint
        if (ck.every or ck.at_end) and self.last_saved != step and step == self.tc.max_steps:
            self.checkpoint(step)
        if self.plan.closing:  # the lost launch's unfinished business: its pruning, its final figures
            self.ckpt.prune()
            self.report.logged_up_to(step, ValSet(self.val_windows, self.tc.eval_tokens))
        summary = self.report.finish(self.model, self.optimizer, self.progress, self.stopped_by)
        self.ctx.barrier()  # leave together: the next multirun job starts on every rank at once
        return summary
