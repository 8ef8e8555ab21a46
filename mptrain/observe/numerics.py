"""The numerics monitor: what each format would do to this run's own numbers.

On monitored steps the monitor looks at the gradients, the parameter updates
and the block activations and asks, for fp16, bf16, e4m3 and e5m2: how many
of these values would flush to zero, land in the subnormal range, or
overflow if they were cast to that format? How many optimizer updates would be
lost if the parameters were stored in bf16 / fp16 instead of fp32?

Design rules:

- Everything stays on the device until :meth:`NumericsMonitor.collect`, which
  does the cross-rank reductions and one host sync. Counts are int64 (exact,
  and NCCL/gloo sum them), norms are fp32, accumulated in fp64.
- Every figure comes out the same, bit for bit, on any number of threads:
  sums of real values go through :func:`mptrain.core.sums.fixed_sum` (a plain
  CPU ``sum()`` adds one partial sum per thread), norms through
  ``vector_norm``, which reduces a whole tensor on one thread.
- The thresholds are derived from :mod:`mptrain.precision.formats` (``torch.finfo``) and
  the round-to-nearest-even rule, never typed in; the tests check them
  against real casts at and next to every boundary.
- On steps that are not monitored every method returns at once: the monitor
  is its own no-op object, so the step calls it unconditionally.

Definitions (for a non-zero value ``x`` cast to format F with round to nearest even):

- *underflow*: the cast is exactly 0, i.e. ``|x| <= smallest_subnormal / 2``
  (the tie at half the smallest subnormal goes to 0, the even neighbour).
- *subnormal*: the cast is non-zero and below ``smallest_normal``, i.e.
  ``smallest_subnormal / 2 < |x| < smallest_normal - smallest_subnormal / 2``
  (the tie at the top goes up to ``smallest_normal``, whose mantissa is even).
- *overflow*: ``|x|`` rounds to a magnitude beyond ``max``, i.e. above the
  midpoint ``max + ulp(max) / 2``, or at it when the tie goes up (it goes up
  when ``max`` has an odd last mantissa bit: fp16, bf16, e5m2, whose
  all-ones ``max`` rounds the tie up to what would be the next binade, inf).
  For fp16/bf16/e5m2 this is exactly "the cast gives inf": >= 65520,
  >= 0x1.ffp127 and >= 61440. **e4m3 (``float8_e4m3fn``) has no inf**: its
  ``max`` (448 = 1.110b x 2^8) has an even last bit, because 1.111b x 2^8 is
  the NaN pattern. We use the same rule: overflow is ``|x| > 464`` (464 is the
  tie between 448 and the unrepresentable 480 and rounds down, to even 448).
  Every such value is one a cast cannot round correctly: depending on the
  torch version and device the cast saturates to 448 (torch 2.13 CPU does) or
  gives NaN; values up to 464 round to 448 like any other value.
- inf counts as overflow in every format; NaN is not a value and is counted
  nowhere (not even as non-zero).
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Union

import torch
import torch.nn as nn

from mptrain.core.shards import local_shard
from mptrain.core.sums import fixed_sum
from mptrain.model.names import canonical_name, group_of, layer_groups
from mptrain.observe.moe import MoEMonitor
from mptrain.observe.stability import StabilityMonitor, unless_skipped
from mptrain.precision import formats, optimizers
from mptrain.precision.formats import thresholds

MONITORED: tuple[str, ...] = ("fp16", "bf16", "e4m3", "e5m2")
"""Formats whose underflow / subnormal / overflow counts are computed."""

COUNT_KINDS: tuple[str, ...] = ("underflow", "subnormal", "overflow")
"""The per-format counts, in the order :func:`format_counts` returns them."""

UPDATE_FORMATS: tuple[str, ...] = ("bf16", "fp16")
"""Storage formats for which :func:`update_underflow_counts` counts lost updates."""

WHOLE_MODEL = "all"
"""Group name used for statistics over the whole model."""


def count_index(fmt: str, kind: str) -> int:
    """Position of ``(fmt, kind)`` in the vector of :func:`format_counts` (0 is the non-zero count)."""
    return 1 + 3 * MONITORED.index(fmt) + COUNT_KINDS.index(kind)


# ----------------------------------------------------------------- statistics
def format_counts(t: torch.Tensor) -> torch.Tensor:
    """Counts over the non-zero elements of ``t`` (any float dtype, upcast to fp32).

    Returns an int64 tensor of shape ``(1 + 3 * len(MONITORED),)``:
    ``[n_nonzero, then per format in MONITORED: n_underflow, n_subnormal, n_overflow]``
    (index with :func:`count_index`). No host sync.
    """
    # abs of an fp32 value is exact, and so is the upcast from bf16/fp16.
    a = t.detach().float().abs().reshape(-1)
    nonzero = a > 0  # NaN compares False: counted nowhere
    out = [nonzero.sum()]
    for name in MONITORED:
        th = thresholds(name)
        out.append((nonzero & (a <= th.last_underflow)).sum())
        out.append(((a > th.last_underflow) & (a < th.first_normal)).sum())
        out.append((a >= th.first_overflow).sum())  # inf included
    return torch.stack(out)


def hist_edges(lo: int = -40, hi: int = 16) -> torch.Tensor:
    """Bin edges (float64, length ``hi - lo + 2``) of :func:`log2_histogram`:
    bin ``i`` holds ``2^(lo+i) <= |x| < 2^(lo+i+1)``; the first and last bins
    also hold everything below / above the range."""
    return torch.pow(2.0, torch.arange(lo, hi + 2, dtype=torch.float64))


def log2_histogram(t: torch.Tensor, lo: int = -40, hi: int = 16) -> torch.Tensor:
    """int64 counts of ``floor(log2|x|)`` for the non-zero finite elements of
    ``t``, bins ``lo..hi`` inclusive (``hi - lo + 1`` of them), values beyond
    the range clamped into the end bins. No host sync."""
    if hi < lo:
        raise ValueError(f"log2_histogram: hi={hi} < lo={lo}")
    a = t.detach().float().reshape(-1)
    # frexp gives |x| = m * 2^e with m in [0.5, 1), so floor(log2|x|) = e - 1
    # exactly; torch.log2 rounds to the next integer just below powers of two.
    _, e = torch.frexp(a)
    nbins = hi - lo + 1
    k = (e.to(torch.int64) - 1).clamp(lo, hi) - lo
    # Zero / inf / NaN go to an extra bin that is cut off: selecting the valid
    # elements with a boolean mask would be a host sync (the size is data-dependent).
    valid = (a != 0) & torch.isfinite(a)
    k = torch.where(valid, k, torch.full_like(k, nbins))
    counts = torch.zeros(nbins + 1, dtype=torch.int64, device=a.device)
    if a.is_cuda:
        # histc keeps per-block counts in shared memory; scatter_add_ sends every
        # element to one of a few global addresses, and those atomics serialize
        # (47 ms of gpt-small's monitored step on an H200). histc counts in fp32,
        # exact below 2^24 per bin: chunks of 2^24 elements keep every count exact.
        # Its range is given, so it reads no min/max back (no host sync).
        for chunk in k.split(2**24):
            counts += torch.histc(chunk.float(), bins=nbins + 1, min=-0.5, max=nbins + 0.5).to(torch.int64)
    else:
        # scatter_add_ rather than bincount: bincount sizes its output from the
        # data's max. Integer adds are exact in any order.
        counts.scatter_add_(0, k, torch.ones_like(k))
    return counts[:nbins]


def _flat(ts: list[torch.Tensor]) -> torch.Tensor:
    """The tensors ``ts`` as one flat fp32 tensor (exact for bf16/fp16/fp32 values).

    The monitor's statistics are sums, counts and maxima, the same over the
    concatenation as summed over the parts; taking them once per layer group
    instead of once per tensor launches about ten times fewer kernels (a
    monitored gpt-small step on an H200 spent most of its time in ~10k tiny
    ones)."""
    return torch.cat([t.detach().reshape(-1).float() for t in ts])


def update_underflow_counts(before: torch.Tensor, after: torch.Tensor) -> torch.Tensor:
    """Updates that only fp32 master weights keep.

    ``update = after - before`` (fp32). An update is lost in format F when the
    parameter stored in F would not change: ``(F(before) + update)`` cast back
    to F equals ``F(before)``. Returns int64 ``[n_nonzero_update,
    n_lost_bf16, n_lost_fp16]`` (the order of :data:`UPDATE_FORMATS`). No host sync.
    """
    before = before.detach().float().reshape(-1)
    after = after.detach().float().reshape(-1)
    update = after - before
    changed = update != 0
    out = [changed.sum()]
    for name in UPDATE_FORMATS:
        dt = formats.FORMATS[name]
        held = before.to(dt)
        lost = (held.float() + update).to(dt) == held
        out.append((changed & lost).sum())
    return torch.stack(out)


def stochastic_stay_probability(before: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
    """Per element, the probability that stochastic rounding to bf16 leaves a
    bf16 weight ``before`` unchanged by ``update`` (both fp32).

    ``before + update`` lies between ``before`` and its bf16 neighbour on the
    side of the update, ``gap`` away; stochastic rounding picks the neighbour
    with probability ``|update| / gap``, so the weight stays with
    ``1 - |update| / gap`` (0 once the update reaches the neighbour). The
    neighbour is one step of the bf16 bit pattern: away from zero when the
    update has the weight's sign, towards it otherwise; from 0, the smallest
    subnormal on the update's side. No host sync."""
    held = before.to(torch.bfloat16)
    bits = held.view(torch.int16)
    away = (held > 0) == (update > 0)
    step = torch.where(away, bits + 1, bits - 1).view(torch.bfloat16).float()
    tiny = torch.full_like(before, formats.info("bf16").smallest_subnormal)
    neighbour = torch.where(held == 0, torch.copysign(tiny, update), step)
    gap = (neighbour - held.float()).abs()
    return (1 - update.abs() / gap).clamp_(min=0.0)


def applied_update_stats(before: torch.Tensor, after: torch.Tensor, intended: torch.Tensor,
                         stochastic: bool, comp: Optional[torch.Tensor]) -> torch.Tensor:
    """What the optimizer step actually did to one tensor's stored weights,
    as float64 ``[n_moved, n_unchanged, expected_unchanged, n_held, held_abs,
    intended_abs]`` (sums; no host sync):

    - ``n_moved``: elements the rule meant to change (``intended != 0``);
    - ``n_unchanged``: of those, how many the step left exactly as they were;
    - ``expected_unchanged``: under stochastic rounding, the sum of each one's
      probability of staying (:func:`stochastic_stay_probability`); 0 otherwise;
    - ``n_held`` / ``held_abs``: elements of the Kahan compensation buffer
      ``comp`` that are non-zero, and the sum of its magnitudes; 0 without one;
    - ``intended_abs``: the sum of the intended update's magnitudes.
    """
    before, after = before.reshape(-1), after.detach().reshape(-1).float()
    intended = intended.reshape(-1)
    moved = intended != 0
    out = [moved.sum(), (moved & (after == before)).sum()]
    zero = torch.zeros((), device=before.device)
    # Counts are exact; the sums of magnitudes and probabilities go through
    # fixed_sum, whose rounding does not depend on the number of threads.
    out.append(fixed_sum(stochastic_stay_probability(before, intended) * moved) if stochastic else zero)
    if comp is not None:
        c = comp.reshape(-1).float()
        out += [(c != 0).sum(), fixed_sum(c.abs())]
    else:
        out += [zero, zero]
    out.append(fixed_sum(intended.abs()))
    return torch.stack([t.to(torch.float64) for t in out])


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def _first_tensor(out) -> Optional[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)):
        for o in out:
            if isinstance(o, torch.Tensor):
                return o
    return None


Reducer = Callable[[torch.Tensor], torch.Tensor]


class NumericsMonitor:
    """Collects ``numerics/*`` statistics on monitored steps.

    The trainer calls, every step and unconditionally::

        monitor.start_step(step)                 # before the forward pass(es)
        ... forward / backward ...
        monitor.after_backward(model, scale)     # grads as held, scaled or not
        monitor.before_optimizer(model)
        skipped = scaler.step(optimizer)
        monitor.after_optimizer(model, skipped)
        if logging: scalars, hists = monitor.collect()   # on every rank: it runs collectives

    On steps where :meth:`active` is False each call returns at once. A
    monitored step replaces whatever an earlier monitored step left
    uncollected; :meth:`collect` reports the latest one.

    ``reduce_sum`` / ``reduce_max`` combine over the ranks that *shard* the
    parameters (identity in one process or under DDP, where every rank holds
    the same full gradients; an all-reduce under FSDP). ``reduce_max_all`` and
    ``reduce_sum_all`` combine over every rank (activations come from
    different data on each rank, whatever the wrapper). ``owned`` gives the
    part of a parameter (or its gradient) this rank adds to the sums: its local
    shard by default; under a device mesh, ``DistContext.owned_shard``, empty
    on every replica but one, so that HSDP's replicate groups and the TP ranks'
    copies of what TP does not split count once.

    With ``monitor.stability`` the same calls also drive the ``stability/*``
    figures of :class:`mptrain.observe.stability.StabilityMonitor`; Adam's need
    :meth:`attach_optimizer`. A model with routed (mixture-of-experts) layers
    also gets the ``moe/*`` figures of :class:`mptrain.observe.moe.MoEMonitor`,
    whose counts ``reduce_sum_dp`` sums over the data-parallel ranks (the ranks
    that see different tokens); where it is ``reduce_sum_all`` they ride in that
    one collective.
    """

    def __init__(self, mcfg, model: nn.Module, reduce_sum: Reducer = _identity, reduce_max: Reducer = _identity,
                 *, reduce_max_all: Reducer = _identity, reduce_sum_all: Reducer = _identity,
                 reduce_sum_dp: Reducer = _identity,
                 hist_lo: int = -40, hist_hi: int = 16, fp8_watch=None, owned: Reducer = local_shard):
        self.cfg = mcfg
        self.enabled = bool(mcfg.enabled)
        self.every = int(mcfg.every)
        self.histogram = bool(mcfg.histogram)
        self.activations = bool(mcfg.activations)
        self.reduce_sum, self.reduce_max, self.reduce_max_all = reduce_sum, reduce_max, reduce_max_all
        self.reduce_sum_all, self.reduce_sum_dp = reduce_sum_all, reduce_sum_dp
        self.owned = owned
        self.hist_lo, self.hist_hi = hist_lo, hist_hi
        # Outermost module per block name: with wrappers (FSDP1, checkpoint
        # wrappers) the same "blocks.N" appears at several depths after
        # canonicalisation, and the outer one runs once per forward.
        self._blocks: dict[str, nn.Module] = {}
        for name, mod in model.named_modules():
            parts = canonical_name(name).split(".")
            if len(parts) == 2 and parts[0] == "blocks" and parts[1].isdigit():
                self._blocks.setdefault(group_of(name), mod)
        self.stability = None
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.choice: optimizers.Choice = optimizers.TORCH_ADAMW
        if self.enabled and getattr(mcfg, "stability", False):

            self.stability = StabilityMonitor(model, owned)
        # The float8 casts' statistics and the quantization signals (fp8watch.CastWatch), when the
        # run has float8 or 4-bit linears.
        self.fp8 = fp8_watch if self.enabled else None
        # The routing figures of a mixture-of-experts model (None for any other model).
        self.moe = MoEMonitor.of(model) if self.enabled else None
        self._on = False
        self._hooks: list = []
        self._reset()

    def attach_optimizer(self, optimizer: torch.optim.Optimizer,
                         choice: optimizers.Choice = optimizers.TORCH_ADAMW) -> None:
        """The optimizer whose state gives the ``numerics/update_lost*`` and
        ``stability/adam_*`` figures (none without it), and which AdamW it is
        (``choice``, from ``optimizers.choose``; torch's unless told)."""
        self.optimizer, self.choice = optimizer, choice
        if self.stability is not None:
            self.stability.attach_optimizer(optimizer, choice)

    def pause_probes(self) -> None:
        """No attention probe in this step (the dtype audit records the step's own
        ops; the probe's fp32 logits are monitoring). Its figures are left out."""
        if self.stability is not None:
            self.stability.disarm()
        if self.moe is not None:
            self.moe.pause()

    # -- schedule
    def active(self, step: int) -> bool:
        """Whether 0-based ``step`` is monitored: the first step, then every ``every``-th."""
        if not self.enabled:
            return False
        return step == 0 or (self.every > 0 and (step + 1) % self.every == 0)

    def _reset(self) -> None:
        self._sum: dict[str, torch.Tensor] = {}      # summed over shards
        self._max: dict[str, torch.Tensor] = {}      # max over shards
        self._max_all: dict[str, torch.Tensor] = {}  # max over all ranks
        self._has_grad: set[str] = set()
        self._snapshot: Optional[list[torch.Tensor]] = None  # per parameter: views of _snapshot_flat
        self._snapshot_flat: Optional[torch.Tensor] = None
        self._pending = False
        if self.stability is not None:
            self.stability.clear()
        if self.fp8 is not None:
            self.fp8.clear()
        if self.moe is not None:
            self.moe.clear()

    def start_step(self, step: int) -> None:
        """Begin ``step``: if monitored, drop stale results and hook the blocks' outputs."""
        self._remove_hooks()  # left over only if a step died between forward and backward
        if self.stability is not None:
            self.stability.disarm()  # likewise
        if self.moe is not None:
            self.moe.disarm()  # likewise
        self._on = self.active(step)
        if not self._on:
            return
        self._reset()
        self._pending = True
        if self.activations or self.stability is not None:
            for group, mod in self._blocks.items():
                # Zeros up front (|x| >= 0), in a fixed order: every rank then
                # packs the same layout for the collective in collect().
                self._max_all[f"act/{group}"] = torch.zeros((), dtype=torch.float32, device=self._device(mod))
                self._hooks.append(mod.register_forward_hook(self._make_hook(group)))
        if self.stability is not None:
            anchor = next(iter(self._blocks.values()), None)
            dev = self._device(anchor) if anchor is not None else torch.device("cpu")
            self._hooks += self.stability.start(dev, list(self._blocks))
        if self.fp8 is not None:
            self._hooks += self.fp8.start(self._device(next(iter(self.fp8.layers.values()), nn.Identity())))
        if self.moe is not None:
            self._hooks += self.moe.start(self._device(next(iter(self.moe.layers.values()))))

    def _make_hook(self, group: str):
        def hook(module, args, output):
            out = _first_tensor(output)
            if out is None or out.numel() == 0:
                return
            key = f"act/{group}"
            m = local_shard(out).detach().abs().amax().float()
            # Several forwards per step (gradient accumulation): keep the largest.
            self._max_all[key] = torch.maximum(self._max_all[key], m)
            if self.stability is not None:
                self.stability.block_output(group, local_shard(out))
        return hook

    def _remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # -- gradients and weights
    def after_backward(self, model: nn.Module, grad_scale: Union[float, torch.Tensor, None]) -> None:
        """Gradient and weight statistics per layer group and for the whole model.

        ``grad_scale``: the loss scale the gradients still carry (None or 1 when
        unscaled). Norms are of the true gradient (divided by it); the format
        counts and the histogram are of the gradient as held, since that is
        what a cast would see."""
        if not self._on:
            return
        self._remove_hooks()
        if self.stability is not None:
            self.stability.read_probes()
        if self.moe is not None:
            self.moe.disarm()
        dev = self._device(model)
        # Norms of the held gradient times 1/scale: the true gradient's, without
        # an unscaled copy of each gradient. The norm is scaled before it is
        # squared, so a large scale does not overflow the sum of squares.
        if grad_scale is None:
            inv: Union[float, torch.Tensor] = 1.0
        elif isinstance(grad_scale, torch.Tensor):
            inv = 1.0 / grad_scale.detach().float().reshape(())
        else:
            inv = 1.0 / float(grad_scale)
        whole = None
        for group, params in layer_groups(model.named_parameters()).items():
            stats = self._group_stats(group, params, inv, dev)
            for key, v in zip(("grad_sq", "weight_sq", "counts"), stats[:3], strict=True):
                self._sum[f"{key}/{group}"] = v
            self._max[f"weight_absmax/{group}"] = stats[3]
            whole = stats if whole is None else (*(a + b for a, b in zip(whole[:3], stats[:3], strict=True)),
                                                  torch.maximum(whole[3], stats[3]), whole[4] + stats[4])
        if whole is None:
            return
        if self._has_grad:
            self._has_grad.add(WHOLE_MODEL)
        for key, v in zip(("grad_sq", "weight_sq", "counts"), whole[:3], strict=True):
            self._sum[f"{key}/{WHOLE_MODEL}"] = v
        self._max[f"weight_absmax/{WHOLE_MODEL}"] = whole[3]
        if self.histogram:
            self._sum["hist"] = whole[4]

    def _group_stats(self, group: str, params: list, inv, dev: torch.device) -> tuple[torch.Tensor, ...]:
        """``(grad_sq, weight_sq, format counts, weight absmax, gradient histogram)``
        of one layer group's local shards, each taken once over the group's
        tensors concatenated (see :func:`_flat`). Zeros where the group holds
        no shard or no gradient; marks the group as having gradients."""
        counts = torch.zeros(1 + 3 * len(MONITORED), dtype=torch.int64, device=dev)
        gsq, wsq, wmax = (torch.zeros((), dtype=torch.float32, device=dev) for _ in range(3))
        hist = torch.zeros(self.hist_hi - self.hist_lo + 1, dtype=torch.int64, device=dev)
        ws, gs = [], []
        for _, p in params:
            if p.grad is not None:
                self._has_grad.add(group)
            w = self.owned(p.detach())
            if w.numel() == 0:  # an FSDP rank may hold no shard of a small parameter, a replica owns none
                continue
            ws.append(w)
            if p.grad is not None:
                gs.append(self.owned(p.grad.detach()))
        # Sums of squares accumulate in fp64: over a whole group's millions of
        # elements an fp32 accumulator drifts (1e-4 relative on a 4x256 block, CPU).
        if ws:
            w = _flat(ws)
            wsq = torch.linalg.vector_norm(w, dtype=torch.float64).square().float()
            wmax = w.abs().amax()
        if gs:
            g = _flat(gs)
            gsq = (torch.linalg.vector_norm(g, dtype=torch.float64) * inv).square().float()
            counts = format_counts(g)
            if self.histogram:
                hist = log2_histogram(g, self.hist_lo, self.hist_hi)
        return gsq, wsq, counts, wmax, hist

    @staticmethod
    def _device(model: nn.Module) -> torch.device:
        for p in model.parameters():
            return local_shard(p.detach()).device
        return torch.device("cpu")

    # -- updates
    def before_optimizer(self, model: nn.Module) -> None:
        """Copy the local parameter shards (fp32), to see what the optimizer step changes."""
        if not self._on:
            return
        if self.stability is not None:
            self.stability.before_optimizer(model, self._device(model))
        # One flat fp32 copy (what after_optimizer compares whole), and each
        # parameter's part of it as a view (what the intended update needs).
        shards = [self.owned(p.detach()) for p in model.parameters() if p.requires_grad]
        self._snapshot_flat = _flat(shards) if shards else None
        self._snapshot = ([] if not shards else
                          [v.view(s.shape) for v, s in zip(self._snapshot_flat.split([s.numel() for s in shards]),
                                                             shards, strict=True)])

    def after_optimizer(self, model: nn.Module, skipped: Union[torch.Tensor, bool, None] = None) -> None:
        """Count the updates bf16 / fp16 storage would lose (whole model).

        ``skipped`` (0-d tensor, 1 when the loss scaler skipped the step) is
        applied as a multiplier rather than read, so there is no host sync: a
        skipped step counts no updates, and :meth:`collect` leaves the
        update metrics out."""
        if self._on and self.stability is not None:
            self.stability.after_optimizer(model, self._device(model), skipped)
        if not self._on or self._snapshot is None:
            return
        params = [p for p in model.parameters() if p.requires_grad]
        if len(params) != len(self._snapshot):
            raise RuntimeError("the model's trainable parameters changed between before_optimizer and after_optimizer")
        if not params:
            self._snapshot = self._snapshot_flat = None
            return
        # whole model: one pass over all parameters (see _flat)
        after = _flat([self.owned(p.detach()) for p in params])
        counts = update_underflow_counts(self._snapshot_flat, after)
        applied = self._applied(params, after) if self.optimizer is not None else None
        self._snapshot = self._snapshot_flat = None
        self._sum["update"] = unless_skipped(counts, skipped)
        if applied is not None:
            self._sum["applied"] = unless_skipped(applied, skipped)

    def _applied(self, params: list, after: torch.Tensor) -> Optional[torch.Tensor]:
        """:func:`applied_update_stats` summed over the tensors the step updated
        (``after``: every parameter's shard, flat, as :meth:`after_optimizer` has it)."""
        stochastic = self.choice.rounding == "stochastic"
        groups = {id(p): g for g in self.optimizer.param_groups for p in g["params"]}
        befores, afters, intendeds, comps = [], [], [], []
        replica = False  # a tensor with state left to its owner: this rank still sends its (zero) figures
        for before, p in zip(self._snapshot, params, strict=True):
            if p.grad is None or id(p) not in groups:
                continue
            if before.numel() == 0:  # a replica's copy (DistContext.owned_shard): its owner counts it
                replica = replica or bool(self.optimizer.state.get(p))
                continue
            intended = optimizers.intended_update(self.optimizer, p, groups[id(p)], before, self.choice)
            if intended is None:
                continue
            befores.append(before)
            afters.append(self.owned(p.detach()))
            intendeds.append(intended)
            comps.append(optimizers.compensation(self.optimizer, p))
        if not befores:
            # The same layout on every rank for collect()'s sum: a rank that owns no part of
            # any tensor with state adds zeros, where the owners add their figures.
            return torch.zeros(6, dtype=torch.float64, device=after.device) if replica else None
        # Once over the concatenation (see _flat). A tensor without a compensation
        # buffer contributes zeros to it, which count as nothing held. When the step
        # updated every parameter (the usual case), the flat copies are those at hand.
        comp = None
        if any(c is not None for c in comps):
            comp = _flat([c if c is not None else torch.zeros_like(b) for c, b in zip(comps, befores, strict=True)])
        if len(befores) == len(params):
            before_flat, after_flat = self._snapshot_flat, after
        else:
            before_flat, after_flat = _flat(befores), _flat(afters)
        return applied_update_stats(before_flat, after_flat, _flat(intendeds), stochastic, comp)

    # -- results
    def _stores(self) -> list[tuple[dict[str, torch.Tensor], Reducer]]:
        """Each store of this step's figures with the reduction it takes: the
        monitor's own, with the stability monitor's, the float8 casts' and the
        routing figures' merged into the store of their kind (one collective per kind)."""
        stab, fp8, moe = self.stability, self.fp8, self.moe
        sums, maxes_all, sums_all, sums_dp = self._sum, self._max_all, {}, {}
        if stab is not None:  # the same collectives carry the stability figures (and one more kind)
            sums, maxes_all, sums_all = {**sums, **stab.sum}, {**maxes_all, **stab.max_all}, stab.sum_all
        if fp8 is not None:  # and the float8 casts' (over every rank: each casts its own data), and the
            q = fp8.signals  # quantization signals' (their weight codes' counts over the shards, like the weights')
            maxes_all, sums_all = {**maxes_all, **fp8.max_all, **q.max_all}, {**sums_all, **fp8.sum_all, **q.sum_all}
            sums = {**sums, **q.sum}
        if moe is not None:  # and the routing figures': counts over the data-parallel ranks
            maxes_all, sums_dp = {**maxes_all, **moe.max_all}, moe.sum_dp
            if self.reduce_sum_dp == self.reduce_sum_all:  # the same ranks (no tensor parallelism): one collective
                sums_all, sums_dp = {**sums_all, **sums_dp}, {}
        return [(sums, self.reduce_sum), (self._max, self.reduce_max), (maxes_all, self.reduce_max_all),
                (sums_all, self.reduce_sum_all), (sums_dp, self.reduce_sum_dp)]

    def collect(self) -> tuple[dict[str, float], dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """Reduce over ranks and return ``(scalars, histograms)`` of the last
        monitored step; ``({}, {})`` when nothing is waiting. Every rank must
        call it at the same steps: it runs collectives."""
        if not self._pending:
            return {}, {}
        self._remove_hooks()
        self._pending = False
        vecs, layout = [], []
        for store, reduce in self._stores():
            if not store:
                continue
            names = list(store)
            # float64: exact for counts up to 2^53, and one dtype -> one collective per kind.
            flat = torch.cat([store[n].reshape(-1).to(torch.float64) for n in names])
            vecs.append(reduce(flat))
            layout += [(n, store[n].numel()) for n in names]
        if not vecs:
            self._reset()
            return {}, {}
        # The monitor's one host sync.
        host = torch.cat(vecs).cpu()
        vals: dict[str, torch.Tensor] = {}
        i = 0
        for n, size in layout:
            vals[n] = host[i:i + size]
            i += size
        scalars = self._scalars(vals)
        for part in (self.stability, self.fp8, self.moe):
            if part is not None:
                scalars.update(part.scalars(vals))
        hists = {}
        if "hist" in vals:
            hists["numerics/grad_log2_hist"] = (vals["hist"].round().to(torch.int64),
                                                hist_edges(self.hist_lo, self.hist_hi))
        self._reset()
        return scalars, hists

    def _scalars(self, vals: dict[str, torch.Tensor]) -> dict[str, float]:
        out: dict[str, float] = {}
        groups = [n.split("/", 1)[1] for n in vals if n.startswith("weight_sq/")]
        for g in groups:
            if g in self._has_grad:
                out[f"numerics/grad_norm/{g}"] = math.sqrt(float(vals[f"grad_sq/{g}"]))
            out[f"numerics/weight_norm/{g}"] = math.sqrt(float(vals[f"weight_sq/{g}"]))
            out[f"numerics/weight_absmax/{g}"] = float(vals[f"weight_absmax/{g}"])
        # A fraction with nothing to count is left out, not logged as 0.
        whole = vals.get(f"counts/{WHOLE_MODEL}")
        if whole is not None and whole[0] > 0:
            for fmt in MONITORED:
                for kind in COUNT_KINDS:
                    out[f"numerics/grad_{kind}/{fmt}"] = float(whole[count_index(fmt, kind)] / whole[0])
        for g in groups:
            c = vals[f"counts/{g}"]
            if g == WHOLE_MODEL or c[0] <= 0:
                continue
            for fmt in MONITORED:
                out[f"numerics/grad_underflow/{fmt}/{g}"] = float(c[count_index(fmt, "underflow")] / c[0])
        upd = vals.get("update")
        if upd is not None and upd[0] > 0:
            for j, fmt in enumerate(UPDATE_FORMATS):
                out[f"numerics/update_underflow/{fmt}"] = float(upd[1 + j] / upd[0])
        applied = vals.get("applied")
        if applied is not None and applied[0] > 0:
            moved, unchanged, expected, held, held_abs, intended_abs = (float(v) for v in applied)
            out["numerics/update_lost"] = unchanged / moved
            choice = self.choice
            if choice.rounding == "stochastic":
                out["numerics/update_lost_expected"] = expected / moved
            if choice.kahan:
                out["numerics/kahan_held"] = held / moved
                out["numerics/kahan_held_over_update"] = held_abs / intended_abs if intended_abs else 0.0
        acts = {n.split("/", 1)[1]: float(v) for n, v in vals.items() if n.startswith("act/") and self.activations}
        for g, v in acts.items():
            out[f"numerics/act_absmax/{g}"] = v
        if acts:
            top = max(acts.values())
            out["numerics/act_absmax_over_fp16_max"] = top / formats.info("fp16").max
            out["numerics/act_absmax_over_e4m3_max"] = top / formats.info("e4m3").max
        return out
