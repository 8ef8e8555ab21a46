"""What tests measure the package against, kept out of the package: nothing in
mptrain needs these.

- :func:`inf_grad_at`: the run's fault injector as ``debug.*`` configures it,
  for a test that calls ``train_step`` itself;
- :func:`param_count`: mptrain's GPT parameter count, by hand;
- :func:`cast_stats`: the cast figures of one whole tensor;
- :func:`fp4_round_trip`, :func:`fp4_scales`: NVFP4's and MXFP4's lab casts as
  whole-tensor round trips and block scales, what torchao's casts are compared with;
- :func:`state_bytes`: the bytes an optimizer's state really holds;
- :class:`Plant`: a pickle that runs code when loaded (it makes a directory);
- :func:`without_wall_clock`: metric rows without the keys that depend on timing.
"""
from __future__ import annotations

import math
import os

import torch

from mptrain.config.schema import DebugConfig
from mptrain.precision import lab
from mptrain.precision.fp8casts import cast_counts, measured, summarize
from mptrain.precision.optimizers import state_parts
from mptrain.run.faults import FaultInjector


def inf_grad_at(*steps: int, value: float = math.inf) -> FaultInjector:
    """The injector of ``debug.inject_inf_grad_steps=[steps]`` (``debug.inject_grad_value=value``)."""
    return FaultInjector(DebugConfig(inject_inf_grad_steps=list(steps), inject_grad_value=value))


def param_count(n_layer: int, d_model: int, vocab: int, block: int, bias: bool = True, qk_norm_dim: int = 0) -> int:
    """Exact parameter count of mptrain's GPT (tied head counted once);
    ``qk_norm_dim`` is the head size of a model with QK-layernorm, 0 without."""
    d = d_model
    per_block = 3 * d * d + d * d + 4 * d * d + 4 * d * d  # qkv, attn proj, mlp fc, mlp proj weights
    norms = 2 * d + 2 * qk_norm_dim  # ln_1, ln_2, and the q/k norms (one per attention, shared by its heads)
    if bias:
        per_block += 3 * d + d + 4 * d + d  # the linears' biases
        final_norm = 2 * d
    else:
        final_norm = d
    per_block += norms * (2 if bias else 1)  # norm weights, and their biases
    return n_layer * per_block + vocab * d + block * d + final_norm


def cast_stats(t: torch.Tensor, recipe: str, fmt: str = "e4m3", operand: str = "input",
               scale: torch.Tensor | None = None) -> dict[str, float]:
    """``fp8casts.summarize`` of ``fp8casts.cast_counts`` for one whole tensor: cast
    as an operand spec says (``recipe`` with a ``/``), or as the named recipe
    ``recipe`` casts ``operand`` (a float8 recipe to the run format ``fmt``)."""
    op = lab.parse(recipe) if "/" in recipe else measured(recipe, dict.fromkeys(("input", "weight", "grad_output"),
                                                                                 fmt))[operand]
    return summarize(*cast_counts(t, op, scale=scale))


FP4_SPECS = {"nvfp4": "e2m1/1x16/e4m3/nearest", "mxfp4": "e2m1/1x32/ue8m0/nearest"}
"""Each format's operand spec (the nvfp4 and mxfp4 recipes' input's)."""
FP4_BLOCK = {"nvfp4": 16, "mxfp4": 32}


def fp4_operand(fmt: str, two_d: bool = False, stochastic: bool = False) -> lab.Operand:
    """``fmt``'s lab operand: in square tiles with ``two_d``, rounding stochastically with ``stochastic``."""
    spec = FP4_SPECS[fmt].replace("1x", f"{FP4_BLOCK[fmt]}x") if two_d else FP4_SPECS[fmt]
    return lab.parse(spec.replace("nearest", "stochastic") if stochastic else spec)


def fp4_round_trip(x: torch.Tensor, fmt: str, *, two_d: bool = False, stochastic: bool = False,
                   per_tensor_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The lab's round trip of ``x`` in ``fmt`` (fp32, ``x``'s shape)."""
    return lab.fake_quantize(x, fp4_operand(fmt, two_d, stochastic), per_tensor=per_tensor_scale)


def fp4_scales(x: torch.Tensor, fmt: str, *, two_d: bool = False,
               per_tensor_scale: torch.Tensor | None = None) -> torch.Tensor:
    """What each block's elements were divided by, ``(rows, blocks)``: nvfp4's two
    levels together, mxfp4's power of two (floored at 2**-126, as torchao divides)."""
    c = lab.cast(x, fp4_operand(fmt, two_d), per_tensor=per_tensor_scale)
    d = c.decode if fmt == "nvfp4" else 1.0 / c.multiplier
    return d.reshape(d.shape[0], d.shape[2])


def state_bytes(optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds per state entry (``exp_avg``, ``exp_avg_sq``,
    ``kahan_comp``), counting every part of a quantized moment. Step counters
    (0-d) are left out, as in the memory estimate."""
    out: dict[str, int] = {}
    for st in optimizer.state.values():
        for k, v in st.items():
            if not torch.is_tensor(v) or v.dim() == 0 or k == "step":
                continue
            if k == "kahan_comp" and v.numel() == 1 and v.dtype == torch.uint8:
                continue  # optimi's placeholder where there is no compensation
            out[k] = out.get(k, 0) + sum(x.numel() * x.element_size() for _, x in state_parts(v))
    return out


class Plant:
    """Unpickled, it creates a directory: a stand-in for any code an attacker would run."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


VOLATILE = ("perf/", "mem/")
"""Wall-clock and memory figures: the only metric keys two runs of the same math may differ in."""


def without_wall_clock(rows: list[dict]) -> list[dict]:
    """``rows`` without the :data:`VOLATILE` keys, for bit-for-bit comparisons of runs."""
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows]


def first_difference(a: list[dict], b: list[dict]) -> str:
    """Where two runs' rows first differ, key by key (pytest's own message shows one side
    of a long row and hides the keys): "" when they are equal."""
    if len(a) != len(b):
        return f"{len(a)} rows vs {len(b)}"
    for i, (ra, rb) in enumerate(zip(a, b)):
        diff = {k: (ra.get(k), rb.get(k)) for k in sorted(set(ra) | set(rb)) if ra.get(k) != rb.get(k)}
        if diff:
            return f"row {i} (step {ra.get('step')}): {len(diff)} keys differ, first ones {list(diff.items())[:8]}"
    return ""
