"""The math of one training step, free of any schedule.

``train_step`` is a function of the model, the optimizer, the precision
objects and one step's micro-batches; it knows nothing about logging,
checkpoints or which wrapper is in use beyond the ``DistContext`` calls it is
handed. ``lr_at`` is the learning-rate schedule, ``build_optimizer`` the
AdamW with its weight-decay groups, ``evaluate`` the validation loss.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn

from .faults import NonFiniteGuard, inject_inf_grad
from .numerics import canonical_name
from .parallel import DistContext
from .precision import LossScaler, PrecisionPolicy


def schedule_lengths(ocfg, max_steps: int) -> tuple[int, int]:
    """(warmup steps, decay steps) of a ``max_steps`` run: the ``*_steps`` keys
    when set, else the fractions. The decay is clamped to what follows warmup."""
    warm = ocfg.warmup_steps if ocfg.warmup_steps is not None else round(ocfg.warmup_fraction * max_steps)
    after = max(1, max_steps - 1 - max(warm - 1, 0))  # steps from the peak to the last step
    decay = ocfg.decay_steps if ocfg.decay_steps is not None else round(ocfg.decay_fraction * after)
    return warm, min(decay, after)


def lr_at(step: int, ocfg, max_steps: int) -> float:
    """Learning rate for 0-based ``step``.

    Linear warmup ends at the peak on step ``warm - 1`` (step 0 with no
    warmup). The peak holds until the decay's last ``decay`` steps, which end at
    the floor ``lr * min_lr_ratio`` on the last step, ``max_steps - 1``; with
    the whole run decaying (``decay_fraction=1``) the peak is a single step.
    """
    peak = ocfg.lr
    warm, decay = schedule_lengths(ocfg, max_steps)
    if step < warm:
        return peak * (step + 1) / warm
    sched = ocfg.schedule.value
    if sched == "constant" or decay == 0:
        return peak
    floor = peak * ocfg.min_lr_ratio
    start = max(warm - 1, 0, max_steps - 1 - decay)  # the last step at the peak
    progress = min(1.0, max(0.0, (step - start) / decay))
    if sched == "linear":
        return peak - (peak - floor) * progress
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))


def describe_schedule(ocfg, max_steps: int) -> str:
    """The schedule in words, for the banner: ``warmup 50 steps (10%), cosine decay over 449 steps to 2.0e-04``."""
    warm, decay = schedule_lengths(ocfg, max_steps)
    how = "steps" if ocfg.warmup_steps is not None else f"{ocfg.warmup_fraction * 100:g}% of the run"
    text = f"warmup {warm} steps ({how})"
    if ocfg.schedule.value == "constant" or decay == 0:
        return text + f", then constant at {ocfg.lr:.1e}"
    return text + (f", {ocfg.schedule.value} decay over the last {decay} steps "
                   f"to {ocfg.lr * ocfg.min_lr_ratio:.1e}")


def decay_names(model: nn.Module) -> set[str]:
    """Parameters that get weight decay: matrices (embeddings, linears), not
    biases or norm gains. Taken before wrapping, since FSDP1 flattens shapes."""
    return {n for n, p in model.named_parameters() if p.dim() >= 2}


def build_optimizer(model: nn.Module, decay: set[str], ocfg, device: torch.device) -> torch.optim.Optimizer:
    """AdamW over two groups: ``decay`` (by canonical name) with ``weight_decay``, the rest without.

    AdamW keeps its moments in the parameters' dtype (fp32 unless
    master_weights=false). Fused on CUDA by default: it takes the inf/nan flag
    on the device, so a step needs no host sync (see :class:`NonFiniteGuard`)."""
    params_decay, params_other = [], []
    for n, p in model.named_parameters():
        if p.requires_grad:
            (params_decay if canonical_name(n) in decay else params_other).append(p)
    groups = [
        {"params": params_decay, "weight_decay": ocfg.weight_decay},
        {"params": params_other, "weight_decay": 0.0},
    ]
    fused = ocfg.fused if ocfg.get("fused") is not None else device.type == "cuda"
    kernel = {"fused": True} if fused else {"foreach": device.type == "cuda" or None}
    return torch.optim.AdamW(groups, lr=ocfg.lr, betas=(ocfg.beta1, ocfg.beta2), eps=ocfg.eps, **kernel)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, scaler: LossScaler,
               policy: PrecisionPolicy, ctx: DistContext, micro_batches: list, grad_clip: float,
               inject_inf: bool = False, monitor=None, guard: Optional[NonFiniteGuard] = None,
               step: int = 0, inject_value: float = math.inf) -> dict[str, torch.Tensor]:
    """One optimizer step over this rank's micro-batches.

    Returns device tensors: ``loss`` (mean over micro-batches, this rank),
    ``grad_norm`` (global, unscaled, before clipping, fp32), ``skipped`` (1 if
    the step was not applied). Host syncs: none with a fused optimizer; with a
    foreach/for-loop optimizer, one inside ``GradScaler.step`` (fp16 loss
    scaling) or one in ``guard`` (inf/nan check without a scaler).

    ``guard`` (runs without a loss scaler) decides whether a step with inf/nan
    gradients is applied; ``None`` does not look. ``monitor`` is the numerics
    monitor (its calls return at once on unmonitored steps). ``inject_inf`` is
    the test aid behind ``debug.inject_inf_grad_steps``: it writes
    ``inject_value`` (``debug.inject_grad_value``) into one gradient.
    """
    optimizer.zero_grad(set_to_none=True)
    n = len(micro_batches)
    loss_sum = torch.zeros((), device=ctx.device)
    for i, (x, y) in enumerate(micro_batches):
        x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)  # no-op when prefetched
        # Gradients cross ranks only on the last micro-batch.
        with ctx.grad_sync(model, enabled=(i == n - 1)):
            with policy.autocast():
                _, loss = model(x, y)
            # Dividing by n makes K micro-batches sum to the mean over the whole batch.
            scaler.scale(loss / n).backward()
        loss_sum += loss.detach()
    if inject_inf:
        inject_inf_grad(model, inject_value)
    if monitor is not None:
        monitor.after_backward(model, scaler.scale_tensor())  # gradients as held: still scaled
    scaler.unscale_(optimizer)  # clipping and the norm must see true gradients
    grad_norm = ctx.clip_grad_norm(model, grad_clip).float()
    found_inf, skip_now = guard.gate(grad_norm, step) if guard is not None else (None, False)
    if skip_now:  # read back on the host (non-fused optimizer)
        optimizer.zero_grad(set_to_none=True)
        return {"loss": loss_sum / n, "grad_norm": grad_norm.detach(), "skipped": torch.ones((), device=ctx.device)}
    if monitor is not None:
        monitor.before_optimizer(model)
    skipped = _apply(optimizer, scaler, found_inf)
    if monitor is not None:
        monitor.after_optimizer(model, skipped)
    return {"loss": loss_sum / n, "grad_norm": grad_norm.detach(), "skipped": skipped}


def _apply(optimizer: torch.optim.Optimizer, scaler: LossScaler, found_inf: Optional[torch.Tensor]) -> torch.Tensor:
    """Run the optimizer step; returns the 0-d "skipped" flag. The precision
    policy's post-step hooks (float8 scale refresh) run inside ``optimizer.step``."""
    if found_inf is None:
        return scaler.step(optimizer)
    # The fused kernel reads found_inf on the device: 1 leaves weights, moments
    # and the step count as they were (GradScaler drives it the same way).
    optimizer.found_inf = found_inf.float()
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf
    return found_inf.float()


@torch.no_grad()
def evaluate(model: nn.Module, policy: PrecisionPolicy, ctx: DistContext, batches) -> float:
    """Mean validation loss per token over every rank's batches (a host sync;
    only at the eval cadence). Each micro-batch's mean loss is weighted by its
    token count, so a short last micro-batch counts for what it holds."""
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=ctx.device)  # sum over tokens
    tokens = 0
    for x, y in batches:
        with policy.autocast():
            _, loss = model(x.to(ctx.device), y.to(ctx.device))
        loss_sum += loss.double() * y.numel()
        tokens += y.numel()
    model.train()
    ctx.reshard(model)
    # The mean over ranks scales both sums alike, so their ratio is the global per-token mean.
    sums = ctx.all_reduce_mean(torch.stack([loss_sum, loss_sum.new_tensor(float(tokens))]))
    return float(sums[0] / sums[1].clamp(min=1))
