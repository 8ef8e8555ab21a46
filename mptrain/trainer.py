"""``run(cfg)``: one training run, as a :class:`Trainer`.

Read it top to bottom like a table of contents:

- ``Trainer.__init__`` builds: data, model, precision, wrapper, optimizer,
  the loop's resumable state, resume, outputs;
- ``Trainer.train`` is the loop: for each step, ``train_step`` (the math, in
  ``step.py``), then ``log``, ``evaluate``, ``observe`` (monitor, collectives,
  audit), ``checkpoint``; at the end ``summarize``.

The concerns the loop calls into have their own homes: inf/nan handling and
fault injection in ``faults.py``, the run record (config.yaml, banner,
summary.json) in ``record.py``, loss-spike and skip-rate warnings in
``alerts.py``, throughput in ``perf.py``.
"""
from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Optional

import torch
from omegaconf import DictConfig, OmegaConf

from . import data as data_mod
from . import optimizers, rundir
from .alerts import SkipRateWarning, SpikeDetector
from .stability import StabilityWarnings
from .checkpoint import Checkpointer, Progress, StopSignal
from .comm import counting
from .config import ConfigError, ParallelMode
from .config_checks import micro_steps, validate
from .doctor import check_precision
from .faults import FaultInjector, NonFiniteError, NonFiniteHandler, NonFiniteStep
from .memory import estimate as memory_estimate
from .memory import summary_figures
from .console import LOG_NAME, RunLog, fmt, plain_cadence
from .metrics import Metrics
from .model import GPT, GPTShape
from .numerics import NumericsMonitor
from .parallel import DistContext, export_submitit_env, setup, wrap
from .perf import Throughput, flops_per_token, matmul_kind, mfu, peak_flops
from .precision import PrecisionPolicy, dtype_name
from .resume import ResumePlan, finished_summary
from .resume import plan as resume_plan
from .record import ComputeDtypeProbe, RunRecord, banner, observed_dtypes, peak_memory, reset_peak_memory
from .shards import local_shard
from .sample import generate
from .step import build_optimizer, decay_names, evaluate, lr_at, train_step

__all__ = ["run", "Trainer", "NonFiniteError"]


def run(cfg: DictConfig, run_dir: Optional[str | Path] = None) -> dict:
    """Train as configured; returns the summary (also written to summary.json).

    The run holds its directory's lock throughout (``rundir.py``); a user error
    raised before training starts leaves the directory as it found it."""
    run_dir = Path(run_dir) if run_dir else _hydra_run_dir()
    export_submitit_env()  # a submitit task learns its rank here; only rank 0 locks the directory
    with rundir.held(run_dir) as claim:
        validate(cfg)
        ctx = setup(cfg.parallel, cfg.train.device)
        log = RunLog(run_dir / LOG_NAME, enabled=ctx.is_main)  # the console, kept in <run>/train.log
        try:
            with log.capturing():
                plan = resume_plan(cfg, run_dir, ctx, log.say)
                if plan.finished:
                    log.say(plan.finished)
                    return finished_summary(run_dir)
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


def _quiet(*_a, **_k) -> None:
    pass


def _eager_if(enabled: bool):
    """Compiled blocks run eagerly inside (a monitored step). The monitor hooks
    every block with its own closure for that step only; traced, each hook
    would recompile every block on and off the monitored steps, past dynamo's
    recompile limit, after which the blocks fall back to eager for good."""
    return torch.compiler.set_stance("force_eager") if enabled else contextlib.nullcontext()


@contextlib.contextmanager
def _audit(enabled: bool, model, optimizer, policy):
    """The dtype audit of one step (``audit.py``), or None when not auditing.
    Compiled blocks run eagerly for it: a dispatch mode cannot look inside a graph."""
    if not enabled:
        yield None
        return
    from .audit import DtypeAudit

    with torch.compiler.set_stance("force_eager"), DtypeAudit(model, optimizer, policy) as audit:
        yield audit


class Trainer:
    """One run: built in ``__init__``, trained by :meth:`train`."""

    # ------------------------------------------------------------------ build
    def __init__(self, cfg: DictConfig, ctx: DistContext, run_dir: Path, plan: Optional[ResumePlan] = None,
                 claim: Optional[rundir.Claim] = None, log: Optional[RunLog] = None):
        self.t_start = time.perf_counter()
        reset_peak_memory(ctx.device)
        validate(cfg, ctx.world)
        self.cfg, self.ctx, self.run_dir, self.tc = cfg, ctx, run_dir, cfg.train
        self.plan, self.claim = plan or ResumePlan(), claim
        self.runlog = log or RunLog(None, enabled=ctx.is_main)
        self.say = self.runlog.say
        self.record = RunRecord(cfg, run_dir, ctx.is_main)
        self.policy = PrecisionPolicy(cfg.precision, ctx.device, fsdp2=ctx.mode == ParallelMode.fsdp)
        self.hw_warnings = check_precision(self.policy, ctx.device)  # refuses the impossible before any work
        self._build_data()
        self._build_model()
        self._build_state()
        self._describe()
        self._resume()
        self._open_outputs()

    def _build_data(self) -> None:
        cfg, ctx, tc = self.cfg, self.ctx, self.tc
        self.mbs, self.accum = micro_steps(cfg, ctx.world)
        # The first rank of each node builds the caches (they live on node-local
        # disk); the others wait, then read them.
        if ctx.local_rank == 0:
            self.tokens = data_mod.prepare(cfg.data, log=self.say)
        ctx.barrier()
        if ctx.local_rank != 0:
            self.tokens = data_mod.prepare(cfg.data, log=_quiet)
        self.vocab = cfg.model.vocab_size or data_mod.padded_vocab(self.tokens.vocab_size)
        if self.vocab < self.tokens.vocab_size:
            raise ConfigError(
                f"model.vocab_size={self.vocab} is smaller than the tokenizer's vocabulary "
                f"({self.tokens.vocab_size}); leave model.vocab_size=null to take it from the tokenizer.")
        block = cfg.model.block_size
        self.train_windows = data_mod.Windows(self.tokens.train, block)
        self.val_windows = data_mod.Windows(self.tokens.val, block)
        self.batches = data_mod.Batches(self.train_windows, tc.global_batch_size, self.mbs, ctx.rank, ctx.world,
                                        tc.seed)
        self.tokens_per_step = tc.global_batch_size * block

    def _build_model(self) -> None:
        cfg, ctx, tc, m = self.cfg, self.ctx, self.tc, self.cfg.model
        torch.manual_seed(tc.seed)  # dropout's stream: the same on every rank
        # Built on the meta device (no memory, no random draws); wrap() gives it storage
        # and its initial weights from a generator seeded with train.seed: after sharding
        # under FSDP2, so a large model never exists whole on one rank, and the same
        # values whatever the world size or device (GPT.reset_parameters says how).
        with torch.device("meta"):
            model = GPT(GPTShape(self.vocab, m.n_layer, m.n_head, m.d_model, m.block_size, m.dropout, m.bias,
                                 qk_norm=m.qk_norm))
        self.n_params = model.num_params()
        decay = decay_names(model)  # before wrapping: FSDP1 flattens shapes
        if ctx.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = tc.tf32
            torch.backends.cudnn.allow_tf32 = tc.tf32
        self.compile_blocks = tc.compile if tc.compile is not None else ctx.device.type == "cuda"
        self.model = wrap(model, self.policy, ctx, activation_checkpointing=tc.activation_checkpointing.value == "block",
                          compile_blocks=self.compile_blocks, init_seed=tc.seed)
        self.opt_choice = optimizers.choose(cfg)
        self.optimizer = build_optimizer(self.model, decay, cfg.optim, ctx.device, self.opt_choice)
        self.policy.attach_optimizer(self.optimizer, self.model)  # float8 scales follow every optimizer step
        self.scaler = self.policy.make_scaler(distributed=ctx.has_group and ctx.world > 1)
        self.faults = FaultInjector(cfg.debug, self.model, ctx.rank)
        self.nonfinite = NonFiniteHandler(tc.on_nonfinite.value, self.optimizer, self.scaler, self.model,
                                          self.policy, ctx, self.batches, self.faults,
                                          cfg.precision.loss_scale.min_loss_scale)
        fp8_watch = (self.policy.fp8.watch(self.model, cfg.monitor.fp8_whatif)
                     if self.policy.fp8 and cfg.monitor.fp8_casts else None)
        self.monitor = NumericsMonitor(cfg.monitor, self.model, reduce_sum=ctx.shard_sum, reduce_max=ctx.shard_max,
                                       reduce_max_all=ctx.all_reduce_max, reduce_sum_all=ctx.all_reduce_sum,
                                       fp8_watch=fp8_watch)
        self.monitor.attach_optimizer(self.optimizer)  # Adam's health on monitored steps (stability.py)
        self.compute_probe = ComputeDtypeProbe(self.model)

    def _build_state(self) -> None:
        """The loop's state. Everything in ``self.states`` survives a resume: the
        checkpointer saves and restores each through state_dict/load_state_dict."""
        cfg = self.cfg
        self.progress = Progress()
        self.spikes = SpikeDetector(cfg.monitor.spike_factor, cfg.monitor.spike_window)
        self.stability_warnings = StabilityWarnings(cfg.monitor, dtype_name(self.policy.compute_dtype))
        self.skip_warning = SkipRateWarning(cfg.precision.loss_scale)
        self.states = {"scaler": self.scaler, "progress": self.progress, "spikes": self.spikes,
                       "skip_warning": self.skip_warning, "stability_warnings": self.stability_warnings}
        if self.nonfinite.guard is not None:
            self.states["nonfinite_guard"] = self.nonfinite.guard
        self.ckpt = Checkpointer(cfg.checkpoint, self.run_dir, self.ctx, cfg, self.faults,
                                 meta_extra={"tokenizer": {"name": self.tokens.tokenizer.name,
                                                           "path": self.tokens.tokenizer.path},
                                             "history": self.plan.history})
        self.clock = Throughput(self.tokens_per_step)
        self.count_comm = cfg.monitor.comm and self.ctx.mode != ParallelMode.none
        self.last_train: dict = {}
        self.last_val: Optional[float] = None
        self.last_comm: dict = {}
        self.fp8_casts: Optional[dict] = None  # the last monitored step's float8 cast figures (fp8stats.report)
        self.last_saved: Optional[int] = None
        self.stopped_by: Optional[str] = None

    def _describe(self) -> None:
        """run_info and the dtype table: what the banner prints and config.yaml records."""
        cfg, ctx, tc, tokens = self.cfg, self.ctx, self.tc, self.tokens
        self.dtypes = {**self.policy.describe(), **ctx.wrapper_dtypes}
        c = self.opt_choice  # the moments as configured; after step 1, as observed
        self.dtypes["optimizer_state"] = c.state + (f" + Kahan compensation {c.param_dtype}" if c.kahan else "")
        info = self.record.info
        info.update({
            "dtypes": self.dtypes, "world_size": ctx.world, "device": str(ctx.device), "backend": ctx.backend,
            "micro_batch_size": self.mbs, "grad_accum_steps": self.accum, "vocab_size": self.vocab,
            "tokenizer": tokens.tokenizer.name, "tokenizer_path": tokens.tokenizer.path, "corpus": tokens.source,
            "train_tokens": int(len(tokens.train)), "val_tokens": int(len(tokens.val)), "params": self.n_params,
            "compile": self.compile_blocks, "activation_checkpointing": tc.activation_checkpointing.value,
            "fused_adamw": any(g.get("fused") for g in self.optimizer.param_groups),
            "optimizer": self.opt_choice.describe()})
        self.fp8_report = self.policy.fp8.report if self.policy.fp8 else None
        if self.fp8_report is not None:
            # Weights FSDP2 will all-gather in float8 carry torchao's float8-cast tensor subclass.
            self.fp8_report["float8_all_gather_weights"] = sum(
                "Float8" in type(local_shard(p)).__name__ for p in self.model.parameters())
            info["fp8"] = self.fp8_report
        m = cfg.model
        self.flops_tok = flops_per_token(self.n_params, m.n_layer, m.d_model, m.block_size)
        device_name = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu"
        kind = matmul_kind(dtype_name(self.policy.compute_dtype), self.policy.fp8_enabled,
                           ctx.device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32)
        self.peak = peak_flops(device_name, kind, tc.peak_tflops)
        self.mem_est = memory_estimate(cfg, self.vocab, ctx.world, self.mbs)
        info["flops_per_token"] = self.flops_tok
        info["stability"] = {"model.qk_norm": m.qk_norm, "train.z_loss": tc.z_loss,
                             "optim.update_clip": cfg.optim.update_clip}
        info["memory_estimate_gib"] = {k: round(v / 2**30, 4) for k, v in self.mem_est.parts().items()}

    def _resume(self) -> None:
        """Load the checkpoint the plan picked (``resume.py``: chosen, verified and
        compared with this config by rank 0 before anything was built)."""
        self.resumed_from = self.plan.path
        if self.resumed_from is not None:
            self.ckpt.load(self.resumed_from, self.model, self.optimizer, self.states, self.policy)
            self.record.info["resumed_from"] = str(self.resumed_from)
        if self.plan.history:
            self.record.info["config_history"] = self.plan.history
        self.start = self.progress.step

    def _open_outputs(self) -> None:
        """From here on the run writes its records. Every (re)start first drops what
        the model's current state did not go through: metric rows after the step it
        starts from (all of them on a fresh start) and the summary of an earlier launch."""
        cfg, tc, run_dir = self.cfg, self.tc, self.run_dir
        if self.claim is not None:
            self.claim.started = True  # an error from now on keeps what this launch wrote
        self.runlog.keep()
        if self.ctx.is_main:
            (run_dir / "summary.json").unlink(missing_ok=True)
        name, tags = self.record.names()
        self.record.write_config()
        total = self.start + 1 if tc.audit_only else tc.max_steps  # the audit stops after one step
        self.metrics = Metrics(run_dir, cfg.log, total, self.ctx.is_main, self.record.resolved(), name, tags,
                               start_step=self.start, runlog=self.runlog,
                               plain_every=plain_cadence(cfg.log.plain_every, tc.log_every, tc.max_steps))
        self.say(banner(cfg, self.ctx, self.record.info, self.dtypes, self.tokens, self.tokens_per_step, run_dir))
        for w in ([self.policy.warning] if self.policy.warning else []) + self.hw_warnings:
            self.say(f"WARNING: {w}")
        if self.resumed_from is not None:
            self.say(f"resumed from {self.resumed_from} at step {self.start} ({self.progress.tokens:,} tokens seen)")
        if tc.audit:
            self.say(f"dtype audit of step {self.start + 1}: every operator's dtypes into {run_dir / 'audit.json'}"
                     + ("; the run stops after it (train.audit_only)" if tc.audit_only else ""))
        self.metrics.text("config", "```\n" + OmegaConf.to_yaml(cfg) + "\n```", wandb=False)  # W&B has it

    # ------------------------------------------------------------------- loop
    def train(self) -> dict:
        """Run the remaining steps, then :meth:`summarize`."""
        stop = StopSignal(self.cfg.checkpoint.on_signal)
        self.model.train()
        self.metrics.console.start(initial=self.start)
        self.waited = {"wait_s": 0.0, "copy_s": 0.0}  # the data wait of the logged laps, for the summary
        try:
            with data_mod.Prefetcher(self.batches, self.start, self.tc.max_steps, self.ctx.device) as feed:
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
        row.update(self._alert(*self.stability_warnings.check(done, row)))  # stability/* of a monitored step
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

    def train_step(self, step: int, micro: list) -> dict:
        """Set the learning rate, run the step's math (``step.train_step``), count it."""
        lr = lr_at(step, self.cfg.optim, self.tc.max_steps)
        optimizers.set_lr(self.optimizer, lr)
        self.faults.begin_step(step)
        self.monitor.start_step(step)
        auditing = self.tc.audit and step == self.start
        if auditing:  # the audit records the step's own ops: no attention probe (monitoring) inside them
            self.monitor.pause_probes()
        try:
            with _eager_if(self.compile_blocks and self.monitor.active(step)), \
                    counting(self.count_comm and self.monitor.active(step)) as comm, \
                    _audit(auditing, self.model, self.optimizer, self.policy) as audit:
                out = train_step(self.model, self.optimizer, self.scaler, self.policy, self.ctx, micro,
                                 self.tc.grad_clip, self.faults.inject_inf(step), self.monitor, self.nonfinite.guard,
                                 step, inject_value=self.faults.grad_value, z_loss=self.tc.z_loss)
        except NonFiniteStep:
            raise self.nonfinite.error(step) from None
        self.nonfinite.watch_loss(out["loss"], step)  # on the device: read back with the loss when logging
        self.progress.step = step + 1
        self.progress.tokens += self.tokens_per_step
        self.clock.step()
        self.metrics.console.advance()
        if step == self.start:
            self._after_first_step()
        return {**out, "lr": lr, "comm": comm, "audit": audit}

    def _after_first_step(self) -> None:
        """The dtypes the objects hold once a step has run (optimizer state exists now)."""
        self.dtypes.update(observed_dtypes(self.model, self.optimizer))
        self.dtypes["compute_observed"] = self.compute_probe.close()
        self.record.write_config()

    def log(self, done: int, out: dict) -> dict:
        """The training metrics of step ``done``: the host syncs of the logging cadence."""
        ctx = self.ctx
        self.nonfinite.check_guard(done)
        flag = self.nonfinite.loss_flag()  # fp16 under abort: was any loss since the last look non-finite?
        # The switches' own figures ride along in the same read-back.
        extra = {k: out[k] for k in ("z_loss", "update_clip_max") if out.get(k) is not None}
        read = torch.stack([out["loss"].float(), *(v.float() for v in extra.values())]
                           + ([flag] if flag is not None else []))
        loss, *rest = ctx.all_reduce_mean(read).tolist()  # host sync: read back only at this cadence
        extra, flagged = dict(zip(extra, rest)), rest[len(extra):]
        self.nonfinite.check_loss(done, loss, bool(flagged and flagged[0] > 0))  # before the scale: the cause
        elapsed, steps = self.clock.lap()
        tps = steps * self.tokens_per_step / elapsed
        row = {"train/loss": loss, "train/lr": out["lr"], "train/grad_norm": float(out["grad_norm"]),
               "train/tokens": self.progress.tokens, "perf/tokens_per_s": tps, "perf/step_time_s": elapsed / steps,
               **self._data_wait(elapsed, steps),
               **({"perf/mfu": mfu(tps, self.flops_tok, self.peak, ctx.world)} if self.peak else {}),
               **{f"train/{k}": v for k, v in extra.items()}, **peak_memory(ctx.device)}
        row.update(self._amp_metrics(done))
        if self.nonfinite.skipped is not None:
            row["train/nonfinite_skipped"] = int(self.nonfinite.skipped)
        row.update(self._alert(*self.spikes.check(done, loss)))
        if ctx.world > 1:
            # Every rank must have the same global grad norm and skip count; a
            # disagreement means the ranks are no longer training one model.
            mine = torch.stack([out["grad_norm"].float(), self.scaler.skipped.float()])
            row["dist/rank_mismatch"] = 0 if ctx.ranks_agree(mine) else 1
        self.last_train = row.copy()
        return row

    def _data_wait(self, elapsed: float, steps: int) -> dict:
        """This rank's wait for input since the previous log row: mean seconds per
        step blocked on the prefetch queue, and its share of the step time
        (``perf/data_wait_s``, ``perf/data_wait_fraction``); on CUDA also the time
        spent issuing the host-to-device copies (``perf/data_copy_s``). Same span
        as the lap it is given: the waits happen in the loop, outside the
        clock's paused eval and checkpoint time. Host clocks only, no sync."""
        wait, copy, _ = self.feed.take_times()
        self.waited["wait_s"] += wait
        self.waited["copy_s"] += copy
        row = {"perf/data_wait_s": wait / steps, "perf/data_wait_fraction": wait / elapsed}
        if self.feed.device.type == "cuda":
            row["perf/data_copy_s"] = copy / steps
        return row

    def _amp_metrics(self, done: int) -> dict:
        """Loss scale and skipped steps (fp16 loss scaling only); stops a collapsed scale."""
        if not self.scaler.enabled:
            return {}
        skipped, scale = int(self.scaler.skipped), self.scaler.get_scale()
        row = {"amp/loss_scale": scale, "amp/skipped_steps": skipped, "amp/skip_rate": skipped / done}
        row.update(self._alert(*self.skip_warning.check(done, skipped)))
        self.nonfinite.check_loss_scale(done, scale)
        return row

    def _alert(self, row: dict, message: Optional[str]) -> dict:
        if message:
            self.metrics.write(message)
        return row

    def evaluate(self, done: int) -> dict:
        """Validation loss at the eval cadence and at the last step; not counted as training time."""
        tc = self.tc
        if not (tc.eval_every and (done % tc.eval_every == 0 or done == tc.max_steps)):
            return {}
        with self.clock.paused():
            val = data_mod.val_batches(self.val_windows, tc.eval_batches, tc.global_batch_size, self.mbs,
                                       self.ctx.rank, self.ctx.world)
            self.last_val = evaluate(self.model, self.policy, self.ctx, val)
            self.metrics.write(f"step {done:>6} | train loss {fmt(self.last_train.get('train/loss'))} | "
                               f"val loss {fmt(self.last_val)} | unigram baseline {self.tokens.unigram_nats:.4f}")
            self.sample(done)
        return {"val/loss": self.last_val}

    def sample(self, done: int) -> None:
        """Continue the fixed prompt (greedy, in the run's precision) so the model's
        progress can be read, not only its loss. Every rank runs it: under FSDP each
        forward gathers weights from all of them."""
        tc, tok = self.tc, self.tokens.tokenizer
        if not tc.sample_tokens or not hasattr(tok, "encode_batch"):
            return  # token shards carry only the tokenizer's name: nothing to decode with
        ids = tok.encode_batch([tc.sample_prompt])[0] or [tok.eos_id]  # no prompt: a new document
        new = generate(self.model, ids, tc.sample_tokens, autocast=self.policy.autocast, device=self.ctx.device)
        text = tok.decode(ids + new)
        self.metrics.write(f"step {done:>6} | sample: {text!r}")
        self.metrics.text("samples/text", text, done)

    def observe(self, step: int, out: dict, row: dict) -> dict:
        """Numerics monitor, collective bytes and the dtype audit of this step, into
        ``row``; returns the monitor's histograms."""
        done, hists = step + 1, {}
        if self.monitor.active(step):
            scalars, hists = self.monitor.collect()  # collectives + one host sync, on monitored steps only
            row.update(scalars)
            if "fp8/worst/flush" in scalars:
                from .fp8stats import report

                self.fp8_casts = report(scalars, self.policy.fp8.recipe, done)
        comm, audit = out["comm"], out["audit"]
        if comm is not None:
            self.last_comm = comm.metrics()
            row.update(self.last_comm)
            if step == self.start:
                self.metrics.write(f"step {done:>6} | collectives of one step on this rank: {comm.text()}")
        if audit is not None:
            report = audit.report()
            report["comm"] = self.last_comm if comm is not None else {}
            path = self.record.write_json("audit.json", report)
            self.metrics.write(audit.table())
            self.metrics.write(f"step {done:>6} | dtype audit written to {path}")
            row["audit/flags"] = len(report["flags"])
        return hists

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
        """Final checkpoint if due, summary.json, the closing lines."""
        self.metrics.console.close()
        step = self.progress.step
        ck = self.cfg.checkpoint
        if (ck.every or ck.at_end) and self.last_saved != step and step == self.tc.max_steps:
            self.checkpoint(step)
        self.dtypes.update(observed_dtypes(self.model, self.optimizer))  # at the end, not just after step 1
        if self.fp8_casts is not None:
            from .fp8stats import table

            self.metrics.write(table(self.fp8_casts))
        summary = self._summary()
        self.record.write_json("summary.json", summary)
        self.metrics.summary(summary)
        self.metrics.close()
        self.say(f"done in {summary['wall_time_s']:.1f}s | train loss {fmt(summary['final/train_loss'])} | "
                 f"val loss {fmt(self.last_val)} | unigram baseline {self.tokens.unigram_nats:.4f} nats/token"
                 + self._skip_text(summary))
        self.say(f"run directory: {self.run_dir}")
        self.ctx.barrier()  # leave together: the next multirun job starts on every rank at once
        return summary

    def _summary(self) -> dict:
        cfg, ctx, p = self.cfg, self.ctx, self.progress
        tps = self.clock.tokens_per_s()
        summary = {
            "steps": p.step, "tokens": p.tokens,
            "final/train_loss": self.last_train.get("train/loss"), "final/val_loss": self.last_val,
            "baseline/unigram_val_loss": self.tokens.unigram_nats,
            "perf/tokens_per_s": tps,
            "wall_time_s": time.perf_counter() - self.t_start,
            "params": self.n_params,  # excluding position embeddings: the N of 6N
            "flops_per_token": self.flops_tok, "mem/estimate_gib": self.mem_est.total / 2**30,
            **summary_figures(self.mem_est),  # bytes per parameter of weights, gradients, moments
            "precision": cfg.precision.name, "parallel": cfg.parallel.name.value, "model": cfg.model.name,
            "world_size": ctx.world, "dtypes": self.dtypes, **peak_memory(ctx.device),
            **self._dist_summary(),
            **({"fp8": self.fp8_report} if self.fp8_report else {}),
            **({"fp8_casts": self.fp8_casts} if self.fp8_casts else {}),
            **({"resumed_from": str(self.resumed_from)} if self.resumed_from is not None else {}),
            **({"config_history": self.plan.history} if self.plan.history else {}),
            **({"stopped_early": self.stopped_by} if self.stopped_by else {}),
            **self.last_comm,
        }
        if self.peak and tps:
            summary["perf/mfu"] = mfu(tps, self.flops_tok, self.peak, ctx.world)
        if self.clock.total_steps:  # over the logged laps, like perf/tokens_per_s
            summary["perf/data_wait_s"] = self.waited["wait_s"] / self.clock.total_steps
            summary["perf/data_wait_fraction"] = self.waited["wait_s"] / self.clock.total_time
            if self.ctx.device.type == "cuda":
                summary["perf/data_copy_s"] = self.waited["copy_s"] / self.clock.total_steps
        if self.scaler.enabled:
            skipped = int(self.scaler.skipped)
            summary.update({"amp/skipped_steps": skipped, "amp/skip_rate": skipped / max(p.step, 1),
                            "amp/final_loss_scale": self.scaler.get_scale()})
        if self.nonfinite.skipped is not None:
            summary["train/nonfinite_skipped"] = int(self.nonfinite.skipped)
        return summary

    def _skip_text(self, summary: dict) -> str:
        """The final line's skip counts, each with its cause; empty when nothing can be skipped."""
        if "amp/skipped_steps" in summary:
            # Under skip a non-finite forward also reaches the scaler (its gradients are inf/nan too).
            cause = ("loss-scale overflow" if self.tc.on_nonfinite.value == "abort"
                     else "loss-scale overflow or non-finite loss, train.on_nonfinite=skip")
            return f" | skipped steps {summary['amp/skipped_steps']} ({cause})"
        if "train/nonfinite_skipped" in summary:
            return (f" | skipped steps {summary['train/nonfinite_skipped']} "
                    "(non-finite loss or gradients, train.on_nonfinite=skip)")
        return ""

    def _dist_summary(self) -> dict:
        """Whether the replicas ended identical, and each rank's skip count (collectives)."""
        ctx = self.ctx
        if ctx.world == 1:
            return {}
        fp = ctx.replica_fingerprint(self.model)
        return {"dist/replicas_identical": ctx.ranks_agree(fp) and fp[2].item() == 0,
                "dist/skipped_steps_per_rank": [int(v) for v in ctx.all_gather(self.scaler.skipped)]}
