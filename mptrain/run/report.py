"""What the run reports about itself, in one place.

The loop (``trainer.py``) decides *when*, and the run's components
(``parts.py``) add what they measured; this module formats:

- run_info (:func:`describe`, when the :class:`Reporter` is built): the dtypes,
  data, model and throughput figures that the banner prints and config.yaml
  records;
- the read-back of a logged step (:func:`read_back`): the loss and the
  switches' figures, with what the components ask to read along, in the one
  host sync of the logging cadence;
- the metric row of a logged step (:meth:`Reporter.row`): tokens/s, MFU, data
  wait, the loss scaler's figures, the gradient norm, whether the ranks still
  agree;
- the validation line and the text sample;
- the summary (:meth:`Reporter.finish`): summary.json and the closing lines.

It decides nothing: it raises no error of the run's, replays nothing and
stops nothing (the loop and the components do). The names of metrics and
summary keys are a contract (``docs/outputs.md``): tools read them.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
from omegaconf import OmegaConf

from mptrain.core.shards import local_shard
from mptrain.core.text import fmt
from mptrain.core.frozen import plain
from mptrain.data.batches import ValSet
from mptrain.distributed.parallel import DistContext, wrapper_dtypes
from mptrain.distributed.expert_parallel import dispatch_said
from mptrain.distributed.tensor_parallel import float8_gathers
from mptrain.model.common import gelu_kernel_text
from mptrain.model.generate import generate
from mptrain.observe.memory import measured_line, summary_figures
from mptrain.observe.memory_phases import Phased, phase_estimates
from mptrain.plan.plan import Plan
from mptrain.observe.perf import SLOW_AT, Pace, Throughput, flops_per_token, matmul_kind, mfu, peak_flops, predict_pace
from mptrain.precision.formats import dtype_name
from mptrain.precision.policy import LossScaler, PrecisionPolicy
from mptrain.run.build import RunData, RunModel
from mptrain.run.console import RunLog, plain_cadence
from mptrain.run.metrics import Metrics
from mptrain.run.mixture import mixture_info
from mptrain.run.record import (ComputeDtypeProbe, RunRecord, banner, mesh_info, observed_dtypes, peak_memory,
                               reset_peak_memory, start_memory)
from mptrain.run.resume import threads_guard
from mptrain.run.step import StepResult
from mptrain.run.threads import ThreadCheck, forward_pass, threads_info
from mptrain.run.validation import ValFigures, text_bytes


def start_clock(device: torch.device) -> tuple[float, dict]:
    """The run's origin: the peak memory counts from here; returns the wall
    clock's start and what the process held then (``record.start_memory``)."""
    reset_peak_memory(device)
    return time.perf_counter(), start_memory(device)


@dataclass
class LoopStep:
    """One step as the loop hands it to the reporter: the math's result, the
    learning rate the loop set for it, and what the parts ask to read back with it."""

    result: StepResult
    lr: float
    reads: dict = field(default_factory=dict)
    """0-d device tensors the components want read along (``Component.after_step``), by name."""


@dataclass
class Reading:
    """What a logged step reads back from the device, in one host sync (each the
    mean over ranks)."""

    loss: float
    figures: dict[str, float]
    """The switches' own figures (``z_loss``, ``update_clip_max``), those that are on."""
    flags: dict[str, float]
    """What the components asked to read along (``Component.after_step``), by name."""
    loss_scale: Optional[float]
    """fp16 loss scaling's current scale; None without loss scaling."""


def read_back(ctx: DistContext, result: StepResult, flags: dict[str, torch.Tensor], scaler: LossScaler) -> Reading:
    """The logging cadence's read-back of ``result``, with ``flags`` riding along."""
    extra = {k: v for k, v in (("z_loss", result.z_loss), ("update_clip_max", result.update_clip_max))
             if v is not None}
    read = torch.stack([result.loss.float(), *(v.float() for v in extra.values()),
                        *(v.float() for v in flags.values())])
    loss, *rest = ctx.all_reduce_mean(read).tolist()  # host sync: read back only at this cadence
    return Reading(loss, dict(zip(extra, rest[:len(extra)], strict=True)),
                   dict(zip(flags, rest[len(extra):], strict=True)), scaler.get_scale())


@dataclass
class RunFacts:
    """What the run is, as the banner, the rows and the summary state it; fixed once built."""

    n_params: int
    """Parameters without position embeddings (the N of 6N)."""
    dtypes: dict
    """The dtype table (as configured; observed ones added after the first step and at the end)."""
    lowp: Optional[dict]
    """The float8 (or 4-bit) linears' report, None without them."""
    lowp_key: str
    """run_info's and summary.json's key for :attr:`lowp`: ``fp8``, ``fp4`` or ``lab``."""
    flops_tok: float
    peak: Optional[float]
    """The device's peak FLOP/s for MFU, None where unknown."""
    mem: Phased
    """The memory estimate of each precision phase ahead (one without phases): the summary
    gives the largest's rows and the run's peak over them."""
    pace: Optional[Pace]
    """How much slower than fp32 this CPU run's matmuls are predicted to be; None where not predicted."""


@dataclass
class Latest:
    """What the summary repeats: the last training row, the last validation loss and
    the set it was measured on, the data wait summed over the logged laps."""

    train: dict = field(default_factory=dict)
    val: Optional[ValFigures] = None
    whole: Optional[ValFigures] = None
    """The last step's figures on every window of the val split (``train.eval_whole_split``)."""
    wait_s: float = 0.0
    copy_s: float = 0.0


def planned_dtypes(plan: Plan, ctx: DistContext, policy: PrecisionPolicy) -> dict:
    """The dtypes of ``plan``'s phase as configured (the moments too; after a step, as observed)."""
    choice = plan.optimizer
    dtypes = {**policy.describe(), **wrapper_dtypes(policy, ctx.mode, ctx.shape if ctx.uses_mesh else None)}
    dtypes["optimizer_state"] = choice.state + (f" + Kahan compensation {choice.param_dtype}" if choice.kahan else "")
    return dtypes


def describe(plan: Plan, ctx: DistContext, policy: PrecisionPolicy, data: RunData, built: RunModel,
             info: dict) -> RunFacts:
    """run_info (into ``info``) and the run's facts: what the banner prints and config.yaml records."""
    tc, choice, model = plan.train, plan.optimizer, built.model
    dtypes = planned_dtypes(plan, ctx, policy)
    tokens = data.tokens
    info.update({
        "dtypes": dtypes, "world_size": ctx.world, "device": str(ctx.device), "backend": ctx.backend,
        "micro_batch_size": data.micro_batch, "grad_accum_steps": data.accum, "vocab_size": data.vocab,
        "tokenizer": tokens.tokenizer.name, "tokenizer_path": tokens.tokenizer.path, "corpus": tokens.source,
        "train_tokens": int(len(tokens.train)), "val_tokens": int(len(tokens.val)), "params": built.n_params,
        "compile": built.compile_blocks, "activation_checkpointing": tc.activation_checkpointing.value,
        "fused_adamw": any(g.get("fused") for g in built.optimizer.param_groups),
        "optimizer": choice.describe(), "plan": plan.describe(),
        "threads": threads_info(tc.threads)})  # part of a CPU run's arithmetic: recorded, and compared on resume
    if len(plan.phases) > 1:  # each phase as planned; its dtypes and first step once it begins
        info["phases"] = [ph.describe() for ph in plan.phases]
        info["phases"][plan.phase]["dtypes"] = dict(dtypes)
    if plan.adopted:  # what model.init_from's config.json fixed (adopt_init_from), for the banner
        info["init_from"] = plain(plan.adopted)
    if ctx.uses_mesh:
        tp_float8 = ctx.shape.tp > 1 and float8_gathers(model, ctx.mesh["tp"], ctx.sequence_parallel)
        info["mesh"] = mesh_info(ctx.shape, ctx.sequence_parallel, tp_float8, dispatch_said(plan.parallel.ep_dispatch,
                                                                                           policy.compute_dtype))
    # fp4 for precision=nvfp4/mxfp4 (the key runs have always had), lab for precision=lab
    lowp_key = policy.lab.key.rpartition(".")[2] if policy.lab else "fp8"
    lowp = policy.lowp.report if policy.lowp else None
    if lowp is not None:
        # Weights FSDP2 will all-gather in float8 carry torchao's float8-cast tensor subclass.
        lowp["float8_all_gather_weights"] = sum("Float8" in type(local_shard(p)).__name__ for p in model.parameters())
        info[lowp_key] = lowp
    gelu = gelu_kernel_text(model, ctx.device)  # chosen per CPU kind: two kinds' runs told apart
    if gelu:
        info["gelu"] = gelu
    mixture = mixture_info(model, ctx.device, policy.compute_dtype, built.n_params, built.n_active)
    if mixture is not None:  # a mixture of experts: its experts' share, what a token uses, the GEMM path
        info["moe"] = mixture
    m = plan.model
    # 6N with N the parameters one token uses: a mixture's chosen experts, not all of them
    flops_tok = flops_per_token(built.n_active, m.n_layer, m.d_model, m.block_size)
    device_name = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu"
    kind = matmul_kind(dtype_name(policy.compute_dtype), policy.fp8_enabled,
                       ctx.device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32)
    mem = phase_estimates(plan, data.vocab)  # every phase ahead: the largest is what the run must hold
    info["flops_per_token"] = flops_tok
    info["stability"] = {"model.qk_norm": m.qk_norm, "train.z_loss": tc.z_loss,
                         "optim.update_clip": plan.optim.update_clip}
    info["memory_estimate_gib"] = {k: round(v / 2**30, 4) for k, v in mem.estimate.parts().items()}
    if len(mem.estimates) > 1:
        info["memory_estimate_phases"] = mem.describe()
    return RunFacts(built.n_params, dtypes, lowp, lowp_key, flops_tok, peak_flops(device_name, kind, tc.peak_tflops),
                    mem, _predict_pace(plan, ctx, policy, model, flops_tok))


def _predict_pace(plan: Plan, ctx: DistContext, policy: PrecisionPolicy, model: nn.Module, flops_tok: float
                  ) -> Optional[Pace]:
    """How much slower than fp32 this CPU run's matmuls will be (``perf.Pace``),
    or None where that is not predicted: on a GPU, and in fp32."""
    compute = dtype_name(policy.compute_dtype)
    if ctx.device.type != "cpu" or not (policy.lowp or compute in ("bf16", "fp16")):
        return None
    m = plan.model
    by_dtype = {compute: flops_tok}
    if policy.lowp:
        # The converted linears' share (6 FLOPs per weight per token) in their matmul path:
        # float8's kernel, or fp32 for the 4-bit emulation (its casts are not counted);
        # attention, the head and excluded linears stay in the autocast dtype.
        low = 6.0 * sum(mod.in_features * mod.out_features for mod in model.modules()
                        if isinstance(mod, nn.Linear) and type(mod) is not nn.Linear)
        path = f"fp8_{policy.fp8.matmul}" if policy.fp8 else "fp32"
        by_dtype = {compute: flops_tok - low}
        by_dtype[path] = by_dtype.get(path, 0.0) + low
    return predict_pace(str(ctx.device), by_dtype, plan.batches.tokens_per_micro, m.d_model)


class Reporter:
    """The run's record (``RunRecord``), its metric sinks (``Metrics``, opened by
    :meth:`open`) and the figures that go into them. Built once the data, the
    model, its optimizer and loss scaler exist; every attribute is set here."""

    def __init__(self, plan: Plan, ctx: DistContext, run_dir: Path, t_start: float, runlog: RunLog,
                 policy: PrecisionPolicy, data: RunData, built: RunModel, mem_start: Optional[dict] = None):
        self.plan, self.ctx, self.run_dir, self.t_start = plan, ctx, run_dir, t_start
        self.first_phase = plan.phase  # the precision phase this launch starts in: the banner's dtypes are its
        self.mem_start = mem_start or {}  # what the process held before the run built anything
        self.runlog = runlog
        self.scaler, self.tokens, self.tokens_per_step = built.scaler, data.tokens, data.tokens_per_step
        self.record = RunRecord(plan, run_dir, ctx.is_main)
        self.clock = Throughput(data.tokens_per_step)  # training time: eval and checkpoints pause it
        self.compute_probe = ComputeDtypeProbe(built.model)  # the dtype the first forward computes in
        self.facts = describe(plan, ctx, policy, data, built, self.record.info)
        self.latest = Latest()
        self.metrics: Optional[Metrics] = None  # opened by open(), once the run starts writing
        self.resumed_from: Optional[Path] = None
        self.history: list = []
        # The validation set: the same windows at every evaluation and on any batch or world size.
        self.val_set = ValSet(data.val_windows, plan.train.eval_tokens)
        self.whole_set = ValSet.whole(data.val_windows)  # train.eval_whole_split's, at the last step
        self._val_bytes: dict = {}  # each set's text bytes, counted (decoded) at its first evaluation in a launch
        self.threads = self._thread_check(plan, ctx, policy, built.model, data.micro_batch)

    def _thread_check(self, plan: Plan, ctx: DistContext, policy: PrecisionPolicy, model: nn.Module,
                      micro_batch: int) -> ThreadCheck:
        """The busy-machine check (``threads.py``), timing the run's forward pass on
        the first validation micro-batch when it has to."""
        guard = threads_guard(plan, ctx.device.type)
        bits = ", for a new run: a resume refuses another count in bf16/fp16 on a CPU" if guard else ""
        check = ThreadCheck(ctx.device, ctx.world, bits)
        first = next(iter(self.val_set.batches(micro_batch, 0, 1)), None)
        # Not on compiled blocks: an eval-mode forward without gradients is another graph, and
        # its compilation (at each thread count) would cost far more than the notice is worth.
        if first is not None and not plan.train.compile:
            self._probe_batch = first[:2]
            check.forward = forward_pass(model, policy, *self._probe_batch, ctx)
        return check

    def busy_note(self, short: bool = False) -> Optional[str]:
        """The busy-machine line for the time since the last one (None: nothing competed;
        ``short``: the progress line's), any timing it takes kept out of the training time."""
        with self.clock.paused():
            return self.threads.notice(short)

    def _pace_warning(self, steps: int) -> Optional[str]:
        """The banner's run-time estimate, only where the matmuls are predicted
        :data:`perf.SLOW_AT` times slower than fp32's."""
        p = self.facts.pace
        if p is None or p.slowdown < SLOW_AT or steps <= 0:
            return None
        faster = "precision=fp32"
        fp8 = self.facts.lowp
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

    def after_first_step(self, model: nn.Module, optimizer: torch.optim.Optimizer, phase: int = 0) -> None:
        """The dtypes the objects hold once a step has run (optimizer state exists now); with
        precision phases, also those of ``phase``, the one the step ran in."""
        observed = {**observed_dtypes(model, optimizer), "compute_observed": self.compute_probe.close()}
        phases = self.record.info.get("phases")
        if phases is None or phase == self.first_phase:
            self.facts.dtypes.update(observed)  # the launch's first phase: the banner's dtypes, observed
        if phases is not None:
            phases[phase].setdefault("dtypes", {}).update(observed)
        self.record.write_config()

    def phase_began(self, began, plan: Plan, policy: PrecisionPolicy, built: RunModel, carried) -> None:
        """A precision phase began (``run/phases.py``): its lines on the console, its dtypes
        and first step into run_info (config.yaml), the new loss scaler read from now on."""
        self.plan, self.scaler = plan, built.scaler  # the phase's precision, for the rows and records from now on
        if self.threads.forward is not None:  # the busy check times the phase's model from now on
            self.threads.forward = forward_pass(built.model, policy, *self._probe_batch, self.ctx)
        self.compute_probe = ComputeDtypeProbe(built.model)  # the dtype its first forward computes in
        ph = plan.phases[began.phase]
        entry = self.record.info["phases"][began.phase]
        entry.update(began_at=began.step, dtypes=planned_dtypes(plan, self.ctx, policy))
        if began.trigger:
            entry.update(trigger_value=began.value, read_at=began.read_at)
        write = self.metrics.write if self.metrics is not None else self.runlog.say
        write(f"step {began.step:>6} | {began.words()}: precision={ph.precision.name}; "
              + ("; ".join(ph.changes) or "nothing changes"))
        moved = ph.carry + tuple(f"{what}: {', '.join(keys)}" for what, keys in
                                 (("start afresh", carried.fresh), ("left behind", carried.dropped)) if keys)
        write("             | carried over: " + "; ".join(moved))
        self.record.write_config()

    # --------------------------------------------------------------- outputs
    def open(self, start: int, warnings: list[str], tokens_seen: int) -> Metrics:
        """config.yaml, the metric sinks and the banner, from step ``start`` on."""
        plan, tc, run_dir = self.plan, self.plan.train, self.run_dir
        name, tags = self.record.names()
        self.record.write_config()
        total = start + 1 if tc.audit_only else tc.max_steps  # the audit stops after one step
        self.metrics = Metrics(run_dir, plan.log, total, self.ctx.is_main, self.record.resolved(), name, tags,
                               start_step=start, runlog=self.runlog,
                               plain_every=plain_cadence(plan.log.plain_every, tc.log_every, tc.max_steps))
        self.metrics.grouping(*self.record.grouping())
        self.runlog.say(banner(plan, self.ctx, self.record.info, self.facts.dtypes, self.tokens, self.tokens_per_step,
                        run_dir))
        pace = self._pace_warning(total - start)
        busy = self.busy_note()  # before step 1: the count can still be changed for a fresh run
        for w in warnings + ([pace] if pace else []) + ([busy] if busy else []):
            self.runlog.say(f"WARNING: {w}")
        if self.resumed_from is not None:
            self.runlog.say(f"resumed from {self.resumed_from} at step {start} ({tokens_seen:,} tokens seen)")
        if tc.audit:
            self.runlog.say(f"dtype audit of step {start + 1}: every operator's dtypes into {run_dir / 'audit.json'}"
                     + ("; the run stops after it (train.audit_only)" if tc.audit_only else ""))
        self.metrics.text("config", "```\n" + OmegaConf.to_yaml(plain(plan.resolved)) + "\n```", wandb=False)
        return self.metrics

    # ------------------------------------------------------------- log rows
    def row(self, done: int, out: LoopStep, seen: Reading, tokens_seen: int, feed) -> dict:
        """The training metrics of step ``done``, from what was read back (``seen``)."""
        ctx, r = self.ctx, out.result
        elapsed, steps = self.clock.lap()
        tps = steps * self.tokens_per_step / elapsed
        f = self.facts
        row = {"train/loss": seen.loss, "train/lr": out.lr, "train/grad_norm": float(r.grad_norm),
               "train/tokens": tokens_seen, "perf/tokens_per_s": tps, "perf/step_time_s": elapsed / steps,
               **self._data_wait(feed, elapsed, steps),
               **({"perf/mfu": mfu(tps, f.flops_tok, f.peak, ctx.world)} if f.peak else {}),
               **{f"train/{k}": v for k, v in seen.figures.items()}, **peak_memory(ctx.device)}
        if seen.loss_scale is not None:  # fp16 loss scaling's figures
            skipped = int(self.scaler.skipped)
            row.update({"amp/loss_scale": seen.loss_scale, "amp/skipped_steps": skipped,
                        "amp/skip_rate": skipped / done})
        if len(self.plan.phases) > 1:  # which precision phase ran this step (a curve's boundaries)
            row["precision/phase"] = self.plan.phase
        if ctx.world > 1:
            # Every rank must have the same global grad norm and skip count; a
            # disagreement means the ranks are no longer training one model.
            mine = torch.stack([r.grad_norm.float(), self.scaler.skipped.float()])
            row["dist/rank_mismatch"] = 0 if ctx.ranks_agree(mine) else 1
        self.latest.train = row.copy()  # the summary's final training figures
        self.metrics.console.note = self.busy_note(short=True)  # said on the progress line while others compete
        return row

    def _data_wait(self, feed, elapsed: float, steps: int) -> dict:
        """This rank's wait for input since the previous log row: mean seconds per
        step blocked on the prefetch queue, and its share of the step time
        (``perf/data_wait_s``, ``perf/data_wait_fraction``); on CUDA also the time
        spent issuing the host-to-device copies (``perf/data_copy_s``). Same span
        as the lap it is given: the waits happen in the loop, outside the
        clock's paused eval and checkpoint time. Host clocks only, no sync."""
        wait, copy, _ = feed.take_times()
        self.latest.wait_s += wait
        self.latest.copy_s += copy
        row = {"perf/data_wait_s": wait / steps, "perf/data_wait_fraction": wait / elapsed}
        if feed.device.type == "cuda":
            row["perf/data_copy_s"] = copy / steps
        return row

    def val_figures(self, loss: float, whole: bool = False) -> ValFigures:
        """A validation loss with its perplexity and bits per byte on the run's set
        (``whole``: on every window of the split)."""
        val = self.whole_set if whole else self.val_set
        if whole not in self._val_bytes:
            self._val_bytes[whole] = text_bytes(val, self.tokens.tokenizer)
        return ValFigures.of(loss, val, self._val_bytes[whole])

    def evaluated(self, done: int, loss: float) -> dict:
        """The validation figures of step ``done`` (its mean loss on the set): its console line and its row."""
        val = self.latest.val = self.val_figures(loss)
        self.metrics.write(f"step {done:>6} | train loss {fmt(self.latest.train.get('train/loss'))} | "
                           f"{val.text()}{self._subset_words(val)} | unigram baseline {self.tokens.unigram_nats:.4f}")
        return val.row()

    def evaluated_whole(self, done: int, loss: Optional[float]) -> None:
        """The last step's loss on every window of the val split (``train.eval_whole_split``);
        None: the run's set is the whole split, its figures are these. Said in a line."""
        last = self.latest.val
        whole = self.latest.whole = last if loss is None else self.val_figures(loss, whole=True)
        subset = ("the val/loss set is the whole split" if whole is last
                  else f"val/loss reads {last.tokens:,} of them (train.eval_tokens)")
        self.metrics.write(f"step {done:>6} | whole val split: {whole.text()} on {whole.tokens:,} tokens, "
                           f"every window; {subset}")

    def _subset_words(self, val: ValFigures) -> str:
        """`` on the train.eval_tokens subset (4,096 of 60,544 tokens)`` after a figure on
        the run's set where that set is not the whole split: a mean over other text than
        ``python -m mptrain.evaluate`` reads, said where the figure is."""
        if self.val_set.is_whole:
            return ""
        return f" on the train.eval_tokens subset ({val.tokens:,} of {self.whole_set.tokens:,} tokens)"

    def _val_text(self) -> str:
        """The closing line's validation figures (``val loss n/a`` when the run never
        evaluated): the whole split's first where the last step measured it (the figure
        ``python -m mptrain.evaluate`` gives for the final checkpoint), the
        ``train.eval_tokens`` subset's beside it; each with the tokens it is the mean
        over (the two are different text, so different means)."""
        val, whole = self.latest.val, self.latest.whole
        if val is None:
            return "val loss n/a"
        if self.val_set.is_whole:
            return f"{val.text()} on {val.tokens:,} tokens (the whole val split)"
        if whole is None:  # not measured: train.eval_whole_split=false, or the run stopped before its end
            return f"{val.text()}{self._subset_words(val)}"
        return (f"{whole.text()} on the whole val split ({whole.tokens:,} tokens) | train.eval_tokens subset "
                f"{fmt(val.loss)} on {val.tokens:,} tokens")

    def _val_summary(self) -> dict:
        """summary.json's validation keys: ``final/val_loss`` (null when the run never
        evaluated), and with a loss its perplexity, bits per byte and set; the whole
        split's (``final/whole_val_loss``, ...) where the last step measured them."""
        val, whole = self.latest.val, self.latest.whole
        if val is None:
            return {"final/val_loss": None}
        return {**val.final(), **(whole.final(whole=True) if whole else {})}

    def sample(self, done: int, model: nn.Module, policy: PrecisionPolicy) -> None:
        """Continue the fixed prompt (greedy, in the run's precision) so the model's
        progress can be read, not only its loss. Every rank runs it: under FSDP each
        forward gathers weights from all of them."""
        tc, tok = self.plan.train, self.tokens.tokenizer
        if not tc.sample_tokens or not hasattr(tok, "encode_batch"):
            return  # token shards carry only the tokenizer's name: nothing to decode with
        ids = tok.encode_batch([tc.sample_prompt])[0] or [tok.eos_id]  # no prompt: a new document
        new = generate(model, ids, tc.sample_tokens, autocast=policy.autocast, device=self.ctx.device,
                       multiple=self.ctx.sequence_multiple)
        text = tok.decode(ids + new)
        self.metrics.write(f"step {done:>6} | sample: {text!r}")
        self.metrics.text("samples/text", text, done)

    # --------------------------------------------------------------- summary
    def logged_up_to(self, step: int) -> None:
        """Take the last training and validation figures from metrics.jsonl (rows up
        to ``step``): for a launch that trains nothing but writes the summary of a
        run whose final launch was lost before writing it (the validation figures on
        the run's set, the same at every launch). The whole split's figure
        (``train.eval_whole_split``) is in no row: such a summary leaves it out."""
        path = self.run_dir / "metrics.jsonl"
        rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.is_file() else []
        rows = [r for r in rows if r["step"] <= step]
        self.latest.train = next((r for r in reversed(rows) if "train/loss" in r), {})
        loss = next((r["val/loss"] for r in reversed(rows) if "val/loss" in r), None)
        self.latest.val = self.val_figures(loss) if loss is not None else None

    def finish(self, model: nn.Module, optimizer: torch.optim.Optimizer, progress, stopped_by: Optional[str],
               figures: dict) -> dict:
        """summary.json (with ``figures``, what the components measured), the sinks
        closed, the closing lines; returns the summary."""
        if "compute_observed" in self.facts.dtypes:  # a launch that ran no step holds no gradients to observe
            self.facts.dtypes.update(observed_dtypes(model, optimizer))  # at the end, not just after step 1
        summary = self._summary(model, progress, stopped_by, figures)
        self.record.write_json("summary.json", summary)
        self.metrics.summary(summary)
        self.metrics.close()
        self._say_memory(summary)
        self.runlog.say(f"done in {summary['wall_time_s']:.1f}s | train loss {fmt(summary['final/train_loss'])} | "
                 f"{self._val_text()} | unigram baseline {self.tokens.unigram_nats:.4f} nats/token"
                 + self._skip_text(summary))
        self.runlog.say(f"run directory: {self.run_dir}")
        for note in self.metrics.closing_notes():
            self.runlog.say(note)
        return summary

    def _summary(self, model: nn.Module, progress, stopped_by: Optional[str], figures: dict) -> dict:
        plan, ctx, p, f, last = self.plan, self.ctx, progress, self.facts, self.latest
        tps = self.clock.tokens_per_s()
        summary = {
            "steps": p.step, "tokens": p.tokens,
            "final/train_loss": last.train.get("train/loss"), **self._val_summary(),
            "baseline/unigram_val_loss": self.tokens.unigram_nats,
            "perf/tokens_per_s": tps,
            "wall_time_s": time.perf_counter() - self.t_start,
            "params": f.n_params,  # excluding position embeddings: the N of 6N
            "flops_per_token": f.flops_tok, "mem/estimate_gib": f.mem.peak / 2**30,
            **summary_figures(f.mem.estimate),  # bytes per parameter of weights, gradients, moments
            "precision": plan.precision.name, "parallel": plan.parallel.name, "model": plan.model.name,
            "world_size": ctx.world, "threads": self.record.info["threads"]["count"], "dtypes": f.dtypes,
            **self._measured_memory(),
            **self._dist_summary(model),
            **({f.lowp_key: f.lowp} if f.lowp else {}),
            **({"resumed_from": str(self.resumed_from)} if self.resumed_from is not None else {}),
            **({"config_history": self.history} if self.history else {}),
            **({"stopped_early": stopped_by} if stopped_by else {}),
            **figures,
        }
        if f.peak and tps:
            summary["perf/mfu"] = mfu(tps, f.flops_tok, f.peak, ctx.world)
        if self.clock.total_steps:  # over the logged laps, like perf/tokens_per_s
            summary["perf/data_wait_s"] = last.wait_s / self.clock.total_steps
            summary["perf/data_wait_fraction"] = last.wait_s / self.clock.total_time
            if ctx.device.type == "cuda":
                summary["perf/data_copy_s"] = last.copy_s / self.clock.total_steps
        if self.scaler.enabled:
            skipped = int(self.scaler.skipped)
            summary.update({"amp/skipped_steps": skipped, "amp/skip_rate": skipped / max(p.step, 1),
                            "amp/final_loss_scale": self.scaler.get_scale()})
        return summary

    def _measured_memory(self) -> dict:
        """The summary's measured memory: this launch's peak, and a CPU run's resident memory at its start."""
        return {**peak_memory(self.ctx.device), **self.mem_start}

    def _say_memory(self, summary: dict) -> None:
        """The closing line that puts the measured peak beside the estimate (``observe.memory.measured_line``)."""
        line = measured_line(self.facts.mem.peak, summary, self.facts.mem.decides(short=True))
        if line:
            self.runlog.say(line)

    def _skip_text(self, summary: dict) -> str:
        """The final line's skip counts, each with its cause; empty when nothing can be skipped."""
        if "amp/skipped_steps" in summary:
            # Under skip a non-finite forward also reaches the scaler (its gradients are inf/nan too).
            cause = ("loss-scale overflow" if self.plan.parts.on_nonfinite == "abort"
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
