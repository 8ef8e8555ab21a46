"""Delayed-scaling float8 linears: the scale of a cast comes from the amaxes of
earlier steps, not from the tensor being cast.

torchao's ``Float8Linear`` scales every cast from the tensor's own absolute
maximum (current, or dynamic, scaling). Delayed scaling, Transformer Engine's
default recipe, keeps for each of a linear's three float8 operands (input and
weight, cast to E4M3 in the forward pass; the output gradient, cast to E5M2 or
E4M3 in the backward pass) a history of the amaxes of the last ``L`` optimizer
steps, and casts step ``t`` with

    scale = fmt_max / (A * 2**margin)

where ``A`` is the largest amax in the history (``amax_compute="max"``) or its
newest entry (``"most_recent"``), and the history holds steps ``< t`` only.
Meanwhile the step records its own amax (the largest over its micro-batches and
any recomputed forwards), and :func:`update_histories` pushes it into the
history after the step. The scale never depends on the tensor being cast, so
no reduction has to finish before the cast; the price is that a tensor whose
amax jumps above everything the history has seen saturates: its largest values
are clamped to the format's largest value, which current scaling never does.

The first step. Before anything is recorded, ``A`` is 0 and the formula has
nothing to say: until a history yields a positive, finite ``A``, a cast is
scaled from its own amax (just in time, as current scaling does), and that amax
seeds the history at the end of the step. Later steps whose ``A`` is 0 or not
finite keep the scale they had (as Transformer Engine does), so a zero
gradient or an overflowed step never produces an infinite scale.

State. Every operand keeps persistent buffers, so the state is in the module's
``state_dict`` and therefore in checkpoints, and a resumed run continues with
the very same scales: ``<operand>_amax_history`` (``[L]``, fp32, newest at
index 0), ``<operand>_amax`` (this step's running amax), ``<operand>_scale``
(the scale the next casts use) and ``<operand>_initialized`` (whether that
scale comes from the history; otherwise casts are just in time). A
non-persistent ``<operand>_cast_scale`` holds the scale of the latest cast,
which :meth:`DelayedFloat8Linear.cast_scales` reports.

Distributed. ``update_histories(..., reduce_max=...)`` makes every rank's
histories and scales identical. Buffers must stay fp32 (a wrapper that casts
buffers, like FSDP1's ``buffer_dtype``, would round the amaxes), and DDP's
``broadcast_buffers`` would overwrite each rank's running amaxes with rank 0's
at every forward, losing what the other ranks recorded before: turn it off.

The matmuls are ``torch._scaled_mm`` with per-tensor scales (on CUDA it
needs float8 tensor cores and dimensions that are multiples of 16, the token
count included, since it is the inner dimension of the weight-gradient
matmul), or with ``emulate`` the same product widened to fp32
(``support.emulated_scaled_mm``: fast on every CPU, where ``_scaled_mm`` can
be ~100x slower than fp32).

``torch.compile`` traces a block of these layers into one graph (the buffer
updates of the forward and backward passes included). On CPU inductor the
result equals eager bit for bit in fp32; under bf16 autocast too once
``torch._inductor.config.emulate_precision_casts`` makes inductor round bf16
intermediates as eager does (without it the neighbouring bf16 ops, not these
layers, differ by rounding).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Callable, Iterable, Optional

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate

from mptrain.precision.lab import fp32_scale
from mptrain.precision.support import emulated_scaled_mm

OPERANDS = ("input", "weight", "grad_output")
AMAX_COMPUTE = ("max", "most_recent")
GRAD_DTYPES = (torch.float8_e5m2, torch.float8_e4m3fn)


def scale_from_amax(amax: torch.Tensor, fmt: torch.dtype, margin: int = 0) -> torch.Tensor:
    """``fmt_max / (amax * 2**margin)`` as fp32: the fp32 scale rule
    (:func:`~mptrain.precision.lab.fp32_scale`, amax floored at 1e-12), so that with
    ``margin=0`` and the same amax torchao's tensorwise scales have the same bits."""
    return fp32_scale(amax, torch.finfo(fmt).max, margin)


def _amax(t: torch.Tensor) -> torch.Tensor:
    """``t``'s largest magnitude (fp32, 0-d). Under tensor parallelism ``t`` is a
    DTensor and this is the logical tensor's amax, the same as one process's: the
    reduction over a split tensor comes out a pending ``Partial(max)``, made
    whole here by an all-reduce MAX over the ranks that split it, before a scale
    is taken from it (the scale is decreasing in the amax, and taken from a
    pending max it would itself be reduced by MAX: the smallest amax's scale)."""
    amax = t.detach().abs().amax().float()
    if isinstance(amax, DTensor) and not all(p.is_replicate() for p in amax.placements):
        amax = amax.redistribute(amax.device_mesh, [Replicate()] * amax.device_mesh.ndim)
    return amax


def _cast(t: torch.Tensor, state: tuple, fmt: torch.dtype, margin: int, record: bool):
    """``t`` cast to ``fmt`` with the operand's stored scale (or just in time
    before it has one); returns ``(float8 tensor, scale used)``. Records the
    running amax when ``record``, and the scale used in every case."""
    scale, initialized, amax_buf, cast_buf = state
    amax = _amax(t)
    s = torch.where(initialized, scale, scale_from_amax(amax, fmt, margin))
    if record:
        amax_buf.copy_(torch.maximum(amax_buf, amax))
    cast_buf.copy_(s)
    top = torch.finfo(fmt).max
    # Clamp before the cast: older torch (2.11) does not saturate an eager cast to float8,
    # and a delayed scale can push values past the format's largest one.
    return (t.float() * s).clamp(-top, top).to(fmt), s


def _col_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` laid out column-major, as ``_scaled_mm`` wants its second operand on CUDA."""
    return t.t().contiguous().t()


def _scaled_mm(a8, b8, sa, sb, out_dtype, emulate, fast_accum=False):
    """``a @ b`` of two float8 tensors cast with multipliers ``sa`` and ``sb``,
    by ``torch._scaled_mm`` or, with ``emulate``, widened to fp32."""
    # Called under CPU autocast, the emulated _scaled_mm runs its inner fp32 matmul in bf16
    # (eager only), which compiled code and CUDA do not: turn autocast off around it.
    with torch.autocast(a8.device.type, enabled=False):
        if emulate:
            return emulated_scaled_mm(a8, b8, sa.reciprocal(), sb.reciprocal(), out_dtype)
        return torch._scaled_mm(a8, b8, scale_a=sa.reciprocal(), scale_b=sb.reciprocal(), out_dtype=out_dtype,
                                use_fast_accum=fast_accum)


class _DelayedFloat8Matmul(torch.autograd.Function):
    """``x @ weight.t()`` with all three matmuls in float8 and delayed scales.

    The operand states are ``(scale, initialized, running amax, last cast scale)``
    buffer tuples; the forward reads and records the input's and the weight's,
    the backward the output gradient's. The backward pass reuses the forward's
    float8 input and weight (the input at half the bytes of bf16), so the
    gradients see exactly the values the forward multiplied."""

    @staticmethod
    def forward(ctx, x, weight, in_state, w_state, go_state, grad_dtype, margin, record, emulate):
        e4m3 = torch.float8_e4m3fn
        x8, sx = _cast(x.reshape(-1, x.shape[-1]), in_state, e4m3, margin, record)
        w8, sw = _cast(weight, w_state, e4m3, margin, record)
        x8 = x8.contiguous()
        # out = x @ w.t(): fast accumulation in the forward, as torchao and Transformer Engine do.
        out = _scaled_mm(x8, w8.t(), sx, sw, x.dtype, emulate, fast_accum=True)
        ctx.save_for_backward(x8, w8, sx, sw)
        # The output gradient's buffers are mutated in the backward pass; saved with
        # save_for_backward their version check would fail when a layer runs twice before
        # its backward (a recomputed forward), so they ride on ctx.
        ctx.go_state, ctx.grad_dtype, ctx.margin, ctx.record = go_state, grad_dtype, margin, record
        ctx.emulate = emulate
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        x8, w8, sx, sw = ctx.saved_tensors
        g8, sg = _cast(grad_out.reshape(-1, grad_out.shape[-1]), ctx.go_state, ctx.grad_dtype,
                       ctx.margin, ctx.record)
        g8 = g8.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:  # grad_x = g @ w
            grad_x = _scaled_mm(g8, _col_major(w8), sg, sw, ctx.x_dtype, ctx.emulate).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:  # grad_w = g.t() @ x; autograd casts it to the weight's dtype
            grad_w = _scaled_mm(g8.t().contiguous(), _col_major(x8), sg, sx, ctx.x_dtype, ctx.emulate)
        return grad_x, grad_w, None, None, None, None, None, None, None


class DelayedFloat8Linear(nn.Linear):
    """An ``nn.Linear`` whose three matmuls run in float8 with delayed scaling
    (see the module docstring).

    Under autocast the input is first cast to the autocast dtype (as torchao's
    ``Float8Linear`` does), and the output and the input gradient come out in
    that dtype; the weight gradient is computed in it and accumulated in the
    weight's dtype. The bias is added in the output's dtype, outside float8.
    Amaxes are recorded only in training mode, so evaluation between steps
    leaves the next step's record alone. Call :func:`update_histories` once per
    optimizer step, after the backward pass."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None, *,
                 history_len: int = 16, amax_compute: str = "max", margin: int = 0,
                 grad_dtype: torch.dtype = torch.float8_e5m2, emulate: bool = False):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.emulate = bool(emulate)  # the matmuls widened to fp32 instead of torch._scaled_mm
        if history_len < 1:
            raise ValueError(f"history_len={history_len}: the amax history needs at least one entry")
        if amax_compute not in AMAX_COMPUTE:
            raise ValueError(f"amax_compute={amax_compute!r}: one of {', '.join(AMAX_COMPUTE)}")
        if grad_dtype not in GRAD_DTYPES:
            raise ValueError(f"grad_dtype={grad_dtype}: torch.float8_e5m2 or torch.float8_e4m3fn")
        self.history_len, self.amax_compute, self.margin = int(history_len), amax_compute, int(margin)
        self.formats = {"input": torch.float8_e4m3fn, "weight": torch.float8_e4m3fn, "grad_output": grad_dtype}
        self._register_delayed_state(self.weight.device)

    def _register_delayed_state(self, device) -> None:
        f32 = dict(dtype=torch.float32, device=device)
        for op in OPERANDS:
            self.register_buffer(f"{op}_amax_history", torch.empty(self.history_len, **f32))
            self.register_buffer(f"{op}_amax", torch.empty((), **f32))
            self.register_buffer(f"{op}_scale", torch.empty((), **f32))
            self.register_buffer(f"{op}_initialized", torch.empty((), dtype=torch.bool, device=device))
            # Reporting only: not needed to continue a run, so not in checkpoints.
            self.register_buffer(f"{op}_cast_scale", torch.empty((), **f32), persistent=False)
        self.reset_delayed_state()

    @classmethod
    def from_linear(cls, linear: nn.Linear, history_len: int = 16, amax_compute: str = "max", margin: int = 0,
                    grad_dtype: torch.dtype = torch.float8_e5m2, emulate: bool = False) -> "DelayedFloat8Linear":
        """A delayed-scaling float8 linear sharing ``linear``'s weight and bias
        (the same ``Parameter`` objects), with fresh state on their device. Works
        for a ``linear`` on the meta device: after ``to_empty``, call
        :meth:`reset_delayed_state`."""
        new = cls(linear.in_features, linear.out_features, bias=False, device="meta", dtype=linear.weight.dtype,
                  history_len=history_len, amax_compute=amax_compute, margin=margin, grad_dtype=grad_dtype,
                  emulate=emulate)
        new.weight = linear.weight
        new.bias = linear.bias
        new._register_delayed_state(linear.weight.device)
        new.train(linear.training)
        return new

    @torch.no_grad()
    def reset_delayed_state(self) -> None:
        """Back to the state of a layer that has never run: empty histories, no
        running amax, scale 1 and not initialized (the next casts are just in
        time), cast scales 0 (no cast yet). Needed after ``to_empty``, which
        leaves buffers uninitialized."""
        for op in OPERANDS:
            getattr(self, f"{op}_amax_history").zero_()
            getattr(self, f"{op}_amax").zero_()
            getattr(self, f"{op}_scale").fill_(1.0)
            getattr(self, f"{op}_initialized").fill_(False)
            getattr(self, f"{op}_cast_scale").zero_()

    def _state(self, op: str) -> tuple:
        return (getattr(self, f"{op}_scale"), getattr(self, f"{op}_initialized"),
                getattr(self, f"{op}_amax"), getattr(self, f"{op}_cast_scale"))

    def cast_operands(self, input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The input and weight as the casts receive them: autocast does not see
        inside the autograd function, so the input is cast to the autocast dtype
        here (the output and the input gradient then have the dtype nn.Linear
        would give them); the weight goes to float8 as stored."""
        dev = input.device.type
        if torch.is_autocast_enabled(dev):
            input = input.to(torch.get_autocast_dtype(dev))
        return input, self.weight

    def scale_for(self, op: str, t: torch.Tensor) -> torch.Tensor:
        """The scale operand ``op`` is cast with in this step when it holds ``t``:
        the stored one once the history has an amax, else just in time from
        ``t`` (the rule of the cast itself). For the cast statistics
        (``observe/fp8watch.py``'s CastWatch), which see the output gradient before the
        backward pass has cast it."""
        scale, initialized, _, _ = self._state(op)
        return torch.where(initialized, scale, scale_from_amax(t.detach().abs().amax().float(), self.formats[op],
                                                               self.margin))

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        input, _ = self.cast_operands(input)
        out = _DelayedFloat8Matmul.apply(input, self.weight, self._state("input"), self._state("weight"),
                                         self._state("grad_output"), self.formats["grad_output"], self.margin,
                                         self.training, self.emulate)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out

    def cast_scales(self) -> dict[str, torch.Tensor]:
        """The scale (multiplier) each operand was last cast with, as 0-d fp32
        tensors on the layer's device (copies; no host sync): ``input`` and
        ``weight`` from the latest forward, ``grad_output`` from the latest
        backward. Just-in-time casts over several micro-batches report the
        last one's. 0 before the first cast. The formats are in ``formats``."""
        return {op: getattr(self, f"{op}_cast_scale").clone() for op in OPERANDS}

    def extra_repr(self) -> str:
        g = "e5m2" if self.formats["grad_output"] == torch.float8_e5m2 else "e4m3"
        return (f"{super().extra_repr()}, delayed: history_len={self.history_len}, "
                f"amax_compute={self.amax_compute}, margin={self.margin}, grad={g}"
                + (", matmul emulated" if self.emulate else ""))


def _local(t: torch.Tensor) -> torch.Tensor:
    """A state buffer's own storage. Under tensor parallelism ``parallelize_module``
    makes a layer's buffers replicated DTensors; the amaxes they hold are already
    the logical tensors' (the casts reduce a sharded operand's amax as DTensor ops),
    so every rank holds the same values and the step's bookkeeping is local."""
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def update_histories(modules: Iterable[nn.Module],
                     reduce_max: Optional[Callable[[torch.Tensor], Optional[torch.Tensor]]] = None) -> None:
    """Close the step for every :class:`DelayedFloat8Linear` in ``modules``
    (e.g. ``model.modules()``): push each operand's running amax into its
    history (newest at index 0, the oldest drops out), compute the scales the
    next step casts with, and reset the running amaxes. Call it once per
    optimizer step, after the backward pass.

    ``reduce_max`` makes every rank keep identical histories: it is called
    once, with one fp32 tensor holding every running amax, and must all-reduce
    it with MAX over the ranks (in place, returning None, or returning the
    result). Nothing is read back to the host."""
    groups: dict[tuple, list[tuple[DelayedFloat8Linear, str]]] = defaultdict(list)
    for m in modules:
        if isinstance(m, DelayedFloat8Linear):
            for op in OPERANDS:
                groups[(m.history_len, m.amax_compute, m.formats[op], m.margin)].append((m, op))
    if not groups:
        return
    entries = [e for g in groups.values() for e in g]
    amaxes = [_local(getattr(m, f"{op}_amax")) for m, op in entries]
    step_amax = torch.stack(amaxes)
    if reduce_max is not None:
        reduced = reduce_max(step_amax)
        step_amax = step_amax if reduced is None else reduced
    start = 0
    # One pass per kind of operand (normally two: E4M3 forward, the gradient format backward).
    for (_, compute, fmt, margin), group in groups.items():
        a = step_amax[start:start + len(group)]
        start += len(group)
        hists = [_local(getattr(m, f"{op}_amax_history")) for m, op in group]
        scales = [_local(getattr(m, f"{op}_scale")) for m, op in group]
        inits = [_local(getattr(m, f"{op}_initialized")) for m, op in group]
        hist = torch.cat([a[:, None], torch.stack(hists)[:, :-1]], dim=1)
        A = hist.amax(dim=1) if compute == "max" else hist[:, 0]
        # A zero A (nothing recorded) or a non-finite one (an overflowed step) keeps the old scale.
        valid = torch.isfinite(A) & (A > 0)
        new_scale = torch.where(valid, scale_from_amax(A, fmt, margin), torch.stack(scales))
        new_init = torch.stack(inits) | valid
        torch._foreach_copy_(hists, list(hist.unbind(0)))
        torch._foreach_copy_(scales, list(new_scale.unbind(0)))
        torch._foreach_copy_(inits, list(new_init.unbind(0)))
    torch._foreach_zero_(amaxes)
