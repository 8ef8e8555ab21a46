"""The math of one training step, free of any schedule.

``train_step`` is a function of the step's state (:class:`StepState`: the
model, the optimizer, the precision objects and the step's switches), one
step's micro-batches and the run's optional parts (``components.py``),
returning a :class:`StepResult`; it knows nothing about logging, checkpoints
or which wrapper is in use beyond the ``DistContext`` calls it is handed.
Each switch (the guard, z-loss, update clipping) is an object whose off form
does nothing, so the step holds no branch per feature. ``lr_at`` is the learning-rate
schedule (``set_lr_at`` applies it), ``build_optimizer`` the
AdamW with its weight-decay groups, ``update_clipping`` the optional
per-tensor update clipping (StableAdamW), ``evaluate`` the validation loss.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Union

import torch
import torch.nn as nn

from mptrain.config.schedule import schedule_lengths
from mptrain.distributed.parallel import DistContext
from mptrain.model.names import canonical_name
from mptrain.plan.plan import Plan
from mptrain.precision import optimizers
from mptrain.precision.optimizers import Choice, bias_correction
from mptrain.precision.policy import LossScaler, PrecisionPolicy
from mptrain.run.components import NO_PARTS, Component
from mptrain.run.faults import NO_FAULTS
from mptrain.run.mixture import NO_MIXTURE, Mixture, NoMixture
from mptrain.run.nonfinite import NO_GUARD, NonFiniteGuard, Unguarded

Guard = Union[NonFiniteGuard, Unguarded]
"""What decides whether a step with inf/nan gradients is applied."""


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


def set_lr_at(optimizer: torch.optim.Optimizer, step: int, ocfg, max_steps: int) -> float:
    """Give every group the learning rate of 0-based ``step`` (:func:`lr_at`); returns it."""
    lr = lr_at(step, ocfg, max_steps)
    optimizers.set_lr(optimizer, lr)
    return lr


def describe_schedule(ocfg, max_steps: int) -> str:
    """The schedule in words, for the banner: ``warmup 50 steps (10% of the run), cosine decay over the last 450 steps to 2.0e-04``."""
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


def build_optimizer(model: nn.Module, decay: set[str], ocfg, device: torch.device,
                    choice: Optional[Choice] = None) -> torch.optim.Optimizer:
    """AdamW over two groups: ``decay`` (by canonical name) with ``weight_decay``, the
    rest without; with update clipping, one group per parameter instead.

    ``choice`` (the plan's ``optimizer``, ``optimizers.choose``) says which AdamW: torch's (the
    default; moments in the parameters' dtype, fused on CUDA, so a step needs
    no host sync, see :class:`NonFiniteGuard`), torchao's (stochastic rounding,
    moments in another dtype or quantized) or torch-optimi's (Kahan summation).

    With ``optim.update_clip > 0`` every parameter gets a group of its own
    (with its weight decay), because torch's AdamW takes one learning rate per
    group and the clipping sets one per tensor (:func:`update_clipping`). That
    costs one foreach/fused launch per tensor instead of per group. The
    threshold itself travels in the step's state (:class:`UpdateClip`), not in
    the groups: loading a checkpoint overwrites the groups' entries with the
    saved ones, and the current config must decide. The layout itself is in
    every checkpoint, so one saved with the switch off does not load with it
    on, nor the other way round.
    """
    clip = float(getattr(ocfg, "update_clip", 0.0) or 0.0)
    params = [(canonical_name(n) in decay, p) for n, p in model.named_parameters() if p.requires_grad]
    if clip > 0:
        groups = [{"params": [p], "weight_decay": ocfg.weight_decay if d else 0.0} for d, p in params]
    else:
        groups = [
            {"params": [p for d, p in params if d], "weight_decay": ocfg.weight_decay},
            {"params": [p for d, p in params if not d], "weight_decay": 0.0},
        ]
    return optimizers.make(groups, ocfg, choice or optimizers.TORCH_ADAMW, device)


class ZLoss:
    """``train.z_loss``: the penalty ``coef * logsumexp(logits)^2`` (mean over
    positions) added to each micro-batch's loss, which keeps the softmax's
    normalizer near 1. ``ZLoss(0)`` is off: nothing is computed or added, and
    the step reports no z-loss figure."""

    def __init__(self, coef: float = 0.0):
        self.coef = float(coef or 0.0)

    def begin(self, device: torch.device) -> "_ZSum | _NoZ":
        """This step's tally over its micro-batches."""
        return _ZSum(self.coef, device) if self.coef > 0 else _NoZ()


class _ZSum:
    """One step's z-loss: added to each micro-batch's loss, summed for the report."""

    def __init__(self, coef: float, device: torch.device):
        self.coef, self.sum = coef, torch.zeros((), device=device)

    def add(self, logits: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        # Outside autocast and in fp32, like the cross-entropy: log Z of
        # half-precision logits would lose the digits the penalty acts on.
        z = self.coef * torch.logsumexp(logits.float(), dim=-1).pow(2).mean()
        self.sum += z.detach()
        return loss + z

    def mean(self, n: int) -> Optional[torch.Tensor]:
        return self.sum / n


class _NoZ:
    """No z-loss: the loss as it is, no figure."""

    def add(self, logits: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def mean(self, n: int) -> Optional[torch.Tensor]:
        return None


@dataclass(frozen=True)
class UpdateClip:
    """``optim.update_clip``: StableAdamW's per-tensor update clipping around the
    optimizer step (:func:`update_clipping`); 0 is off. The optimizer must have
    been built for it (:func:`build_optimizer`: one group per parameter)."""

    threshold: float = 0.0

    def around(self, optimizer: torch.optim.Optimizer, ctx: DistContext):
        """The clipping context of one step; yields its largest ratio, or None when off."""
        return update_clipping(optimizer, ctx, self.threshold)

    def unapplied(self, device: torch.device) -> Optional[torch.Tensor]:
        """The figure of a step that was not taken: 0, or None when off."""
        return torch.zeros((), device=device) if self.threshold > 0 else None


@dataclass(frozen=True)
class StepState:
    """What one optimizer step works on, each part by name: the model, its
    optimizer, the loss scaler and precision policy, the process group's
    context, and the step's switches (each a no-op object when off)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: LossScaler
    policy: PrecisionPolicy
    ctx: DistContext
    grad_clip: float = 0.0
    """``train.grad_clip``: the global norm gradients are clipped to; 0 measures only."""
    z_loss: ZLoss = ZLoss()
    update_clip: UpdateClip = UpdateClip()
    guard: Guard = NO_GUARD
    """Whether a step with inf/nan gradients is applied (runs without a loss scaler,
    :class:`NonFiniteGuard`); :data:`NO_GUARD` leaves it to the loss scaler."""
    backward_loss: Callable[[torch.Tensor], torch.Tensor] = NO_FAULTS.backward_loss
    """The loss each backward pass sees: the loss itself, unless the ``debug.*`` injector
    multiplies it (``debug.loss_multiplier``, ``FaultInjector.backward_loss``)."""
    mixture: Union[Mixture, NoMixture] = NO_MIXTURE
    """A mixture of experts' balancing term, counts and bias update (``mixture.py``);
    :data:`NO_MIXTURE` for a dense model."""


def step_state(plan: Plan, model: nn.Module, optimizer: torch.optim.Optimizer, scaler: LossScaler,
               policy: PrecisionPolicy, ctx: DistContext, guard: Guard = NO_GUARD, faults=NO_FAULTS) -> StepState:
    """The :class:`StepState` the run of ``plan`` steps with (``train.grad_clip``,
    ``train.z_loss``, ``optim.update_clip``; ``faults``: the ``debug.*`` injector; a
    mixture of experts' routed layers, found in ``model``)."""
    return StepState(model, optimizer, scaler, policy, ctx, plan.train.grad_clip, ZLoss(plan.train.z_loss),
                     UpdateClip(float(plan.optim.update_clip or 0.0)), guard, faults.backward_loss,
                     Mixture.of(model, ctx.all_reduce_sum))


@dataclass
class StepResult:
    """What one optimizer step returns: 0-d device tensors, so that returning
    them costs no host sync; the loop reads them back at its logging cadence."""

    loss: torch.Tensor
    """The cross-entropy, mean over micro-batches, this rank."""
    grad_norm: torch.Tensor
    """Global, unscaled, before clipping, fp32 (inf/nan on a bad step)."""
    skipped: torch.Tensor
    """1 if the step was not applied, else 0."""
    z_loss: Optional[torch.Tensor] = None
    """With ``z_loss > 0``: the term added to the loss, mean over micro-batches; else None."""
    update_clip_max: Optional[torch.Tensor] = None
    """With update clipping (:class:`UpdateClip`): the largest ``RMS / update_clip``
    over tensors (above 1, that tensor's step was shrunk; 0 on a skipped step); else None."""
    aux_loss: Optional[torch.Tensor] = None
    """A mixture with ``balance=aux_loss``: the balancing term added to the loss (summed
    over the routed layers), mean over micro-batches, this rank; else None."""
    dropped: Optional[torch.Tensor] = None
    """A mixture with a capacity: token choices dropped over capacity in this step, over
    every routed layer, micro-batch and data-parallel rank (int64); else None."""


def train_step(state: StepState, micro_batches: list, parts: Component = NO_PARTS, step: int = 0) -> StepResult:
    """One optimizer step over this rank's micro-batches (:class:`StepResult`).

    Host syncs: none with a fused optimizer; with a foreach/for-loop
    optimizer, one inside ``GradScaler.step`` (fp16 loss scaling) or one in
    the guard (inf/nan check without a scaler), and one more with update
    clipping (the learning rates, see :func:`update_clipping`).

    ``state.guard`` decides whether a step with inf/nan gradients is applied, and
    ``state.backward_loss`` what loss each backward sees. ``parts`` are the run's
    optional parts (``components.py``): the numerics monitor (its calls return at
    once on unmonitored steps) and the ``debug.*`` injector, told when the backward
    is done; :data:`NO_PARTS` does nothing.
    """
    model, optimizer, scaler, ctx = state.model, state.optimizer, state.scaler, state.ctx
    optimizer.zero_grad(set_to_none=True)
    loss, z, mix = _forward_backward(state, micro_batches)
    state.policy.end_backward(ctx.all_reduce_max)  # delayed float8 scaling: the step's amaxes into the histories
    parts.after_backward(model, scaler.scale_tensor(), step)  # gradients as held: still scaled
    scaler.unscale_(optimizer)  # clipping and the norm must see true gradients
    grad_norm = ctx.clip_grad_norm(model, state.grad_clip).float().detach()
    found_inf, skip_now = state.guard.gate(grad_norm, step)
    if skip_now:  # read back on the host (non-fused optimizer)
        optimizer.zero_grad(set_to_none=True)
        skipped = torch.ones((), device=ctx.device)
        return StepResult(loss, grad_norm, skipped, z, state.update_clip.unapplied(ctx.device), **mix.close(skipped))
    parts.before_optimizer(model)
    with state.update_clip.around(optimizer, ctx) as clip_max:
        skipped = _apply(optimizer, scaler, found_inf)
    # after the optimizer: a mixture's balancing bias moves for an applied step only
    return StepResult(loss, grad_norm, skipped, z, clip_max, **mix.close(skipped))


def _forward_backward(state: StepState, micro_batches: list):
    """Forward and backward over the micro-batches, gradients accumulated in
    ``.grad``; returns (loss, z_loss, the mixture's tally): the cross-entropy and,
    with a z-loss, its term (else None), each the mean over micro-batches, on the
    device (as computed: ``debug.loss_multiplier`` acts on what the backward sees
    only), and what a mixture of experts counted (``mixture.py``; its balancing term
    is in what the backward sees, not in the loss returned)."""
    model, ctx, policy = state.model, state.ctx, state.policy
    n = len(micro_batches)
    loss_sum = torch.zeros((), device=ctx.device)
    z = state.z_loss.begin(ctx.device)
    mix = state.mixture.begin(ctx.device)
    for i, (x, y) in enumerate(micro_batches):
        x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)  # no-op when prefetched
        # Gradients cross ranks only on the last micro-batch.
        with ctx.grad_sync(model, enabled=(i == n - 1)):
            with policy.autocast():
                logits, loss = model(x, y)
            total = mix.add(z.add(logits, loss))
            # Dividing by n makes K micro-batches sum to the mean over the whole batch.
            # state.backward_loss: total itself unless debug.loss_multiplier is set.
            state.scaler.scale(state.backward_loss(total) / n).backward()
        loss_sum += loss.detach()
    return loss_sum / n, z.mean(n), mix


@torch.no_grad()
def update_rms(optimizer: torch.optim.Optimizer, ctx: DistContext) -> torch.Tensor:
    """Per one-parameter group, StableAdamW's ``RMS = sqrt(mean(g^2 / max(v, eps^2)))``
    (fp32, on the device), from the current (unscaled, clipped) gradient ``g``.

    ``v`` is the second moment AdamW is about to form, this step's gradient
    included and bias-corrected as AdamW's own update divides by it:
    ``(beta2 * exp_avg_sq + (1 - beta2) * g^2) / (1 - beta2^t)``, ``t`` the
    step being taken (``exp_avg_sq`` is zero before the first step). Without
    the correction every tensor would be clipped on the early steps (by
    ``sqrt(1 / (1 - beta2))`` on the first), which is not what the rule is for.

    The mean is over the whole tensor under every wrapper: each rank sums its
    local part (a DTensor shard under FSDP2; under FSDP1 with
    ``use_orig_params`` this rank's slice of each original parameter, possibly
    empty), and the sums and element counts of all tensors are added over the
    shard group in one collective (``ctx.shard_sum``). A tensor without a
    gradient gets 0.
    """
    sums, counts = [], []
    for group in optimizer.param_groups:
        (p,) = group["params"]  # update clipping builds one group per parameter
        counts.append(ctx.owned_shard(p).numel())  # with no gradient the sum is 0, and so is the RMS
        if p.grad is None:
            sums.append(torch.zeros((), device=ctx.device))
            continue
        g2 = ctx.owned_shard(p.grad).float().square()
        beta2 = group["betas"][1]
        state = optimizer.state.get(p, {})
        v = g2 * (1 - beta2)  # two temporaries of the tensor's size, updated in place
        if "exp_avg_sq" in state:
            v.add_(ctx.owned_shard(state["exp_avg_sq"]), alpha=beta2)
        t = state["step"] + 1 if "step" in state else 1.0  # a tensor (host or device): no sync
        v.div_(bias_correction(beta2, t)).clamp_(min=group["eps"] ** 2)
        sums.append(g2.div_(v).sum())
    # Counts go up without waiting on the device (an asynchronous copy from a
    # host list); sums and counts then cross the shard group in one collective.
    count = torch.tensor(counts, dtype=torch.float64).to(ctx.device, non_blocking=True)
    totals = ctx.shard_sum(torch.cat([torch.stack(sums).double(), count]))
    s, c = totals.split(len(sums))
    return (s / c.clamp(min=1)).sqrt().float()


@contextlib.contextmanager
def update_clipping(optimizer: torch.optim.Optimizer, ctx: DistContext,
                    update_clip: float) -> Iterator[Optional[torch.Tensor]]:
    """Around ``optimizer.step()``: each tensor's learning rate becomes
    ``lr / max(1, RMS / update_clip)`` (:func:`update_rms`) for this step, and
    the group's own value is put back afterwards (what the trainer set, and
    what a checkpoint saves). Yields the step's largest ``RMS / update_clip``
    (0-d, on the device), or None when ``update_clip`` is 0 (nothing happens).

    A step whose gradients hold inf/nan has a non-finite RMS: every factor
    is then 1, the yielded maximum 0, and the step is skipped as ever
    (GradScaler or the guard's flag).

    Host sync: a fused optimizer takes each learning rate as a 0-d device
    tensor, so none; the foreach and for-loop optimizers need floats, read
    back with one ``.tolist()`` per step: the price of the switch there.
    """
    if update_clip <= 0:
        yield None
        return
    ratio = update_rms(optimizer, ctx) / update_clip
    ratio = torch.where(torch.isfinite(ratio).all(), ratio, torch.zeros_like(ratio))  # a step to be skipped
    factors = 1.0 / ratio.clamp(min=1.0)
    groups = optimizer.param_groups
    base = [g["lr"] for g in groups]
    if any(g.get("fused") for g in groups):
        # fp32 0-d tensors, as the fused kernel reads them (one copy up, one multiply).
        lrs = (factors * torch.tensor(base, dtype=torch.float32).to(ctx.device, non_blocking=True)).unbind()
    else:
        lrs = [lr * f for lr, f in zip(base, factors.tolist(), strict=True)]  # host sync: the one the switch adds
    try:
        for g, lr in zip(groups, lrs, strict=True):
            g["lr"] = lr
        yield ratio.max()
    finally:
        for g, lr in zip(groups, base, strict=True):
            g["lr"] = lr


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
    only at the eval cadence). ``batches`` yields ``(x, y, counted)``
    (:meth:`mptrain.data.batches.ValSet.batches`): each micro-batch's mean loss
    is weighted by the ``counted`` tokens it holds, so a short last micro-batch
    counts for what it holds, a filler for nothing, and the mean over the whole
    set does not depend on how it was split into micro-batches and ranks."""
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=ctx.device)  # sum over tokens
    tokens = 0
    for x, y, counted in batches:
        with policy.autocast():
            _, loss = model(x.to(ctx.device), y.to(ctx.device))
        loss_sum += loss.double() * counted
        tokens += counted
    model.train()
    ctx.reshard(model)
    # Summed over ranks, shares of any size: the ratio is the per-token mean of the whole set.
    sums = ctx.all_reduce_sum(torch.stack([loss_sum, loss_sum.new_tensor(float(tokens))]))
    return float(sums[0] / sums[1].clamp(min=1))
