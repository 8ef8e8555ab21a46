"""What the run reports about itself, in one place.

The loop (``trainer.py``) decides *when*; :class:`Reporter` decides *what*:

- run_info (:meth:`Reporter.describe`): the dtypes, data, model and
  throughput figures that the banner prints and config.yaml records;
- the metric row of a logged step (:meth:`Reporter.row`): the loss read back
  (the one host sync of the logging cadence), tokens/s, MFU, data wait, the
  loss scaler's figures, the gradient norm, whether the ranks still agree,
  and the alerts (loss spike, skip rate, stability) that ride on it;
- a monitored step's extras (:meth:`Reporter.observe`): the numerics
  monitor's scalars, float8 cast figures, collective bytes, the dtype audit;
- the summary (:meth:`Reporter.finish`): summary.json and the closing lines.

The names of metrics and summary keys are a contract (``docs/outputs.md``):
tools read them.
"""
from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
from omegaconf import DictConfig, OmegaConf

from mptrain.config.schema import ParallelMode
from mptrain.core.shards import local_shard
from mptrain.core.text import fmt
from mptrain.data.batches import ValSet
from mptrain.distributed.comm import CommCounter, counting
from mptrain.distributed.parallel import DistContext, wrapper_dtypes
from mptrain.model.generate import generate
from mptrain.observe import fp8watch
from mptrain.observe.alerts import SkipRateWarning, SpikeDetector
from mptrain.observe.audit import DtypeAudit
from mptrain.observe.memory import estimate as memory_estimate
from mptrain.observe.memory import summary_figures
from mptrain.observe.numerics import NumericsMonitor
from mptrain.observe.perf import SLOW_AT, Pace, Throughput, flops_per_token, matmul_kind, mfu, peak_flops, predict_pace
from mptrain.observe.stability import StabilityWarnings, outlier_table
from mptrain.precision.formats import dtype_name
from mptrain.precision.optimizers import Choice
from mptrain.precision.policy import LossScaler, PrecisionPolicy
from mptrain.run.console import RunLog, plain_cadence
from mptrain.run.faults import NonFiniteHandler
from mptrain.run.metrics import Metrics
from mptrain.run.record import ComputeDtypeProbe, RunRecord, banner, observed_dtypes, peak_memory, reset_peak_memory
from mptrain.run.step import StepResult


def start_clock(device: torch.device) -> float:
    """The run's origin: the peak memory counts from here; returns the wall clock's start."""
    reset_peak_memory(device)
    return time.perf_counter()


def numerics_monitor(cfg: DictConfig, model: nn.Module, optimizer: torch.optim.Optimizer, policy: PrecisionPolicy,
                     ctx: DistContext) -> NumericsMonitor:
    """The numerics monitor of the run (``monitor.*``), with the float8 cast
    watch when the run casts to float8 and ``monitor.fp8_casts`` is on."""
    fp8_watch = (fp8watch.CastWatch.of_run(policy.lowp, model, cfg.monitor.fp8_whatif)
                 if policy.lowp and cfg.monitor.fp8_casts else None)
    monitor = NumericsMonitor(cfg.monitor, model, reduce_sum=ctx.shard_sum, reduce_max=ctx.shard_max,
                              reduce_max_all=ctx.all_reduce_max, reduce_sum_all=ctx.all_reduce_sum,
                              fp8_watch=fp8_watch)
    monitor.attach_optimizer(optimizer)  # Adam's health on monitored steps (stability.py)
    return monitor


@dataclass
class LoopStep:
    """One step as the loop hands it to the reporter: the math's result and
    what the loop added around it."""

    result: StepResult
    lr: float
    """The learning rate the step ran with."""
    comm: Optional[CommCounter] = None
    """The step's collectives, counted on monitored steps under ``monitor.comm``."""
    audit: Optional[DtypeAudit] = None
    """The step's dtype audit (``train.audit``: the first step of a launch)."""


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
    with torch.compiler.set_stance("force_eager"), DtypeAudit(model, optimizer, policy) as audit:
        yield audit


class Reporter:
    """The run's record (``RunRecord``), its metric sinks (``Metrics``, opened by
    :meth:`open`) and every figure that goes into them. Built once the model,
    optimizer and loss scaler exist; the warnings it holds are resumable
    (:meth:`states`)."""

    def __init__(self, cfg: DictConfig, ctx: DistContext, run_dir: Path, t_start: float, policy: PrecisionPolicy,
                 scaler: LossScaler, nonfinite: NonFiniteHandler, tokens_per_step: int):
        self.cfg, self.ctx, self.tc, self.run_dir, self.t_start = cfg, ctx, cfg.train, run_dir, t_start
        self.scaler, self.nonfinite, self.tokens_per_step = scaler, nonfinite, tokens_per_step
        self.record = RunRecord(cfg, run_dir, ctx.is_main)
        self.clock = Throughput(tokens_per_step)
        self.spikes = SpikeDetector(cfg.monitor.spike_factor, cfg.monitor.spike_window)
        self.stability_warnings = StabilityWarnings(cfg.monitor, dtype_name(policy.compute_dtype))
        self.skip_warning = SkipRateWarning(cfg.precision.loss_scale)
        self.fp8_recipe = policy.lowp.recipe if policy.lowp else None
        # run_info's and summary.json's key for the low-precision linears' report
        self.lowp_key = "fp4" if policy.fp4 else "fp8"
        self.count_comm = cfg.monitor.comm and ctx.mode != ParallelMode.none
        self.metrics: Optional[Metrics] = None
        self.say = print
        self.last_train: dict = {}
        self.last_val: Optional[float] = None
        self.eval_set: dict = {}  # what the validation loss is measured on, once evaluated (for the summary)
        self.last_comm: dict = {}
        self.fp8_casts: Optional[dict] = None  # the last monitored step's float8 cast figures (fp8watch.report)
        self.outliers: Optional[tuple[int, dict]] = None  # (step, the last monitored step's figures)
        self.waited = {"wait_s": 0.0, "copy_s": 0.0}  # the data wait of the logged laps, for the summary
        self.resumed_from: Optional[Path] = None
        self.history: list = []

    def states(self) -> dict:
        """The warnings' state, which survives a resume (state_dict/load_state_dict)."""
        return {"spikes": self.spikes, "skip_warning": self.skip_warning,
                "stability_warnings": self.stability_warnings}

    # ------------------------------------------------------------- run_info
    def describe(self, model: nn.Module, optimizer: torch.optim.Optimizer, policy: PrecisionPolicy,
                 choice: Choice, tokens, n_params: int, vocab: int, micro: tuple[int, int],
                 compile_blocks: bool) -> None:
        """run_info and the dtype table: what the banner prints and config.yaml
        records. ``micro`` is (micro-batch size, accumulation steps)."""
        cfg, ctx, tc = self.cfg, self.ctx, self.tc
        self.tokens, self.n_params = tokens, n_params
        self.compute_probe = ComputeDtypeProbe(model)  # the dtype the first forward computes in
        self.dtypes = {**policy.describe(), **wrapper_dtypes(policy, ctx.mode)}
        # the moments as configured; after step 1, as observed
        self.dtypes["optimizer_state"] = choice.state + (f" + Kahan compensation {choice.param_dtype}"
                                                         if choice.kahan else "")
        info = self.record.info
        info.update({
            "dtypes": self.dtypes, "world_size": ctx.world, "device": str(ctx.device), "backend": ctx.backend,
            "micro_batch_size": micro[0], "grad_accum_steps": micro[1], "vocab_size": vocab,
            "tokenizer": tokens.tokenizer.name, "tokenizer_path": tokens.tokenizer.path, "corpus": tokens.source,
            "train_tokens": int(len(tokens.train)), "val_tokens": int(len(tokens.val)), "params": n_params,
            "compile": compile_blocks, "activation_checkpointing": tc.activation_checkpointing.value,
            "fused_adamw": any(g.get("fused") for g in optimizer.param_groups),
            "optimizer": choice.describe()})
        self.fp8_report = policy.lowp.report if policy.lowp else None
        if self.fp8_report is not None:
            # Weights FSDP2 will all-gather in float8 carry torchao's float8-cast tensor subclass.
            self.fp8_report["float8_all_gather_weights"] = sum(
                "Float8" in type(local_shard(p)).__name__ for p in model.parameters())
            info[self.lowp_key] = self.fp8_report
        self._perf_figures(policy, vocab, micro[0])
        self.pace = self._predict_pace(model, policy, micro[0])
        info["stability"] = {"model.qk_norm": cfg.model.qk_norm, "train.z_loss": tc.z_loss,
                             "optim.update_clip": cfg.optim.update_clip}
        info["memory_estimate_gib"] = {k: round(v / 2**30, 4) for k, v in self.mem_est.parts().items()}

    def _perf_figures(self, policy: PrecisionPolicy, vocab: int, mbs: int) -> None:
        """FLOPs per token, the device's peak (for MFU) and the memory estimate."""
        cfg, ctx, m = self.cfg, self.ctx, self.cfg.model
        self.flops_tok = flops_per_token(self.n_params, m.n_layer, m.d_model, m.block_size)
        device_name = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu"
        kind = matmul_kind(dtype_name(policy.compute_dtype), policy.fp8_enabled,
                           ctx.device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32)
        self.peak = peak_flops(device_name, kind, self.tc.peak_tflops)
        self.mem_est = memory_estimate(cfg, vocab, ctx.world, mbs)
        self.record.info["flops_per_token"] = self.flops_tok

    def _predict_pace(self, model: nn.Module, policy: PrecisionPolicy, mbs: int) -> Optional[Pace]:
        """How much slower than fp32 this CPU run's matmuls will be (``perf.Pace``),
        or None where that is not predicted: on a GPU, and in fp32."""
        compute = dtype_name(policy.compute_dtype)
        if self.ctx.device.type != "cpu" or not (policy.lowp or compute in ("bf16", "fp16")):
            return None
        m = self.cfg.model
        by_dtype = {compute: self.flops_tok}
        if policy.lowp:
            # The converted linears' share (6 FLOPs per weight per token) in their matmul path:
            # float8's kernel, or fp32 for the 4-bit emulation (its casts are not counted);
            # attention, the head and excluded linears stay in the autocast dtype.
            low = 6.0 * sum(mod.in_features * mod.out_features for mod in model.modules()
                            if isinstance(mod, nn.Linear) and type(mod) is not nn.Linear)
            path = f"fp8_{policy.fp8.matmul}" if policy.fp8 else "fp32"
            by_dtype = {compute: self.flops_tok - low}
            by_dtype[path] = by_dtype.get(path, 0.0) + low
        return predict_pace(str(self.ctx.device), by_dtype, mbs * m.block_size, m.d_model)

    def _pace_warning(self, steps: int) -> Optional[str]:
        """The banner's run-time estimate, only where the matmuls are predicted
        :data:`perf.SLOW_AT` times slower than fp32's."""
        p = getattr(self, "pace", None)
        if p is None or p.slowdown < SLOW_AT or steps <= 0:
            return None
        faster = "precision=fp32"
        fp8 = self.fp8_report
        if fp8 is not None and fp8.get("matmul") == "scaled_mm" and "float8 torch._scaled_mm" in p.slowest:
            faster = "precision.fp8.matmul=emulated (the same float8 casts), or precision=fp32"
        return p.message(steps, self.tokens_per_step, faster)

    def resumed(self, path: Optional[Path], history: list) -> None:
        """Where the run resumed from (None: a fresh start) and its config history."""
        self.resumed_from, self.history = path, history
        if path is not None:
            self.record.info["resumed_from"] = str(path)
        if history:
            self.record.info["config_history"] = history

    def after_first_step(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """The dtypes the objects hold once a step has run (optimizer state exists now)."""
        self.dtypes.update(observed_dtypes(model, optimizer))
        self.dtypes["compute_observed"] = self.compute_probe.close()
        self.record.write_config()

    # --------------------------------------------------------------- outputs
    def open(self, start: int, runlog: RunLog, warnings: list[str], tokens_seen: int) -> Metrics:
        """config.yaml, the metric sinks and the banner, from step ``start`` on."""
        cfg, tc, run_dir = self.cfg, self.tc, self.run_dir
        self.say = runlog.say
        name, tags = self.record.names()
        self.record.write_config()
        total = start + 1 if tc.audit_only else tc.max_steps  # the audit stops after one step
        self.metrics = Metrics(run_dir, cfg.log, total, self.ctx.is_main, self.record.resolved(), name, tags,
                               start_step=start, runlog=runlog,
                               plain_every=plain_cadence(cfg.log.plain_every, tc.log_every, tc.max_steps))
        self.say(banner(cfg, self.ctx, self.record.info, self.dtypes, self.tokens, self.tokens_per_step, run_dir))
        pace = self._pace_warning(total - start)
        for w in warnings + ([pace] if pace else []):
            self.say(f"WARNING: {w}")
        if self.resumed_from is not None:
            self.say(f"resumed from {self.resumed_from} at step {start} ({tokens_seen:,} tokens seen)")
        if tc.audit:
            self.say(f"dtype audit of step {start + 1}: every operator's dtypes into {run_dir / 'audit.json'}"
                     + ("; the run stops after it (train.audit_only)" if tc.audit_only else ""))
        self.metrics.text("config", "```\n" + OmegaConf.to_yaml(cfg) + "\n```", wandb=False)  # W&B has it
        return self.metrics

    @contextlib.contextmanager
    def instruments(self, monitored: bool, auditing: bool, compile_blocks: bool, model: nn.Module,
                    optimizer: torch.optim.Optimizer, policy: PrecisionPolicy):
        """What watches one step: eager blocks on a monitored step, its collectives
        counted (``monitor.comm``, monitored steps), its dtype audit. Yields
        (comm counter or None, audit or None), for :class:`LoopStep`."""
        with _eager_if(compile_blocks and monitored), counting(self.count_comm and monitored) as comm, \
                _audit(auditing, model, optimizer, policy) as audit:
            yield comm, audit

    # ------------------------------------------------------------- log rows
    def row(self, done: int, out: LoopStep, tokens_seen: int, feed) -> dict:
        """The training metrics of step ``done``: the host syncs of the logging cadence."""
        ctx, r = self.ctx, out.result
        self.nonfinite.check_guard(done)
        flag = self.nonfinite.loss_flag()  # fp16 under abort: was any loss since the last look non-finite?
        # The switches' own figures ride along in the same read-back.
        extra = {k: v for k, v in (("z_loss", r.z_loss), ("update_clip_max", r.update_clip_max)) if v is not None}
        read = torch.stack([r.loss.float(), *(v.float() for v in extra.values())]
                           + ([flag] if flag is not None else []))
        loss, *rest = ctx.all_reduce_mean(read).tolist()  # host sync: read back only at this cadence
        extra, flagged = dict(zip(extra, rest)), rest[len(extra):]
        self.nonfinite.check_loss(done, loss, bool(flagged and flagged[0] > 0))  # before the scale: the cause
        elapsed, steps = self.clock.lap()
        tps = steps * self.tokens_per_step / elapsed
        row = {"train/loss": loss, "train/lr": out.lr, "train/grad_norm": float(r.grad_norm),
               "train/tokens": tokens_seen, "perf/tokens_per_s": tps, "perf/step_time_s": elapsed / steps,
               **self._data_wait(feed, elapsed, steps),
               **({"perf/mfu": mfu(tps, self.flops_tok, self.peak, ctx.world)} if self.peak else {}),
               **{f"train/{k}": v for k, v in extra.items()}, **peak_memory(ctx.device)}
        row.update(self._amp_metrics(done))
        if self.nonfinite.skipped is not None:
            row["train/nonfinite_skipped"] = int(self.nonfinite.skipped)
        row.update(self._alert(*self.spikes.check(done, loss)))
        if ctx.world > 1:
            # Every rank must have the same global grad norm and skip count; a
            # disagreement means the ranks are no longer training one model.
            mine = torch.stack([r.grad_norm.float(), self.scaler.skipped.float()])
            row["dist/rank_mismatch"] = 0 if ctx.ranks_agree(mine) else 1
        self.last_train = row.copy()
        return row

    def _data_wait(self, feed, elapsed: float, steps: int) -> dict:
        """This rank's wait for input since the previous log row: mean seconds per
        step blocked on the prefetch queue, and its share of the step time
        (``perf/data_wait_s``, ``perf/data_wait_fraction``); on CUDA also the time
        spent issuing the host-to-device copies (``perf/data_copy_s``). Same span
        as the lap it is given: the waits happen in the loop, outside the
        clock's paused eval and checkpoint time. Host clocks only, no sync."""
        wait, copy, _ = feed.take_times()
        self.waited["wait_s"] += wait
        self.waited["copy_s"] += copy
        row = {"perf/data_wait_s": wait / steps, "perf/data_wait_fraction": wait / elapsed}
        if feed.device.type == "cuda":
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

    def warn_stability(self, done: int, row: dict) -> None:
        """The stability/* warnings of a monitored step's row, into the row."""
        row.update(self._alert(*self.stability_warnings.check(done, row)))

    def observe(self, step: int, start: int, out: LoopStep, row: dict, monitor: NumericsMonitor) -> dict:
        """Numerics monitor, collective bytes and the dtype audit of this step, into
        ``row``; returns the monitor's histograms."""
        done, hists = step + 1, {}
        if monitor.active(step):
            scalars, hists = monitor.collect()  # collectives + one host sync, on monitored steps only
            row.update(scalars)
            if "fp8/worst/flush" in scalars:
                self.fp8_casts = fp8watch.report(scalars, self.fp8_recipe, done)
            if scalars:
                self.outliers = (done, scalars)  # the last monitored step's, for the closing table
        comm, audit = out.comm, out.audit
        if comm is not None:
            self.last_comm = comm.metrics()
            row.update(self.last_comm)
            if step == start:
                self.metrics.write(f"step {done:>6} | collectives of one step on this rank: {comm.text()}")
        if audit is not None:
            report = audit.report()
            report["comm"] = self.last_comm if comm is not None else {}
            path = self.record.write_json("audit.json", report)
            self.metrics.write(audit.table())
            self.metrics.write(f"step {done:>6} | dtype audit written to {path}")
            row["audit/flags"] = len(report["flags"])
        return hists

    def evaluated(self, done: int, val_loss: float, val_set: ValSet) -> dict:
        """The validation loss of step ``done`` on ``val_set``: its console line and its row."""
        self.last_val = val_loss
        self.eval_set = {"eval/tokens": val_set.tokens, "eval/windows": val_set.windows}
        self.metrics.write(f"step {done:>6} | train loss {fmt(self.last_train.get('train/loss'))} | "
                           f"val loss {fmt(val_loss)} | unigram baseline {self.tokens.unigram_nats:.4f}")
        return {"val/loss": val_loss}

    def sample(self, done: int, model: nn.Module, policy: PrecisionPolicy) -> None:
        """Continue the fixed prompt (greedy, in the run's precision) so the model's
        progress can be read, not only its loss. Every rank runs it: under FSDP each
        forward gathers weights from all of them."""
        tc, tok = self.tc, self.tokens.tokenizer
        if not tc.sample_tokens or not hasattr(tok, "encode_batch"):
            return  # token shards carry only the tokenizer's name: nothing to decode with
        ids = tok.encode_batch([tc.sample_prompt])[0] or [tok.eos_id]  # no prompt: a new document
        new = generate(model, ids, tc.sample_tokens, autocast=policy.autocast, device=self.ctx.device)
        text = tok.decode(ids + new)
        self.metrics.write(f"step {done:>6} | sample: {text!r}")
        self.metrics.text("samples/text", text, done)

    # --------------------------------------------------------------- summary
    def logged_up_to(self, step: int, val_set: Optional[ValSet] = None) -> None:
        """Take the last training and validation figures from metrics.jsonl (rows up
        to ``step``): for a launch that trains nothing but writes the summary of a
        run whose final launch was lost before writing it. ``val_set``: the set
        the run's validation loss was measured on (the same at every launch)."""
        path = self.run_dir / "metrics.jsonl"
        rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.is_file() else []
        rows = [r for r in rows if r["step"] <= step]
        self.last_train = next((r for r in reversed(rows) if "train/loss" in r), {})
        self.last_val = next((r["val/loss"] for r in reversed(rows) if "val/loss" in r), None)
        if self.last_val is not None and val_set is not None:
            self.eval_set = {"eval/tokens": val_set.tokens, "eval/windows": val_set.windows}

    def finish(self, model: nn.Module, optimizer: torch.optim.Optimizer, progress, stopped_by: Optional[str]) -> dict:
        """summary.json, the sinks closed, the closing lines; returns the summary."""
        if "compute_observed" in self.dtypes:  # a launch that ran no step holds no gradients to observe
            self.dtypes.update(observed_dtypes(model, optimizer))  # at the end, not just after step 1
        if self.fp8_casts is not None:
            self.metrics.write(fp8watch.table(self.fp8_casts))
        outliers = outlier_table(self.outliers[1], self.outliers[0]) if self.outliers is not None else ""
        if outliers:
            self.metrics.write(outliers)
        summary = self._summary(model, progress, stopped_by)
        self.record.write_json("summary.json", summary)
        self.metrics.summary(summary)
        self.metrics.close()
        self.say(f"done in {summary['wall_time_s']:.1f}s | train loss {fmt(summary['final/train_loss'])} | "
                 f"val loss {fmt(self.last_val)} | unigram baseline {self.tokens.unigram_nats:.4f} nats/token"
                 + self._skip_text(summary))
        self.say(f"run directory: {self.run_dir}")
        return summary

    def _summary(self, model: nn.Module, progress, stopped_by: Optional[str]) -> dict:
        cfg, ctx, p = self.cfg, self.ctx, progress
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
            **self._dist_summary(model),
            **({self.lowp_key: self.fp8_report} if self.fp8_report else {}),
            **({"fp8_casts": self.fp8_casts} if self.fp8_casts else {}),
            **({"resumed_from": str(self.resumed_from)} if self.resumed_from is not None else {}),
            **({"config_history": self.history} if self.history else {}),
            **({"stopped_early": stopped_by} if stopped_by else {}),
            **self.last_comm,
            **self.eval_set,
        }
        if self.peak and tps:
            summary["perf/mfu"] = mfu(tps, self.flops_tok, self.peak, ctx.world)
        if self.clock.total_steps:  # over the logged laps, like perf/tokens_per_s
            summary["perf/data_wait_s"] = self.waited["wait_s"] / self.clock.total_steps
            summary["perf/data_wait_fraction"] = self.waited["wait_s"] / self.clock.total_time
            if ctx.device.type == "cuda":
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

    def _dist_summary(self, model: nn.Module) -> dict:
        """Whether the replicas ended identical, and each rank's skip count (collectives)."""
        ctx = self.ctx
        if ctx.world == 1:
            return {}
        fp = ctx.replica_fingerprint(model)
        return {"dist/replicas_identical": ctx.ranks_agree(fp) and fp[2].item() == 0,
                "dist/skipped_steps_per_rank": [int(v) for v in ctx.all_gather(self.scaler.skipped)]}
