"""``run(cfg)``: the schedule of a training run; ``train_step``: the math of one step.

The schedule (data, wrapping, when to log/evaluate, what to write where) is
in ``run``; the step itself is a plain function of model, optimizer, scaler
and micro-batches, with no knowledge of logging or of the parallel mode
beyond the ``DistContext`` hooks it is handed.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
from omegaconf import DictConfig, OmegaConf

from . import data as data_mod
from .checkpoint import Checkpointer, Progress, StopSignal, resolve_resume
from .comm import counting
from .config import ConfigError, ParallelMode, micro_steps, validate
from .doctor import check_precision
from .memory import estimate as memory_estimate
from .metrics import Metrics, fmt
from .numerics import NumericsMonitor, canonical_name
from .model import GPT, GPTShape
from .parallel import DistContext, setup, wrap
from .perf import flops_per_token, matmul_kind, mfu, peak_flops
from .precision import LossScaler, PrecisionPolicy, dtype_name


# ------------------------------------------------------------------ step math
def lr_at(step: int, ocfg, max_steps: int) -> float:
    """Learning rate for 0-based ``step``: linear warmup, then the decay schedule."""
    peak, warm = ocfg.lr, ocfg.warmup_steps
    if step < warm:
        return peak * (step + 1) / warm
    sched = ocfg.schedule.value
    if sched == "constant":
        return peak
    floor = peak * ocfg.min_lr_ratio
    progress = min(1.0, (step - warm) / max(1, max_steps - warm))
    if sched == "linear":
        return peak - (peak - floor) * progress
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))


def decay_names(model: nn.Module) -> set[str]:
    """Parameters that get weight decay: matrices (embeddings, linears), not
    biases or norm gains. Taken before wrapping, since FSDP1 flattens shapes."""
    return {n for n, p in model.named_parameters() if p.dim() >= 2}


def build_optimizer(model: nn.Module, decay: set[str], ocfg, device: torch.device) -> torch.optim.Optimizer:
    params_decay, params_other = [], []
    for n, p in model.named_parameters():
        if p.requires_grad:
            (params_decay if canonical_name(n) in decay else params_other).append(p)
    groups = [
        {"params": params_decay, "weight_decay": ocfg.weight_decay},
        {"params": params_other, "weight_decay": 0.0},
    ]
    # AdamW keeps its moments in the parameters' dtype (fp32 unless master_weights=false).
    fused = ocfg.fused if ocfg.get("fused") is not None else device.type == "cuda"
    kernel = {"fused": True} if fused else {"foreach": device.type == "cuda" or None}
    return torch.optim.AdamW(groups, lr=ocfg.lr, betas=(ocfg.beta1, ocfg.beta2), eps=ocfg.eps, **kernel)


def _inject_inf(model: nn.Module) -> None:
    """Testing aid: put an inf into the first non-empty local gradient shard."""
    for p in model.parameters():
        g = p.grad
        if g is None:
            continue
        g = g.to_local() if hasattr(g, "to_local") else g
        if g.numel():
            g.view(-1)[0] = float("inf")
            return


class NonFiniteStep(Exception):
    """Raised inside a step whose gradients hold inf/nan when the run aborts on it."""


class NonFiniteError(RuntimeError):
    """The run stopped on non-finite numbers; the message names the step and the module."""


def _plant_nan(model: nn.Module, name: Optional[str], steps) -> dict:
    """Testing aid (debug.nan_in_module): NaN out one module's forward output at
    chosen steps. Returns the dict whose "step" the loop keeps current."""
    state = {"step": -1}
    if not name:
        return state

    mods = {canonical_name(n): m for n, m in model.named_modules()}
    if name not in mods:
        raise ConfigError(f"debug.nan_in_module='{name}' is not a module of this model; "
                          f"e.g. {', '.join(list(mods)[1:6])}, ...")
    at = set(steps)

    def hook(_m, _inp, out):
        if state["step"] in at:
            return out * float("nan")
        return None

    mods[name].register_forward_hook(hook)
    return state


class NonFiniteGuard:
    """Watches each step's gradient norm for inf/nan in runs without a loss scaler.

    When the optimizer can skip a step on the device (fused AdamW reads a
    ``found_inf`` flag, as it does for ``GradScaler``), nothing is read back per
    step: a bad step is skipped on the device, and under ``abort`` every step
    after it is skipped too, so the weights stay those the bad step started
    from until the loop looks (at the logging cadence, before a checkpoint and
    at the end) and raises. Other optimizers cannot skip without knowing, so
    the check then reads one flag back per step.
    """

    def __init__(self, mode: str, optimizer: torch.optim.Optimizer, device: torch.device):
        self.mode = mode
        self.on_device = bool(getattr(optimizer, "_step_supports_amp_scaling", False))
        self.bad_step = torch.full((), -1, dtype=torch.int64, device=device)  # first bad 0-based step
        self.skipped = torch.zeros((), dtype=torch.int64, device=device)

    def gate(self, grad_norm: torch.Tensor, step: int) -> tuple[Optional[torch.Tensor], bool]:
        """``(found_inf, skip_now)``. On the device path, ``found_inf`` is the 0-d
        flag to hand the fused kernel (1: do not apply) and ``skip_now`` is False.
        Otherwise the flag is read back (one host sync): ``found_inf`` is None and
        ``skip_now`` says whether to skip; under ``abort`` a bad step raises
        :class:`NonFiniteStep` instead."""
        bad = ~torch.isfinite(grad_norm.float())
        if self.mode == "abort":
            self.bad_step = torch.where(bad & (self.bad_step < 0), step, self.bad_step)
            stop = self.bad_step >= 0  # sticky: nothing after the first bad step is applied
        else:
            stop = bad
        self.skipped += stop.to(self.skipped.dtype)
        if self.on_device:
            return stop, False
        skip_now = bool(stop)  # host sync (non-fused optimizer only)
        if skip_now and self.mode == "abort":
            raise NonFiniteStep()
        return None, skip_now

    def first_bad_step(self) -> Optional[int]:
        """The first bad 0-based step under ``abort`` (a host sync), or None."""
        at = int(self.bad_step)
        return at if at >= 0 else None


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, scaler: LossScaler,
               policy: PrecisionPolicy, ctx: DistContext, micro_batches: list, grad_clip: float,
               inject_inf: bool = False, monitor=None, guard: Optional[NonFiniteGuard] = None,
               step: int = 0) -> dict[str, torch.Tensor]:
    """One optimizer step over this rank's micro-batches.

    Returns device tensors: ``loss`` (mean over micro-batches, this rank),
    ``grad_norm`` (global, unscaled, before clipping), ``skipped`` (1 if the
    step was not applied). Host syncs: none with a fused optimizer; with a
    foreach/for-loop optimizer, one inside ``GradScaler.step`` (fp16 loss
    scaling) or one in ``guard`` (inf/nan check without a scaler).

    ``guard`` (runs without a loss scaler) decides whether a step with inf/nan
    gradients is applied; see :class:`NonFiniteGuard`. ``None`` does not look.
    """
    optimizer.zero_grad(set_to_none=True)
    n = len(micro_batches)
    loss_sum = torch.zeros((), device=ctx.device)
    for i, (x, y) in enumerate(micro_batches):
        x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
        # Gradients cross ranks only on the last micro-batch.
        with ctx.grad_sync(model, enabled=(i == n - 1)):
            with policy.autocast():
                _, loss = model(x, y)
            # Dividing by n makes K micro-batches sum to the mean over the whole batch.
            scaler.scale(loss / n).backward()
        loss_sum += loss.detach()
    if inject_inf:
        _inject_inf(model)
    if monitor is not None:
        monitor.after_backward(model, scaler.scale_tensor())  # gradients as held: still scaled
    scaler.unscale_(optimizer)  # clipping and the norm must see true gradients
    grad_norm = ctx.clip_grad_norm(model, grad_clip)
    found_inf, skip_now = guard.gate(grad_norm, step) if guard is not None else (None, False)
    if skip_now:  # read back on the host (non-fused optimizer)
        optimizer.zero_grad(set_to_none=True)
        return {"loss": loss_sum / n, "grad_norm": grad_norm.detach(),
                "skipped": torch.ones((), device=ctx.device)}
    if monitor is not None:
        monitor.before_optimizer(model)
    if found_inf is not None:
        # The fused kernel reads found_inf on the device: 1 leaves weights, moments
        # and the step count as they were (GradScaler drives it the same way).
        optimizer.found_inf = found_inf.float()
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf
        skipped = found_inf.float()
    else:
        skipped = scaler.step(optimizer)
    if monitor is not None:
        monitor.after_optimizer(model, skipped)
    policy.after_optimizer_step(model)  # float8 all-gather scales follow the new weights
    return {"loss": loss_sum / n, "grad_norm": grad_norm.detach(), "skipped": skipped}


@contextlib.contextmanager
def _audit(enabled: bool, model: nn.Module, optimizer: torch.optim.Optimizer, policy: PrecisionPolicy):
    """The dtype audit of one step (``mptrain/audit.py``), or None when not auditing.
    Compiled blocks run eagerly for it: a dispatch mode cannot look inside a graph."""
    if not enabled:
        yield None
        return
    from .audit import DtypeAudit

    with torch.compiler.set_stance("force_eager"), DtypeAudit(model, optimizer, policy) as audit:
        yield audit


def locate_nonfinite(model: nn.Module, policy: PrecisionPolicy, ctx: DistContext, micro_batches: list,
                     scale: float = 1.0) -> str:
    """Replay a step's forward and backward with hooks and name the first module
    whose output (in forward order) or output gradient (in backward order) holds
    inf/nan. The weights are those the bad step started from: it was not applied."""

    found: list[str] = []

    def bad(t) -> bool:
        return torch.is_tensor(t) and t.is_floating_point() and not bool(torch.isfinite(t).all())

    def fwd_hook(name):
        def hook(_m, _inp, out):
            t = out[0] if isinstance(out, (tuple, list)) else out
            if bad(t):
                found.append(f"forward output of '{name}'")
            elif torch.is_tensor(t) and t.requires_grad:
                t.register_hook(lambda g: found.append(f"gradient of '{name}' output") if bad(g) else None)
        return hook

    handles = [m.register_forward_hook(fwd_hook(canonical_name(n) or "model (the loss)"))
               for n, m in model.named_modules()]
    try:
        model.zero_grad(set_to_none=True)
        for x, y in micro_batches:
            with ctx.grad_sync(model, enabled=True), policy.autocast():
                _, loss = model(x.to(ctx.device), y.to(ctx.device))
            if found:
                break
            (loss * scale).backward()
            if found:
                break
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
    return found[0] if found else "no module (inf/nan appeared in the gradient reduction or clipping)"


@torch.no_grad()
def evaluate(model: nn.Module, policy: PrecisionPolicy, ctx: DistContext, batches) -> float:
    """Mean validation loss over ranks (a host sync; only at the eval cadence)."""
    model.eval()
    total = torch.zeros((), device=ctx.device)
    count = 0
    for x, y in batches:
        with policy.autocast():
            _, loss = model(x.to(ctx.device), y.to(ctx.device))
        total += loss.float()
        count += 1
    model.train()
    ctx.reshard(model)
    return float(ctx.all_reduce_mean(total / max(count, 1)))


class SpikeDetector:
    """A logged loss above ``factor`` x the median of the previous ``window``
    logged losses is a spike. Resumable (its window is checkpointed)."""

    def __init__(self, factor: float, window: int):
        self.factor, self.size = factor, window
        self.window: list[float] = []
        self.median = float("nan")

    def update(self, loss: float) -> bool:
        hist = sorted(self.window)
        spike = False
        if len(hist) >= min(5, self.size) and math.isfinite(loss):
            self.median = hist[len(hist) // 2]
            spike = loss > self.factor * self.median
        self.window = (self.window + [loss])[-self.size:]
        return spike

    def state_dict(self) -> dict:
        return {"window": list(self.window)}

    def load_state_dict(self, sd: dict) -> None:
        self.window = list(sd.get("window", []))


# ------------------------------------------------------------- run records
def _git_commit() -> str:
    here = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5)
        if out.returncode:
            return "unknown"
        return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _versions() -> dict:
    import hydra
    import numpy
    import tokenizers
    import transformers

    return {"python": platform.python_version(), "torch": str(torch.__version__), "hydra": hydra.__version__,
            "numpy": numpy.__version__, "tokenizers": tokenizers.__version__,
            "transformers": transformers.__version__, "platform": platform.platform()}


def _reset_peak_memory(device: torch.device) -> None:
    """Start this run's peak from here (several runs can share a process: multirun)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:  # Linux: writing 5 to clear_refs resets the process's peak RSS (VmHWM)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _peak_memory(device: torch.device) -> dict:
    if device.type == "cuda":
        return {"mem/peak_gib": torch.cuda.max_memory_allocated(device) / 2**30}
    # On CPU there is no allocator counter; the process's peak RSS is the honest figure.
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return {"mem/peak_rss_gib": int(line.split()[1]) / 2**20}  # kB
    except OSError:
        pass
    return {"mem/peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def _observe_compute_dtype(model: nn.Module) -> tuple[dict, callable]:
    """Record the output dtype of the first Linear in the first forward."""
    seen: dict = {}
    lin = next(m for m in model.modules() if isinstance(m, nn.Linear))

    def hook(_m, _inp, out):
        seen.setdefault("linear_output", dtype_name(out.dtype))

    h = lin.register_forward_hook(hook)
    return seen, h.remove


def observed_dtypes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Dtypes read off the live objects after a step."""
    pd = sorted({dtype_name(p.dtype) for p in model.parameters()})
    gd = sorted({dtype_name(p.grad.dtype) for p in model.parameters() if p.grad is not None})
    od = sorted({dtype_name(v.dtype) for s in optimizer.state.values() for v in s.values()
                 if torch.is_tensor(v) and v.is_floating_point() and v.dim() > 0})
    return {"parameters": ",".join(pd), "gradients": ",".join(gd) or "none", "optimizer_state": ",".join(od) or "none"}


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def _write_config(run_dir: Path, cfg: DictConfig, info: dict) -> None:
    resolved = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    resolved["run_info"] = info
    tmp = run_dir / "config.yaml.tmp"
    tmp.write_text(OmegaConf.to_yaml(OmegaConf.create(resolved)))
    os.replace(tmp, run_dir / "config.yaml")


def _sweep_identity() -> tuple[Optional[str], Optional[str]]:
    """(W&B group, job name) for a Hydra multirun job: the sweep directory and
    the job's overrides; (None, None) otherwise."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return None, None
    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:
        return None, None
    group = "sweep-" + Path(hc.sweep.dir).as_posix().strip("/").replace("/", "_")
    return group, hc.job.override_dirname or f"job{hc.job.num}"


def _hydra_run_dir() -> Path:
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        raise ConfigError("run(cfg) outside @hydra.main needs an explicit run_dir.")
    return Path(HydraConfig.get().runtime.output_dir)


# ------------------------------------------------------------------- schedule
def run(cfg: DictConfig, run_dir: Optional[str | os.PathLike] = None) -> dict:
    """Train as configured; returns the summary (also written to summary.json)."""
    validate(cfg)
    ctx = setup(cfg.parallel, cfg.train.device)
    try:
        return _run(cfg, ctx, Path(run_dir) if run_dir else _hydra_run_dir())
    finally:
        ctx.shutdown()


def _run(cfg: DictConfig, ctx: DistContext, run_dir: Path) -> dict:
    t_start = time.perf_counter()
    _reset_peak_memory(ctx.device)
    validate(cfg, ctx.world)
    tc = cfg.train
    mbs, accum = micro_steps(cfg, ctx.world)
    say = print if ctx.is_main else (lambda *a, **k: None)
    if ctx.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)

    policy = PrecisionPolicy(cfg.precision, ctx.device, fsdp2=ctx.mode == ParallelMode.fsdp)
    hw_warnings = check_precision(policy, ctx.device)  # refuses the impossible before any work

    # Data: the first rank of each node builds the caches (they live on node-local
    # disk), the others wait and then read them.
    if ctx.local_rank == 0:
        tokens = data_mod.prepare(cfg.data, log=say)
    ctx.barrier()
    if ctx.local_rank != 0:
        tokens = data_mod.prepare(cfg.data, log=lambda *a: None)
    vocab = cfg.model.vocab_size or data_mod.padded_vocab(tokens.vocab_size)
    if vocab < tokens.vocab_size:
        raise ConfigError(
            f"model.vocab_size={vocab} is smaller than the tokenizer's vocabulary ({tokens.vocab_size}); "
            "leave model.vocab_size=null to take it from the tokenizer."
        )
    block = cfg.model.block_size
    train_w, val_w = data_mod.Windows(tokens.train, block), data_mod.Windows(tokens.val, block)
    batches = data_mod.Batches(train_w, tc.global_batch_size, mbs, ctx.rank, ctx.world, tc.seed)

    # Model: the same seed on every rank gives the same initial weights.
    torch.manual_seed(tc.seed)
    m = cfg.model
    shape = GPTShape(vocab, m.n_layer, m.n_head, m.d_model, block, m.dropout, m.bias)
    model = GPT(shape)
    n_params = model.num_params()
    decay = decay_names(model)
    if ctx.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = tc.tf32
        torch.backends.cudnn.allow_tf32 = tc.tf32
    compile_blocks = tc.compile if tc.compile is not None else ctx.device.type == "cuda"
    model = wrap(model, policy, ctx, activation_checkpointing=tc.activation_checkpointing.value == "block",
                 compile_blocks=compile_blocks)
    optimizer = build_optimizer(model, decay, cfg.optim, ctx.device)
    scaler = policy.make_scaler(distributed=ctx.has_group and ctx.world > 1)

    dtypes = {**policy.describe(), **ctx.wrapper_dtypes}
    fp8_report = policy.fp8.report if policy.fp8 else None
    if fp8_report is not None:
        # Weights FSDP2 will all-gather in float8 carry torchao's float8-cast tensor subclass.
        fp8_report["float8_all_gather_weights"] = sum(
            "Float8" in type(p.to_local() if hasattr(p, "to_local") else p).__name__ for p in model.parameters())
    info = {"dtypes": dtypes, "world_size": ctx.world, "device": str(ctx.device), "backend": ctx.backend,
            "micro_batch_size": mbs, "grad_accum_steps": accum, "vocab_size": vocab,
            "tokenizer": tokens.tokenizer.name, "tokenizer_path": tokens.tokenizer.path, "corpus": tokens.source,
            "train_tokens": int(len(tokens.train)), "val_tokens": int(len(tokens.val)),
            "params": n_params, "git_commit": _git_commit(), "versions": _versions(),
            "argv": sys.argv, "compile": compile_blocks,
            "activation_checkpointing": tc.activation_checkpointing.value,
            "fused_adamw": any(g.get("fused") for g in optimizer.param_groups)}
    if fp8_report:
        info["fp8"] = fp8_report
    run_name = f"{m.name}-{cfg.precision.name}-{cfg.parallel.name.value}"
    sweep_group, job_name = _sweep_identity()
    if sweep_group and not cfg.log.wandb.group:
        # one W&B group per sweep, each job named by its overrides
        cfg.log.wandb.group = sweep_group
        run_name = job_name or run_name
    info["run_name"] = cfg.log.wandb.name or run_name
    tags = [f"precision:{cfg.precision.name}", f"parallel:{cfg.parallel.name.value}", f"model:{m.name}"]
    if ctx.is_main:
        _write_config(run_dir, cfg, info)
    # Resume: rank 0 picks the checkpoint (one listing of the directory), every rank loads it.
    progress = Progress()
    ckpt = Checkpointer(cfg.checkpoint, run_dir, ctx, cfg, cfg.debug.kill_during_save_at_step,
                        meta_extra={"tokenizer": {"name": tokens.tokenizer.name, "path": tokens.tokenizer.path}})
    resume_path = ctx.broadcast_object(resolve_resume(cfg.resume, run_dir) if ctx.is_main else None)
    if resume_path is not None:
        ckpt.load(Path(resume_path), model, optimizer, scaler, progress, policy)
        info["resumed_from"] = str(resume_path)
    start = progress.step

    wandb_cfg = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True) | {"run_info": info}
    metrics = Metrics(run_dir, cfg.log, tc.max_steps, ctx.is_main, wandb_cfg, run_name, tags,
                      resume_step=start if resume_path is not None else None)

    tokens_per_step = tc.global_batch_size * block
    flops_tok = flops_per_token(n_params, m.n_layer, m.d_model, block)
    device_name = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu"
    kind = matmul_kind(dtype_name(policy.compute_dtype), policy.fp8_enabled,
                       ctx.device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32)
    peak = peak_flops(device_name, kind, tc.peak_tflops)
    mem_est = memory_estimate(cfg, vocab, ctx.world, mbs)
    info["flops_per_token"] = flops_tok
    info["memory_estimate_gib"] = {k: round(v / 2**30, 4) for k, v in mem_est.rows()}
    say(_banner(cfg, ctx, policy, dtypes, info, tokens, tokens_per_step, run_dir))
    for w in ([policy.warning] if policy.warning else []) + hw_warnings:
        say(f"WARNING: {w}")
    if resume_path is not None:
        say(f"resumed from {resume_path} at step {start} ({progress.tokens:,} tokens seen)")
    if tc.audit:
        say(f"dtype audit of step {start + 1}: every operator's dtypes into {run_dir / 'audit.json'}"
            + ("; the run stops after it (train.audit_only)" if tc.audit_only else ""))
    metrics.text("config", "```\n" + OmegaConf.to_yaml(cfg) + "\n```")

    monitor = NumericsMonitor(cfg.monitor, model, reduce_sum=ctx.shard_sum, reduce_max=ctx.shard_max,
                              reduce_max_all=ctx.all_reduce_max)
    spikes = SpikeDetector(cfg.monitor.spike_factor, cfg.monitor.spike_window)
    if resume_path is not None:
        spikes.load_state_dict(ckpt.loaded_extra.get("spikes", {}))
    ls_cfg = cfg.precision.loss_scale
    # Warned about the skip rate already (kept across resumes: once per run).
    skip_warned = bool(ckpt.loaded_extra.get("skip_warned", False)) if resume_path is not None else False
    count_comm = cfg.monitor.comm and ctx.mode != ParallelMode.none
    last_comm: dict = {}

    def loop_state() -> dict:  # the loop's own resumable state, saved beside the checkpoint's
        return {"spikes": spikes.state_dict(), "skip_warned": skip_warned}

    # With a loss scaler the scaler skips bad steps; without one we look ourselves.
    guard = None if scaler.enabled else NonFiniteGuard(cfg.train.on_nonfinite.value, optimizer, ctx.device)

    def abort_on_nonfinite(bad_step: int, detected: Optional[int] = None):
        nan_fault["step"] = bad_step  # replay the bad step exactly (debug.nan_in_module included)
        where = locate_nonfinite(model, policy, ctx, batches.batch(bad_step))
        later = (f" (seen at step {detected}, the next point the loop looks: the steps in between were "
                 "not applied either)" if detected is not None and detected != bad_step + 1 else "")
        return NonFiniteError(
            f"step {bad_step + 1}: the gradients hold inf/nan; first non-finite value: {where}. "
            f"Nothing of this step was applied or saved{later}. (train.on_nonfinite=skip skips such steps "
            "instead; lowering optim.lr or checking the data are the usual fixes.)")

    def check_deferred_abort(done: int) -> None:
        # Fused optimizer under abort: bad steps were skipped on the device; look now.
        if guard is not None and guard.on_device and guard.mode == "abort":
            bad = guard.first_bad_step()
            if bad is not None:
                raise abort_on_nonfinite(bad, done)
    nan_fault = _plant_nan(model, cfg.debug.nan_in_module, cfg.debug.nan_at_steps)
    seen_compute, unhook = _observe_compute_dtype(model)
    inject_steps, inject_rank = set(cfg.debug.inject_inf_grad_steps), cfg.debug.inject_inf_grad_rank
    stop = StopSignal(cfg.checkpoint.on_signal)
    stopped_by: Optional[str] = None
    last_saved: Optional[int] = None
    last_train: dict = {}
    last_val: Optional[float] = None
    train_time = 0.0
    t_mark, steps_since, excluded = time.perf_counter(), 0, 0.0
    model.train()
    metrics.console.start(initial=start)
    try:
        for step in range(start, tc.max_steps):
            lr = lr_at(step, cfg.optim, tc.max_steps)
            for g in optimizer.param_groups:
                g["lr"] = lr
            inject = step in inject_steps and inject_rank in (-1, ctx.rank)
            micro = batches.batch(step)
            nan_fault["step"] = step
            monitor.start_step(step)
            auditing = tc.audit and step == start
            try:
                with counting(count_comm and monitor.active(step)) as comm, _audit(auditing, model, optimizer,
                                                                                    policy) as audit:
                    out = train_step(model, optimizer, scaler, policy, ctx, micro, tc.grad_clip, inject,
                                     monitor, guard, step)
            except NonFiniteStep:
                raise abort_on_nonfinite(step) from None
            done = step + 1
            log_now = done == 1 or done % tc.log_every == 0 or done == tc.max_steps
            progress.step, progress.tokens = done, progress.tokens + tokens_per_step
            steps_since += 1
            metrics.console.advance()
            if done == start + 1:
                unhook()
                dtypes.update(observed_dtypes(model, optimizer))
                dtypes["compute_observed"] = seen_compute.get("linear_output", "?")
                if ctx.is_main:
                    _write_config(run_dir, cfg, info)

            row: dict = {}
            if log_now:
                # Host sync: the loss/norm/scale are read back only at this cadence.
                check_deferred_abort(done)
                loss = float(ctx.all_reduce_mean(out["loss"].float()))
                now = time.perf_counter()
                # Throughput counts everything a training step costs (logging and the
                # monitor included) except evaluation and checkpointing.
                elapsed, t_mark, excluded = now - t_mark - excluded, now, 0.0
                train_time += elapsed
                row.update({
                    "train/loss": loss,
                    "train/lr": lr,
                    "train/grad_norm": float(out["grad_norm"]),
                    "train/tokens": progress.tokens,
                    "perf/tokens_per_s": steps_since * tokens_per_step / elapsed,
                    "perf/step_time_s": elapsed / steps_since,
                    **({"perf/mfu": mfu(steps_since * tokens_per_step / elapsed, flops_tok, peak, ctx.world)}
                       if peak else {}),
                    **_peak_memory(ctx.device),
                })
                if scaler.enabled:
                    skipped = int(scaler.skipped)
                    scale_now = scaler.get_scale()
                    row.update({"amp/loss_scale": scale_now, "amp/skipped_steps": skipped,
                                "amp/skip_rate": skipped / done})
                    if (not skip_warned and ls_cfg.warn_skip_rate > 0 and done >= ls_cfg.warn_after_steps
                            and skipped / done > ls_cfg.warn_skip_rate):
                        skip_warned = True
                        row["events/skip_rate_warning"] = skipped / done
                        metrics.write(
                            f"WARNING step {done}: the loss scaler skipped {skipped} of {done} steps "
                            f"({skipped / done:.1%}, above precision.loss_scale.warn_skip_rate="
                            f"{ls_cfg.warn_skip_rate:g}); skipped steps train nothing. Usual fixes: a lower "
                            f"precision.loss_scale.init_scale (now {ls_cfg.init_scale:g}), checking the data for "
                            "bad batches, or precision=bf16 on hardware that has it (python -m mptrain.doctor).")
                    if scale_now < ls_cfg.min_loss_scale:
                        where = locate_nonfinite(model, policy, ctx, micro, scale=scale_now)
                        raise NonFiniteError(
                            f"step {done}: the loss scale fell to {scale_now:g}, below "
                            f"precision.loss_scale.min_loss_scale={ls_cfg.min_loss_scale:g}: the gradients "
                            f"overflow at every scale. First non-finite value: {where}. Nothing of the broken state "
                            "was saved. Consider bf16, a lower optim.lr, or checking the data.")
                if guard is not None and guard.mode == "skip":
                    row["train/nonfinite_skipped"] = int(guard.skipped)
                if spikes.update(loss):
                    row["events/loss_spike"] = loss / spikes.median
                    metrics.write(f"step {done:>6} | loss spike: {loss:.4f} is {loss / spikes.median:.1f}x "
                                  f"the median {spikes.median:.4f} of the last {len(spikes.window) - 1} logged losses")
                if ctx.world > 1:
                    # Every rank must have the same global grad norm and skip count; a
                    # disagreement means the ranks are no longer training one model.
                    mine = torch.stack([out["grad_norm"].float(), scaler.skipped.float()])
                    row["dist/rank_mismatch"] = 0 if ctx.ranks_agree(mine) else 1
                last_train = row.copy()
            if tc.eval_every and (done % tc.eval_every == 0 or done == tc.max_steps):
                t_eval = time.perf_counter()
                val_iter = data_mod.val_batches(val_w, tc.eval_batches, tc.global_batch_size, mbs, ctx.rank, ctx.world)
                last_val = evaluate(model, policy, ctx, val_iter)
                excluded += time.perf_counter() - t_eval
                row["val/loss"] = last_val
                metrics.write(f"step {done:>6} | train loss {fmt(last_train.get('train/loss'))} | "
                              f"val loss {fmt(last_val)} | unigram baseline {tokens.unigram_nats:.4f}")
            hists = {}
            if monitor.active(step):
                scalars, hists = monitor.collect()  # collectives + one host sync, on monitored steps only
                row.update(scalars)
            if comm is not None:
                last_comm = comm.metrics()
                row.update(last_comm)
                if step == start:
                    metrics.write(f"step {done:>6} | collectives of one step on this rank: {comm.text()}")
            if audit is not None:
                report = audit.report()
                report["comm"] = last_comm if comm is not None else {}
                if ctx.is_main:
                    _write_json(run_dir / "audit.json", report)
                metrics.write(audit.table())
                metrics.write(f"step {done:>6} | dtype audit written to {run_dir / 'audit.json'}")
                row["audit/flags"] = len(report["flags"])
            if row:
                metrics.log(done, row, hists)
            if tc.audit_only:
                stopped_by = "train.audit_only"
                break  # the audit was the point: no checkpoint of a one-step run

            # Stop here? A signal may reach ranks at different steps: they agree through
            # a tiny all-reduce, a host sync, so several ranks look only when they log.
            if (ctx.world == 1 or log_now) and ctx.any_rank(stop.flag):
                stopped_by = stop.name or "a signal on another rank"
            elif tc.stop_after is not None and done >= tc.stop_after and done < tc.max_steps:
                stopped_by = f"train.stop_after={tc.stop_after}"
            every = cfg.checkpoint.every
            if stopped_by or (every and done % every == 0) or (every and done == tc.max_steps):
                check_deferred_abort(done)  # never save after a bad step
                t_save = time.perf_counter()
                ckpt.save(done, model, optimizer, scaler, progress, loop_state())
                excluded += time.perf_counter() - t_save
                last_saved = done
                metrics.write(f"step {done:>6} | checkpoint saved: {ckpt.root / f'step-{done}'}")
            if stopped_by:
                metrics.write(f"step {done:>6} | stopping ({stopped_by}); resume with resume=auto "
                              f"hydra.run.dir={run_dir}")
                break
            if "train/loss" in row:
                steps_since = 0
    except BaseException:
        metrics.close()  # flush what was logged up to the failure (JSONL, TensorBoard, W&B)
        raise
    finally:
        stop.restore()  # also when a step raises: never leave our handler installed
    metrics.console.close()
    if cfg.checkpoint.every and last_saved != progress.step and progress.step == tc.max_steps:
        ckpt.save(progress.step, model, optimizer, scaler, progress, loop_state())
    dtypes.update(observed_dtypes(model, optimizer))  # what the objects hold at the end, not just at step 1

    skipped = int(scaler.skipped)
    dist_summary = {}
    if ctx.world > 1:
        fp = ctx.replica_fingerprint(model)
        dist_summary = {
            "dist/replicas_identical": ctx.ranks_agree(fp) and fp[2].item() == 0,
            "dist/skipped_steps_per_rank": [int(v) for v in ctx.all_gather(scaler.skipped)],
        }
    summary = {
        "steps": progress.step,
        "tokens": progress.tokens,
        "final/train_loss": last_train.get("train/loss"),
        "final/val_loss": last_val,
        "baseline/unigram_val_loss": tokens.unigram_nats,
        "perf/tokens_per_s": (progress.step - start) * tokens_per_step / train_time if train_time else None,
        "wall_time_s": time.perf_counter() - t_start,
        "params": n_params,  # excluding position embeddings: the N of 6N
        "flops_per_token": flops_tok,
        "mem/estimate_gib": mem_est.total / 2**30,
        "precision": cfg.precision.name,
        "parallel": cfg.parallel.name.value,
        "model": m.name,
        "world_size": ctx.world,
        "dtypes": dtypes,
        **_peak_memory(ctx.device),
        **dist_summary,
        **({"fp8": fp8_report} if fp8_report else {}),
        **({"resumed_from": str(resume_path)} if resume_path is not None else {}),
        **({"stopped_early": stopped_by} if stopped_by else {}),
        **last_comm,
    }
    if peak and summary["perf/tokens_per_s"]:
        summary["perf/mfu"] = mfu(summary["perf/tokens_per_s"], flops_tok, peak, ctx.world)
    if scaler.enabled:
        summary.update({"amp/skipped_steps": skipped, "amp/skip_rate": skipped / max(progress.step, 1),
                        "amp/final_loss_scale": scaler.get_scale()})
    if ctx.is_main:
        _write_json(run_dir / "summary.json", summary)
    metrics.summary(summary)
    metrics.close()
    say(f"done in {summary['wall_time_s']:.1f}s | train loss {fmt(summary['final/train_loss'])} | "
        f"val loss {fmt(last_val)} | unigram baseline {tokens.unigram_nats:.4f} nats/token"
        + (f" | skipped steps {skipped}" if scaler.enabled else ""))
    say(f"run directory: {run_dir}")
    ctx.barrier()  # leave together: the next multirun job starts on every rank at once
    return summary


def _banner(cfg, ctx, policy, dtypes, info, tokens, tokens_per_step, run_dir) -> str:
    m = cfg.model
    lines = [
        f"mptrain | {m.name} ({info['params'] / 1e6:.2f}M params, "
        f"{m.n_layer}x{m.d_model}, {m.n_head} heads, block {m.block_size}, vocab {info['vocab_size']})",
        f"  device {ctx.device} | world size {ctx.world} | parallel={cfg.parallel.name.value}"
        + (f" ({ctx.backend})" if ctx.backend else ""),
        f"  data {info['corpus']} | tokenizer {tokens.tokenizer.name} | {info['train_tokens']:,} train / "
        f"{info['val_tokens']:,} val tokens | unigram baseline {tokens.unigram_nats:.4f} nats/token",
        f"  batch {cfg.train.global_batch_size} seqs = {tokens_per_step:,} tokens/step | micro-batch "
        f"{info['micro_batch_size']} x {info['grad_accum_steps']} accumulation | {cfg.train.max_steps} steps",
        f"  precision={cfg.precision.name}:",
    ]
    lines += [f"    {k:<16} {v}" for k, v in dtypes.items()]
    if "fp8" in info:
        r = info["fp8"]
        lines.append(f"  fp8: {len(r['converted'])} linears converted ({r['forward']}; {r['backward']}; "
                     f"float8 all-gather {'on' if r['fsdp_float8_all_gather'] else 'off'})")
        lines += [f"    kept high precision: {n} ({why})" for n, why in r["excluded"].items()]
    lines.append(f"  run directory {run_dir}")
    return "\n".join(lines)
